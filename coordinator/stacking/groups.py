"""A fleet's stacking: the tasks of one group executed as one stacked call, for a run's lifetime.

Every algorithm is tried stacked, except one whose clients read each other's models during a
round (`exchanges_models`: FedeRiCo). The SDK's own algorithms are held to client-by-client
results by its tests; an algorithm from outside the SDK (a plugin) is checked by the fleet
instead: the first time each of its phases runs stacked, one member runs it again alone, from
the same state and random generator, and the two must agree to float rounding. One that does
not trains client by client for the rest of the run, and the log says why.

What a fleet learns while it stacks lives here, in an object the fleet owns, not in the process:
the stacks kept between rounds (`KeptStacks`), the largest stack that fitted in memory per
algorithm, architecture and device, which algorithms were checked or refused, and what it has
said. A second fleet in the same process (a sweep, a test) starts from none of it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from coordinator.run_config import CohortMode
from coordinator.stacking.cohort import run_stacked
from coordinator.stacking.kept import KeptStacks
from coordinator.stacking.pays import unpaid
from coordinator.stacking.state import state_kind
from edge_sdk.algorithms import ClientAlgorithm, FitResult
from edge_sdk.algorithms.members import CohortUnsupported
from edge_sdk.codec import WireModel
from edge_sdk.device import exclusive
from edge_sdk.node import ClientNode, NodeTask
from model_zoo import ArchSpec

__all__ = ["Stacking", "disagreement"]

log = logging.getLogger(__name__)

# How far a checked stacked phase may be from the same phase alone: the distance between the
# two models as a fraction of the model's norm, or a metric's difference as a fraction of the
# larger (of at least 1). Stacking reorders float sums (grouped convolutions, batched matrix
# products): float32 lands within about 1e-7 of the weights after a round (mlr, mlp, cnn1,
# cnn2 on the CPU); bfloat16 autocast rounds every product to 8 bits of mantissa (not yet
# measured on a GPU).
TOLERANCE = {"float32": 1e-4, "autocast": 3e-2}


def _trusted(cls: type[ClientAlgorithm]) -> bool:
    """The SDK's own algorithms, whose stacked phases its tests hold to client by client."""
    return cls.__module__.startswith("edge_sdk.algorithms.")


