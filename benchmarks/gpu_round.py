"""A federation's round as one batched program against client by client, on CUDA or the CPU.

Parts (`--parts`):

- **fml**: the PFLlib-like FML round, training and evaluation: Fashion-MNIST, Dirichlet(0.1)
  over 20 clients, cnn2 at width 32, batch 10, SGD lr 0.005, one local epoch, every client
  evaluated every round (one architecture: one stack of 20).
- **pfml**: PFML on Synthetic(0.5, 0.5), 100 clients (all train, 10 are aggregated), MLR,
  D = E = 20, K = 3, λ = 20, β = 2, η = 0.01 (`examples/pfml_synthetic.toml`'s setting).
- **fml100**: FML rounds of 100 clients, 100 Fashion-MNIST samples each (iid), batch 10, one
  epoch, for each of `--families` (default mlr, mlp, lenet5).
- **fml20**: the same with 20 clients: 20 clients of one architecture with equal data, the
  setting of the operator-call goal (batched ≤ 1/10 of client by client; the floor is 1/20).
- **fedme100**: FedMe rounds in fml100's setting (100 clients, 100 samples each, batch 10, one
  epoch, lr 0.005): each client trains its personal and exchanged models by deep mutual
  learning, and the coordinator clusters the models on 1,000 unlabeled samples. KMeans can
  turn float rounding into other clusters and exchanges, so the two modes' accuracies need not
  agree to rounding (nor do client by client's on 1 thread and on 2).
- **persfl100**: PersFL in fml100's setting: stage 1 (FedAvg, each client weighing the received
  global model as its teacher) every round, then after the last round stage 2, the distillation
  grid (5 students, each trained rounds × local_epochs epochs) and the guard. Its rounds are
  timed as the others'; `finalize_s` is the time from the last round's end to the run's, stage 2
  included (every part records it; `finalize_speedup` compares the two modes').
- **step**: one cnn2 (width 32) client's FML rounds at batch 10 on its own, as a device takes
  them: milliseconds per step of a round after the first, captured in a CUDA graph (kept from
  round to round) and eager (on CUDA); what one more step costs, and what a round costs besides.

Each federation runs twice in this process, side by side: **batched** (clients of one
architecture as one stacked program, every group however small, `cohort = "always"`) and
**client by client** (`cohort = "never"`), with `--parallel` groups at once (default 1: one
stream of work). Round times are wall seconds (median of rounds 2.., the first includes building
and capturing); `cpu_s` the process's CPU seconds a round. Separate runs per mode count the
**torch operator calls** of a round (a TorchDispatchMode over every aten call, the coordinator's
included): the calls between the ends of a two-round run's two rounds, i.e. a round before the
last (training, evaluation, the guard, aggregation; the finalize after the last round left out),
with steps run eagerly so that the count does not depend on the device (a CUDA graph replays its
kernels without calling operators; only a stacked convolution's input, made channels-last on the
CPU, takes a call more there), next to its floor: the ratio of the longest client's local steps
to all clients' (`ops_floor`), below which no stacking can go. Accuracies are the final mean
personalized accuracies: batched and client by client should agree.

    python benchmarks/gpu_round.py --device cuda                 # on a GPU machine
    python benchmarks/gpu_round.py --device cpu --parts pfml fml100 --rounds 3
    python benchmarks/gpu_round.py --parts fml20 --ops-only       # operator counts alone
    python benchmarks/gpu_round.py --parts fml --modes batched --fp32   # batched only, no autocast

`--eager` runs every step without CUDA graphs, `--fp32` without autocast (both record it in the
JSON's `machine.settings`).

Fashion-MNIST is read from /usr/share/datasets/fashion-mnist, or from `.device/data/fashion-mnist`
on a machine prepared without network access. Prints one JSON object, then a table.
On a shared machine absolute times are noisy: compare the ratios taken in one run.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from _report import emit, machine, save
from torch.utils._python_dispatch import TorchDispatchMode

from coordinator.config import load_config
from coordinator.federation import prepare_federation
from coordinator.results import RoundRecord
from coordinator.results_model import deployment_summary
from coordinator.simulator import run_federation
from edge_sdk.algorithms import algorithm_class
from edge_sdk.algorithms.base import ClientContext
from edge_sdk.client_data import ClientData
from edge_sdk.codec import WireModel
from edge_sdk.device import cpu_threads, resolve_device
from edge_sdk.trainer import Trainer
from model_zoo import ArchSpec, build

ROOT = Path(__file__).resolve().parents[1]
DATA_ROOTS = (Path("/usr/share/datasets/fashion-mnist"), ROOT / ".device/data/fashion-mnist")
PARTS = ("fml", "pfml", "fml100", "fml20", "fedme100", "persfl100", "step")
MODES = {"batched": True, "client_by_client": False}  # name: cohort
GOALS = {  # the issue's, per part and device type: seconds per round, or ms per step
    ("fml", "cuda"): "<= 1.0 s a round (H100)",
    ("pfml", "cuda"): "<= 0.1 s a round (H100)",
    ("step", "cuda"): "<= 0.5 ms a step (H100)",
    ("fml100", "cpu"): ">= 3x client by client (2 cores)",
    ("fml20", "cpu"): "ops ratio <= 0.1",
    ("fml20", "cuda"): "ops ratio <= 0.1",
}


def _data_root() -> str:
    for root in DATA_ROOTS:
        if (root / "train-images-idx3-ubyte.gz").is_file():
            return str(root)
    raise SystemExit(f"Fashion-MNIST not found in {[str(r) for r in DATA_ROOTS]}")


# -- the federations ---------------------------------------------------------------------------
def fml_overrides(device: str) -> dict[str, Any]:
    return {
        "algorithm": "fml",
        "clients": 20,
        "models": ["cnn2"],
        "model_kwargs": {"cnn2": {"width": 32}},
        "device": device,
        "data.dataset": "fashion_mnist",
        "data.root": _data_root(),
        "data.partition": "dirichlet",
        "data.partition_params": {"alpha": 0.1},
        "fml.local_epochs": 1,
        "fml.batch_size": 10,
        "fml.lr": 0.005,
    }


def pfml_overrides(device: str) -> dict[str, Any]:
    return {
        "algorithm": "pfml",
        "clients": 100,
        "clients_per_round": 10,
        "models": ["mlr"],
        "device": device,
        "data.dataset": "synthetic",
        "data.partition": "natural",
        "data.split": [0.75, 0.0, 0.25],
        "data.options": {"alpha": 0.5, "beta": 0.5},
        "pfml.local_iterations": 20,
        "pfml.batch_size": 20,
        "pfml.lr": 0.01,
        "pfml.k_steps": 3,
        "pfml.lam": 20.0,
        "pfml.beta": 2.0,
        "pfml.participation": "all",
        "pfml.weighting": "by_samples",
    }


def fml100_overrides(
    device: str, family: str, clients: int = 100, algorithm: str = "fml"
) -> dict[str, Any]:
    return {
        "algorithm": algorithm,
        "clients": clients,
        "models": [family],
        "device": device,
        "data.dataset": "fashion_mnist",
        "data.root": _data_root(),
        "data.max_samples": clients * 100,
        "data.partition": "iid",
        f"{algorithm}.local_epochs": 1,
        f"{algorithm}.batch_size": 10,
        f"{algorithm}.lr": 0.005,
    }


# -- measuring ---------------------------------------------------------------------------------
class OpCounter(TorchDispatchMode):
    """Counts the aten operator calls made on this thread while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def trainer_settings(**settings: Any) -> Iterator[None]:
    """Every Trainer built inside takes `settings` (graphs=False: steps run eagerly; amp=False:
    float32 steps, no autocast)."""
    init = Trainer.__init__

    def patched(self: Trainer, device: torch.device, **kw: Any) -> None:
        init(self, device, **(kw | settings))

    Trainer.__init__ = patched  # type: ignore[method-assign]
    try:
        yield
    finally:
        Trainer.__init__ = init  # type: ignore[method-assign]


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _mode(batched: bool) -> str:
    """The `cohort` setting of a mode: batched stacks every group, however small (the default,
    "auto", leaves small groups on the CPU one by one)."""
    return "always" if batched else "never"


