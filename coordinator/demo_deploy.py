"""The demo's processes: a coordinator daemon and one process per client, followed live.

`ProcessGroup` starts `python -m coordinator ...` children, each writing to its own log file,
and stops them as a group (SIGTERM, then SIGKILL after a grace period). `deploy_and_follow`
starts the federation and prints each round as the coordinator records it in `rounds.jsonl`
(and, before the first round, how many clients are online, from its Prometheus endpoint).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from coordinator.broker import free_port
from coordinator.deploy import RUN_RECORD, read_run
from coordinator.results import RunResult
from coordinator.results_model import EXIT_CODES
from coordinator.run_config import RunConfig

__all__ = ["STOP_GRACE_S", "DemoError", "ProcessGroup", "deploy_and_follow", "interruptible"]

STOP_GRACE_S: Final[float] = 10.0  # after SIGTERM, before SIGKILL
_POLL_S: Final[float] = 0.25


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and where its log is."""


class ProcessGroup:
    """The demo's child processes, each logging to its own file; stopped as a group."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, args: Sequence[str]) -> subprocess.Popen[bytes]:
        env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with (self.logs / f"{name}.log").open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "coordinator", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        self.procs[name] = proc
        return proc

    def tail(self, name: str, lines: int = 25) -> str:
        path = self.logs / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def failed(self) -> tuple[str, int] | None:
        for name, p in self.procs.items():
            code = p.poll()
            if code not in (None, 0):
                return name, code
        return None

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for name, p in self.procs.items():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise DemoError(
                    f"{name} did not finish within {timeout:.0f} s after the coordinator; "
                    f"its log: {self.logs / name}.log"
                ) from None

    def stop(self, grace: float = STOP_GRACE_S) -> int:
        """SIGTERM every live process, SIGKILL what is left after `grace`; how many were live."""
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        deadline = time.monotonic() + grace
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return len(live)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt, so both unwind through `finally`; a signal
    whose exception Python swallowed (one raised inside a `__del__`, such as a collected MQTT
    client's, is only printed) is raised again by the next `raise_if_interrupted`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _interrupted.clear()
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_interrupted = threading.Event()


def _interrupt(signum: int, frame: object) -> None:
    _interrupted.set()
    raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    """KeyboardInterrupt when a signal arrived inside `interruptible` (see there)."""
    if _interrupted.is_set():
        raise KeyboardInterrupt


def _clients_online(port: int) -> int | None:
    """`edgefl_clients_online` from the coordinator's Prometheus endpoint (None: not up yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        if family.name == "edgefl_clients_online":
            return int(family.samples[0].value)
    return None


def _round_line(rec: dict[str, Any], cfg: RunConfig, arch: dict[str, str]) -> str:
    def pct(v: float | None) -> str:
        return "  —  " if v is None else f"{100 * v:5.1f}"

    accs = rec.get("client_acc") or {}
    per_client = "  ".join(f"{cid} {pct(accs.get(cid))}" for cid in arch)
    state = " FAILED" if rec.get("failed") else ""
    return (
        f"round {rec['round']:>2}/{cfg.rounds}{state} | online {rec.get('online', 0)}/"
        f"{len(arch)} | mean {pct(rec.get('mean_personal_acc'))}% | {per_client} | "
        f"{rec['seconds']:.1f} s"
    )


def deploy_and_follow(
    cfg: RunConfig,
    url: str,
    out: Path,
    arch: dict[str, str],
    procs: ProcessGroup,
    echo: Callable[[str], None],
    extra_sets: Sequence[str],
    child_args: Sequence[str] = (),
) -> RunResult:
    """The coordinator daemon and one process per client; follows the rounds as they finish.
    `child_args` go to every process (log options, plugins)."""
    config = str(out / "demo.toml")
    coordinator_out = out / "coordinator"
    metrics_port = free_port()
    common = ["--config", config, "--broker", url, "--run-id", cfg.run_id, *child_args]

    def key(name: str) -> list[str]:  # each process its own signing key (OUT/keys)
        return ["--set", f"auth.key_file={out / 'keys' / name}.key"]

    coordinator = procs.start(
        "coordinator",
        [
            "coordinator",
            *common,
            "--out",
            str(coordinator_out),
            "--fresh",
            "--metrics-port",
            str(metrics_port),
            *(x for s in extra_sets for x in ("--set", s)),
            *key("coordinator"),
        ],
    )
    echo(f"coordinator: pid {coordinator.pid} (log: {procs.logs / 'coordinator.log'})")
    started = []
    for i, (cid, family) in enumerate(arch.items()):
        state = out / "clients" / cid
        p = procs.start(
            cid,
            [
                "client",
                *common,
                *("--index", str(i), "--state-dir", str(state), "--threads", "1"),
                *key(cid),
            ],
        )
        started.append(f"{cid} {family} (pid {p.pid})")
    echo("clients: " + ", ".join(started))
    echo(f"logs: {procs.logs}/<name>.log, one per process (coordinator, {', '.join(arch)})")
    echo(f"waiting for {len(arch)} clients to start and register (each process imports torch)")
    t0, online, shown = time.perf_counter(), -1, 0
    rounds_path = coordinator_out / "rounds.jsonl"
    while coordinator.poll() is None:
        raise_if_interrupted()
        bad = procs.failed()
        if bad is not None:
            name, code = bad
            raise DemoError(
                f"{name} exited with code {code}; the end of its log "
                f"({procs.logs / name}.log):\n{procs.tail(name)}"
            )
        if shown == 0:
            now = _clients_online(metrics_port)
            if now is not None and now != online:
                online = now
                echo(f"  clients online: {online}/{len(arch)} ({time.perf_counter() - t0:.1f} s)")
        if rounds_path.exists():
            lines = [ln for ln in rounds_path.read_text().splitlines() if ln.strip()]
            for line in lines[shown:]:
                echo(_round_line(json.loads(line), cfg, arch))
            if len(lines) > shown and len(lines) == cfg.rounds:
                echo("finalizing: each client exports its personalized model to ONNX")
            shown = max(shown, len(lines))
        time.sleep(_POLL_S)
    if coordinator.returncode not in EXIT_CODES.values():  # a run that lost rounds still ends
        raise DemoError(
            f"the coordinator exited with code {coordinator.returncode}; the end of its log:\n"
            f"{procs.tail('coordinator')}"
        )
    procs.wait(timeout=120)
    bad = procs.failed()
    if bad is not None:
        raise DemoError(f"{bad[0]} exited with code {bad[1]}:\n{procs.tail(bad[0])}")
    return read_run(coordinator_out / RUN_RECORD)
