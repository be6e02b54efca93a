"""The Trainer of a stack of clients (coordinator.stacking.cohort): each client's batches from
its own generator and data, one step for all of them, and each client only the steps it takes
alone.

Clients of a stack hold different amounts of data (a Dirichlet split differs 10× and more), so
their epochs have different numbers of batches, and the last batch of each is short. A stacked
epoch runs as many steps as the longest member's; at each step:

- the members are ordered by their number of training samples, longest first (`run_stacked`
  orders them so), so the members still in their epoch are a *prefix* of the stack: the step
  runs on that prefix only (the stacked models take as many rows of their parameters as the
  batch has rows), and the optimizer's update of the other members is undone (parameters and
  optimizer state: momentum and weight decay would move them even without a gradient);
- a member whose batch is short has it padded to the others' size, with each sample's weight in
  its client's mean (`edge_sdk.losses.stacked_batch`): padding weighs 0, so the losses and
  gradients are those of its own samples.

That is the CPU's way: no padded client costs compute. A CUDA graph needs one shape for every
step, so on CUDA (`masked`) every step takes the whole stack, finished members with all-zero
weights and their update undone by a mask (members who all take every step need no mask). Both
ways give every member exactly its own steps, and both are tested on the CPU.

Each member's generator draws exactly what it would draw alone, in the same order (a permutation
per epoch, a permutation per fresh batch), so the stacked result equals the client-by-client one
to float rounding.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from coordinator.stacking.frozen import Frozen, Stepping
from coordinator.stacking.stacked_data import Packed, cumulative
from edge_sdk.algorithms.members import CohortUnsupported, PerMember
from edge_sdk.client_data import mix_draws, mixed_by, moved_by, shift_draws
from edge_sdk.graphs import StepRunner, footprint
from edge_sdk.losses import StackedBatch, stacked_batch
from edge_sdk.trainer import Score, Step, Trainer, _check_finite

__all__ = ["CohortTrainer", "StackedEval"]


@dataclass(frozen=True)
class StackedEval:
    """Trainer.evaluate's result for each member (`EvalResult`'s fields, one value each)."""

    correct: PerMember
    total: PerMember
    loss_sum: PerMember

    @property
    def accuracy(self) -> PerMember:
        pairs = zip(self.correct, self.total, strict=True)
        return PerMember(c / t if t else math.nan for c, t in pairs)

    @property
    def loss(self) -> PerMember:
        pairs = zip(self.loss_sum, self.total, strict=True)
        return PerMember(s / t if t else math.nan for s, t in pairs)


# -- one stacked step ---------------------------------------------------------------------------
class _Batch(tuple[torch.Tensor | None, ...]):
    """A stacked batch for `CohortTrainer.run`: (inputs, labels, *more, weights, active) and,
    on the host, which members take this step (`taking`) and how many of their samples it
    holds (`counts`)."""

    taking: list[bool]
    counts: list[int]


def _batch(tensors: Sequence[torch.Tensor | None], taking: list[bool], counts: list[int]) -> _Batch:
    out = _Batch(tensors)
    out.taking, out.counts = taking, counts
    return out


class CohortTrainer(Trainer):
    """A Trainer over stacked models: each member's batch from its own generator and data,
    one step for the members that take it, averages per member.

    `masked`: run every step on the whole stack, masking finished members (default: when it
    captures CUDA graphs, which need one shape); otherwise only the members still in their
    epoch run."""

    def __init__(self, members: Sequence[Trainer], *, masked: bool | None = None) -> None:
        first = members[0]
        self.device = first.device
        self.generator = first.generator  # unused: each member draws from its own
        self.amp = first.amp
        self._amp_dtype = first._amp_dtype
        self._scaler = None
        self.graphs = first.graphs
        if first._scaler is not None:
            raise CohortUnsupported("fp16 loss scaling is per client")
        self.members = list(members)
        self.masked = self.graphs if masked is None else masked
        self._stepping: Stepping | None = None
        self._uneven = False  # the current loop's members take different numbers of steps
        self.stats = first.stats  # not used: each member's own stats are counted
        self._kept: OrderedDict[Any, StepRunner] = OrderedDict()  # see Trainer.run's keep
        self._held: dict[str, torch.Tensor] = {}  # see Trainer.held

    @property
    def size(self) -> int:
        return len(self.members)

    # -- batches ---------------------------------------------------------------------------
    def batches(
        self, x: torch.Tensor, y: torch.Tensor, batch_size: int, *more: torch.Tensor
    ) -> Iterator[Any]:
        """One epoch of each member, stacked: member i's own permutation of its own samples,
        `batch_size` at a time; a member whose epoch has ended sits the step out. `more`:
        packed as `x` (`logits`), gathered with it."""
        xs, ys = _packed(x), _packed(y)
        extra = [_packed(t) for t in more]
        n = self.size
        perms = [
            torch.randperm(size, generator=t.generator, device=t.device)
            for t, size in zip(self.members, ys.sizes, strict=True)
        ]
        steps = [math.ceil(size / batch_size) for size in ys.sizes]
        total = max(steps)
        self._uneven = len(set(steps)) > 1
        # The members still in their epoch are a prefix when the longest come first (as
        # run_stacked orders them); otherwise the whole stack runs, masked.
        masked = self.masked or steps != sorted(steps, reverse=True)
        # Each member's permutation at the start of its row, zeros after it: the rows' first
        # `size` places filled in order from all permutations end to end (a fixed number of
        # calls, where a row at a time took three a member).
        width = total * batch_size
        table = torch.zeros(n, width, dtype=torch.int64, device=self.device)
        filled = torch.arange(width, device=self.device) < torch.tensor(
            ys.sizes, device=self.device
        ).unsqueeze(1)
        table.masked_scatter_(filled, torch.cat(perms))
        table = table.view(n, total, batch_size).transpose(0, 1).contiguous()  # (S, N, B)
        # On the host: how many samples of its step s each member has (0: it sits it out).
        counts = [
            [max(0, min(batch_size, size - s * batch_size)) for size in ys.sizes]
            for s in range(total)
        ]
        padded = [any(0 < c < batch_size for c in row) for row in counts]
        # Masked, every step of the epoch is of one kind (one CUDA graph): weighted where a
        # batch is short or a member sits a step out, and masked only when one does (equal
        # members take plain steps, without a masked step's saving and restoring every row).
        mask = masked and any(0 in row for row in counts)
        if masked:
            padded = [mask or any(padded)] * total
        weights = _weight_table(counts, batch_size, self.device) if any(padded) else None
        # Who takes each step, on the device once per epoch (not a host-to-device copy a step).
        actives = torch.tensor(counts, device=self.device).gt(0).float() if mask else None
        for s in range(total):
            taking = [c > 0 for c in counts[s]]
            for t, c in zip(self.members, counts[s], strict=True):
                t.samples += c  # what each member's own epoch would count
            rows = n if masked else sum(taking)
            local = table[s, :rows]
            w = weights[s, :rows] if weights is not None and padded[s] else None
            active = actives[s] if actives is not None else None
            tensors = [p.gather(local, rows) for p in (xs, ys, *extra)]
            yield _batch((*tensors, w, active), taking, counts[s])

    def fresh_batches(
        self, x: torch.Tensor, y: torch.Tensor, batch_size: int, count: int
    ) -> Iterator[Any]:
        """`count` stacked fresh batches: each member's from its own generator, as
        `Trainer.sample_batch` draws it alone (min(batch_size, its samples), distinct)."""
        xs, ys = _packed(x), _packed(y)
        sizes = [min(batch_size, size) for size in ys.sizes]
        width = max(sizes)
        weights = None
        if len(set(sizes)) > 1:
            c = torch.tensor(sizes, dtype=torch.float32)
            weights = ((torch.arange(width) < c[:, None]) / c[:, None]).to(self.device)
        active = None  # every member takes every fresh batch: nothing to mask
        taking = [True] * self.size
        self._uneven = False
        rows = self.size
        for local in self._fresh_tables(ys.sizes, batch_size, count, width):
            batch = (xs.gather(local, rows), ys.gather(local, rows), weights, active)
            yield _batch(batch, taking, sizes)

    def _fresh_tables(
        self, sizes: Sequence[int], batch_size: int, count: int, width: int
    ) -> Iterator[torch.Tensor]:
        """Each step's (N, width) local indices: member i's rows of its own `index_draws`,
        padded to `width`. Where every member draws all `count` at once (the usual case), one
        table for all steps; otherwise member by member, a step at a time."""
        if count <= 0:
            return
        draws = [
            t.index_draws(size, batch_size, count)
            for t, size in zip(self.members, sizes, strict=True)
        ]
        if all(count <= Trainer.rows_per_draw(size) for size in sizes):
            table = torch.stack([_padded(next(d), width) for d in draws], dim=1)  # (S, N, W)
            yield from table
            return
        rows = [itertools.chain.from_iterable(d) for d in draws]
        for _ in range(count):
            yield torch.stack([_padded(next(r), width) for r in rows])

    def sample_batch(self, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> Any:
        """Outside `run`, a stacked batch of equal members' batches (padding needs `run`)."""
        xs, ys = _packed(x), _packed(y)
        if len({min(batch_size, s) for s in ys.sizes}) > 1:
            raise CohortUnsupported("members' batches of different sizes outside Trainer.run")
        (batch,) = self.fresh_batches(xs, ys, batch_size, 1)  # type: ignore[arg-type]
        return batch[0], batch[1]

    def epoch(self, n: int, batch_size: int) -> Any:
        raise CohortUnsupported("index batches are per client")

    def _images(self, x: torch.Tensor) -> bool:
        return _packed(x).base.dim() == 4

    def _moved(
        self, batch: tuple[Any, ...], shift: int, teacher: nn.Module, mix: bool = False
    ) -> _Batch:
        """`Trainer._moved` for the stack: each member's images moved, then with `mix` mixed,
        as they would be alone (its offsets, permutation and weights drawn from its own random
        stream, for the samples of its batch, in the order alone draws them), and the stacked
        teacher labelling the stacked batch."""
        stacked = cast(_Batch, batch)
        inputs, yb, weights, active = stacked
        xb = cast(torch.Tensor, inputs)
        rows, width = xb.shape[:2]
        members = list(zip(self.members[:rows], stacked.counts, strict=False))
        if shift > 0:
            draws = torch.zeros(2, rows, width, 1, dtype=torch.int64, device=self.device)
            for i, (t, c) in enumerate(members):
                if c:  # (padding, and a member sitting the step out, draw nothing)
                    draws[:, i, :c] = shift_draws(c, shift, t.generator, self.device)
            xb = moved_by(xb.flatten(0, 1), shift, draws.flatten(1, 2)).view(xb.shape)
        if mix:
            xb, yb = self._mixed(xb, cast(torch.Tensor, yb), members)
        labels = self._labels(teacher, xb)
        return _batch((xb, yb, labels, weights, active), stacked.taking, stacked.counts)

    def _mixed(
        self, xb: torch.Tensor, yb: torch.Tensor, members: list[tuple[Trainer, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A stacked batch (rows, B, ...) mixed member by member as `mixed` mixes one batch:
        each member's `mix_draws` from its own stream (none for fewer than two samples), its
        padding mixed with itself at weight 1, which leaves it as it was."""
        rows, width = yb.shape
        other = torch.arange(rows * width, device=self.device).view(rows, width)
        lam = torch.ones(rows, width, device=self.device)
        for i, (t, c) in enumerate(members):
            if c >= 2:
                perm, lam[i, :c] = mix_draws(c, t.generator, self.device)
                other[i, :c] = perm + i * width
        x, y = mixed_by(xb.flatten(0, 1), yb.flatten(), other.flatten(), lam.flatten())
        return x.view(xb.shape), y.view(yb.shape)

    @torch.no_grad()
    def _labels(self, teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The stacked `teacher`'s logits (fp32) for a stacked batch `x` (rows, B, ...)."""
        was_training = teacher.training
        teacher.eval()
        try:
            with self.autocast():
                return teacher(x).float()
        finally:
            teacher.train(was_training)

    def rng_state(self) -> Any:
        """Every member's random stream's state, in the stack's order."""
        return [t.generator.get_state() for t in self.members]

    def set_rng_state(self, state: Any) -> None:
        """Restore `rng_state()`'s output: each member draws the same batches again."""
        for t, s in zip(self.members, state, strict=True):
            t.generator.set_state(s)

    @torch.no_grad()
    def logits(self, model: nn.Module, x: torch.Tensor, batch_size: int | None = None) -> Any:
        """Each member's stacked model over its own samples of `x` (packed), packed as `x`:
        rows that `batches` gathers with it (a fixed teacher's logits for every step)."""
        sizes = _packed(x).sizes
        offsets = torch.tensor(cumulative(sizes), device=self.device)
        out: torch.Tensor | None = None
        for rows, start, _, counted, z in self._forwards(model, x):
            if out is None:
                out = torch.empty(sum(sizes), z.shape[-1], device=self.device)
            at = offsets[:rows, None] + torch.arange(start, start + z.shape[1], device=self.device)
            out[at[counted]] = z[counted]
        if out is None:  # no member has samples
            out = torch.empty(0, 0, device=self.device)
        return Packed.of_rows(out, sizes)

    # -- the loop --------------------------------------------------------------------------
    def run(
        self,
        step: Step,
        batches: Iterable[tuple[torch.Tensor, ...]],
        values: int = 1,
        *,
        keep: Sequence[object] = (),
    ) -> list[Any]:
        """`Trainer.run` for the stack: the step runs once per stacked batch for the members
        taking it; each value's mean is per member, over the steps it took. A captured step
        is kept as `Trainer.run` keeps it, for a stack kept from round to round
        (`coordinator.stacking.run_stacked`), whose tensors stay where they are."""
        n = self.size
        runner, key = self._runner(self._stepper(step), keep)
        graphs = runner.graphs
        sums = torch.zeros(values, n, device=self.device)
        taken, replayed = [0] * n, [0] * n
        for batch in batches:
            taking = getattr(batch, "taking", None)
            if taking is None:
                raise CohortUnsupported("a stacked loop runs on the cohort trainer's batches")
            out = torch.stack([v.float() for v in runner(*batch)])  # (values, rows)
            active = batch[-1]
            if active is not None:
                sums.add_(out * active)
            else:
                sums[:, : out.shape[1]].add_(out)
            taken = [k + t for k, t in zip(taken, taking, strict=True)]
            if runner.last_replayed:
                replayed = [k + t for k, t in zip(replayed, taking, strict=True)]
        self._uneven = False
        for t, k, r in zip(self.members, taken, replayed, strict=True):
            t.stats.steps += k
            t.stats.stacked += k
            t.stats.replayed += r
        self.members[0].stats.graphs += runner.graphs - graphs  # the stack's, counted once
        if key is not None and runner.graphs:
            self._keep(footprint(*keep), runner)
        means = (sums / torch.tensor(taken, device=self.device).clamp(min=1)).tolist()
        for row in means:
            _check_finite([v for v, k in zip(row, taken, strict=True) if k])
        return [
            PerMember(v if k else math.nan for v, k in zip(row, taken, strict=True))
            for row in means
        ]

    def _stepper(self, step: Step) -> Callable[..., Sequence[torch.Tensor]]:
        def stepped(*batch: torch.Tensor | None) -> Sequence[torch.Tensor]:
            *tensors, weights, active = batch  # (inputs, labels, *more, weights, active)
            rows = cast(torch.Tensor, tensors[0]).shape[0]
            self._stepping = Stepping(rows, active)
            try:
                with stacked_batch(StackedBatch(rows, weights)):
                    return step(*tensors)
            finally:
                self._stepping = None

        return stepped

    def step(
        self,
        loss: torch.Tensor,
        optimizers: Iterable[torch.optim.Optimizer],
        *,
        clip: Iterable[tuple[Iterable[nn.Parameter], float]] = (),
    ) -> torch.Tensor:
        """Trainer.step for the stack: one backward of the members' summed losses, each
        member's gradient clipped to its own norm, and the optimizers' update undone for the
        members not taking this step."""
        optimizers = list(optimizers)
        if self._uneven and any(isinstance(o, torch.optim.Adam) for o in optimizers):
            raise CohortUnsupported("Adam counts its steps per client and they differ")
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.sum().backward()
        self._clip(clip)
        frozen = Frozen(optimizers, self._stepping, self.size)
        for opt in optimizers:
            opt.step()
        frozen.restore()
        return loss.detach()

    def _clip(self, clip: Iterable[tuple[Iterable[nn.Parameter], float]]) -> None:
        """Each member's gradient scaled to at most `max_norm` (its own total 2-norm), as
        `torch.nn.utils.clip_grad_norm_` does for one client."""
        for params, max_norm in clip:
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                continue
            # Each row's norm over the row's own dimensions: `flatten(1)` would copy the
            # gradients held transposed (a linear layer's, see cohort._transposed), 6x the time
            # of the norms for a stack of 100 mlps.
            norms = torch.stack(
                [torch.linalg.vector_norm(g, dim=tuple(range(1, g.dim()))) for g in grads]
            )  # (params, N)
            coef = (max_norm / (norms.norm(dim=0) + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(coef.view(-1, *[1] * (g.dim() - 1)))

    # -- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
        """Each member's stacked model on its own samples: StackedEval (one value each)."""
        n = self.size
        correct = torch.zeros(n, dtype=torch.int64, device=self.device)
        loss_sum = torch.zeros(n, device=self.device)
        for rows, _, counted, right, nll in self._chunks(model, x, y):
            loss_sum[:rows] += (nll * counted).sum(1)
            correct[:rows] += (right & counted).sum(1)
        return StackedEval(
            correct=PerMember(correct.tolist()),
            total=PerMember(_packed(y).sizes),
            loss_sum=PerMember(loss_sum.tolist()),
        )

    @torch.no_grad()
    def scores(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[Score]:
        """Each member's stacked model on its own samples, as the guard scores a model: which
        samples it gets right (bool, on the CPU), its mean cross-entropy and how many it gets
        right."""
        sizes = _packed(y).sizes
        longest = max(sizes, default=0)
        right_all = torch.zeros(self.size, longest, dtype=torch.bool, device=self.device)
        loss_sum = torch.zeros(self.size, device=self.device)
        for rows, start, counted, right, nll in self._chunks(model, x, y):
            right_all[:rows, start : start + right.shape[1]] = right & counted
            loss_sum[:rows] += (nll * counted).sum(1)
        right_cpu, sums = right_all.cpu(), loss_sum.tolist()
        counts = right_cpu.sum(1).tolist()
        return [  # hits: views of one tensor made here (a few bytes a member), never changed
            Score(
                row if k == longest else row[:k],
                sums[i] / k if k else math.nan,
                counts[i],
            )
            for i, (row, k) in enumerate(zip(right_cpu.unbind(0), sizes, strict=True))
        ]

    def _chunks(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor
    ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """`_forwards` scored: (rows, the chunk's first position, and (rows, c): which samples
        count, which it gets right, their cross-entropy)."""
        ys = _packed(y)
        for rows, start, local, counted, z in self._forwards(model, x):
            labels = ys.gather(local, rows)
            nll = nn.functional.cross_entropy(
                z.flatten(0, 1), labels.flatten(), reduction="none"
            ).view(labels.shape)
            yield rows, start, counted, z.argmax(-1) == labels, nll

    def _forwards(
        self, model: nn.Module, x: torch.Tensor
    ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The stacked model over each member's own samples of `x`, chunk by chunk: (rows, the
        chunk's first position, and of its (rows, c) samples: their indices in each member's
        own, which count, their logits (rows, c, C) in fp32).

        The members that still have samples run (the first `rows` of the stack, as in
        training: the longest come first), a member's last chunk padded and its padding not
        counted, so no member costs more than its own samples."""
        xs = _packed(x)
        sizes = xs.sizes
        # Samples a forward, all members together at most a budget (activations are held for
        # the whole stack at once). On the CPU the stack's forwards cost calls more than
        # arithmetic (a PFML evaluation of 100 MLR clients made 100 calls of 64 samples each
        # per member), so the budget is what 8 MB of inputs holds, at least 1024 samples.
        if self.device.type == "cuda":
            per_member, budget = 1024, 32768
        else:
            per_sample = max(1, math.prod(xs.base.shape[1:]))
            budget = max(_CPU_CHUNK_MIN, _CPU_CHUNK_VALUES // per_sample)
            per_member = budget
        last = torch.tensor([max(0, k - 1) for k in sizes], device=self.device)
        start, longest = 0, max(sizes, default=0)
        was_training = model.training
        model.eval()
        try:
            while start < longest:
                rows = 1 + max(i for i, k in enumerate(sizes) if k > start)
                chunk = max(1, min(per_member, budget // rows, longest - start))
                position = torch.arange(start, start + chunk, device=self.device)
                local = torch.minimum(position[None, :], last[:rows, None])  # (rows, c)
                with self.autocast():
                    z = model(xs.gather(local, rows)).float()  # (rows, c, C)
                counted = position[None, :] <= last[:rows, None]
                if any(k <= start for k in sizes[:rows]):  # a member without samples here
                    counted &= torch.tensor([k > start for k in sizes[:rows]], device=self.device)[
                        :, None
                    ]
                yield rows, start, local, counted, z
                start += chunk
        finally:
            model.train(was_training)


# A stacked evaluation's forward on the CPU: what 8 MB of float inputs holds, at least 1024
# samples (all members together).
_CPU_CHUNK_VALUES, _CPU_CHUNK_MIN = 2 << 20, 1024


def _packed(t: Any) -> Packed:
    if not isinstance(t, Packed):
        raise CohortUnsupported("a stacked trainer draws from the stacked data's splits")
    return t


def _weight_table(counts: list[list[int]], batch_size: int, device: torch.device) -> torch.Tensor:
    """(S, N, B): at step s, each sample's weight in member n's mean: 1/count for its first
    `count` samples, 0 for padding (and for every sample of a member sitting the step out)."""
    c = torch.tensor(counts, dtype=torch.float32)  # (S, N), built on the host
    position = torch.arange(batch_size, dtype=torch.float32)
    return ((position < c[..., None]) / c.clamp(min=1)[..., None]).to(device)


def _padded(idx: torch.Tensor, width: int) -> torch.Tensor:
    """Indices (…, k) padded with zeros to (…, width) (the padding is weighted 0)."""
    if idx.shape[-1] == width:
        return idx
    return F.pad(idx, (0, width - idx.shape[-1]))
