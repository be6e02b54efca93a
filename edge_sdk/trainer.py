"""The one place where batches are drawn and optimizers step, shared by every algorithm.

Data is moved to the device once (`ClientData.to`, in edge_sdk.client_data); batches are index
tensors drawn on the device from the trainer's own seeded generator (no DataLoader for in-memory
tensors); optimizers and learning-rate schedules come from config (`OptimConfig`, in
edge_sdk.optim_config); mixed precision (bf16 autocast) on CUDA.

A training loop is a step function run over batches (`Trainer.run`): the losses it returns stay
on the device and are read once, when the loop ends, so no step waits for the host; on CUDA the
step is captured in a CUDA graph and replayed (`edge_sdk.graphs`). The simulator's trainer of
a stack of clients (`coordinator.stacking.CohortTrainer`) runs the same step function once for
all of them.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from edge_sdk.client_data import ClientData, mixed, shifted
from edge_sdk.device import autocast_dtype
from edge_sdk.graphs import StepRunner, footprint
from edge_sdk.losses import cross_entropy
from edge_sdk.optim import SGD, Adam, restart
from edge_sdk.optim_config import OptimConfig

# ClientData and OptimConfig are importable from here, as the README and examples import them.
__all__ = ["ClientData", "EvalResult", "LoopStats", "OptimConfig", "Score", "Step", "Trainer"]

# A training step: one batch's tensors (inputs, labels) → the values to average over the loop
# (losses), after it has updated the models (Trainer.step).
Step = Callable[..., Sequence[torch.Tensor]]


# Captured steps kept between loops (Trainer.run's keep), each holding its graph's memory: per
# trainer, a device's step and, when an algorithm alternates between two settings (FML's α
# gate), the other one's; per process, a few (a simulation's clients one after another on one
# GPU would otherwise hold one each: a hundred VGG clients' activations).
_KEPT_STEPS = 2
_KEPT_IN_PROCESS = 8
_KEPT_ORDER: OrderedDict[tuple[int, Any], weakref.ref[Trainer]] = OrderedDict()
_KEPT_LOCK = threading.Lock()
# Uniform keys drawn at once for fresh batches (Trainer.index_draws): 16 MB of fp32.
_DRAW_KEYS = 1 << 22


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


class Score(NamedTuple):
    """How a model did on a client's validation samples, as the guard scores it."""

    hits: torch.Tensor  # bool, per sample (on the CPU): predicted right
    loss: float  # mean cross-entropy
    correct: int  # hits' count


@dataclass
class LoopStats:
    """How a client's training steps ran (`Trainer.run`), for the record of a run."""

    steps: int = 0  # training steps taken
    stacked: int = 0  # of which in a stack of clients (coordinator.stacking)
    replayed: int = 0  # of which replayed from a captured CUDA graph
    graphs: int = 0  # CUDA graphs captured (one per loop and batch shape)

    def as_dict(self) -> dict[str, int]:
        return {k: int(v) for k, v in vars(self).items()}


