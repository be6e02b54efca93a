"""Data sets and federated partitions.

`load_dataset(name, root, **kwargs)` reads a data set from local files (nothing is ever
downloaded) or generates it; `partition(labels, scheme, num_clients, ...)` hands its samples to
clients and splits each client's share into train/val/test; `split_summary`,
`format_split_table` and `plot_label_distribution` describe the result.
"""

from .base import Dataset, DatasetError, DatasetNotFound, UnknownDataset
from .cifar import load_cifar10, load_cifar100
from .generated import load_digits, load_synthetic, synthetic_arrays
from .idx import load_fashion_mnist, load_mnist, read_idx
from .leaf import FEMNIST_CLASSES, SHAKESPEARE_VOCAB, load_femnist, load_shakespeare
from .partition import (
    ClientSplit,
    Partition,
    PartitionError,
    partition,
    partition_schemes,
)
from .registry import dataset_names, default_root, load_dataset, register_dataset
from .schemes import register_scheme
from .summary import (
    PLOT_CLIENTS_MAX,
    class_bars,
    format_split_table,
    plot_label_distribution,
    split_summary,
)

__all__ = [
    "FEMNIST_CLASSES",
    "PLOT_CLIENTS_MAX",
    "SHAKESPEARE_VOCAB",
    "ClientSplit",
    "Dataset",
    "DatasetError",
    "DatasetNotFound",
    "Partition",
    "PartitionError",
    "UnknownDataset",
    "class_bars",
    "dataset_names",
    "default_root",
    "format_split_table",
    "load_cifar10",
    "load_cifar100",
    "load_dataset",
    "load_digits",
    "load_fashion_mnist",
    "load_femnist",
    "load_mnist",
    "load_shakespeare",
    "load_synthetic",
    "partition",
    "partition_schemes",
    "plot_label_distribution",
    "read_idx",
    "register_dataset",
    "register_scheme",
    "split_summary",
    "synthetic_arrays",
]
