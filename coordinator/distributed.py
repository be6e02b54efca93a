"""Simulations over several processes and machines: `torch.distributed` ranks (gloo).

Two ways to start the ranks, one code path once they run (`run_rank`):
- `edgefl simulate --workers N`: this process starts N local ranks with torch's elastic launcher
  (`launch`), waits for them and prints rank 0's results; a rank that fails stops the others,
  and the error names it (`RankFailed`).
- `torchrun --nnodes M --nproc-per-node K -m coordinator simulate ...`: torchrun starts every
  rank (its environment says RANK, WORLD_SIZE, MASTER_ADDR...), on every machine.

At start (`join`) the ranks meet at the rendezvous within `round.register_timeout_s` and compare
what they run: a hash of the config (less what may differ between machines: `out`, `threads`,
`parallel`), the edgefl and torch versions, and a digest of edgefl's code (`source_digest`: two
checkouts of one version with different code differ there). Rank 0's `out` is every rank's
(clients export there). The federation is sharded by `coordinator.fleet.ranks`;
`coordinator.simulator` runs it.

The ranks of one machine (`on_machine`: by `machine()`, however they were started) share its CPU
cores (`rank_threads`). On GPUs (`--device auto|cuda` where CUDA is available), each rank trains
on one GPU of its machine: its place among the machine's ranks (LOCAL_RANK under one launcher a
machine) modulo the machine's GPUs (`rank_gpu`), so one rank per GPU, and ranks beyond the GPUs
share them. The ranks still exchange through gloo: what crosses is pickled host memory (a
phase's tasks and replies, see `coordinator.fleet.ranks`), and NCCL refuses two ranks on one
GPU, which is how a single GPU is shared.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from datetime import timedelta
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.fleet.ranks import Ranks, check_ranks
from coordinator.run_config import RunConfig, run_config_model

if TYPE_CHECKING:
    from coordinator.results_model import Results

__all__ = ["RankFailed", "current", "fingerprint", "in_launch", "join", "launch", "run_rank"]

log = logging.getLogger(__name__)

_RANKS: Ranks | None = None
# Settings that may differ between machines, or between starts of one simulation, without
# changing a result (what the ranks compare, and what a checkpoint must match, leave them out).
# onnx_exporter changes how the ONNX files are written, not the models or accuracies.
LOCAL_SETTINGS = ("out", "threads", "parallel", "idle_dir", "onnx_exporter")


class RankFailed(RuntimeError):
    """A rank of a launch stopped before the run's end (named, with its exit status)."""


def current() -> Ranks | None:
    """This process's rank among several (None: a simulation in one process)."""
    return _RANKS


