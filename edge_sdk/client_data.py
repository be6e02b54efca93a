"""A client's data on its device: its train/validation/test tensors (`ClientData`), made from
datasets or moved to a device once, where splits that are views of one data set stay views of
one copy of it; the cache of values kept per tensor for as long as it lives (`IdentityCache`);
and images shifted at random (`shifted`), the guard's students' view of a few dozen images.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch.utils.data import Dataset as TorchDataset

__all__ = [
    "ClientData",
    "IdentityCache",
    "laid_out",
    "mix_draws",
    "mixed",
    "mixed_by",
    "moved_by",
    "row_range",
    "shift_draws",
    "shifted",
]

V = TypeVar("V")


@dataclass
class ClientData:
    """A client's own train/validation/test tensors (x: inputs, y: int64 class ids)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    def __post_init__(self) -> None:
        for split in ("train", "val", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if len(x) != len(y):
                raise ValueError(f"{split}: {len(x)} inputs but {len(y)} labels")
        if len(self.x_train) == 0:
            raise ValueError("a client needs at least one training sample")

    @classmethod
    def from_datasets(
        cls,
        train: TorchDataset,
        val: TorchDataset | None = None,
        test: TorchDataset | None = None,
        *,
        num_classes: int,
    ) -> ClientData:
        """Materialise map-style `torch.utils.data.Dataset`s of (input, label) pairs as tensors.

        A device app's own datasets become the tensors the trainer batches on the device; an
        omitted split is empty (no validation-based selection, no test score).
        """
        x_train, y_train = _stack(train)
        none_x, none_y = x_train[:0], torch.empty(0, dtype=torch.int64)
        x_val, y_val = _stack(val) if val is not None else (none_x, none_y)
        x_test, y_test = _stack(test) if test is not None else (none_x, none_y)
        return cls(x_train, y_train, x_val, y_val, x_test, y_test, num_classes=num_classes)

    def to(self, device: torch.device) -> ClientData:
        """Move every split to `device` once; image batches go channels_last (see Trainer).

        Splits that are views of one tensor (a simulation's clients slice one client-major
        data set) stay views of one copy of it on the device: clients moved one by one share
        it, and a stack of them gathers its batches from it in one operation."""
        moved = {k: _moved(getattr(self, k), device) for k in self._tensor_fields()}
        return ClientData(**moved, num_classes=self.num_classes)

    @staticmethod
    def _tensor_fields() -> tuple[str, ...]:
        return ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")

    @property
    def n_train(self) -> int:
        return len(self.y_train)

    @property
    def n_val(self) -> int:
        return len(self.y_val)


def _stack(ds: TorchDataset) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(ds)  # type: ignore[arg-type]
    if n == 0:
        raise ValueError("an empty dataset cannot be stacked; pass None for an empty split")
    pairs = [ds[i] for i in range(n)]
    try:
        x = torch.stack([torch.as_tensor(p[0]) for p in pairs])
        y = torch.as_tensor([int(p[1]) for p in pairs], dtype=torch.int64)
    except (TypeError, IndexError, RuntimeError, ValueError) as exc:
        raise ValueError(
            f"a dataset item must be an (input, label) pair of equal-shaped inputs: {exc}"
        ) from exc
    return x, y


class IdentityCache(Generic[V]):
    """Values kept for some tensors, by their identity, each forgotten when one of its tensors
    is collected (and, given a `limit`, when it is the least recently used beyond it).

    Keyed by ids, not by the tensors: a WeakKeyDictionary compares keys with ==, which on
    tensors is elementwise (finding a tensor already there raised "Boolean value of Tensor with
    more than one value is ambiguous"). While an entry lives its tensors do, so their ids are
    theirs."""

    def __init__(self, limit: int | None = None) -> None:
        self._entries: OrderedDict[tuple[int, ...], V] = OrderedDict()
        self._limit = limit
        self._lock = threading.RLock()  # a collected tensor's finalizer may run inside a block

    def get(self, tensors: Sequence[torch.Tensor]) -> V | None:
        key = tuple(map(id, tensors))
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, tensors: Sequence[torch.Tensor], value: V) -> V:
        key = tuple(map(id, tensors))
        with self._lock:
            if key not in self._entries:
                for t in {id(t): t for t in tensors}.values():
                    weakref.finalize(t, self._forget, key)
            self._entries[key] = value
            while self._limit is not None and len(self._entries) > self._limit:
                self._entries.popitem(last=False)
        return value

    def _forget(self, key: tuple[int, ...]) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)


