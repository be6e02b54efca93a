"""Device halves of the algorithms, one file each, registered by name on import."""

from edge_sdk.algorithms import fedavg, fedavg_ft, fedprox, fml, local, pfml  # noqa: F401
from edge_sdk.algorithms.base import (
    AlgorithmConfig,
    AlgorithmError,
    BaseAlgorithmConfig,
    ClientAlgorithm,
    ClientContext,
    FitResult,
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
    "FitResult",
    "algorithm_class",
    "algorithm_names",
    "register_algorithm",
]