class Trainer:
    """Batches, optimizers, mixed precision and evaluation for one client on one device.

    `graphs`: capture training steps in CUDA graphs (default: on CUDA without fp16 loss
    scaling, whose overflow check reads the host every step)."""

    def __init__(
        self,
        device: torch.device,
        *,
        seed: int = 0,
        amp: bool = True,
        graphs: bool | None = None,
    ) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # Training samples drawn so far (epochs and fresh batches; evaluation not counted): the
        # budget an algorithm spent, reported next to its accuracy.
        self.samples = 0
        dtype = autocast_dtype(device) if amp else None  # what results report as precision
        self.amp = dtype is not None
        self._amp_dtype = dtype or torch.float16
        # fp16 needs loss scaling; bf16 does not.
        self._scaler = (
            torch.amp.GradScaler("cuda") if self.amp and self._amp_dtype == torch.float16 else None
        )
        capturable = device.type == "cuda" and self._scaler is None
        self.graphs = capturable if graphs is None else graphs and capturable
        self.stats = LoopStats()
        # Captured steps kept for later loops (`run`'s keep), by footprint, oldest first.
        self._kept: OrderedDict[Any, StepRunner] = OrderedDict()
        self._held: dict[str, torch.Tensor] = {}  # see `held`

    def held(self, name: str, value: float | torch.Tensor) -> float | torch.Tensor:
        """`value` as a captured step reads it: a tensor (one value per client of a stack) is
        written into the tensor held under `name` last time, where it fits, so that a step
        captured then reads the new values; a number is taken into the step as it is."""
        if not isinstance(value, torch.Tensor):
            return value
        kept = self._held.get(name)
        if kept is not None and (kept.shape, kept.device, kept.dtype) == (
            value.shape,
            value.device,
            value.dtype,
        ):
            return kept.copy_(value)
        self._held[name] = value
        return value

    @property
    def amp_dtype(self) -> str | None:
        """The autocast dtype of training steps ("bfloat16", "float16"), None in fp32."""
        return str(self._amp_dtype).removeprefix("torch.") if self.amp else None

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
        (rows,) = self.index_draws(n, batch_size, 1)
        return rows[0]

    def index_draws(self, n: int, batch_size: int, count: int) -> Iterator[torch.Tensor]:
        """`count` fresh batches of min(batch_size, n) distinct indices of range(n), as tensors
        of (rows, batch) drawn one at a time when the loop reaches them: each row is the
        positions of the largest of n uniform keys, a uniformly random subset in random order.
        One draw holds at most 2**22 keys (`rows_per_draw`): one call instead of a
        permutation per batch; a cohort draws each member's the same way."""
        b = min(batch_size, n)
        per_draw = self.rows_per_draw(n)
        for start in range(0, count, per_draw):
            rows = min(per_draw, count - start)
            keys = torch.rand(rows, n, generator=self.generator, device=self.device)
            self.samples += rows * b
            yield keys.topk(b, dim=1).indices

    def batches(
        self, x: torch.Tensor, y: torch.Tensor, batch_size: int, *more: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """(inputs, labels) batches over one random permutation, gathered on the device; with
        `more` tensors of one row per sample (a fixed teacher's logits), their rows of the
        batch too: (inputs, labels, *more)."""
        for idx in self.epoch(len(y), batch_size):
            # index_select is ~4× cheaper per call than advanced indexing (x[idx]) on CPU.
            yield tuple(t.index_select(0, idx) for t in (x, y, *more))

    def epochs(
        self, x: torch.Tensor, y: torch.Tensor, batch_size: int, epochs: int, *more: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """`batches` for `epochs` epochs in a row (each drawing its permutation when it starts)."""
        return itertools.chain.from_iterable(
            self.batches(x, y, batch_size, *more) for _ in range(epochs)
        )

    def distillation_batches(
        self,
        teacher: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        epochs: int,
        shift: int = 0,
        views: int = 1,
        mix: bool = False,
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """(inputs, labels, the teacher's logits) batches for `epochs` epochs of distilling
        `teacher`. With `shift` > 0 or `mix`, and images (n, c, h, w): each epoch shows `views`
        views of every image, every batch moved by up to `shift` pixels each way afresh, with
        `mix` each image mixed with another of its batch (`mixed`), and labelled by the teacher
        as it is then (`_moved`). Otherwise the images as they are, and the teacher's logits
        computed once (it is fixed)."""
        if not self._moves(x, shift, mix):
            return self.epochs(x, y, batch_size, epochs, self.logits(teacher, x))
        return (
            self._moved(batch, shift, teacher, mix)
            for batch in self.epochs(x, y, batch_size, epochs * views)
        )

    def views_per_epoch(self, x: torch.Tensor, shift: int, views: int, mix: bool) -> int:
        """How many passes over `x` an epoch of `distillation_batches` makes: `views` where it
        moves the images (a shift or mixing, and images), else 1."""
        return views if self._moves(x, shift, mix) else 1

    def _moves(self, x: torch.Tensor, shift: int, mix: bool) -> bool:
        """Whether a distillation moves `x`'s samples: images, shifted or mixed."""
        return (shift > 0 or mix) and self._images(x)

    def _images(self, x: torch.Tensor) -> bool:
        """Whether `x` holds images (n, c, h, w), which a distillation may shift."""
        return x.dim() == 4

    def _moved(
        self, batch: tuple[Any, ...], shift: int, teacher: nn.Module, mix: bool = False
    ) -> tuple[Any, ...]:
        """A batch's images moved (`shifted`, from this trainer's random stream), then with
        `mix` mixed (`mixed`, from the same stream), their labels, and the teacher's logits
        for the images as they are then."""
        xb, yb = batch
        if shift > 0:
            xb = shifted(xb, shift, self.generator)
        if mix:
            xb, yb = mixed(xb, yb, self.generator)
        return xb, yb, self.logits(teacher, xb)

    def rng_state(self) -> Any:
        """The state of the random stream batches are drawn from (`set_rng_state` restores
        it: the same batches again)."""
        return self.generator.get_state()

    def set_rng_state(self, state: Any) -> None:
        """Restore `rng_state()`'s output."""
        self.generator.set_state(state)

    def sample_batch(
        self, x: torch.Tensor, y: torch.Tensor, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One fresh (inputs, labels) batch of distinct samples."""
        idx = self.sample(len(y), batch_size)
        return x.index_select(0, idx), y.index_select(0, idx)

    @staticmethod
    def rows_per_draw(n: int) -> int:
        """How many batches of `index_draws` over n samples one draw holds."""
        return max(1, _DRAW_KEYS // n)

    def fresh_batches(
        self, x: torch.Tensor, y: torch.Tensor, batch_size: int, count: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """`count` fresh batches of distinct samples (`index_draws`)."""
        for rows in self.index_draws(len(y), batch_size, count):
            for idx in rows:
                yield x.index_select(0, idx), y.index_select(0, idx)

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
            return Adam(
                params,
                lr=lr,
                betas=betas,
                weight_decay=cfg.weight_decay,
                capturable=self.graphs,  # its step count on the device, as a graph needs
            )
        return SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)

    def fresh_optimizer(
        self,
        kept: torch.optim.Optimizer | None,
        params: Iterable[nn.Parameter],
        cfg: OptimConfig,
        lr: float | None = None,
    ) -> torch.optim.Optimizer:
        """An optimizer that steps as a new one from `Trainer.optimizer` would: `kept` itself,
        restarted in place (`optim.restart`) at this learning rate, when it is of the same kind
        and settings and steps exactly `params`; otherwise the new one. For an algorithm that
        starts an optimizer afresh every round: a kept one keeps the tensors a device's captured
        step reads, and so the step itself (`run`'s keep)."""
        params = list(params)
        new = self.optimizer(params, cfg, lr)
        if kept is None or type(kept) is not type(new) or len(kept.param_groups) != 1:
            return new
        (group,), (fresh,) = kept.param_groups, new.param_groups
        same = len(group["params"]) == len(params) and all(
            a is b for a, b in zip(group["params"], params, strict=True)
        )
        if not same or any(group[k] != v for k, v in fresh.items() if k not in ("params", "lr")):
            return new
        restart(kept)
        group["lr"] = fresh["lr"]
        return kept

    @staticmethod
    def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr

    def value_and_grad(
        self,
        model: nn.Module,
        objective: Callable[..., torch.Tensor],
        x: torch.Tensor,
        *args: Any,
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The gradient of `objective(model(x), *args)` with respect to the model's trainable
        parameters, and its value (detached).

        On a cohort's stacked model (coordinator.stacking) the objective gives one value per client
        (the shared losses do for stacked logits); their sum's gradient is each client's own
        gradient in its row, since no client's loss depends on another's parameters.
        """
        params = [p for p in model.parameters() if p.requires_grad]
        with self.autocast():
            z = model(x)
        loss = objective(z, *args)
        return torch.autograd.grad(loss.sum(), params), loss.detach()

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.amp:
            # No cache of cast weights across the step: a CUDA graph replays the casts instead.
            return torch.autocast(
                device_type="cuda", dtype=self._amp_dtype, cache_enabled=not self.graphs
            )
        return contextlib.nullcontext()

    def step(
        self,
        loss: torch.Tensor,
        optimizers: Iterable[torch.optim.Optimizer],
        *,
        clip: Iterable[tuple[Iterable[nn.Parameter], float]] = (),
    ) -> torch.Tensor:
        """zero_grad → backward (scaled under fp16) → clip → step; returns the loss, detached.

        `clip` lists (parameters, max_norm) groups, each clipped to its own total gradient norm
        (one group per model when several models step together). Nothing is read on the host:
        `run` checks the losses once its loop has ended.
        """
        optimizers = list(optimizers)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        if self._scaler is not None:
            self._scaler.scale(loss.sum()).backward()
            for opt in optimizers:
                self._scaler.unscale_(opt)
        else:
            loss.sum().backward()
        self._clip(clip)
        for opt in optimizers:
            if self._scaler is not None:
                self._scaler.step(opt)
            else:
                opt.step()
        if self._scaler is not None:
            self._scaler.update()
        return loss.detach()

    def _clip(self, clip: Iterable[tuple[Iterable[nn.Parameter], float]]) -> None:
        for params, max_norm in clip:
            nn.utils.clip_grad_norm_(params, max_norm)

    def run(
        self,
        step: Step,
        batches: Iterable[tuple[torch.Tensor, ...]],
        values: int = 1,
        *,
        keep: Sequence[object] = (),
    ) -> list[Any]:
        """A training loop: `step(*batch)` on every batch (inputs, labels); the mean of each
        of the `values` values it returns.

        The values are summed on the device and read once, after the last batch (one host
        sync per loop); a non-finite mean stops the task with FloatingPointError. On CUDA the
        step runs as a captured CUDA graph (`edge_sdk.graphs`). A loop of no batches gives NaN.

        `keep`: everything the step reads besides its batch, the modules, optimizers and plain
        values (learning rate factors, loss weights). Given it, a captured step is kept after
        the loop, and a later loop whose `keep` has the same footprint (`graphs.footprint`: the
        same tensors at the same addresses, the same settings and values) replays it from its
        first batch, without warming up or capturing again. The caller promises that the step
        reads nothing else that changes between loops.
        """
        runner, key = self._runner(step, keep)
        before = (runner.eager + runner.replayed, runner.replayed, runner.graphs)
        sums: list[torch.Tensor] | None = None
        for batch in batches:
            out = runner(*batch)
            if sums is None:
                sums = [torch.zeros_like(v) for v in out]
            torch._foreach_add_(sums, list(out))
        steps = runner.eager + runner.replayed - before[0]
        self.stats.steps += steps
        self.stats.replayed += runner.replayed - before[1]
        self.stats.graphs += runner.graphs - before[2]
        if key is not None and runner.graphs:
            self._keep(footprint(*keep), runner)  # the optimizers' state exists now
        if sums is None:
            return [math.nan] * values
        means = torch.stack(sums).div_(steps).tolist()  # the loop's one host sync
        _check_finite(means)
        return means

    def _keep(self, key: Any, runner: StepRunner) -> None:
        """Keep `runner` under `key`, dropping the least recently kept beyond the limits."""
        if key is None:
            return
        with _KEPT_LOCK:
            self._kept[key] = runner
            self._kept.move_to_end(key)
            while len(self._kept) > _KEPT_STEPS:
                old, _ = self._kept.popitem(last=False)
                _KEPT_ORDER.pop((id(self), old), None)
            _KEPT_ORDER[id(self), key] = weakref.ref(self)
            _KEPT_ORDER.move_to_end((id(self), key))
            while len(_KEPT_ORDER) > _KEPT_IN_PROCESS:
                (_, old), ref = _KEPT_ORDER.popitem(last=False)
                owner = ref()
                if owner is not None:
                    owner._kept.pop(old, None)

    def _runner(self, step: Step, keep: Sequence[object]) -> tuple[StepRunner, Any]:
        """A kept runner whose step read what `keep` holds now (its later captures made with
        this `step`), else a new one; and the footprint (None: not to be kept)."""
        key = footprint(*keep) if keep and self.graphs else None
        with _KEPT_LOCK:
            runner = self._kept.pop(key, None) if key is not None else None
            if runner is not None:
                _KEPT_ORDER.pop((id(self), key), None)
        if runner is None:
            return StepRunner(step, capture=self.graphs), key
        runner.step = step
        return runner, key

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

        def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor]:
            with self.autocast():
                loss = cross_entropy(model(x), y)
            if extra_loss is not None:
                loss = loss + extra_loss(model)
            return (self.step(loss, [opt]),)

        n = cfg.local_epochs if epochs is None else epochs
        batches = self.epochs(data.x_train, data.y_train, cfg.batch_size, n)
        # What else the step reads (the extra loss's tensors) is the caller's to know.
        keep = (model, opt) if extra_loss is None else ()
        (loss,) = self.run(step, batches, keep=keep)
        return loss

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


def _check_finite(means: list[Any]) -> None:
    bad = next((v for v in means if not math.isfinite(v)), None)
    if bad is not None:
        raise FloatingPointError(f"training loss became {bad}; lower the learning rate")