# A data set's tensor → its copy on each device it was moved to, for as long as the tensor lives.
_ON_DEVICE: IdentityCache[dict[torch.device, torch.Tensor]] = IdentityCache()


def _moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    base = t._base
    rows = row_range(t, base) if base is not None and t.device != device else None
    if base is None or rows is None:
        return laid_out(t.to(device))
    copies = _ON_DEVICE.get([base])
    if copies is None:
        copies = _ON_DEVICE.put([base], {})
    if device not in copies:
        copies[device] = laid_out(base.to(device))
    return copies[device][rows[0] : rows[1]]


def row_range(t: torch.Tensor, base: torch.Tensor) -> tuple[int, int] | None:
    """(start, stop) when `t` is base[start:stop] (rows of its base, nothing else)."""
    if t.dim() == 0 or t.shape[1:] != base.shape[1:] or t.stride() != base.stride():
        return None
    offset = t.storage_offset() - base.storage_offset()
    row = base.stride(0) if base.dim() else 1
    same = t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    if row == 0 or offset % row or not same:
        return None
    start = int(offset // row)
    return start, start + len(t)


def laid_out(t: torch.Tensor) -> torch.Tensor:
    """`t` laid out as ClientData holds it: images channels_last, anything else as it is."""
    # NHWC ("channels_last") images: convolutions ran 1.3-1.4× faster on CPU in
    # benchmarks/local_update.py, and it is what cuDNN prefers under mixed precision.
    if t.dim() == 4 and t.is_floating_point():
        return t.contiguous(memory_format=torch.channels_last)
    return t


def shifted(x: torch.Tensor, most: int, generator: torch.Generator) -> torch.Tensor:
    """Images `x` (n, c, h, w), each moved by its own random whole-pixel offset of up to `most`
    each way (`shift_draws` from `generator`, on its device), the uncovered border repeating the
    image's edge (its background, not a value normalization may have made meaningful); laid
    out as ClientData holds images (`laid_out`)."""
    return laid_out(moved_by(x, most, shift_draws(len(x), most, generator, x.device)))


def mixed(
    x: torch.Tensor, y: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images `x` (n, c, h, w), each mixed with another of them (`mixed_by` the `mix_draws` of
    `generator`, on its device), and their labels `y`; laid out as ClientData holds images. A
    batch of one is left as it is."""
    if len(y) < 2:
        return x, y
    x, y = mixed_by(x, y, *mix_draws(len(y), generator, x.device))
    return laid_out(x), y


def mix_draws(
    n: int, generator: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """For n images: a random permutation p (image i is mixed with image p(i)) and λ uniform in
    [0, 1] for each image, drawn in that order (`mixed_by`)."""
    perm = torch.randperm(n, generator=generator, device=device)
    return perm, torch.rand(n, generator=generator, device=device)


def mixed_by(
    x: torch.Tensor, y: torch.Tensor, other: torch.Tensor, lam: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs `x` (n, ...) mixed as λ·x_i + (1 − λ)·x_other(i), `lam` and `other` (indices into
    x) one each per input, and labels `y`, each the label of its input's larger part (y_i where
    λ ≥ 0.5). An input mixed with itself at λ = 1 stays as it is."""
    weights = lam.view(len(lam), *([1] * (x.dim() - 1)))
    x = weights * x + (1 - weights) * x.index_select(0, other)
    return x, torch.where(lam >= 0.5, y, y.index_select(0, other))


def shift_draws(
    n: int, most: int, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """(2, n, 1): the rows and columns n images are read from, 0 to 2·`most` (`moved_by`)."""
    return torch.randint(0, 2 * most + 1, (2, n, 1), generator=generator, device=device)


def moved_by(x: torch.Tensor, most: int, draws: torch.Tensor) -> torch.Tensor:
    """Images `x` (n, c, h, w) moved by `draws` (`shift_draws`: offset + `most` each way)."""
    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (most, most, most, most), mode="replicate")
    dy, dx = draws
    rows = (dy + torch.arange(h, device=x.device))[:, None, :, None]  # (n, 1, h, 1)
    cols = (dx + torch.arange(w, device=x.device))[:, None, None, :]  # (n, 1, 1, w)
    index = torch.arange(n, device=x.device)[:, None, None, None]
    channel = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    return padded[index, channel, rows, cols]
