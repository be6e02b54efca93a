"""`edgefl demo`: a real federation on this machine, then baselines, an ONNX benchmark and a report.

What it does, in order (each step prints what it did):

1. Data: Fashion-MNIST when its files are installed, else scikit-learn's digits (28×28). The
   split is the one personalization is for: `label_groups` puts the clients in pairs that share a
   few classes, each with about 100 training images.
2. A broker: mosquitto as a child process when it is installed, else the embedded amqtt broker
   (in this process); `broker` uses an existing one instead.
3. `OUT/keys/`: a signing key for the coordinator and each client, and the roster of their
   public keys (`edgefl keys`): every message of the run is signed and checked.
   `OUT/demo.toml`: the whole run config. The coordinator and every client read it.
4. A coordinator daemon and one process per client, each a separate process (`python -m
   coordinator coordinator|client`, each given its own key file), each client with its own
   architecture. Their output goes to `OUT/logs/`. Progress comes from the coordinator's round
   records (`OUT/coordinator/rounds.jsonl`) and, before the first round, from its Prometheus
   endpoint.
5. The baselines the report compares against, `local`, `fedavg` and `fedavg_ft` (FedAvg, then
   each client fine-tunes the global model on its own data), with the in-process simulator on
   the same split and budget. A simulation and a deployment of one config give the
   same accuracies (tests/coordinator/test_deploy.py), so they compare like with like.
6. The ONNX benchmark (quick mode) of each client's exported personalized model, on that
   client's own test split.
7. `results.json`, `report.md`, `report.html` and the plots in OUT.

SIGINT / SIGTERM at any point stop every process the demo started (SIGTERM, then SIGKILL after a
grace period) and the broker, then raise `KeyboardInterrupt`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

from coordinator.broker import EmbeddedBroker, MosquittoBroker, start_broker
from coordinator.config import load_config, write_config
from coordinator.demo_deploy import DemoError, ProcessGroup, deploy_and_follow, interruptible
from coordinator.federation import (
    Federation,
    config_families,
    prepare_federation,
    split_record,
    split_table,
)
from coordinator.results import RunResult, build_results, write_results
from coordinator.results_model import OnnxRow, Results
from coordinator.run_config import RunConfig
from coordinator.simulator import run_federation
from coordinator.strategies import strategy_class
from edge_sdk.auth import AuthSettings, issue_keys
from edge_sdk.budget import arch_name
from edge_sdk.onnx_bench import BenchSettings, benchmark_onnx
from edge_sdk.onnx_format import read_metadata
from model_zoo.data import DatasetNotFound
from model_zoo.files import atomic_open, write_atomic

__all__ = [
    "DEFAULT_FAMILIES",
    "DemoError",
    "DemoOptions",
    "demo_config",
    "run_demo",
]

log = logging.getLogger(__name__)

# One architecture per client, in this order (round-robin beyond six clients).
DEFAULT_FAMILIES: Final[tuple[str, ...]] = ("mlr", "mlp", "lenet5", "cnn1", "vgg11", "lstm")
MODEL_KWARGS: Final[dict[str, dict[str, Any]]] = {"vgg11": {"width": 0.125}}  # a small VGG
GLOBAL_FAMILY: Final[str] = "lenet5"  # the shared model (FML's meme, FedAvg's global model)
SAMPLES_PER_CLIENT: Final[int] = 250  # before the split: about 100 train, 25 val, 125 test
SPLIT: Final[tuple[float, float, float]] = (0.4, 0.1, 0.5)  # a big test split: stable accuracy
TRAINING: Final[dict[str, Any]] = {"local_epochs": 2, "batch_size": 32, "lr": 0.01}
BASELINES: Final[tuple[str, ...]] = ("local", "fedavg", "fedavg_ft")
RUN_ID: Final[str] = "demo"


@dataclass(frozen=True)
class DemoOptions:
    """What `edgefl demo` takes on its command line."""

    algorithm: str = "fml"
    rounds: int = 10
    clients: int = 6
    dataset: str | None = None  # None: Fashion-MNIST when installed, else digits
    out: Path = Path("runs/demo")
    seed: int = 0
    broker: str | None = None  # None: start one
    keep_broker: bool = False  # after the report, keep the broker up for your own client app
    device: str = "cpu"  # where the devices train: auto, cpu or cuda
    # Options every child process gets: log level and format, plugins (`edgefl demo --plugin`).
    child_args: tuple[str, ...] = ()


@dataclass
class _Timer:
    start: float = field(default_factory=time.perf_counter)
    phases: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = round(time.perf_counter() - t, 1)

    @property
    def total(self) -> float:
        return time.perf_counter() - self.start


# --- the configuration -----------------------------------------------------------------------


def _families(algorithm: str, clients: int) -> list[str]:
    """Each client's architecture: all different, except for algorithms that average one model."""
    if strategy_class(algorithm).one_architecture:
        return [GLOBAL_FAMILY]
    return list(DEFAULT_FAMILIES[: min(clients, len(DEFAULT_FAMILIES))])


