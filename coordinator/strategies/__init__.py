"""Server halves of the algorithms, one file each, registered by name on import.

Every module of this package is imported here, so a new strategy is one new file (named like
its device half in `edge_sdk/algorithms/`): nothing to add to a list. Strategies outside the
package register with `register_strategy` from a plugin (`coordinator.plugins`).
"""

import importlib
import pkgutil

from coordinator.strategies.base import (
    ClientInfo,
    FitReply,
    GlobalModelStrategy,
    IncompatibleClients,
    ServerData,
    Strategy,
    StrategyError,
    by_what,
    count_clients,
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
    "by_what",
    "count_clients",
    "register_strategy",
    "strategy_class",
    "strategy_names",
    "weighted_mean",
]

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")