def run_mode(overrides: dict[str, Any], cohort: bool, rounds: int, parallel: int) -> dict[str, Any]:
    """One federation, batched or client by client: round times, CPU seconds, accuracy."""
    cfg = load_config(
        overrides=overrides | {"cohort": _mode(cohort), "rounds": rounds, "parallel": parallel},
        environ=False,
    )
    fed = prepare_federation(cfg)
    device = overrides["device"]
    cpu = [_cpu_s()]
    walls: list[float] = []
    last = [0.0]  # when the last round ended

    def on_round(rec: RoundRecord) -> None:
        _sync(device)
        cpu.append(_cpu_s())
        walls.append(rec.seconds)
        last[0] = time.perf_counter()

    run = run_federation(cfg, fed, cfg.algorithm, on_round=on_round)
    _sync(device)
    finalize_s = time.perf_counter() - last[0]
    accs = [c.personal_acc for c in run.clients if c.personal_acc is not None]
    cpus = [b - a for a, b in itertools.pairwise(cpu)]
    later = walls[1:] or walls
    return {
        "round_s": [round(s, 3) for s in walls],
        "median_round_s": round(statistics.median(later), 3),
        "cpu_s": [round(s, 3) for s in cpus],
        "median_cpu_s": round(statistics.median(cpus[1:] or cpus), 3),
        "mean_personal_acc": round(sum(accs) / len(accs), 4) if accs else None,
        "deployed": deployment_summary(run.clients),
        "finalize_s": round(finalize_s, 3),
    }


