"""What is trained: architectures (ArchSpec + registry), datasets and federated partitions."""

from model_zoo.models import example_input
from model_zoo.spec import (
    ArchSpec,
    InvalidInputShape,
    ModelZooError,
    UnknownArchitecture,
    build,
    families,
    input_dtype,
    is_network,
    register,
)

__all__ = [
    "ArchSpec",
    "InvalidInputShape",
    "ModelZooError",
    "UnknownArchitecture",
    "build",
    "example_input",
    "families",
    "input_dtype",
    "is_network",
    "register",
]
