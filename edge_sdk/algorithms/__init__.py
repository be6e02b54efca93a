"""Device halves of the algorithms, one file each, registered by name on import.

Every module of this package is imported here, so a new algorithm is one new file: nothing to
add to a list. Algorithms outside the package register with `register_algorithm` from a plugin
(`coordinator.plugins`).
"""

import importlib
import pkgutil

from edge_sdk.algorithms.base import (
    AlgorithmConfig,
    AlgorithmError,
    BaseAlgorithmConfig,
    ClientAlgorithm,
    ClientContext,
    Detail,
    FitResult,
    TaskInfo,
    algorithm_class,
    algorithm_names,
    register_algorithm,
)

__all__ = [
    "AlgorithmConfig",
    "AlgorithmError",
    "BaseAlgorithmConfig",
    "ClientAlgorithm",
    "ClientContext",
    "Detail",
    "FitResult",
    "TaskInfo",
    "algorithm_class",
    "algorithm_names",
    "register_algorithm",
]

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")