def demo_config(opts: DemoOptions, dataset: str) -> RunConfig:
    """The demo's run config for `dataset` (every process of the demo reads this one)."""
    # Pairs of clients share a group of classes; at least two groups, so no client sees them all.
    num_groups = min(5, max(2, math.ceil(opts.clients / 2)), opts.clients)
    flags: dict[str, Any] = {
        "algorithm": opts.algorithm,
        "run_id": RUN_ID,
        "seed": opts.seed,
        "device": opts.device,
        "rounds": opts.rounds,
        "clients": opts.clients,
        "models": _families(opts.algorithm, opts.clients),
        "global_model": GLOBAL_FAMILY,
        # Named here so that TRAINING applies to them too: the same budget for every run.
        "baselines": [b for b in BASELINES if b != opts.algorithm],
        "model_kwargs": MODEL_KWARGS,
        "data.dataset": dataset,
        "data.max_samples": opts.clients * SAMPLES_PER_CLIENT,
        "data.partition": "label_groups",
        "data.partition_params": {"num_groups": num_groups},
        "data.split": list(SPLIT),
    }
    cfg = load_config(None, flags, training=TRAINING)
    holdout = strategy_class(cfg.algorithm).unlabeled_holdout(cfg.algorithm_config())
    if holdout:  # FedMe's unlabeled set comes on top of the clients' samples
        data = cfg.data.model_copy(update={"max_samples": (cfg.data.max_samples or 0) + holdout})
        cfg = cfg.model_copy(update={"data": data})
    return cfg


def _write_config(cfg: RunConfig, path: Path) -> Path:
    return write_config(
        cfg,
        path,
        "edgefl demo: the run config every process of the demo read.\n"
        "Rerun it in one process, baselines included: edgefl simulate --config demo.toml",
    )


def _federation(opts: DemoOptions, echo: Callable[[str], None]) -> tuple[RunConfig, Federation]:
    """The config and the split: Fashion-MNIST when installed, else digits (unless asked)."""
    dataset = opts.dataset or "fashion_mnist"
    cfg = demo_config(opts, dataset)
    try:
        fed = prepare_federation(cfg)
    except DatasetNotFound as exc:
        if opts.dataset:
            raise
        echo(f"Fashion-MNIST is not installed ({str(exc).splitlines()[0]})")
        echo("  -> using scikit-learn's digits instead (apt-get install dataset-fashion-mnist)")
        cfg = demo_config(opts, "digits")
        fed = prepare_federation(cfg)
    return cfg, fed


def _split_words(cfg: RunConfig, fed: Federation) -> str:
    part, names = fed.partition, fed.dataset.classes
    y = fed.dataset.y.numpy()
    n_train = [len(c.train) for c in part.clients]
    n_classes = [len(np.unique(y[c.train])) for c in part.clients]
    groups = part.params.get("label_groups", [])
    train, val, test = (round(100 * f) for f in cfg.data.split)
    shown = "; ".join("{" + ", ".join(names[k] for k in g) + "}" for g in groups)
    return (
        f"label_groups: the {len(names)} classes cut into {len(groups)} groups ({shown}); "
        f"each client holds the samples of one group, shared with the other clients of that "
        f"group: {min(n_classes)}-{max(n_classes)} classes and {min(n_train)}-{max(n_train)} "
        f"training images per client ({train}/{val}/{test} train/val/test split)"
    )


def _budget_words(cfg: RunConfig) -> str:
    """The algorithm's own local-training settings (not every algorithm has all of TRAINING)."""
    budget = cfg.algorithm_config().model_dump()
    keys = ("local_epochs", "local_iterations", "batch_size", "optimizer", "lr")
    return ", ".join(f"{k.replace('_', ' ')} {budget[k]}" for k in keys if k in budget)


# --- after the deployment --------------------------------------------------------------------


def _baselines(cfg: RunConfig, fed: Federation) -> dict[str, RunResult]:
    """local, fedavg and fedavg_ft on the same split and budget, in this process (the
    simulator)."""
    runs = {}
    for name in cfg.baselines:
        # FedAvg averages one architecture: every client trains the global one, as in simulate.
        models = [cfg.global_family] if strategy_class(name).one_architecture else None
        runs[name] = run_federation(cfg, fed, name, models=models)
    return runs


