"""How fast and how lean the simulator is: PFML against a vectorised reference, FML's memory,
round time and RSS as the federation grows.

Three measurements (pick with `--parts`):

1. **pfml** — PFML on Synthetic(0.5, 0.5), 100 clients, all train and 10 are aggregated per
   round, MLR, D = 20 (batch), E = 20 (local iterations), K = 3, λ = 20, β = 2, η = 0.01, by-sample
   weighting; `edgefl`'s simulator (`--fleets`: `local`, the default, every client a ClientNode
   in this process and clients of one architecture training as one stacked model;
   `local-one-by-one`, the same without stacking; `network`, every client an EdgeClient and
   every model through the in-memory transport) against the reference script
   `shared/reference/pfml_synthetic.py`
   (vectorised over clients: one batched matmul per step for all of them), both in this process,
   one after the other, same rounds. Reports both wall times, their ratio (goal ≤ 3×) and the
   final mean personalized accuracy of each (goal: within 0.5 point). The two use the same
   generator but each its own 75/25 split, so accuracies agree only to sampling noise.
2. **fml** — FML on Fashion-MNIST, Dirichlet(0.1) over 20 clients, batch 10, SGD lr 0.005, one
   local epoch, CNN2 at width 32 (about the cost of PFLlib's CNN), evaluation every round. Runs in
   a child process; reports its peak RSS (goal ≤ 1 GB), the RSS after each round and the round
   times.
3. **scale** — FML with 100 Fashion-MNIST samples per client (iid), 1 epoch, batch
   10, for 10, 50, 100 and 200 clients, `mlr` and `lenet5`; each in a child process. Reports
   the median round time (rounds 2..), time per client (goal: flat, i.e. linear growth), the
   same for the process's CPU seconds (what other jobs on the machine stretch less) and RSS
   after each round; `--rss-rounds` runs one configuration longer to show RSS stays flat.
4. **population** — FML on all of Fashion-MNIST (iid) cut into 1,000 and 10,000 clients,
   `mlp` and `lenet5`, 100 trained a round (`--cohort`), the last round evaluating every client,
   then every client finalized; once per `idle_state` (`--idle`: where clients wait between
   their tasks). Reports RSS after the data and at its peak (the high-water mark: the last
   phases, every client's state at once when they are kept live), and the peak over the data
   per client. With `--device cuda`, also the GPU's high-water marks (allocated tensors and
   torch's cache); there `idle_state = host` keeps idle clients' state in host memory.

    python benchmarks/simulate_scale.py --parts pfml --rounds 100      # ~2 min on 2 cores
    python benchmarks/simulate_scale.py --parts pfml --fleets local local-one-by-one network
    python benchmarks/simulate_scale.py --parts scale --fleet network   # the other runtime
    python benchmarks/simulate_scale.py                                 # everything, ~10 min
    python benchmarks/simulate_scale.py --json-out simulate_scale.json
    python benchmarks/simulate_scale.py --parts population --scale-rounds 3   # ~45 min

Prints one JSON object, then tables. The 2 cores of the machine this was written on were shared
with other jobs, so absolute seconds are noisy: compare the ratios taken in one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import torch
from _report import emit, machine

from coordinator.config import load_config
from coordinator.federation import prepare_federation
from coordinator.results import RoundRecord
from coordinator.results_model import deployment_summary
from coordinator.simulator import run_federation

_ROOT = Path(__file__).resolve().parents[1]
# `../shared/reference/` of the main checkout; a worktree one level deeper finds it one further up.
REFERENCE = next(
    (
        d / "shared/reference/pfml_synthetic.py"
        for d in (_ROOT.parent, _ROOT.parent.parent)
        if (d / "shared/reference/pfml_synthetic.py").is_file()
    ),
    _ROOT.parent / "shared/reference/pfml_synthetic.py",
)
FMNIST = "/usr/share/datasets/fashion-mnist"


# -- 1. PFML against the reference -------------------------------------------------------------
FLEETS = {  # --fleets: the config of each way to run the clients
    "local": {"fleet": "local", "cohort": "always"},
    "local-one-by-one": {"fleet": "local", "cohort": "never"},
    "network": {"fleet": "network"},
}


def _pfml_config(rounds: int, eval_every: int, fleet: str = "local") -> Any:
    return load_config(
        overrides={
            **FLEETS[fleet],
            "algorithm": "pfml",
            "rounds": rounds,
            "clients": 100,
            "clients_per_round": 10,
            "models": ["mlr"],
            "device": "cpu",
            "data.dataset": "synthetic",
            "data.partition": "natural",
            "data.split": [0.75, 0.0, 0.25],
            "data.options": {"alpha": 0.5, "beta": 0.5},
            "round.eval_every": eval_every,
            "pfml.local_iterations": 20,
            "pfml.batch_size": 20,
            "pfml.lr": 0.01,
            "pfml.k_steps": 3,
            "pfml.lam": 20.0,
            "pfml.beta": 2.0,
            "pfml.participation": "all",
            "pfml.weighting": "by_samples",
        },
        environ=False,
    )


def _load_reference(path: Path) -> ModuleType:
    if not path.is_file():
        raise SystemExit(f"reference script {path} not found; pass --reference PATH")
    spec = importlib.util.spec_from_file_location("pfml_reference", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_pfml(rounds: int, eval_every: int, reference: Path, fleets: list[str]) -> dict[str, Any]:
    ref = _load_reference(reference)
    args = SimpleNamespace(
        model="mlr", rounds=rounds, users=10, E=20, D=20, K=3, lr=0.01, lam=20.0, beta=2.0,
        agg="weighted", protocol="all", aux_reset=False, peval=eval_every, seed=0,
    )  # fmt: skip
    data = ref.FedData(0.75, 1)
    t0 = time.perf_counter()
    res = ref.run_pfml(args, data, np.random.RandomState(1000), torch.Generator().manual_seed(0))
    ref_s = time.perf_counter() - t0
    ref_acc = res["pers_acc_unweighted"]["end"]["final"]

    ours: dict[str, dict[str, Any]] = {}
    fed = prepare_federation(_pfml_config(rounds, eval_every))  # the data: the same for each
    for fleet in fleets:
        cfg = _pfml_config(rounds, eval_every, fleet)
        t0 = time.perf_counter()
        run = run_federation(cfg, fed, "pfml")
        wall = time.perf_counter() - t0
        accs = [c.personal_acc for c in run.clients if c.personal_acc is not None]
        acc = sum(accs) / len(accs)
        ours[fleet] = {
            "wall_s": round(wall, 2),
            "ratio": round(wall / ref_s, 2),
            "mean_personal_acc": round(acc, 4),
            "deployed": deployment_summary(run.clients),
            "acc_gap_points": round(100 * (acc - ref_acc), 2),
            "round_s": [round(r.seconds, 3) for r in run.rounds],
        }
    return {
        "setting": "Synthetic(0.5,0.5), 100 clients (all train, 10 aggregated), MLR, D=20, E=20, "
        f"K=3, lam=20, beta=2, lr=0.01, {rounds} rounds, personal eval every {eval_every}",
        "rounds": rounds,
        "ref_s": round(ref_s, 2),
        "ref_mean_personal_acc": round(ref_acc, 4),
        "goal_ratio": 3.0,
        "ours": ours,  # by fleet: "local" (stacked, the default), "local-one-by-one", "network"
    }


# -- 2./3. federations in a child process ------------------------------------------------------
def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _gpu_marks() -> dict[str, int]:
    """The GPU's high-water marks so far (tensors, and torch's cache); none off a GPU."""
    if not torch.cuda.is_initialized():
        return {}
    return {
        "gpu_peak_allocated_mb": torch.cuda.max_memory_allocated() >> 20,
        "gpu_peak_reserved_mb": torch.cuda.max_memory_reserved() >> 20,
    }


def _child(overrides: dict[str, Any], conn: Any) -> None:
    torch.set_num_threads(1)
    cfg = load_config(overrides=overrides, environ=False)
    fed = prepare_federation(cfg)
    after_data = _rss()
    rounds: list[dict[str, Any]] = []
    cpu = [_cpu_s()]
    ended = [time.perf_counter()]  # when the last round's record came

    def on_round(rec: RoundRecord) -> None:
        # The process's CPU seconds in the round (all threads): the work done, which a machine
        # shared with other jobs stretches less than the wall time.
        cpu.append(_cpu_s())
        ended[0] = time.perf_counter()
        rounds.append(
            {
                "round": rec.round,
                "s": round(rec.seconds, 3),
                "cpu_s": round(cpu[-1] - cpu[-2], 3),
                "rss_mb": _rss() >> 20,
                **_gpu_marks(),
            }
        )
        # Said at once: a run cut short by its time limit (the finalize of 10,000 clients on a
        # lent GPU) still leaves its rounds' memory in the log.
        print(f"round {json.dumps(rounds[-1])}", file=sys.stderr, flush=True)

    out = run_federation(cfg, fed, cfg.algorithm, on_round=on_round)
    # After the last round: every client's finalize (its guard's fine-tuning and students).
    finalize_s = round(time.perf_counter() - ended[0], 2)
    accs = [c.personal_acc for c in out.clients if c.personal_acc is not None]
    # ru_maxrss is in KiB on Linux: the high-water mark, which polling would miss.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    gpu: dict[str, Any] = dict(_gpu_marks())
    if gpu:
        gpu["gpu"] = torch.cuda.get_device_name()
    conn.send(
        {
            "rss_after_data_mb": after_data >> 20,
            "peak_rss_mb": peak >> 20,
            "rounds": rounds,
            "finalize_s": finalize_s,
            "mean_personal_acc": round(sum(accs) / len(accs), 4) if accs else None,
            "deployed": deployment_summary(out.clients),
            **gpu,
        }
    )


def in_child(overrides: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # a fresh interpreter: its RSS is the federation's alone
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(overrides, child))
    t0 = time.perf_counter()
    p.start()
    result: dict[str, Any] = parent.recv()
    p.join()
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    times = [r["s"] for r in result["rounds"]]
    result["median_round_s"] = round(statistics.median(times[1:] or times), 3)
    cpus = [r["cpu_s"] for r in result["rounds"]]
    result["median_round_cpu_s"] = round(statistics.median(cpus[1:] or cpus), 3)
    return result


def run_fml(rounds: int, fleet: str, root: str) -> dict[str, Any]:
    res = in_child(
        {
            **FLEETS[fleet],
            "algorithm": "fml",
            "rounds": rounds,
            "clients": 20,
            "models": ["cnn2"],
            "model_kwargs": {"cnn2": {"width": 32}},
            "device": "cpu",
            "data.dataset": "fashion_mnist",
            "data.root": root,
            "data.partition": "dirichlet",
            "data.partition_params": {"alpha": 0.1},
            "fml.local_epochs": 1,
            "fml.batch_size": 10,
            "fml.lr": 0.005,
        }
    )
    res["setting"] = (
        "FML, Fashion-MNIST (70k), Dirichlet 0.1, 20 clients, cnn2 width 32, batch 10, "
        f"lr 0.005, 1 epoch, eval every round, {rounds} rounds, fleet {fleet}"
    )
    res["goal_peak_rss_mb"] = 1024
    return res


def _scale_overrides(
    family: str, clients: int, rounds: int, fleet: str, root: str, device: str = "cpu"
) -> dict[str, Any]:
    return {
        **FLEETS[fleet],
        "algorithm": "fml",
        "rounds": rounds,
        "clients": clients,
        "models": [family],
        "threads": 1,  # as the child process: one thread (a single job gets the run's threads)
        "device": device,
        "data.dataset": "fashion_mnist",
        "data.root": root,
        "data.max_samples": 100 * clients,
        "data.partition": "iid",
        "fml.local_epochs": 1,
        "fml.batch_size": 10,
        "fml.lr": 0.005,
    }


def _scale_row(family: str, n: int, rounds: int, fleet: str, root: str) -> dict[str, Any]:
    res = in_child(_scale_overrides(family, n, rounds, fleet, root))
    res |= {"family": family, "clients": n, "fleet": fleet}
    res["per_client_ms"] = round(1000 * res["median_round_s"] / n, 2)
    res["per_client_cpu_ms"] = round(1000 * res["median_round_cpu_s"] / n, 2)
    return res


def run_scale(
    families: list[str], sizes: list[int], rounds: int, rss_rounds: int, fleet: str, root: str
) -> list[dict[str, Any]]:
    rows = []
    for family in families:
        for n in sizes:
            rows.append(_scale_row(family, n, rounds, fleet, root))
            print(tables({"scale": rows[-1:]}).splitlines()[-1], file=sys.stderr, flush=True)
    if rss_rounds:
        res = _scale_row(families[0], sizes[1], rss_rounds, fleet, root) | {"long": True}
        rss = [r["rss_mb"] for r in res["rounds"]]
        res["rss_growth_mb_after_round_5"] = rss[-1] - rss[min(4, len(rss) - 1)]
        rows.append(res)
    return rows


def run_population(
    families: list[str],
    sizes: list[int],
    idles: list[str],
    rounds: int,
    cohort: int,
    root: str,
    device: str = "cpu",
    evaluated: list[int] | None = None,
) -> list[dict[str, Any]]:
    """FML on all of Fashion-MNIST (iid) cut into `sizes` clients, `cohort` trained a round,
    evaluated once (the last round), finalized, once per way of keeping idle clients
    (`idle_state`) and per number of clients evaluated and finalized (`evaluated`: 0 is every
    client, else `round.eval_clients`), on `device`."""
    rows = []
    for family in families:
        for n in sizes:
            for idle, k in itertools.product(idles, evaluated or [0]):
                overrides = _scale_overrides(family, n, rounds, "local", root, device) | {
                    "clients_per_round": cohort,
                    "data.max_samples": None,
                    "round.eval_every": rounds,
                    "round.eval_clients": k or None,
                    "idle_state": idle,
                }
                res = in_child(overrides)
                res |= {"family": family, "clients": n, "cohort": cohort, "idle_state": idle}
                res["evaluated"] = min(k, n) if k else n
                # At its peak (the last phases, every client evaluated and finalized), what the
                # run held beyond the data, per client: live, every client's state at once.
                res["peak_kib_per_client"] = round(
                    1024 * (res["peak_rss_mb"] - res["rss_after_data_mb"]) / n, 1
                )
                rows.append(res)
                print(_population_lines(rows[-1:])[-1], file=sys.stderr, flush=True)
    return rows


def _population_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"{'model':>7}{'clients':>9}{'evaluated':>11}{'idle':>8}{'after data':>12}{'peak':>8}"
        f"{'peak KiB/client':>17}{'GPU peak':>10}{'wall s':>8}{'finalize s':>12}{'acc':>8}"
    ]
    for r in rows:
        acc = r["mean_personal_acc"]
        lines.append(
            f"{r['family']:>7}{r['clients']:>9}{r.get('evaluated', r['clients']):>11}"
            f"{r['idle_state']:>8}{r['rss_after_data_mb']:>12}"
            f"{r['peak_rss_mb']:>8}{r['peak_kib_per_client']:>17}"
            f"{r.get('gpu_peak_allocated_mb', '-'):>10}"
            f"{r['wall_s']:>8.0f}{r.get('finalize_s', '-'):>12}"
            f"{'-' if acc is None else f'{acc:.4f}':>8}"
        )
    return lines


# -- output ------------------------------------------------------------------------------------
def tables(out: dict[str, Any]) -> str:
    lines = []
    if "pfml" in out:
        p = out["pfml"]
        lines += [
            f"PFML vs reference ({p['rounds']} rounds; goal: ratio <= 3x, gap within 0.5 pt)",
            f"{'':18}{'wall s':>8}{'ratio':>8}{'pers acc':>10}{'gap pt':>8}",
            f"{'reference':18}{p['ref_s']:>8.1f}{'1.00x':>8}{p['ref_mean_personal_acc']:>10.4f}",
        ]
        for name, o in p["ours"].items():
            lines.append(
                f"{'ours, ' + name:18}{o['wall_s']:>8.1f}{o['ratio']:>7.2f}x"
                f"{o['mean_personal_acc']:>10.4f}{o['acc_gap_points']:>+8.2f}"
            )
        lines.append("")
    if "fml" in out:
        f = out["fml"]
        lines += [
            "FML Fashion-MNIST Dir(0.1), 20 clients",
            f"peak RSS {f['peak_rss_mb']} MB (goal <= 1024), "
            f"after data {f['rss_after_data_mb']} MB, median round {f['median_round_s']:.1f} s "
            f"({f['median_round_cpu_s']:.1f} CPU s), "
            f"personal acc {f['mean_personal_acc']}",
            "RSS per round (MB): " + " ".join(str(r["rss_mb"]) for r in f["rounds"]),
            "",
        ]
    if "scale" in out:
        lines.append(
            f"{'family':8}{'clients':>8}{'round s':>9}{'ms/client':>10}{'cpu ms/client':>14}"
            f"{'peak MB':>9}  RSS/round MB"
        )
        for r in out["scale"]:
            rss = [x["rss_mb"] for x in r["rounds"]]
            shown = rss if len(rss) <= 6 else [*rss[:3], "...", *rss[-2:]]
            lines.append(
                f"{r['family']:8}{r['clients']:>8}{r['median_round_s']:>9.2f}"
                f"{r['per_client_ms']:>10.1f}{r['per_client_cpu_ms']:>14.1f}{r['peak_rss_mb']:>9}  "
                + " ".join(map(str, shown))
                + (f"  ({len(rss)} rounds)" if r.get("long") else "")
            )
    if "population" in out:
        lines += ["", "Populations (RSS in MB; peak KiB/client: peak minus after the data)"]
        lines += _population_lines(out["population"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["pfml", "fml", "scale"])
    ap.add_argument("--rounds", type=int, default=20, help="PFML rounds (the paper: 800)")
    ap.add_argument("--eval-every", type=int, default=10, help="PFML personal evaluation")
    ap.add_argument("--reference", type=Path, default=REFERENCE)
    ap.add_argument(
        "--fleets",
        nargs="+",
        choices=list(FLEETS),
        default=["local"],
        help="PFML: how the clients run (local: in process, stacked; the default)",
    )
    ap.add_argument(
        "--fleet", choices=list(FLEETS), default="local", help="fml and scale: how clients run"
    )
    ap.add_argument("--fml-rounds", type=int, default=2)
    ap.add_argument("--scale-rounds", type=int, default=3)
    ap.add_argument("--rss-rounds", type=int, default=50, help="0: skip the long RSS run")
    ap.add_argument("--families", nargs="+", default=["mlr", "lenet5"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[10, 50, 100, 200])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--population-families", nargs="+", default=["mlp", "lenet5"])
    ap.add_argument("--population-sizes", nargs="+", type=int, default=[1000, 10000])
    ap.add_argument("--idle", nargs="+", default=["memory", "disk"], help="idle_state values")
    ap.add_argument("--cohort", type=int, default=100, help="population: clients_per_round")
    ap.add_argument(
        "--eval-clients",
        nargs="+",
        type=int,
        default=[0],
        help="population: round.eval_clients values (0: every client evaluated and finalized)",
    )
    ap.add_argument("--device", default="cpu", help="population: where the clients train")
    ap.add_argument("--data-root", default=FMNIST, help="Fashion-MNIST's files")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    out: dict[str, Any] = {"machine": machine(threads=torch.get_num_threads())}
    if "pfml" in a.parts:
        out["pfml"] = run_pfml(a.rounds, a.eval_every, a.reference, a.fleets)
    if "fml" in a.parts:
        out["fml"] = run_fml(a.fml_rounds, a.fleet, a.data_root)
    if "scale" in a.parts:
        out["scale"] = run_scale(
            a.families, a.sizes, a.scale_rounds, a.rss_rounds, a.fleet, a.data_root
        )
    if "population" in a.parts:
        out["population"] = run_population(
            a.population_families,
            a.population_sizes,
            a.idle,
            a.scale_rounds,
            a.cohort,
            a.data_root,
            a.device,
            a.eval_clients,
        )
    emit(out, a.json_out, tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
