"""A simulated federation sharded over `torch.distributed` ranks (gloo: objects between processes).

Every rank holds a shard of the clients as a `ShardFleet`, a LocalFleet: their state never leaves
the rank, and the shard trains stacked as one process does. Rank 0 also runs the `Coordinator`,
over a `RankFleet`, whose clients are the union of the shards:
- a phase: each rank is sent its part of the `PhaseRequest` (one scatter), every rank runs its
  part as a LocalFleet runs a phase, and the replies come back to rank 0 (one gather), where
  they are validated as a LocalFleet validates them;
- FedeRiCo's peer exchange: between the begin and execute passes of every phase, each rank
  sends the others what its nodes put on their `PeerBoard` since the last exchange (new
  publications, and messages to another rank's clients; one all-gather), so every node sees
  what it would see in one process before any node executes;
- ranks other than 0 serve phases (`serve`) until rank 0 says the run is over;
- progress: each rank adds the clients whose tasks ended to a count in the rendezvous's store
  (`Ranks.store`, torch's TCPStore) as its jobs end, and rank 0 reads it every
  `COUNT_EVERY_S` while a phase runs, so a long phase (the finalize) is counted as in one
  process (`Fleet.finished`), not only when its replies come back.

Replies are not pre-summed on the ranks: the coordinator's aggregation bounds each update
against the cohort's (coordinator.robust: norm clipping, a robust aggregator), which needs each
update, and a sum in another order would not give one process's results to the bit.

What crosses ranks is pickled once, by `dumps` (tensors as their bytes, a view as only its
own elements), and counted: `bytes_out` (tasks to other ranks), `bytes_in` (their replies) and
`peer_bytes` (what the board exchange moved between all ranks).

Shards are balanced by work (`balance`): each client costs its training samples × its
architecture's parameter count, and clients go, costliest first, to the rank with the least work
so far (ties: the earlier client, the lower rank). Deterministic given the config.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from coordinator.fleet.base import (
    CoordinatorError,
    Fleet,
    PhaseRequest,
    RunInfo,
    Validator,
    admit,
    client_cost,
)
from coordinator.fleet.local import LocalFleet
from coordinator.strategies import FitReply
from edge_sdk.node import ClientNode

__all__ = [
    "RankFleet",
    "RankLost",
    "Ranks",
    "ShardFleet",
    "balance",
    "check_ranks",
    "client_cost",
    "dumps",
    "from_rank0",
    "serve",
]

log = logging.getLogger(__name__)

DONE = "clients-done"  # the key of the count in `Ranks.store`
COUNT_EVERY_S = 0.5  # how often rank 0 reads it while a phase runs


class RankLost(RuntimeError):
    """A rank stopped answering (its process died, or its connection broke)."""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks of a sharded simulation, and their group."""

    rank: int
    world: int
    group: Any = None  # the process group (None: the default one)
    devices: tuple[str, ...] = ()  # what each rank trains on (cpu, cuda:N), by rank
    # its intra-op threads: its share of its machine's cores, among the ranks there
    # (coordinator.distributed.rank_threads, set once at the rendezvous)
    threads: int = 1
    # where the ranks count the clients whose tasks ended (a TCPStore; None: not counted)
    store: Any = field(default=None, compare=False, repr=False)


# -- shards ------------------------------------------------------------------------------------
def check_ranks(ranks: int, clients: int) -> None:
    """Raise ValueError when there are more ranks than clients (a rank needs a client)."""
    if ranks > clients:
        raise ValueError(
            f"{ranks} ranks (--workers) for {clients} clients: every rank needs at least one "
            f"client; use at most {clients} workers"
        )


def balance(costs: Sequence[int], ranks: int) -> list[list[int]]:
    """Client indices per rank: costliest first, each to the rank with the least work so far
    (ties: the earlier client first, then the lower rank). Every rank gets at least one client;
    each shard lists its clients in index order."""
    if ranks < 1:
        raise ValueError(f"need at least one rank, got {ranks}")
    check_ranks(ranks, len(costs))
    load = [0] * ranks
    shards: list[list[int]] = [[] for _ in range(ranks)]
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    for i in order:
        # an empty rank first, so that every rank has a client; then the least loaded
        r = min(range(ranks), key=lambda k: (bool(shards[k]), load[k], k))
        shards[r].append(i)
        load[r] += costs[i]
    return [sorted(s) for s in shards]