def _onnx_rows(fed: Federation, results: Results, out: Path) -> list[OnnxRow]:
    """Each client's exported model (its architecture read from the file), measured with
    onnxruntime on its own test split."""
    personal = {c.id: c.personal_acc for c in results.clients}
    rows = []
    for i, cid in enumerate(fed.client_ids):
        path = out / "clients" / cid / f"{cid}.onnx"
        data = fed.client_data[i]
        [row] = benchmark_onnx(
            path, data.x_test, data.y_test, settings=BenchSettings.quick(threads=1)
        )
        rows.append(
            OnnxRow(
                client=cid,
                arch=arch_name(read_metadata(path).spec),
                file=str(path.relative_to(out)),
                size_bytes=row.size_bytes,
                latency_p50_ms=row.latency_p50_ms_b1,
                latency_p99_ms=row.latency_p99_ms_b1,
                throughput=row.throughput_b64,
                accuracy=row.accuracy,
                personal_acc=personal.get(cid),
                eval_samples=row.eval_samples,
                provider=row.provider,
            )
        )
    return rows


def _print_outcome(results: Results, echo: Callable[[str], None]) -> None:
    def pct(v: float | None) -> str:
        return "—" if v is None else f"{100 * v:.1f}%"

    echo("")
    echo(
        "client  arch     personalized   local   FedAvg   FedAvg+FT   "
        "ONNX (deployed model, size, p50 latency)"
    )
    onnx = {r.client: r for r in results.onnx or []}
    for c in results.clients:
        o = onnx.get(c.id)
        model = (
            f"{o.arch}, {(o.size_bytes or 0) / 1024:.0f} KiB, {o.latency_p50_ms or 0:.3f} ms"
            if o
            else "—"
        )
        best = c.best_baseline()
        diff = (
            ""
            if c.personal_acc is None or best is None
            else f" ({100 * (c.personal_acc - best[1]):+.1f} vs {best[0]}, the best baseline)"
        )
        echo(
            f"{c.id:<7} {c.arch or '—':<8} {pct(c.personal_acc):>12}   {pct(c.local_acc):>5}"
            f"   {pct(c.fedavg_acc):>6}   {pct(c.fedavg_ft_acc):>9}   {model}{diff}"
        )
    echo(
        f"mean over clients: personalized {pct(results.client_mean('personal_acc'))}, local "
        f"{pct(results.client_mean('local_acc'))}, FedAvg global model "
        f"{pct(results.client_mean('fedavg_acc'))}, FedAvg+FT "
        f"{pct(results.client_mean('fedavg_ft_acc'))}"
    )
    for what, pairs in (
        ("training alone", [(c.personal_acc, c.local_acc) for c in results.clients]),
        (
            "the best baseline",
            [(c.personal_acc, (c.best_baseline() or (None, None))[1]) for c in results.clients],
        ),
    ):
        known = [(p, b) for p, b in pairs if p is not None and b is not None]
        won = sum(p > b for p, b in known)
        lost = sum(p < b for p, b in known)
        tied = len(known) - won - lost
        echo(
            f"personalization beat {what} on {won} of {len(known)} clients"
            + (f", lost on {lost}" if lost else "")
            + (f", tied on {tied}" if tied else "")
        )


def _client_app_hint(url: str, echo: Callable[[str], None]) -> None:
    keys = "runs/phones/keys"
    echo("your own client app against this broker (examples/embedded_client.py):")
    echo(f"  edgefl keys --clients phone0,phone1 --out {keys}")
    echo(
        f"  edgefl coordinator --broker {url} --run-id phones --algorithm fml --clients 2 "
        f"--rounds 3 --global-model mlr --out runs/phones --set auth.key_file={keys}/"
        f"coordinator.key --set auth.roster={keys}/roster.json &"
    )
    for i in range(2):
        echo(
            f"  python examples/embedded_client.py --broker {url} --run-id phones "
            f"--id phone{i} --slice {i} --key-file {keys}/phone{i}.key "
            f"--roster {keys}/roster.json &"
        )


def _clean(out: Path) -> None:
    """Remove what a previous demo run left in OUT (and nothing else)."""
    for sub in (
        "coordinator",
        "clients",
        "devices",
        "logs",
        "keys",
    ):  # devices: what older demos wrote
        shutil.rmtree(out / sub, ignore_errors=True)


# --- the whole demo --------------------------------------------------------------------------