def in_launch(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher (torchrun, `--workers`) started this process as one of several ranks."""
    env = os.environ if environ is None else environ
    return int(env.get("WORLD_SIZE", "1")) > 1


# edgefl's code: what `source_digest` reads by default.
PACKAGES = ("coordinator", "edge_sdk", "model_zoo")


def source_digest(roots: Sequence[Path] | None = None) -> str:
    """A digest of the Python sources under `roots`, their names (from each root's own name)
    and contents: by default the packages of `PACKAGES` as imported here, wherever installed."""
    if roots is None:
        roots = [Path(str(importlib.import_module(p).__file__)).parent for p in PACKAGES]
    digest = hashlib.sha256()
    for root in roots:
        for source in sorted(root.rglob("*.py")):
            digest.update(f"\0{root.name}/{source.relative_to(root).as_posix()}\0".encode())
            digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def fingerprint(cfg: RunConfig) -> tuple[str, str, str, str]:
    """What every rank must agree on: the edgefl version, torch's, a digest of edgefl's code and
    a hash of the config (less the settings of one machine)."""
    import torch

    try:
        ours = version("edgefl")
    except PackageNotFoundError:
        ours = "not installed"
    settings = cfg.model_dump_json(exclude=set(LOCAL_SETTINGS))
    config = hashlib.sha256(settings.encode()).hexdigest()[:16]
    return ours, torch.__version__, source_digest(), config


def disagreement(prints: Sequence[tuple[str, ...]]) -> str | None:
    """Why the ranks' fingerprints cannot run one federation, or None when they agree."""
    odd = [r for r, p in enumerate(prints) if p != prints[0]]
    if not odd:
        return None
    what = ["the edgefl version", "the torch version", "the code", "the config"]
    lines = [
        f"rank {r}: {what[k]} {prints[r][k]} where rank 0 has {prints[0][k]}"
        for r in odd
        for k in range(len(what))
        if prints[r][k] != prints[0][k]
    ]
    return (
        "the ranks disagree on what they run: "
        + "; ".join(lines)
        + ". Start every rank with the same command, config file, environment and edgefl "
        "(the same version and code: `edgefl settings` shows a config)"
    )


def check_launch(cfg: RunConfig, ranks: int) -> None:
    """Raise ValueError when `cfg` cannot run over `ranks` ranks."""
    if cfg.fleet != "local" or cfg.broker.url is not None:
        raise ValueError(
            "a simulation over several ranks runs the local fleet: drop --fleet network / --broker"
        )
    check_ranks(ranks, cfg.clients)


def rank_threads(cfg: RunConfig, machine_ranks: int) -> int:
    """The CPU threads of one rank: `threads`, else its share of the cores of its machine, which
    `machine_ranks` ranks share (itself included)."""
    from edge_sdk.device import cpu_threads

    return cfg.threads or max(1, cpu_threads() // max(1, machine_ranks))


def machine() -> str:
    """What tells this machine from the others of a launch: its host name (containers on one
    host have their own, and their own cores) and, on Linux, the kernel's boot id (machines
    given one host name by a careless image still differ)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()} {boot}".strip()


def on_machine(hosts: Sequence[str], rank: int) -> tuple[int, int]:
    """`rank`'s place among the ranks of its machine (0 for the lowest rank there) and how many
    there are, itself included, from every rank's `machine()`: however they were started (one
    launcher's processes, whose place is their LOCAL_RANK, or several launches on one machine,
    each of which counts only its own in LOCAL_RANK and LOCAL_WORLD_SIZE)."""
    mine = [r for r, host in enumerate(hosts) if host == hosts[rank]]
    return mine.index(rank), len(mine)


def rank_gpu(local_rank: int, gpus: int) -> int:
    """The GPU of the `local_rank`-th rank of a machine (`on_machine`) with `gpus` GPUs: one
    rank per GPU, and ranks beyond them share the GPUs in turn."""
    if gpus < 1:
        raise ValueError(f"no GPU to place rank {local_rank} on")
    return local_rank % gpus


def place(cfg: RunConfig, local_rank: int) -> str:
    """Make this rank's GPU (`rank_gpu` of its place on its machine) torch's current device when
    the run trains on CUDA; the device this rank trains on, as results name it (`cpu`,
    `cuda:N`)."""
    import torch

    from edge_sdk.device import choose_device

    if choose_device(cfg.device).device.type != "cuda":
        return "cpu"
    index = rank_gpu(local_rank, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def join(cfg: RunConfig) -> tuple[Ranks, RunConfig]:
    """Meet the other ranks (torch's env:// rendezvous, gloo) and check that they run the same;
    returns this rank and the config with rank 0's `out`. Raises ValueError on a bad launch."""
    global _RANKS
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    check_launch(cfg, world)
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    wait = cfg.round.register_timeout_s
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=wait))
    except (RuntimeError, ValueError) as exc:  # torch's DistStoreError is a RuntimeError
        raise ValueError(
            f"rank {rank} of {world}: the ranks did not all meet at the rendezvous {where} "
            f"within {wait:g} s (round.register_timeout_s): start every rank with the same "
            f"MASTER_ADDR/MASTER_PORT (torchrun: --rdzv-endpoint) and --nnodes ({exc})"
        ) from exc
    # Collectives wait as long as the slowest rank's phase takes: torch's default of 30 minutes
    # (a rank that dies is noticed at once: its connection closes).
    group = dist.new_group(backend="gloo", timeout=timedelta(minutes=30))
    assert isinstance(group, dist.ProcessGroup)
    prints: list[Any] = [None] * world
    here = (fingerprint(cfg), cfg.out, machine())
    dist.all_gather_object(prints, here, group=group)
    why = disagreement([p[0] for p in prints])
    if why is not None:
        raise ValueError(f"rank {rank}: {why}")
    local_rank, sharing = on_machine([p[2] for p in prints], rank)
    threads = rank_threads(cfg, sharing)
    torch.set_num_threads(threads)
    devices: list[Any] = [None] * world
    dist.all_gather_object(devices, place(cfg, local_rank), group=group)
    # The clients' count (`Ranks.store`): a connection of this rank's own to the rendezvous's
    # store, which MASTER_ADDR:MASTER_PORT names however the ranks were started.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=wait),
    )
    ranks = Ranks(
        rank,
        world,
        group,
        devices=tuple(devices),
        threads=threads,
        store=dist.PrefixStore("edgefl", store),
    )
    _RANKS = ranks
    return ranks, cfg.model_copy(update={"out": prints[0][1]})