class Stacking:
    """Executes begun tasks of one group (equal `NodeTask.group_key`) together, for one fleet."""

    def __init__(self, mode: CohortMode = "auto") -> None:
        self.mode = mode  # "auto": groups stack where it pays; "always"; "never"
        self.kept = KeptStacks()
        # The largest stack that fitted in memory, per (algorithm, architecture, device): a
        # stack that ran out of GPU memory is halved, and later rounds start from the half.
        self.limits: dict[tuple[str, str, str], int] = {}
        self._checked: set[tuple[type[ClientAlgorithm], str]] = set()  # (class, phase) agreed
        self._refused: dict[type[ClientAlgorithm], str] = {}  # class -> why it trains alone
        self._told: set[object] = set()  # classes, and (class, architecture) that do not pay
        self._kinds: dict[str, str | None] = {}  # architecture (JSON) -> pays.kind

    def stacks(
        self,
        cls: type[ClientAlgorithm],
        specs: Sequence[ArchSpec],
        device: torch.device,
        clients: int,
        parallel: int,
    ) -> bool:
        """Whether a group of `clients` of `cls` on `device` is tried stacked, whose models are
        of architectures `specs` (their own first, then those their tasks bring), `parallel`
        jobs training at once; if not, said once, with why."""
        if self.mode == "never":
            return False
        why = self._why_alone(cls)
        if why is not None:
            self._tell(cls, f"{clients} clients of one architecture train one by one: {why}")
            return False
        why = (
            None if self.mode == "always" else unpaid(specs, device, clients, parallel, self._kinds)
        )
        if why is not None:
            what = f"{clients} clients of {specs[0].family} train one by one: {why}"
            self._tell(cls, what, key=(cls, *(spec.to_json() for spec in specs)))
        return why is None

    def _why_alone(self, cls: type[ClientAlgorithm]) -> str | None:
        if cls.exchanges_models:
            return "they read each other's models during a round (exchanges_models)"
        return self._refused.get(cls)

    def execute_together(
        self, nodes: Sequence[ClientNode], tasks: Sequence[NodeTask]
    ) -> list[FitResult | Exception]:
        """Execute begun tasks of one group as one call: stacked where the algorithm can be (its
        fit, evaluation and finalize run once on models with a leading client dimension,
        `coordinator.stacking.cohort`), in stacks small enough for the device's memory;
        whatever cannot stack runs node by node, from the same state and random generators.
        Each node gets its own result, or the exception its task raised. A GPU they run on is
        held meanwhile (`edge_sdk.device.exclusive`)."""
        with exclusive(nodes[0].device):
            return self._execute(nodes, tasks)

    def _execute(
        self, nodes: Sequence[ClientNode], tasks: Sequence[NodeTask]
    ) -> list[FitResult | Exception]:
        out: list[FitResult | Exception | None] = [None] * len(nodes)
        same_params = all(t.params == tasks[0].params for t in tasks)
        if len(nodes) > 1 and same_params:
            algos = [n.current() for n in nodes]
            if self._why_alone(type(algos[0])) is None:
                for chunk, results in self._stacked(nodes, algos, tasks):
                    for i, result in zip(chunk, results, strict=True):
                        out[i] = result
        for i, (node, task) in enumerate(zip(nodes, tasks, strict=True)):
            if out[i] is None:
                try:
                    out[i] = node.execute(task)
                except Exception as exc:  # that client's error
                    out[i] = exc
        return [r for r in out if r is not None]

    def _stacked(
        self,
        nodes: Sequence[ClientNode],
        algos: Sequence[ClientAlgorithm],
        tasks: Sequence[NodeTask],
    ) -> Iterator[tuple[list[int], list[FitResult]]]:
        """(members, their results) of each stack that trained; members of a stack that could
        not are left out (they train one by one)."""
        first, task = algos[0], tasks[0]
        cls = type(first)
        key = (first.name, first.ctx.spec.to_json(), str(first.ctx.device))
        limit = self.limits.get(key, len(algos))
        # Members whose tasks carry models of other architectures (FedMe's exchanged models)
        # stack apart: a stack's incoming models are one architecture each. So do members whose
        # state differs in kind (`state_kind`: in a population, clients never sampled hold no
        # meme or optimizer yet).
        kinds: dict[tuple[Any, ...], list[int]] = {}
        for i, t in enumerate(tasks):
            models = tuple(sorted((name, m.spec.to_json()) for name, m in t.models.items()))
            kinds.setdefault((models, state_kind(algos[i])), []).append(i)
        pending = [
            group[i : i + limit] for group in kinds.values() for i in range(0, len(group), limit)
        ]
        # Kept between rounds where the device captures its steps (CUDA graphs), which the
        # stack keeps with it.
        kept = self.kept if first.ctx.trainer.graphs else None
        while pending:
            chunk = pending.pop(0)
            if len(chunk) < 2 or cls in self._refused:
                continue  # a stack of one is that client alone
            check = not _trusted(cls) and (cls, task.phase) not in self._checked
            before = [algos[i].state_dict() for i in chunk] if check else []
            try:
                results = run_stacked(
                    [algos[i] for i in chunk],
                    task.phase,
                    task.round,
                    task.rounds,
                    [tasks[i].models for i in chunk],
                    kept=kept,
                )
            except torch.OutOfMemoryError:
                half = len(chunk) // 2
                self.limits[key] = half
                log.info("a stack of %d clients ran out of memory; stacks of %d", len(chunk), half)
                self.kept.clear()
                if first.ctx.device.type == "cuda":
                    torch.cuda.empty_cache()
                pending[:0] = [chunk[:half], chunk[half:]]
                continue
            except CohortUnsupported as exc:
                log.info("%d clients train one by one: %s", len(chunk), exc)
                continue
            except Exception as exc:  # each member gets its own error one by one
                log.info(
                    "stacked %s failed (%s); %d clients one by one", task.phase, exc, len(chunk)
                )
                if check:  # never seen to work: not tried again in this run
                    self._refuse(cls, f"its stacked {task.phase} failed ({exc})")
                continue
            if check and not self._agrees(nodes, algos, tasks, chunk, results, before):
                continue
            self._tell(cls, f"{len(chunk)} clients of one architecture train stacked{_how(cls)}")
            yield chunk, results

    def _agrees(
        self,
        nodes: Sequence[ClientNode],
        algos: Sequence[ClientAlgorithm],
        tasks: Sequence[NodeTask],
        chunk: list[int],
        results: list[FitResult],
        before: list[dict[str, Any]],
    ) -> bool:
        """The check of a plugin's stacked phase: its first member's phase run again alone,
        from the state and random generator it started from, agrees with its stacked result.
        Then the member keeps what it did alone (`results[0]` becomes that); otherwise every
        member is put back as it was before the stack and the class is refused."""
        i, cls, phase = chunk[0], type(algos[chunk[0]]), tasks[chunk[0]].phase
        algos[i].load_state_dict(before[0])
        try:
            alone: FitResult | Exception = nodes[i].execute(tasks[i])
        except Exception as exc:  # its own error alone: it runs again one by one
            alone = exc
        if isinstance(alone, Exception):
            why: str | None = f"alone it raised {alone!r}"
        else:
            why = disagreement(results[0], alone, _tolerance(algos[i]))
            if why is None:
                self._checked.add((cls, phase))
                results[0] = alone
                return True
        for k, j in enumerate(chunk):
            algos[j].load_state_dict(before[k])
        self._refuse(
            cls,
            f"its stacked {phase} does not give what one client's gives alone ({why}). A round "
            "that sums over a model's parameters or a batch, or draws random numbers outside "
            "the context's trainer, does this; call self._alone(why) in the round to say it "
            "cannot stack",
        )
        return False

    def _refuse(self, cls: type[ClientAlgorithm], why: str) -> None:
        """`cls` trains client by client for the rest of this run, said at WARNING."""
        self._refused[cls] = why
        self.kept.clear()
        self._told.discard(cls)
        self._tell(cls, f"its clients train one by one for the rest of the run: {why}", True)

    def _tell(
        self, cls: type[ClientAlgorithm], what: str, warn: bool = False, key: object = None
    ) -> None:
        """Once per algorithm class (once more when it is refused), or per `key` where given
        (a class and the architectures that do not pay): whether it stacks."""
        key = cls if key is None else key
        if key in self._told:
            return
        self._told.add(key)
        log.log(logging.WARNING if warn else logging.INFO, "%s: %s", cls.name, what)