def run_demo(opts: DemoOptions, echo: Callable[[str], None]) -> Results:
    """Run the demo (module docs); `echo` prints a line. Returns the results it wrote.

    Raises DemoError when a step fails, KeyboardInterrupt on SIGINT/SIGTERM: either way every
    process it started has been stopped (and the broker it started).
    """
    timer = _Timer()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    _clean(out)
    broker: MosquittoBroker | EmbeddedBroker | None = None
    procs = ProcessGroup(out / "logs")
    with interruptible():
        try:
            with timer.phase("data"):
                cfg, fed = _federation(opts, echo)
            arch = config_families(cfg, fed)
            echo(f"data: {fed.dataset.name}, {len(fed.dataset)} images in all")
            echo(f"split: {_split_words(cfg, fed)}")
            if len(cfg.models) == 1 and opts.clients > 1:
                echo(
                    f"{cfg.algorithm} averages one architecture: every client runs {cfg.models[0]}"
                )
            # Every process signs what it sends with its own key; all check against the roster.
            keys = issue_keys(out / "keys", fed.client_ids)
            cfg = cfg.model_copy(update={"auth": AuthSettings(roster=keys["roster"])})
            echo(f"keys: {out / 'keys'}/<id>.key, one per process; every message is signed")
            _write_config(cfg, out / "demo.toml")
            write_atomic(out / "split.txt", split_table(fed) + "\n")
            if opts.broker:
                url, what = opts.broker, "the broker you named"
            else:
                broker = start_broker()
                url = broker.url
                what = (
                    f"mosquitto, child process pid {broker.proc.pid}"
                    if isinstance(broker, MosquittoBroker) and broker.proc is not None
                    else "the embedded amqtt broker (mosquitto is not installed), in this process"
                )
            echo(f"broker: {url} ({what})")
            extra = []
            if fed.server_data.unlabeled is not None:  # FedMe's, held out of the split
                unlabeled = out / "unlabeled.npy"
                with atomic_open(unlabeled) as handle:
                    np.save(handle, fed.server_data.unlabeled.numpy())
                extra.append(f"{cfg.algorithm}.unlabeled_path={unlabeled}")
            shared = strategy_class(cfg.algorithm).has_global_model
            echo(
                f"{cfg.algorithm}: {cfg.rounds} round{'s' if cfg.rounds > 1 else ''}, "
                + (f"global model {cfg.global_family}; " if shared else "no global model; ")
                + f"local training per round: {_budget_words(cfg)}"
            )
            with timer.phase("deployment"):
                deployed = deploy_and_follow(
                    cfg, url, out, arch, procs, echo, extra, opts.child_args
                )
            echo(
                f"deployment finished in {timer.phases['deployment']:.1f} s; personalized "
                f"models: {out / 'clients'}/<id>/<id>.onnx"
            )
            with timer.phase("baselines"):
                echo(
                    f"baselines: {', '.join(cfg.baselines)}, in-process simulator, same split "
                    "and budget"
                )
                runs = {cfg.algorithm: deployed, **_baselines(cfg, fed)}
            # The clients trained where they registered they did (the deployment's clients).
            results = build_results(cfg, runs)
            with timer.phase("onnx"):
                echo("ONNX benchmark: onnxruntime, quick mode, 1 thread, each client's test split")
                results.onnx = _onnx_rows(fed, results, out)
            results.onnx_note = (
                "Each client's personalized model as exported by the client itself after the "
                "run, measured with onnxruntime (CPU, 1 thread, quick mode: indicative) on the "
                "client's own test split. Its accuracy there should equal the federation's "
                "personalized accuracy."
            )
            results.split = split_record(fed).model_copy(
                update={"description": _split_words(cfg, fed)}
            )
            results.setup = {
                "Broker": f"{url} ({what})",
                "Processes": (
                    f"1 coordinator daemon + {len(arch)} client processes "
                    "(`python -m coordinator coordinator|client`), over MQTT"
                ),
                "Clients": ", ".join(f"{cid}: {a}" for cid, a in arch.items()),
                "Data": f"{fed.dataset.name}, {len(fed.dataset)} images",
                "Split": f"{cfg.data.partition}: a few classes per client (see Data per client)",
                "Baselines": (
                    f"{', '.join(cfg.baselines)}, in-process simulator, same split and budget"
                ),
                "Local training": f"per round: {_budget_words(cfg)}",
                "Time per step": ", ".join(f"{k} {v:.1f} s" for k, v in timer.phases.items())
                + " (together: the summary's wall time)",
            }
            # One wall time in the report: every step before it (not only the training runs).
            results.summary.wall_seconds = sum(timer.phases.values())
            with timer.phase("report"):
                write_results(results, out)
            total = timer.total
            _print_outcome(results, echo)
            echo(f"report: {out / 'report.html'} (open it in a browser), {out / 'report.md'}")
            phases = ", ".join(f"{k} {v:.1f} s" for k, v in timer.phases.items())
            echo(f"wall time: {total:.1f} s ({phases}); the target is 3 minutes on 2 CPU cores")
            if opts.keep_broker and broker is not None:
                _client_app_hint(url, echo)
                echo("the broker stays up for it: Ctrl-C to stop")
                with contextlib.suppress(KeyboardInterrupt):
                    while True:
                        time.sleep(1)
            elif broker is not None:
                echo(
                    "try your own client app: examples/embedded_client.py "
                    "(`edgefl demo --keep-broker` keeps this broker up and shows how)"
                )
            return results
        finally:
            procs.stop()
            if broker is not None:
                broker.stop()
