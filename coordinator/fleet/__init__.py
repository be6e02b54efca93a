"""The seam between the round loop and the clients (see `coordinator.fleet.base`)."""

from coordinator.fleet.base import (
    BrokerUnfit,
    CoordinatorError,
    Fleet,
    Interrupted,
    PhaseRequest,
    RunInfo,
    Validator,
    check_reply,
    refusal,
)
from coordinator.fleet.local import LocalFleet
from coordinator.fleet.network import NetworkFleet

__all__ = [
    "BrokerUnfit",
    "CoordinatorError",
    "Fleet",
    "Interrupted",
    "LocalFleet",
    "NetworkFleet",
    "PhaseRequest",
    "RunInfo",
    "Validator",
    "check_reply",
    "refusal",
]
