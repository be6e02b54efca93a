"""What runs on a server: the round loop, strategies, config, simulator, metrics, reports.

Importing the package (or `coordinator.config`, or the `edgefl` command line for its help)
loads neither torch nor paho; the names below load their module when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coordinator.config import RoundConfig, RunConfig, load_config
    from coordinator.federation import build_coordinator, build_node, prepare_federation
    from coordinator.fleet import Fleet, LocalFleet, NetworkFleet
    from coordinator.server import Coordinator
    from coordinator.simulator import simulate

__all__ = [
    "Coordinator",
    "Fleet",
    "LocalFleet",
    "NetworkFleet",
    "RoundConfig",
    "RunConfig",
    "build_coordinator",
    "build_node",
    "load_config",
    "prepare_federation",
    "simulate",
]

_WHERE = {
    "Coordinator": "coordinator.server",
    "Fleet": "coordinator.fleet",
    "LocalFleet": "coordinator.fleet",
    "NetworkFleet": "coordinator.fleet",
    "RoundConfig": "coordinator.config",
    "RunConfig": "coordinator.config",
    "build_coordinator": "coordinator.federation",
    "build_node": "coordinator.federation",
    "load_config": "coordinator.config",
    "prepare_federation": "coordinator.federation",
    "simulate": "coordinator.simulator",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'coordinator' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