def round_ops(overrides: dict[str, Any], cohort: bool) -> int:
    """Operator calls of a round before the last: in a two-round run (steps run eagerly), the
    calls between the ends of its first and second rounds. Not a two-round run's calls minus a
    one-round run's: the finalize after the last round (the guard's students) can differ
    between the two, and FML's 20 mlr clients then counted 95,617 calls "a round" batched where
    the round itself takes about 1,300. The first round is left out too: a process's first stack
    of an architecture reads its chain of layers once (`coordinator.stacking`)."""
    cfg = load_config(
        overrides=overrides | {"cohort": _mode(cohort), "rounds": 2, "parallel": 1},
        environ=False,
    )
    fed = prepare_federation(cfg)
    ends: list[int] = []
    with trainer_settings(graphs=False), OpCounter() as counter:
        run_federation(cfg, fed, cfg.algorithm, on_round=lambda _: ends.append(counter.calls))
    return ends[1] - ends[0]


def ops_floor(overrides: dict[str, Any]) -> float:
    """The lowest ops ratio any stacking of one round's local steps can reach: a stacked step
    is one set of operator calls whatever the stack's size, but a client's steps stay
    sequential, so the batched round takes at least the longest client's steps, where client
    by client takes every client's: max(steps) / sum(steps). (Fixed iterations, PFML's
    `local_iterations` alone: 1 / clients.)"""
    cfg = load_config(overrides=overrides | {"rounds": 1}, environ=False)
    section = getattr(cfg, cfg.algorithm)
    epochs, batch = getattr(section, "local_epochs", None), section.batch_size
    sizes = [len(cd.y_train) for cd in prepare_federation(cfg).client_data]
    steps = [math.ceil(epochs * n / batch) if epochs else 1 for n in sizes]
    return round(max(steps) / sum(steps), 4)


