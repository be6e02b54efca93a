"""What runs on a server: the round loop, strategies, config, simulator, metrics, reports."""

from coordinator.config import RunConfig, load_config
from coordinator.server import Coordinator, RoundConfig
from coordinator.simulator import simulate

__all__ = ["Coordinator", "RoundConfig", "RunConfig", "load_config", "simulate"]
