"""Server halves of the algorithms, one file each, registered by name on import."""

from coordinator.strategies import (  # noqa: F401
    fedavg,
    fedavg_ft,
    federico,
    fedme,
    fedprox,
    fml,
    local,
    persfl,
    pfml,
)
from coordinator.strategies.base import (
    ClientInfo,
    FitReply,
    GlobalModelStrategy,
    IncompatibleClients,
    ServerData,
    Strategy,
    StrategyError,
    register_strategy,
    strategy_class,
    strategy_names,
    weighted_mean,
)

__all__ = [
    "ClientInfo",
    "FitReply",
    "GlobalModelStrategy",
    "IncompatibleClients",
    "ServerData",
    "Strategy",
    "StrategyError",
    "register_strategy",
    "strategy_class",
    "strategy_names",
    "weighted_mean",
]
