"""The one place where batches are drawn and optimizers step, shared by every algorithm.

Data is moved to the device once (`ClientData.to`); batches are index tensors drawn on the device
from the trainer's own seeded generator (no DataLoader for in-memory tensors); optimizers and
learning-rate schedules come from config; mixed precision (bf16 autocast) on CUDA.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn
from torch.utils.data import Dataset as TorchDataset

from edge_sdk.losses import cross_entropy
from edge_sdk.optim import SGD, Adam

__all__ = ["ClientData", "EvalResult", "OptimConfig", "Trainer"]


_DEFAULT_LR_GAMMA = 0.1


class OptimConfig(BaseModel):
    """Local training in whole epochs with SGD or Adam (defaults: FML's, algorithms.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    local_epochs: int = Field(5, ge=0)
    batch_size: int = Field(128, ge=1)
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.01, gt=0)
    # SGD's momentum; for Adam it is β1 (Adam's betas are (momentum, 0.999)).
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    # "step": lr × lr_gamma every max(1, ⌊rounds/3⌋) rounds (FML's schedule); "none": constant.
    lr_schedule: Literal["none", "step"] = "none"
    lr_gamma: float = Field(_DEFAULT_LR_GAMMA, gt=0)

    @model_validator(mode="after")
    def _gamma_needs_a_schedule(self) -> OptimConfig:
        if self.lr_schedule == "none" and self.lr_gamma != _DEFAULT_LR_GAMMA:
            raise ValueError(
                f"lr_gamma={self.lr_gamma} has no effect with lr_schedule='none'; "
                "set lr_schedule='step' to decay the learning rate"
            )
        return self

    def lr_at(self, round_: int, rounds: int) -> float:
        if self.lr_schedule == "none":
            return self.lr
        step = max(1, rounds // 3)
        return self.lr * self.lr_gamma ** ((max(1, round_) - 1) // step)


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
        """Move every split to `device` once; image batches go channels_last (see Trainer)."""
        moved = {k: _layout(getattr(self, k).to(device)) for k in self._tensor_fields()}
        return ClientData(**moved, num_classes=self.num_classes)

    @staticmethod
    def _tensor_fields() -> tuple[str, ...]:
        return ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")

    @property
    def n_train(self) -> int:
        return len(self.y_train)


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


def _layout(t: torch.Tensor) -> torch.Tensor:
    # NHWC ("channels_last") images: convolutions ran 1.3-1.4× faster on CPU in
    # benchmarks/local_update.py, and it is what cuDNN prefers under mixed precision.
    if t.dim() == 4 and t.is_floating_point():
        return t.contiguous(memory_format=torch.channels_last)
    return t


@dataclass(frozen=True)
class EvalResult:
    correct: int
    total: int
    loss_sum: float

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else float("nan")

    @property
    def loss(self) -> float:
        return self.loss_sum / self.total if self.total else float("nan")


class Trainer:
    """Batches, optimizers, mixed precision and evaluation for one client on one device."""

    def __init__(self, device: torch.device, *, seed: int = 0, amp: bool = True) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # Training samples drawn so far (epochs and fresh batches; evaluation not counted): the
        # budget an algorithm spent, reported next to its accuracy.
        self.samples = 0
        self.amp = amp and device.type == "cuda"
        self._amp_dtype = (
            torch.bfloat16 if self.amp and torch.cuda.is_bf16_supported() else torch.float16
        )
        # fp16 needs loss scaling; bf16 does not.
        self._scaler = (
            torch.amp.GradScaler("cuda") if self.amp and self._amp_dtype == torch.float16 else None
        )

    # -- batches ---------------------------------------------------------------------------
    def epoch(self, n: int, batch_size: int) -> Iterator[torch.Tensor]:
        """Index batches over one random permutation of range(n) (the last may be short)."""
        perm = torch.randperm(n, generator=self.generator, device=self.device)
        for start in range(0, n, batch_size):
            batch = perm[start : start + batch_size]
            self.samples += len(batch)
            yield batch

    def sample(self, n: int, batch_size: int) -> torch.Tensor:
        """One fresh batch of min(batch_size, n) distinct indices."""
        perm = torch.randperm(n, generator=self.generator, device=self.device)
        self.samples += min(batch_size, n)
        return perm[: min(batch_size, n)]

    def batches(
        self, x: torch.Tensor, y: torch.Tensor, batch_size: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, labels) batches over one random permutation, gathered on the device."""
        for idx in self.epoch(len(y), batch_size):
            # index_select is ~4× cheaper per call than advanced indexing (x[idx]) on CPU.
            yield x.index_select(0, idx), y.index_select(0, idx)

    def sample_batch(
        self, x: torch.Tensor, y: torch.Tensor, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One fresh (inputs, labels) batch of distinct samples."""
        idx = self.sample(len(y), batch_size)
        return x.index_select(0, idx), y.index_select(0, idx)

    def prepare(self, model: nn.Module) -> nn.Module:
        """Put a model on the device, channels_last when it convolves (matching ClientData)."""
        model = model.to(self.device)
        if any(isinstance(m, nn.Conv2d) for m in model.modules()):
            model = model.to(memory_format=torch.channels_last)
        return model

    # -- optimisation ----------------------------------------------------------------------
    def optimizer(
        self, params: Iterable[nn.Parameter], cfg: OptimConfig, lr: float | None = None
    ) -> torch.optim.Optimizer:
        lr = cfg.lr if lr is None else lr
        if cfg.optimizer == "adam":
            betas = (cfg.momentum, 0.999)
            return Adam(params, lr=lr, betas=betas, weight_decay=cfg.weight_decay)
        return SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)

    @staticmethod
    def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr

    def value_and_grad(
        self,
        model: nn.Module,
        objective: Callable[..., torch.Tensor],
        x: torch.Tensor,
        *args: torch.Tensor,
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The gradient of `objective(model(x), *args)` with respect to the model's trainable
        parameters, and its value (detached).

        On a cohort's stacked model (edge_sdk.cohort) the objective gives one value per client
        (the shared losses do for stacked logits); their sum's gradient is each client's own
        gradient in its row, since no client's loss depends on another's parameters.
        """
        params = [p for p in model.parameters() if p.requires_grad]
        with self.autocast():
            z = model(x)
        loss = objective(z, *args)
        return torch.autograd.grad(loss.sum(), params), loss.detach()

    def average(self, values: Sequence[torch.Tensor]) -> float:
        """The mean of per-step scalar values (a training loss over a round)."""
        return sum(float(v) for v in values) / max(1, len(values))

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.amp:
            return torch.autocast(device_type="cuda", dtype=self._amp_dtype)
        return contextlib.nullcontext()

    def step(
        self,
        loss: torch.Tensor,
        optimizers: Iterable[torch.optim.Optimizer],
        *,
        clip: Iterable[tuple[Iterable[nn.Parameter], float]] = (),
    ) -> float:
        """zero_grad → backward (scaled under fp16) → clip → step; returns the loss.

        `clip` lists (parameters, max_norm) groups, each clipped to its own total gradient norm
        (one group per model when several models step together).
        """
        optimizers = list(optimizers)
        value = float(loss.detach())  # one host sync per step, shared by the check and the caller
        if not math.isfinite(value):
            raise FloatingPointError(f"training loss became {value}; lower the learning rate")
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        if self._scaler is not None:
            self._scaler.scale(loss).backward()
            for opt in optimizers:
                self._scaler.unscale_(opt)
        else:
            loss.backward()
        for params, max_norm in clip:
            nn.utils.clip_grad_norm_(params, max_norm)
        for opt in optimizers:
            if self._scaler is not None:
                self._scaler.step(opt)
            else:
                opt.step()
        if self._scaler is not None:
            self._scaler.update()
        return value

    def train_epochs(
        self,
        model: nn.Module,
        data: ClientData,
        cfg: OptimConfig,
        *,
        epochs: int | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        extra_loss: Callable[[nn.Module], torch.Tensor] | None = None,
    ) -> float:
        """Plain supervised training (CE + optional `extra_loss(model)` term); mean batch loss."""
        model.train()
        opt = optimizer or self.optimizer(model.parameters(), cfg)
        losses = []
        for _ in range(cfg.local_epochs if epochs is None else epochs):
            for x, y in self.batches(data.x_train, data.y_train, cfg.batch_size):
                with self.autocast():
                    loss = cross_entropy(model(x), y)
                if extra_loss is not None:
                    loss = loss + extra_loss(model)
                losses.append(self.step(loss, [opt]))
        return sum(losses) / len(losses) if losses else math.nan

    # -- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def logits(
        self, model: nn.Module, x: torch.Tensor, batch_size: int | None = None
    ) -> torch.Tensor:
        # On the CPU 64 at a time: a batch's activations are held at once in every client thread
        # of a simulation, and the heaps keep them (1024 put ~700 MB on the FML benchmark's peak
        # RSS, benchmarks/simulate_scale.py); a GPU gets 1024.
        if batch_size is None:
            batch_size = 1024 if self.device.type == "cuda" else 64
        was_training = model.training
        model.eval()
        outs = []
        for start in range(0, len(x), batch_size):
            with self.autocast():
                outs.append(model(x[start : start + batch_size]).float())
        model.train(was_training)
        if not outs:
            return torch.empty(0, device=self.device)
        return torch.cat(outs)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> EvalResult:
        if len(y) == 0:
            return EvalResult(0, 0, 0.0)
        z = self.logits(model, x)
        loss = torch.nn.functional.cross_entropy(z, y, reduction="sum")
        return EvalResult(int((z.argmax(1) == y).sum()), len(y), float(loss))
