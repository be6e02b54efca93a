"""What runs on a server: the round loop, strategies, config, simulator, metrics, reports."""

from coordinator.config import RunConfig, load_config
from coordinator.federation import build_coordinator, build_node, prepare_federation
from coordinator.fleet import Fleet, LocalFleet, NetworkFleet
from coordinator.server import Coordinator, RoundConfig
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