# -- what crosses ranks ------------------------------------------------------------------------
def _tensor(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


class _Pickler(pickle.Pickler):
    """Tensors as their own elements' bytes: a view of a stacked model's weights carries its
    client's part, not the whole stack (torch's own pickling saves a view's whole storage)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().to("cpu").contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return _tensor, (raw, t.dtype, tuple(t.shape))
        return NotImplemented


def dumps(obj: Any) -> bytes:
    """`obj` as the bytes that cross between ranks."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


# What a blob from another rank may name when it is unpickled: classes of this project (a
# phase request, a reply, a model and its spec...), torch's dtypes, a few containers, and the
# tensor rebuilder above. A blob that names anything else (os.system, say, sent by a process
# that reached the rendezvous without being a rank of this launch) is refused, not run. The
# rendezvous endpoint should still sit on a trusted network: torch.distributed authenticates no
# one (docs/reference/distributed.md).
_PACKAGES = ("coordinator", "edge_sdk", "model_zoo")
_NAMES = {
    "builtins": {"set", "frozenset", "bytearray", "complex", "slice", "range"},
    "collections": {"Counter", "OrderedDict", "defaultdict", "deque"},
}


def _admitted(module: str, name: str, found: Any) -> bool:
    if found is _tensor or name in _NAMES.get(module, ()):
        return True
    if module == "torch":
        return isinstance(found, torch.dtype)
    return module.split(".")[0] in _PACKAGES and isinstance(found, type)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # (no module outside these is even imported)
        if module in _NAMES or module == "torch" or module.split(".")[0] in _PACKAGES:
            found = super().find_class(module, name)
            if _admitted(module, name, found):
                return found
        raise pickle.UnpicklingError(
            f"a blob from another rank names {module}.{name}, which nothing that crosses ranks "
            "holds: refused"
        )


def loads(blob: bytes) -> Any:
    """What `dumps` made, from another rank (see _Unpickler)."""
    return _Unpickler(io.BytesIO(blob)).load()


def _lost(ranks: Ranks, what: str, exc: Exception) -> RankLost:
    return RankLost(
        f"rank {ranks.rank}: lost contact with the other ranks during {what} (a rank's process "
        f"stopped or its connection broke; that rank's own log, or the launcher's, says why): "
        f"{exc}"
    )


def _scatter(ranks: Ranks, items: Sequence[bytes] | None, what: str) -> bytes:
    """Rank 0 sends item r to rank r; every rank gets its own."""
    got: list[Any] = [None]
    try:
        dist.scatter_object_list(got, list(items) if items is not None else None, 0, ranks.group)
    except (RuntimeError, ValueError) as exc:
        raise _lost(ranks, what, exc) from exc
    return bytes(got[0])


def _gather(ranks: Ranks, item: bytes, what: str) -> list[bytes]:
    """Every rank's item, on rank 0 (an empty list elsewhere)."""
    out: list[Any] | None = [None] * ranks.world if ranks.rank == 0 else None
    try:
        dist.gather_object(item, out, 0, ranks.group)
    except (RuntimeError, ValueError) as exc:
        raise _lost(ranks, what, exc) from exc
    return list(out or [])


def _all_gather(ranks: Ranks, item: bytes, what: str) -> list[bytes]:
    out: list[Any] = [None] * ranks.world
    try:
        dist.all_gather_object(out, item, ranks.group)
    except (RuntimeError, ValueError) as exc:
        raise _lost(ranks, what, exc) from exc
    return out


def from_rank0(ranks: Ranks, value: Any, what: str) -> Any:
    """Rank 0's `value` on every rank (what the others pass is ignored)."""
    blobs = [dumps(value)] * ranks.world if ranks.rank == 0 else None
    return loads(_scatter(ranks, blobs, what))


# -- every rank: a shard -----------------------------------------------------------------------
def _given(reply: FitReply) -> Callable[[], FitReply]:
    return lambda: reply


def _accept_all(cid: str, reply: FitReply) -> None:
    """A shard's replies are validated on rank 0, where the strategy is."""


class ShardFleet(LocalFleet):
    """One rank's clients: a LocalFleet whose peer board is exchanged with the other ranks
    between the begin and execute passes of every phase (every rank takes part in every phase,
    with or without tasks of its own)."""

    def __init__(self, nodes: Sequence[ClientNode], ranks: Ranks, **kw: Any) -> None:
        super().__init__(nodes, **kw)
        self.ranks = ranks
        self.peer_bytes = 0
        self._known: dict[tuple[str, str], object] = {}  # the publications already exchanged
        if ranks.rank and ranks.store is not None:
            self.finished = self._count

    def _count(self, n: int) -> None:
        """Add `n` clients whose tasks ended to the count rank 0 reads (`RankFleet`)."""
        try:
            self.ranks.store.add(DONE, n)
        except RuntimeError as exc:  # the store gone with its launcher: the exchange says why
            log.debug("rank %d: the clients' count was not kept: %s", self.ranks.rank, exc)

    def _begun(self) -> None:
        board = self.board
        with board._lock:
            pubs = {k: v for k, v in board.publications.items() if self._known.get(k) is not v}
            away = {
                k: board.messages.pop(k) for k in list(board.messages) if k[0] not in self.nodes
            }
        blobs = _all_gather(self.ranks, dumps((pubs, away)), "the peer exchange")
        self.peer_bytes += sum(len(b) for b in blobs) * (self.ranks.world - 1)
        with board._lock:
            for r, blob in enumerate(blobs):
                if r == self.ranks.rank:
                    continue
                theirs, messages = loads(blob)
                board.publications.update(theirs)
                board.messages.update({k: v for k, v in messages.items() if k[0] in self.nodes})
            self._known = dict(board.publications)

    def serve_phase(self, request: PhaseRequest) -> tuple[dict[str, FitReply | None], Counter[str]]:
        """Run this rank's part of a phase: its replies (validated on rank 0) and what it
        dropped since the last phase."""
        replies = self.run_phase(request, _accept_all)
        dropped, self.rejected = self.rejected, Counter()
        return replies, dropped


def serve(shard: ShardFleet) -> None:
    """A rank other than 0: serve rank 0's requests until it says the run is over (returns) or
    stopped (raises CoordinatorError)."""
    ranks = shard.ranks
    while True:
        op, arg = loads(_scatter(ranks, None, "a wait for rank 0"))
        if op == "open":
            shard.open(arg)
        elif op == "rejoin":
            shard.rejoin(arg, 0.0)
        elif op == "register":
            infos = [(cid, n.spec, n.capabilities()) for cid, n in shard.nodes.items()]
            _gather(ranks, dumps(infos), "registration")
        elif op == "phase":
            what = f"{arg.phase} of round {arg.round}"
            _gather(ranks, dumps(shard.serve_phase(arg)), what)
        elif op == "finish":
            return
        else:  # "pause": rank 0 stopped before the run's end
            raise CoordinatorError(f"rank {ranks.rank}: rank 0 stopped the run: {arg}")


# -- rank 0: the coordinator's fleet -----------------------------------------------------------
class RankFleet(Fleet):
    """The clients of every rank, as the Coordinator on rank 0 sees them. `shard`: rank 0's
    own; `owners`: the rank of every client, in the federation's order (which admission keeps)."""

    def __init__(self, shard: ShardFleet, owners: Mapping[str, int]) -> None:
        super().__init__()
        self.shard = shard
        self.ranks = shard.ranks
        self.owners = dict(owners)
        self._out = self._in = 0
        self._broken = False  # an exchange with the other ranks broke off
        shard.finished = self._told  # rank 0's own clients, as they end

    def _told(self, n: int) -> None:
        if self.finished is not None:
            self.finished(n)

    @property
    def bytes_out(self) -> int:
        return self._out

    @property
    def bytes_in(self) -> int:
        return self._in

    @property
    def peer_bytes(self) -> int:
        return self.shard.peer_bytes

    @contextlib.contextmanager
    def _counting(self) -> Iterator[None]:
        """While a phase runs, tell `finished` of the other ranks' clients whose tasks ended:
        the rise of their count in the store, read every COUNT_EVERY_S and once more when
        their replies are in (each rank counts a job before it replies). A store that does
        not answer leaves the phase uncounted, not stopped."""
        store = self.ranks.store
        if self.finished is None or store is None or self.ranks.world == 1:
            yield
            return
        seen: list[int] = []  # the count at the last read

        def read() -> bool:
            """Tell the rise since the last read; False where the store did not answer."""
            try:
                now = int(store.add(DONE, 0))
            except RuntimeError as exc:  # a rank or the store lost: the exchange says so
                log.debug("the other ranks' count could not be read: %s", exc)
                return False
            if seen and now > seen[0] and self.finished is not None:
                self.finished(now - seen[0])
            seen[:] = [now]
            return True

        if not read():  # the count before the phase is sent (no rank counts before then)
            yield
            return
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(COUNT_EVERY_S) and read():
                pass

        reader = threading.Thread(target=poll, name="rank-count", daemon=True)
        reader.start()
        try:
            yield
        finally:
            stop.set()
            reader.join()
        read()

    @contextlib.contextmanager
    def _exchange(self) -> Iterator[None]:
        """Remember that the ranks lost contact when an exchange with them fails."""
        try:
            yield
        except RankLost:
            self._broken = True
            raise

    def _send(self, items: Sequence[tuple[str, Any]], what: str) -> None:
        blobs = [dumps(item) if r else b"" for r, item in enumerate(items)]
        self._out += sum(len(b) for b in blobs)
        with self._exchange():
            _scatter(self.ranks, blobs, what)

    def _collect(self, mine: Any, what: str) -> list[Any]:
        with self._exchange():
            blobs = _gather(self.ranks, b"", what)
        self._in += sum(len(b) for b in blobs)
        return [mine, *(loads(b) for b in blobs[1:])]

    def open(self, run: RunInfo) -> None:
        self._run = run
        self._send([("open", run)] * self.ranks.world, "the run's start")
        self.shard.open(run)

    def gather(self, timeout_s: float, min_clients: int | None) -> None:
        """Admit every rank's clients by one process's rules (`LocalFleet.gather`), in the
        federation's order."""
        self._send([("register", None)] * self.ranks.world, "registration")
        mine = [(cid, n.spec, n.capabilities()) for cid, n in self.shard.nodes.items()]
        infos = {cid: (spec, caps) for part in self._collect(mine, "registration")
                 for cid, spec, caps in part}  # fmt: skip
        ordered = [(cid, *infos[cid]) for cid in self.owners if cid in infos]
        admit(self, ordered, min_clients)

    def rejoin(self, run: RunInfo, timeout_s: float) -> None:
        """Every rank's nodes continue from the states they saved (`LocalFleet.rejoin`)."""
        self._run = run
        self._send([("rejoin", run)] * self.ranks.world, "the run's resumption")
        self.shard.rejoin(run, timeout_s)
        self.started = True

    def online(self) -> set[str]:
        return set(self.clients)

    def known_online(self) -> set[str]:
        return self.online()

    def await_back(self, timeout_s: float) -> None:
        """Ranks' clients never drop out (a rank that dies stops the run)."""

    def run_phase(self, request: PhaseRequest, validate: Validator) -> dict[str, FitReply | None]:
        self.check_stop(request.round)
        what = f"{request.phase} of round {request.round}"
        parts: list[dict[str, Any]] = [{} for _ in range(self.ranks.world)]
        for cid, models in request.plan.items():
            parts[self.owners[cid]][cid] = models
        subs = [
            replace(
                request,
                plan=part,
                params={c: request.params[c] for c in part if c in request.params},
            )
            for part in parts
        ]
        with self._counting():
            self._send([("phase", sub) for sub in subs], what)
            with self._exchange():  # the peer exchange with the other ranks
                mine = self.shard.serve_phase(subs[0])
            answers = self._collect(mine, what)
        replies: dict[str, FitReply | None] = {cid: None for cid in request.plan}
        for got, dropped in answers:
            replies.update(got)
            self.rejected.update(dropped)
        for cid, reply in replies.items():
            if reply is not None:
                replies[cid] = self.accepted(cid, request, _given(reply), validate)
        self.check_stop(request.round)
        return replies

    def finish(self, reason: str) -> None:
        self._end("finish", reason)

    def pause(self) -> None:
        self._end("pause", "the run stopped before its end")

    def _end(self, op: str, reason: str) -> None:
        if not self._broken:  # else they cannot be told: the error that stopped it says why
            self._send([(op, reason)] * self.ranks.world, "the run's end")
        log.info(
            "ranks moved %d bytes of tasks, %d of replies and %d of peer models",
            self._out,
            self._in,
            self.peer_bytes,
        )