def compare(overrides: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """Batched and client by client, side by side."""
    out: dict[str, Any] = {}
    if not a.ops_only:
        for name, cohort in MODES.items():
            if name in a.modes:
                out[name] = run_mode(overrides, cohort, a.rounds, a.parallel)
    if len(out) == len(MODES):
        out["speedup"] = round(
            out["client_by_client"]["median_round_s"] / out["batched"]["median_round_s"], 2
        )
        out["cpu_speedup"] = round(
            out["client_by_client"]["median_cpu_s"] / out["batched"]["median_cpu_s"], 2
        )
        out["finalize_speedup"] = round(
            out["client_by_client"]["finalize_s"] / out["batched"]["finalize_s"], 2
        )
    if not a.no_ops:
        ops = {name: round_ops(overrides, cohort) for name, cohort in MODES.items()}
        out["ops_per_round"] = ops
        out["ops_ratio"] = round(ops["batched"] / ops["client_by_client"], 4)
        out["ops_floor"] = ops_floor(overrides)
    return out


def step_part(device: str, steps: int) -> dict[str, Any]:
    """One cnn2 client's FML rounds at batch 10, as a device takes them: captured (CUDA; with
    autocast and in float32) and eager. `ms_per_step`: a round after the first (which warms up
    and captures) over its steps, median of three; from rounds of `steps` and 3 × `steps`
    steps, what one more step costs (`marginal_ms`) and what a round costs besides its steps
    (`round_overhead_ms`: building the meme's optimizer, the loop's one host read, the reply)."""
    dev = resolve_device(device)
    spec = ArchSpec(family="cnn2", num_classes=10, input_shape=(1, 28, 28), kwargs={"width": 32})
    glob = WireModel(spec, dict(build(spec, seed=1).state_dict()))
    cls = algorithm_class("fml")
    cfg = cls.config_cls(local_epochs=1, batch_size=10, lr=0.005)

    def round_s(n: int, graphs: bool, amp: bool) -> tuple[float, Trainer]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(10 * n, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (10 * n,), generator=g)
        data = ClientData(x, y, x[:0], y[:0], x[:0], y[:0], num_classes=10).to(dev)
        trainer = Trainer(dev, seed=0, graphs=graphs, amp=amp)
        client = cls(ClientContext("c0", spec, data, dev, 0, trainer), cfg)
        client.fit(1, 4, {"global": glob})  # warm up (and capture)
        times = []
        for r in (2, 3, 4):
            _sync(device)
            t0 = time.perf_counter()
            client.fit(r, 4, {"global": glob})
            _sync(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times), trainer

    out: dict[str, Any] = {}
    variants = (("captured", True, True), ("captured_fp32", True, False), ("eager", False, True))
    for name, graphs, amp in variants:
        if graphs and dev.type != "cuda":
            continue
        short, trainer = round_s(steps, graphs, amp)
        long, _ = round_s(3 * steps, graphs, amp)
        marginal = (long - short) / (2 * steps)
        out[name] = {
            "ms_per_step": round(short * 1e3 / steps, 3),
            "marginal_ms": round(marginal * 1e3, 3),
            "round_overhead_ms": round((short - steps * marginal) * 1e3, 2),
            "graphs": trainer.stats.graphs,  # captured in four rounds
            "replayed_steps": trainer.stats.replayed,
            "amp": trainer.amp_dtype,
        }
    return out


# -- the report --------------------------------------------------------------------------------
def machine_on(device: str) -> dict[str, Any]:
    info = machine(device=device, cpu_threads=cpu_threads(), torch_threads=torch.get_num_threads())
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
        info["amp"] = Trainer(torch.device(device)).amp_dtype
    return info


def table(out: dict[str, Any]) -> str:
    dev = out["machine"]["device"]
    lines = [
        f"{out['machine'].get('gpu', out['machine']['processor'])}, {dev}, torch "
        f"{out['machine']['torch']}, load {out['machine']['loadavg_start'][0]:.1f}",
        f"{'part':<16} {'batched s':>10} {'1-by-1 s':>9} {'speedup':>8} {'cpu x':>6} "
        f"{'ops batched':>12} {'ops 1-by-1':>11} {'ops ratio':>9} {'floor':>6}  "
        "acc (batched / 1-by-1)  goal",
    ]
    rows = []
    for part in ("fml", "pfml"):
        if part in out:
            rows.append((part, out[part], GOALS.get((part, dev.split(":")[0]), "")))
    for part in ("fml100", "fml20", "fedme100", "persfl100"):
        for family, r in out.get(part, {}).items():
            rows.append((f"{part} {family}", r, GOALS.get((part, dev.split(":")[0]), "")))
    for name, r, goal in rows:
        b, c = r.get("batched", {}), r.get("client_by_client", {})
        ops = r.get("ops_per_round", {})
        lines.append(
            f"{name:<16} {b.get('median_round_s', ''):>10} {c.get('median_round_s', ''):>9} "
            f"{r.get('speedup', ''):>8} {r.get('cpu_speedup', ''):>6} "
            f"{ops.get('batched', ''):>12} {ops.get('client_by_client', ''):>11} "
            f"{r.get('ops_ratio', ''):>9} {r.get('ops_floor', ''):>6}  "
            f"{b.get('mean_personal_acc')} / "
            f"{c.get('mean_personal_acc')}  {goal}"
        )
    for family, r in out.get("persfl100", {}).items():
        if "finalize_speedup" not in r:  # (operator counts alone: nothing timed)
            continue
        b, c = r["batched"], r["client_by_client"]
        lines.append(
            f"persfl100 {family} finalize (stage 2, the guard): {b.get('finalize_s')} s batched, "
            f"{c.get('finalize_s')} s client by client ({r.get('finalize_speedup')}x)"
        )
    for name, r in out.get("step", {}).items():
        lines.append(
            f"step {name:<13} {r['ms_per_step']} ms a step (one more: {r['marginal_ms']} ms; "
            f"a round besides its steps: {r['round_overhead_ms']} ms; amp {r['amp']})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--rounds", type=int, default=3, help="rounds per federation (>= 2)")
    ap.add_argument(
        "--families",
        nargs="+",
        default=["mlr", "mlp", "lenet5"],
        help="fml100/20, fedme100, persfl100",
    )
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--parallel", type=int, default=1, help="groups training at once")
    ap.add_argument("--steps", type=int, default=200, help="step: steps timed")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: cpu_threads())")
    ap.add_argument("--ops-only", action="store_true", help="only count operator calls")
    ap.add_argument("--no-ops", action="store_true", help="skip counting operator calls")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs: every step eager")
    ap.add_argument("--fp32", action="store_true", help="no autocast on CUDA: float32 steps")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)
    device = str(resolve_device(a.device))
    torch.set_num_threads(a.threads or cpu_threads())
    settings = ({"graphs": False} if a.eager else {}) | ({"amp": False} if a.fp32 else {})
    with trainer_settings(**settings):
        out: dict[str, Any] = {"machine": machine_on(device) | {"settings": settings}}
        _run_parts(a, device, out)
    emit(out, a.json_out, table)
    return 0


def _run_parts(a: argparse.Namespace, device: str, out: dict[str, Any]) -> None:
    def families(**kw: Any) -> dict[str, Any]:
        return {f: compare(fml100_overrides(device, f, **kw), a) for f in a.families}

    runs: dict[str, Callable[[], Any]] = {
        "fml": lambda: compare(fml_overrides(device), a),
        "pfml": lambda: compare(pfml_overrides(device), a),
        "fml100": lambda: families(),
        "fml20": lambda: families(clients=20),
        "fedme100": lambda: families(algorithm="fedme"),
        "persfl100": lambda: families(algorithm="persfl"),
        "step": lambda: step_part(device, a.steps),
    }
    for part, run in runs.items():
        if part not in a.parts or (part == "step" and a.ops_only):
            continue
        if part == "fedme100":
            # The coordinator's KMeans loads scikit-learn on its first clustering (1.4 s here):
            # once a process, so before either mode's rounds rather than inside the first's.
            import sklearn.cluster  # noqa: F401
        out[part] = run()
        save(out, a.json_out)  # the parts so far: a run cut short by a time limit keeps them


if __name__ == "__main__":
    sys.exit(main())
