"""Device halves of the algorithms, one file each, registered by name on import."""

from edge_sdk.algorithms import (  # noqa: F401
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