def _how(cls: type[ClientAlgorithm]) -> str:
    if _trusted(cls):
        return ""
    return (
        ", as one model whose parameters carry a leading client dimension: each phase is "
        "checked once against one client alone, the first time it stacks (--set cohort=false "
        "trains client by client)"
    )


def _tolerance(algo: ClientAlgorithm) -> float:
    return TOLERANCE["autocast" if algo.ctx.trainer.amp else "float32"]


def disagreement(stacked: FitResult, alone: FitResult, tol: float) -> str | None:
    """How a stacked phase's result for one client differs from the same phase alone beyond
    `tol` (see TOLERANCE), in words; None where they agree."""
    if stacked.n_samples != alone.n_samples:
        return f"it reports {stacked.n_samples} samples stacked, {alone.n_samples} alone"
    if stacked.models.keys() != alone.models.keys():
        return f"it replies {sorted(stacked.models)} stacked, {sorted(alone.models)} alone"
    for name, model in alone.models.items():
        far = _distance(stacked.models[name], model)
        if far is None:
            return f"its model {name!r} differs in architecture"
        if far > tol:
            return f"its model {name!r} is {far:.2g} of its norm away"
    if stacked.metrics.keys() != alone.metrics.keys():
        return f"it reports {sorted(stacked.metrics)} stacked, {sorted(alone.metrics)} alone"
    for key, a in alone.metrics.items():
        s = stacked.metrics[key]
        # (a count of samples predicted right may differ by one where a logit's rounding tips)
        slack = 1.0 if float(a).is_integer() and float(s).is_integer() else 0.0
        if not abs(s - a) <= slack + tol * max(1.0, abs(a), abs(s)):
            return f"its {key} is {s:.6g} stacked, {a:.6g} alone"
    return None


def _distance(a: WireModel, b: WireModel) -> float | None:
    """‖a − b‖ / ‖b‖ over all their tensors; None where their architectures differ."""
    if a.spec != b.spec or a.weights.keys() != b.weights.keys():
        return None
    diff = norm = 0.0
    for k, t in b.weights.items():
        x, y = a.weights[k].detach().double().cpu(), t.detach().double().cpu()
        if x.shape != y.shape:
            return None
        diff += float((x - y).pow(2).sum())
        norm += float(y.pow(2).sum())
    return math.sqrt(diff) / max(math.sqrt(norm), 1e-12)
