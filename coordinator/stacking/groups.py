"""A fleet's stacking: the tasks of one group executed as one stacked call, for a run's lifetime.

What a fleet learns while it stacks lives here, in an object the fleet owns, not in the process:
the stacks kept between rounds (`KeptStacks`), the largest stack that fitted in memory per
algorithm, architecture and device, and which algorithms it has said train stacked. A second
fleet in the same process (a sweep, a test) starts from none of it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import torch

from coordinator.stacking.cohort import run_stacked
from coordinator.stacking.kept import KeptStacks
from edge_sdk.algorithms import ClientAlgorithm, FitResult
from edge_sdk.algorithms.members import CohortUnsupported
from edge_sdk.device import exclusive
from edge_sdk.node import ClientNode, NodeTask

__all__ = ["Stacking"]

log = logging.getLogger(__name__)


class Stacking:
    """Executes begun tasks of one group (equal `NodeTask.group_key`) together, for one fleet."""

    def __init__(self) -> None:
        self.kept = KeptStacks()
        # The largest stack that fitted in memory, per (algorithm, architecture, device): a
        # stack that ran out of GPU memory is halved, and later rounds start from the half.
        self.limits: dict[tuple[str, str, str], int] = {}
        self._told: set[type[ClientAlgorithm]] = set()

    def execute_together(
        self, nodes: Sequence[ClientNode], tasks: Sequence[NodeTask]
    ) -> list[FitResult | Exception]:
        """Execute begun tasks of one group as one call: the tasks of an algorithm that can run
        stacked (`ClientAlgorithm.stackable`: its fit, evaluation and finalize) run once on
        models with a leading client dimension (`coordinator.stacking.cohort`), in stacks small
        enough for the device's memory; whatever cannot stack runs node by node, from the same
        state and random generators. Each node gets its own result, or the exception its task
        raised. A GPU they run on is held meanwhile (`edge_sdk.device.exclusive`)."""
        with exclusive(nodes[0].device):
            return self._execute(nodes, tasks)

    def _execute(
        self, nodes: Sequence[ClientNode], tasks: Sequence[NodeTask]
    ) -> list[FitResult | Exception]:
        out: list[FitResult | Exception | None] = [None] * len(nodes)
        same_params = all(t.params == tasks[0].params for t in tasks)
        if len(nodes) > 1 and same_params:
            algos = [n.current() for n in nodes]
            if type(algos[0]).stackable:
                for chunk, results in self._stacked(algos, tasks):
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
        self, algos: Sequence[ClientAlgorithm], tasks: Sequence[NodeTask]
    ) -> Iterator[tuple[list[int], list[FitResult]]]:
        """(members, their results) of each stack that trained; members of a stack that could
        not are left out (they train one by one)."""
        first, task = algos[0], tasks[0]
        key = (first.name, first.ctx.spec.to_json(), str(first.ctx.device))
        limit = self.limits.get(key, len(algos))
        # Members whose tasks carry models of other architectures (FedMe's exchanged models)
        # stack apart: a stack's incoming models are one architecture each.
        kinds: dict[tuple[tuple[str, str], ...], list[int]] = {}
        for i, t in enumerate(tasks):
            kind = tuple(sorted((name, m.spec.to_json()) for name, m in t.models.items()))
            kinds.setdefault(kind, []).append(i)
        pending = [
            group[i : i + limit] for group in kinds.values() for i in range(0, len(group), limit)
        ]
        # Kept between rounds where the device captures its steps (CUDA graphs), which the
        # stack keeps with it.
        kept = self.kept if first.ctx.trainer.graphs else None
        while pending:
            chunk = pending.pop(0)
            if len(chunk) < 2:
                continue  # a stack of one is that client alone
            self._tell(type(first), len(chunk))
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
                continue
            yield chunk, results

    def tell_alone(self, cls: type[ClientAlgorithm], clients: int) -> None:
        """Once per algorithm class: that its clients train one by one, and why (it does not
        declare `stackable`)."""
        if cls in self._told:
            return
        self._told.add(cls)
        log.info(
            "%s: %d clients of one architecture train one by one: the algorithm does not "
            "declare stackable = True (a round written with the context's trainer, model "
            "builders, losses and per-client values can: docs, Extending edgefl)",
            cls.name,
            clients,
        )

    def _tell(self, cls: type[ClientAlgorithm], members: int) -> None:
        """Once per algorithm class: that its clients train stacked. An algorithm from outside
        the SDK (a plugin) is told at WARNING: it may have inherited `stackable` unknowingly."""
        if cls in self._told:
            return
        self._told.add(cls)
        own = cls.__module__.startswith("edge_sdk.algorithms.")
        origin = next(c for c in cls.__mro__ if "stackable" in vars(c))
        inherited = "" if origin is cls else f", inherited from {origin.__name__}"
        log.log(
            logging.INFO if own else logging.WARNING,
            "%s: %d clients of one architecture train stacked, as one model whose parameters "
            "carry a leading client dimension (stackable = True%s): train_round runs once for "
            "all of them, so it may use only the context's trainer, model builders and losses. "
            "Set stackable = False on the class, or --set cohort=false, to train client by "
            "client",
            cls.name,
            members,
            inherited,
        )