def leave() -> None:
    global _RANKS
    import torch.distributed as dist

    _RANKS = None
    if dist.is_initialized():
        dist.destroy_process_group()


def run_rank(cfg: RunConfig, *, progress: bool = True) -> Results | None:
    """This process's part of a simulation over ranks: rank 0's results, None elsewhere."""
    from coordinator.simulator import serve_runs, simulate

    try:
        ranks, cfg = join(cfg)
        if ranks.rank == 0:
            return simulate(cfg, progress=progress)
        serve_runs(cfg)
        return None
    finally:
        leave()


# -- `--workers N`: local ranks through torch's elastic launcher --------------------------------
def _entry(
    settings: dict[str, Any], levels: tuple[int, int], fmt: str, progress: bool
) -> Results | None:
    """A launched rank: the config as its launcher validated it, logging as the launcher's
    (`levels`: edgefl's and other libraries')."""
    from edge_sdk.logs import configure_logging

    configure_logging(levels[0], fmt=fmt, libraries=levels[1])  # type: ignore[arg-type]
    cfg = run_config_model().model_validate(settings)
    return run_rank(cfg, progress=progress)


def launch(
    cfg: RunConfig,
    workers: int,
    *,
    level: int = logging.WARNING,
    fmt: str = "text",
    progress: bool = True,
    libraries: int | None = None,
) -> Results:
    """Run `cfg` on `workers` local ranks started by torch's elastic launcher; rank 0's results.
    A rank that fails stops the run: RankFailed names it. SIGTERM or SIGINT to this process
    stops every rank, then raises KeyboardInterrupt."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from coordinator.broker import free_port

    check_launch(cfg, workers)
    settings = cfg.model_dump(mode="json")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=workers,
        run_id=f"edgefl-{cfg.run_id}-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        start_method="spawn",
    )
    # The launcher logs a failed rank's whole traceback at ERROR, and the stopping of the
    # others; RankFailed says which rank failed and its error's last line, so the launcher's
    # lines are logged from -v on (as ours are).
    told = [logging.getLogger(name) for name in _LAUNCHER_LOGS]
    were = [t.level for t in told]
    for t in told if level > logging.INFO else []:
        t.setLevel(logging.CRITICAL)
    try:
        levels = (level, level if libraries is None else libraries)
        results = elastic_launch(config, _entry)(settings, levels, fmt, progress)
    except ChildFailedError as exc:
        raise RankFailed(_failure(exc, shown=level <= logging.INFO)) from None
    except SignalException:  # SIGTERM or SIGINT here: the launcher has stopped every rank
        raise KeyboardInterrupt from None
    finally:
        for t, was in zip(told, were, strict=True):
            t.setLevel(was)
    return results[0]


_LAUNCHER_LOGS = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")


def _failure(exc: Any, *, shown: bool = True) -> str:
    """The first rank that failed, in words: its exit status and its error's last line (and,
    where the launcher's log of its traceback was not `shown`, how to see it)."""
    rank, failure = exc.get_first_failure()
    code = failure.exitcode
    how = f"exit code {code}" if code >= 0 else f"killed by signal {failure.signal_name()}"
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    last = str(message).strip().splitlines()[-1:] if message else []
    said = f": {last[0]}" if last and "<N/A>" not in last[0] else ""
    more = "" if shown or not said else " (-v shows the rank's traceback)"
    return f"rank {rank} stopped ({how}){said}; the run stopped with it{more}"
