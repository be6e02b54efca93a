"""LocalFleet: the simulator's clients as `ClientNode`s in this process.

No transport, no serialisation, no thread per client, no timers. A phase runs in three passes
over its tasks (see `edge_sdk.node`): every node `begin`s (so what peers must see is out before
any node reads it: FedeRiCo's exchange needs no waiting), then the tasks execute group by group,
then every node `end`s (persistence, export). A group is the tasks of one deterministic key
(architecture, algorithm, config, round, phase, step) and runs through one call of the fleet's
`Stacking` (coordinator.stacking): the tasks of an algorithm that runs stacked (its fit,
evaluation and finalize) run as one stacked model.
Up to `parallel` groups (or single clients, for what does not stack) run at once on a small
pool of worker threads.

Replies are checked as a NetworkFleet checks them after decoding them (the same `check_reply`
and the same weight checks: finite values, names and shapes that fit the architecture), and what
a device could not have sent (a non-finite metric) becomes a failed task. Models cross by
reference, never copied: algorithms and strategies treat received weights as read-only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import torch

from coordinator.fleet.base import (
    Fleet,
    PhaseRequest,
    RunInfo,
    Validator,
    admit,
    client_cost,
)
from coordinator.run_config import CohortMode, cohort_mode
from coordinator.stacking import Stacking
from coordinator.strategies import FitReply
from edge_sdk.algorithms import FitResult, algorithm_class
from edge_sdk.codec import WireModel, check_weights
from edge_sdk.device import cpu_threads
from edge_sdk.model_blobs import reference_shapes
from edge_sdk.node import ClientNode, NodeTask
from edge_sdk.peers import PeerBoard
from model_zoo import is_network

__all__ = ["IdleState", "LocalFleet"]

IdleState = Literal["memory", "host", "disk"]

log = logging.getLogger(__name__)

IDLE_PREFIX = "edgefl-idle-"  # idle_state = "disk" without an idle_dir: a temporary folder
IDLE_OWNER = "owner"  # in it: "MACHINE PID" of the process it belongs to (`_machine`)


def idle_scratch() -> tempfile.TemporaryDirectory[str]:
    """A temporary folder for parked client states, which the process removes as it exits,
    stamped with this process. A process that was killed (SIGKILL, the OOM killer, a launcher
    stopping its ranks) cannot remove its own, and a population's states can be gigabytes: the
    folders of such processes on this machine are removed first (`sweep_idle_scratch`)."""
    sweep_idle_scratch()
    scratch = tempfile.TemporaryDirectory(prefix=IDLE_PREFIX)
    (Path(scratch.name) / IDLE_OWNER).write_text(f"{_machine()} {os.getpid()}")
    return scratch


def _machine() -> str:
    """This machine, as the ranks tell machines apart (`coordinator.distributed.machine`: its
    host name and boot id, so that machines of one host name sharing a temporary folder differ)."""
    from coordinator.distributed import machine  # (it imports the fleets)

    return machine()


def sweep_idle_scratch(root: str | Path | None = None) -> list[Path]:
    """Remove the `idle_scratch` folders under `root` (default: the temporary folder) whose
    process, on this machine and of this user, no longer runs; the folders removed. A folder of
    another machine or user, without its stamp, or whose process still runs is left alone."""
    if os.name != "posix":  # os.kill(pid, 0) is how a process is found, POSIX only
        return []
    here, gone = _machine(), []
    for folder in sorted(Path(root or tempfile.gettempdir()).glob(IDLE_PREFIX + "*")):
        try:
            owner, pid = (folder / IDLE_OWNER).read_text().rsplit(" ", 1)
            if owner != here or folder.stat().st_uid != os.getuid() or _runs(int(pid)):
                continue
        except (OSError, ValueError):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        gone.append(folder)
    if gone:
        log.info(
            "removed %d folder(s) of parked client states left by processes that were killed: %s",
            len(gone),
            ", ".join(str(f) for f in gone),
        )
    return gone


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


class LocalFleet(Fleet):
    """`nodes` as the clients of a run. `threads`: the CPU threads this fleet trains with
    (default: those this process may use, `edge_sdk.device.cpu_threads`). `parallel`: how many
    groups train at once, each with an equal share of the threads (default: one per thread).
    `stack`: whether compatible tasks run as one stacked model: "auto" where that pays
    (`coordinator.stacking.pays`), "always", "never" (one by one; True is "auto", False
    "never"). `fp16_upload`:
    replies are rounded through fp16, as a client uploading in fp16 would send them.

    `idle`: where a client's state waits between its tasks. "memory": its live models, as a
    device holds them. "host" or "disk": as the bytes of a state file, in host memory or in a
    file under `idle_dir` (default: a temporary folder), its models and optimizers let go
    (`ClientNode.park`); a phase then runs its tasks `chunk` at a time (the round's cohort),
    so that memory is bounded by the cohort, not the population. Algorithms whose clients
    exchange models with each other (FedeRiCo) run a phase's tasks all at once."""

    def __init__(
        self,
        nodes: Sequence[ClientNode],
        *,
        parallel: int | None = None,
        threads: int | None = None,
        stack: CohortMode | bool = "auto",
        fp16_upload: bool = False,
        idle: IdleState = "memory",
        idle_dir: str | Path | None = None,
        chunk: int | None = None,
    ) -> None:
        super().__init__()
        self.nodes = {n.client_id: n for n in nodes}
        if len(self.nodes) != len(nodes):
            raise ValueError("two nodes share a client id")
        self.threads = max(1, threads or cpu_threads())
        self.parallel = max(1, parallel or self.threads)
        self.stacking = Stacking(cohort_mode(stack))  # what it learns, for this fleet alone
        self.fp16_upload = fp16_upload
        self.board = PeerBoard()
        self.idle = idle
        self.chunk = chunk
        self._idle_dir: Path | None = None
        self._scratch: tempfile.TemporaryDirectory[str] | None = None
        if idle == "disk":
            if idle_dir is None:
                self._scratch = idle_scratch()
                idle_dir = self._scratch.name
            self._idle_dir = Path(idle_dir)
            self._idle_dir.mkdir(parents=True, exist_ok=True)

    def open(self, run: RunInfo) -> None:
        self._run = run
        for cid, node in self.nodes.items():
            node.peers = self.board.channel(cid)

    def gather(self, timeout_s: float, min_clients: int | None) -> None:
        admit(self, [(c, n.spec, n.capabilities()) for c, n in self.nodes.items()], min_clients)

    def rejoin(self, run: RunInfo, timeout_s: float) -> None:
        """After the coordinator resumed from its checkpoint: each node continues from the
        state it saved (a node that never trained has none and starts as it would have)."""
        self.open(run)
        for node in self.nodes.values():
            node.restore()
        self.started = True

    def online(self) -> set[str]:
        return set(self.clients)

    def known_online(self) -> set[str]:
        return self.online()  # takes nothing in

    def await_back(self, timeout_s: float) -> None:
        """In-process clients never drop out."""

    def finish(self, reason: str) -> None:
        """Nothing to tell: the nodes are in this process."""

    def pause(self) -> None:
        """Nothing to tell: the nodes keep their state in memory (and in their state dirs)."""

    # -- phases ----------------------------------------------------------------------------
    def run_phase(self, request: PhaseRequest, validate: Validator) -> dict[str, FitReply | None]:
        self.check_stop(request.round)
        tasks = {cid: self._task(request, cid, models) for cid, models in request.plan.items()}
        results: dict[str, FitReply | None] = {cid: None for cid in tasks}
        ids = list(tasks)
        size = len(ids)
        if (
            self.idle != "memory"
            and self.chunk
            and not algorithm_class(self.run.algorithm).exchanges_models
        ):
            size = self.chunk
        for first in range(0, max(len(ids), 1), max(size, 1)):
            part = {cid: tasks[cid] for cid in ids[first : first + size]}
            self._run_part(request, part, results, validate, exchange=first == 0)
        self.check_stop(request.round)
        return results

    def _run_part(
        self,
        request: PhaseRequest,
        tasks: Mapping[str, NodeTask],
        results: dict[str, FitReply | None],
        validate: Validator,
        *,
        exchange: bool,
    ) -> None:
        """Begin, execute and end `tasks` (all of a phase's, or a chunk of them: `exchange`
        on the first, the only one that passes the peer board on), then park their nodes."""
        begun: dict[str, NodeTask] = {}
        for cid, task in tasks.items():  # everyone begins before anyone executes
            try:
                self.nodes[cid].begin(task)
                begun[cid] = task
            except Exception as exc:
                self._failed(cid, request, exc)
        if exchange:
            self._begun()
        outcomes = self._execute(begun)
        for cid, task in begun.items():
            outcome = outcomes[cid]
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                result = self.nodes[cid].end(task, outcome)
            except Exception as exc:
                self._failed(cid, request, exc)
                continue
            results[cid] = self._accept(cid, request, result, validate)
        if self.idle != "memory":
            for cid in tasks:
                self._park(self.nodes[cid], request.phase)

    def _park(self, node: ClientNode, phase: str) -> None:
        algo = node.algorithm
        if algo is None:
            return
        # An evaluation changes nothing but the attributes its algorithm names.
        changed = phase != "evaluate" or bool(type(algo).evaluation_keeps)
        where = None if self._idle_dir is None else self._idle_dir / f"{node.client_id}.state"
        node.park(where, changed=changed)

    def _begun(self) -> None:
        """Between the begin and execute passes of a phase: what peers published is on the board
        already, in one process (a fleet sharded over ranks exchanges it here)."""

    def _task(self, request: PhaseRequest, cid: str, models: Mapping[str, WireModel]) -> NodeTask:
        run = self.run
        return NodeTask(
            round=request.round,
            rounds=run.rounds,
            phase=request.phase,
            algorithm=run.algorithm,
            config=run.config,
            models=models,
            step=request.step,
            params=request.params.get(cid, {}),
            kept_round=request.kept_round,
        )

    def _execute(self, begun: Mapping[str, NodeTask]) -> dict[str, FitResult | Exception]:
        """Run the begun tasks group by group: a group that stacks as one job, anything
        else one job per client, up to `parallel` jobs at once."""
        groups: dict[tuple[object, ...], list[str]] = {}
        for cid, task in begun.items():
            key = (self.nodes[cid].spec.to_json(), *task.group_key())
            groups.setdefault(key, []).append(cid)
        jobs: list[tuple[list[str], bool]] = []  # (clients, whether they may be dealt apart)
        for ids in groups.values():
            node, task = self.nodes[ids[0]], begun[ids[0]]
            first = node.algorithm
            # (the networks they train: not the inputs a finalize task may carry)
            specs = [node.spec, *(m.spec for m in task.models.values() if is_network(m.spec))]
            if (
                first is not None
                and len(ids) > 1
                and self.stacking.stacks(type(first), specs, node.device, len(ids), self.parallel)
            ):
                jobs.append((ids, node.device.type == "cpu"))
            else:
                jobs.extend(([cid], False) for cid in ids)
        nodes = self.nodes
        jobs = _spread(
            jobs, self.parallel, lambda c: client_cost(nodes[c].spec, nodes[c].data.n_train)
        )

        def run(ids: list[str]) -> list[FitResult | Exception]:
            outs = self.stacking.execute_together(
                [self.nodes[c] for c in ids], [begun[c] for c in ids]
            )
            if self.finished is not None:
                self.finished(len(ids))
            return outs

        work = [ids for ids, _ in jobs]
        if self.parallel == 1 or len(work) == 1:
            with _threads_each(self.threads, 1):  # one job at a time: all of `threads`
                done = [run(ids) for ids in work]
        else:
            with (
                _threads_each(self.threads, self.parallel),
                ThreadPoolExecutor(self.parallel) as pool,
            ):
                done = list(pool.map(run, work))
        return {
            cid: out
            for ids, outs in zip(work, done, strict=True)
            for cid, out in zip(ids, outs, strict=True)
        }

    def _accept(
        self, cid: str, request: PhaseRequest, result: FitResult, validate: Validator
    ) -> FitReply | None:
        """The reply a NetworkFleet would have decoded from this result, checked alike."""
        bad = [k for k, v in result.metrics.items() if not math.isfinite(v)]
        if bad:
            self._failed(cid, request, ValueError(f"the reply does not validate: metrics {bad}"))
            return None
        return self.accepted(
            cid,
            request,
            lambda: FitReply(
                cid,
                {
                    name: self._uploaded(name, m, partial=name in request.partial)
                    for name, m in result.models.items()
                },
                dict(result.metrics),
                result.n_samples,
                result.details,
            ),
            validate,
        )

    def _uploaded(self, name: str, model: WireModel, *, partial: bool) -> WireModel:
        weights = model.weights
        if self.fp16_upload:
            weights = {
                k: v.to(torch.float16).to(torch.float32) if v.dtype == torch.float32 else v
                for k, v in weights.items()
            }
        check_weights(
            weights,
            reference_shapes(model.spec),
            what=name,
            partial=partial,
            max_abs=self.run.max_abs,
        )
        return WireModel(model.spec, weights)

    def _failed(self, cid: str, request: PhaseRequest, exc: Exception) -> None:
        log.error("%s failed its %s task: %s: %s", cid, request.phase, type(exc).__name__, exc)


def _spread(
    jobs: list[tuple[list[str], bool]], workers: int, size: Callable[[str], int]
) -> list[tuple[list[str], bool]]:
    """Stacks on the CPU dealt into smaller stacks until the jobs fill the `workers`: two
    stacks on one thread each, not one on two. A stack's step is a chain of small ops, and two
    threads on one op wait for each other at its end: on a machine that runs anything else, that
    wait made a stacked round slower than the same clients one by one (each alone on a thread).
    The stack of most work (`size`: a client's `client_cost`, samples × parameters) is halved
    first, its clients dealt by size in turn so that both halves hold as much work; a stack of
    fewer than four is left whole."""
    jobs = list(jobs)
    while len(jobs) < workers:
        apart = [i for i, (ids, may) in enumerate(jobs) if may and len(ids) >= 4]
        if not apart:
            break
        i = max(apart, key=lambda k: sum(map(size, jobs[k][0])))
        ids, _ = jobs.pop(i)
        by_size = sorted(ids, key=size, reverse=True)
        jobs[i:i] = [(by_size[0::2], True), (by_size[1::2], True)]
    return jobs


@contextlib.contextmanager
def _threads_each(threads: int, workers: int) -> Iterator[None]:
    """Give each of `workers` concurrently training threads an equal share of `threads` intra-op
    threads (instead of each spawning a pool the size of the machine); restored afterwards."""
    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // workers))
    try:
        yield
    finally:
        torch.set_num_threads(saved)
