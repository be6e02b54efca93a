"""Shared test helpers: tiny configs and federations that run in seconds on 2 cores."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.config import load_config
from coordinator.federation import build_coordinator, build_node, prepare_federation
from coordinator.fleet import NetworkFleet
from edge_sdk import topics
from edge_sdk.algorithms import algorithm_class, algorithm_names
from edge_sdk.auth import Keyring, issue_keys
from edge_sdk.client import EdgeClient
from edge_sdk.transport import InMemoryBroker
from model_zoo import ArchSpec, families

# A test that needs a GPU: skipped where there is none, and marked `cuda`, so that a GPU machine
# runs them alone (`pytest -m cuda`). As a decorator (`@needs_cuda`) or a parameter's marks.
CUDA_MARKS = (
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
)


def needs_cuda(test: Callable[..., Any]) -> Callable[..., Any]:
    for mark in CUDA_MARKS:
        test = mark(test)
    return test


# Small enough for a test, with every algorithm's own machinery running: two architectures where
# an algorithm allows them, fit steps (FedeRiCo), PersFL's stage 2, FedMe's exchange.
EVERY_ALGORITHM = {
    "persfl": {
        "persfl.distill_epochs": 1,
        "persfl.distill_lambdas": [0.0, 0.5],
        "persfl.distill_temperatures": [2.0],
        # PersFL's default, not tiny_config's one view: with one, client 1's student ends two
        # validation samples apart, stacked or one by one (its teacher differs by float
        # rounding); with four, it has learnt what it can and the two agree.
        "persfl.guard_distill_views": 4,
    },
    "fedme": {"fedme.unlabeled_size": 60},
    "federico": {"federico.neighbours": 2, "federico.lr": 0.05},
    "pfml": {"pfml.local_iterations": 3, "pfml.lam": 1.0},
}


def every_algorithm_args(**flags: object) -> list[str]:
    """`edgefl simulate` arguments that run every algorithm at once: FedMe (which needs its
    held-out set) and the eight others as its baselines, on 8×8 digits, mlr and mlp clients,
    with EVERY_ALGORITHM's settings and, as tiny_config's, one view of each image an epoch for
    the guards' students (where EVERY_ALGORITHM says no other). `flags`: more options, such as
    clients=4 for `--clients 4`."""
    names = algorithm_names()
    args = [
        "--dataset", "digits", "--set", "data.options.size=8", "--models", "mlr,mlp",
        "--global-model", "mlr", "--algorithm", "fedme",
        "--baselines", ",".join(a for a in names if a != "fedme"),
        "--device", "cpu", "--lr", "0.05", "--quiet",
    ]  # fmt: skip
    for algorithm in names:
        settings = dict(EVERY_ALGORITHM.get(algorithm, {}))
        if "guard_distill_views" in algorithm_class(algorithm).config_cls.model_fields:
            settings.setdefault(f"{algorithm}.guard_distill_views", 1)
        for key, value in settings.items():
            args += ["--set", f"{key}={json.dumps(value, separators=(',', ':'))}"]
    for flag, value in flags.items():
        args += [f"--{flag.replace('_', '-')}", str(value)]
    return args


def tiny_config(**flags: Any) -> Any:
    """A run config on 8×8 digits (no files needed): 4 clients, 3 rounds, mlr, CPU, every
    group stacked."""
    base: dict[str, Any] = {
        "algorithm": "fedavg",
        "data.dataset": "digits",
        "data.options": {"size": 8},
        "data.max_samples": 800,
        "data.partition": "iid",
        "models": ["mlr"],
        "clients": 4,
        "rounds": 3,
        "device": "cpu",
        # Every group stacks, however small ("auto" leaves a test's few clients one by one on
        # the CPU): the tests hold stacked training to client by client's.
        "cohort": "always",
        "round.deadline_s": 60,
        "round.register_timeout_s": 30,
    }
    training = {"local_epochs": 2, "batch_size": 32, "lr": 0.1}
    epochs_given = "local_epochs" in flags
    for key in ("local_epochs", "batch_size", "lr"):
        if key in flags:
            training[key] = flags.pop(key)
    overrides = flags.pop("overrides", {})
    base.update(flags)
    fields = algorithm_class(base["algorithm"]).config_cls.model_fields
    if "local_epochs" not in fields or (base["algorithm"] == "pfml" and not epochs_given):
        del training["local_epochs"]  # pfml counts its own iterations unless given epochs
    algorithm = base["algorithm"]
    if "guard_distill_views" in fields and algorithm not in base:
        # One view of each image an epoch for the guard's students, not FML's, PersFL's and
        # FedMe's four (made for a few dozen images): a few hundred tiny images need no more,
        # and the suite stays fast. The deployment tests' coordinators say the same (FML below).
        overrides = {f"{algorithm}.guard_distill_views": 1, **overrides}
    return load_config(None, base, overrides, training=training)


def small_federation(
    n=3,
    algorithm="fedavg",
    client_cls=EdgeClient,
    rounds=2,
    broker=None,
    config=None,
    clients_per_round=None,
    state_dir=None,
    checkpoint_path=None,
    keys=None,
    incarnation=None,
    robust=None,
    **round_kw,
):
    """A Coordinator and n (not yet started) EdgeClients (ids c0..) on one in-memory broker;
    mlr on 8×8 digits, IID. Client c0 is a `client_cls` (a test's misbehaving client).
    `config`: the algorithm's settings (default: one local epoch). `state_dir`: where the
    clients persist their state; `checkpoint_path`: the coordinator's checkpoint. `keys`: the
    participants' keyrings by id (default: fresh ones, so every message is signed; `{}`: open
    mode); the coordinator's is `coordinator.fleet.keyring`, a client's `client.keyring`.
    `robust`: the coordinator's `robust.*` settings (default: the defaults)."""
    section = algorithm_class(algorithm).config_cls(**(config or {"local_epochs": 1}))
    cfg = tiny_config(
        algorithm=algorithm,
        clients=n,
        rounds=rounds,
        clients_per_round=clients_per_round,
        run_id="default",
        overrides={
            algorithm: section.model_dump(mode="json"),
            "round": {"deadline_s": 30, "register_timeout_s": 30, **round_kw},
            "robust": robust or {},
        },
    )
    fed = prepare_federation(cfg)
    broker = broker or InMemoryBroker()
    if keys is None:
        keys = Keyring.ephemeral([topics.COORDINATOR, *fed.client_ids])
    fleet = NetworkFleet(broker.connect("coordinator"), keyring=keys.get(topics.COORDINATOR))
    coordinator = build_coordinator(
        cfg, fleet, fed=fed, checkpoint_path=checkpoint_path, incarnation=incarnation
    ).open()
    clients = [
        (client_cls if i == 0 else EdgeClient)(
            build_node(cfg, fed, i, state_dir=state_dir),
            broker.connect(cid),
            keyring=keys.get(cid),
        )
        for i, cid in enumerate(fed.client_ids)
    ]
    return coordinator, clients


def simulated_fml_accuracies(rounds, models=("mlr", "mlp", "cnn1")):
    """Each client's personalized accuracy after `rounds` of the deployment tests' FML federation
    (3 clients of `models` on 8×8 digits, mlr memes), simulated in one process: what a
    deployment of it must end with (the two are shown equal in test_deploy)."""
    from coordinator.simulator import simulate

    cfg = tiny_config(
        algorithm="fml",
        models=list(models),
        global_model="mlr",
        clients=3,
        rounds=rounds,
        local_epochs=2,
        batch_size=32,
        lr=0.1,
        parallel=2,
    )
    return [c.personal_acc for c in simulate(cfg, progress=False).clients]


EDGEFL = str(Path(sys.executable).parent / "edgefl")
# The deployment tests' small federation: 3 clients on 8×8 digits, FML, 2 rounds.
DATA = ["--dataset", "digits", "--max-samples", "800", "--partition", "iid", "--clients", "3"]
SETS = ["--set", 'data.options={"size": 8}', "--set", "device=cpu"]
ARCHS = ["mlr", "mlp", "cnn1"]
TRAIN = ["--local-epochs", "2", "--batch-size", "32", "--lr", "0.1"]
# The coordinator's: its FML students see one view an epoch, as tiny_config's do, so that a run
# over a broker equals `simulated_fml_accuracies` (and the suite stays fast).
ONE_VIEW = ["--set", "fml.guard_distill_views=1"]
# Client processes of tests whose subject is the transport (faults, brokers, bridges, attacks)
# export their model with TorchScript's exporter: torch.export's costs about 3 s of CPU in every
# process, a quarter of the suite's CPU time (benchmarks/onnx_export.py). The default exporter's
# end-to-end path stays in test_deploy's first test, the examples, the demo and the plugin test.
FAST_EXPORT = ["--set", "onnx_exporter=legacy"]
FML = ["--algorithm", "fml", "--global-model", "mlr", "--local-epochs", "2", "--lr", "0.1"]
FML += ONE_VIEW
FEDERICO = ["--algorithm", "federico", "--set", "federico.lr=0.01"]


def deploy(
    urls: str | Sequence[str],
    tmp_path: Path,
    run_id: str,
    algorithm: Sequence[str] = FML,
    coordinator_sets: Sequence[str] = (),
    client_flags: Sequence[str] = (),
    timeout: float = 240,
) -> tuple[Path, list[str]]:
    """`edgefl coordinator` and three `edgefl client` processes (with `client_flags`), signed,
    each on its broker: `urls` is one URL for all, or the coordinator's then each client's.
    Returns the coordinator's output folder and every process's log; asserts they all exited
    with 0 within `timeout` s."""
    urls = [urls] * (1 + len(ARCHS)) if isinstance(urls, str) else list(urls)
    out = tmp_path / "out"
    keys = key_flags(tmp_path / "keys", [f"c{i}" for i in range(len(ARCHS))])
    run = ["--clients", "3", "--rounds", "2", "--batch-size", "32", *algorithm]
    sets = [*SETS, *(x for s in coordinator_sets for x in ("--set", s))]
    on = [["--broker", url, "--run-id", run_id] for url in urls]
    commands = [
        [EDGEFL, "coordinator", *on[0], *run, "--out", str(out), *sets, *keys["coordinator"]]
    ]
    for i, arch in enumerate(ARCHS):
        me = ["--id", f"c{i}", "--model", arch, "--index", str(i), "--seed", "0", "--threads", "1"]
        state = ["--state-dir", str(tmp_path / f"state{i}"), *SETS, *client_flags]
        commands.append([EDGEFL, "client", *on[1 + i], *me, *DATA, *state, *keys[f"c{i}"]])
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd in commands
    ]
    deadline = time.monotonic() + timeout
    try:
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                p.kill()
                logs.append(p.communicate()[0] + f"\n(killed after {timeout} s)")
    finally:
        for p in procs:
            p.kill()
    codes = [p.returncode for p in procs]
    assert codes == [0] * len(procs), "\n\n".join(logs)
    return out, logs


def simulated_federico() -> Any:
    """The deployment tests' FedeRiCo federation (`deploy` with `FEDERICO`, clients that may
    deploy any model), simulated in one process: the results a deployment of it must end with
    (the two are shown equal in test_deploy)."""
    from coordinator.simulator import simulate

    cfg = tiny_config(
        algorithm="federico",
        models=ARCHS,
        clients=3,
        rounds=2,
        parallel=2,
        overrides={"federico": {"lr": 0.01, "batch_size": 32}, "deploy": {"allow": ["any"]}},
    )
    return simulate(cfg, progress=False)


def load_benchmark(name: str, as_module: str) -> Any:
    """benchmarks/NAME.py imported as module `as_module` (benchmarks/ is not a package)."""
    return _load_script("benchmarks", name, as_module)


def load_tool(name: str) -> Any:
    """tools/NAME.py imported as module NAME (tools/ is not a package)."""
    return _load_script("tools", name, name)


def _load_script(folder: str, name: str, as_module: str) -> Any:
    import importlib.util

    script = Path(__file__).resolve().parents[1] / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(as_module, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[as_module] = module
    spec.loader.exec_module(module)
    return module


def exit_codes(procs, deadline):
    """Each process's exit code by name, waiting for each until `deadline` (time.monotonic(); at
    least a second each); None for one still running then."""
    codes = {}
    for name, p in procs.items():
        try:
            codes[name] = p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[name] = None
    return codes


def key_flags(where, clients):
    """Signing keys for a run's processes (written under `where`): each participant's `--set`
    flags, by id (the coordinator's under "coordinator")."""
    paths = issue_keys(where, clients)
    roster = paths["roster"]
    return {
        pid: ["--set", f"auth.key_file={paths[pid]}", "--set", f"auth.roster={roster}"]
        for pid in [topics.COORDINATOR, *clients]
    }


IMAGE = (1, 28, 28)
# Small enough for 2 CPU cores: one spec per registered family, plus the char LSTM.
_SMALL_KWARGS: dict[str, dict] = {
    "vgg11": {"width": 0.125},
    "vgg13": {"width": 0.125},
    "vgg16": {"width": 0.125},
    "vgg19": {"width": 0.125},
    "cnn2": {"width": 32},
}
CHAR_SPEC = ArchSpec(
    family="lstm",
    num_classes=20,
    input_shape=(12,),
    kwargs={"mode": "char", "vocab_size": 20, "embed": 8, "hidden": 64, "layers": 2},
)
MIXTURE_SPEC = ArchSpec(
    family="mixture",
    num_classes=10,
    input_shape=IMAGE,
    kwargs={
        "members": [
            {"family": "mlr", "num_classes": 10, "input_shape": list(IMAGE), "kwargs": {}},
            {"family": "lenet5", "num_classes": 10, "input_shape": list(IMAGE), "kwargs": {}},
        ],
        "weights": [0.25, 0.75],
    },
)
ZOO_SPECS = [
    ArchSpec(family=f, num_classes=10, input_shape=IMAGE, kwargs=_SMALL_KWARGS.get(f, {}))
    for f in families()
] + [CHAR_SPEC, MIXTURE_SPEC]


def spec_id(spec: ArchSpec) -> str:
    return f"{spec.family}-{spec.kwargs['mode']}" if "mode" in spec.kwargs else spec.family


def eventually(check: Callable[[], object], timeout: float = 10.0, step: float = 0.02) -> None:
    """Wait until `check()` is truthy (asserting it at the end): bounded, no sleep-and-hope."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(step)
    assert check(), f"condition not met within {timeout} s"


def raises_exactly(exc: type[BaseException], message: str) -> Any:
    """`pytest.raises` that holds the error to this whole message, not a part of it."""
    return pytest.raises(exc, match=f"^{re.escape(message)}$")


def to_rounding(value: Any, rel: float = 1e-5) -> Any:
    """`value` (nested dicts, lists, tuples) with every float as `pytest.approx`: results that
    must agree up to float rounding, such as a stacked simulation's (its sums run in another
    order) against a client-by-client run's, compare equal with `==`."""
    if isinstance(value, float):
        return pytest.approx(value, rel=rel, abs=1e-9)
    if isinstance(value, dict):
        return {k: to_rounding(v, rel) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_rounding(v, rel) for v in value)
    return value


def per_client_results(out: Path, main: str = "fedme") -> dict[str, object]:
    """What OUT/results.json says of each run (`main` and its baselines): every client's final
    personalized and global accuracy, and the main run's accuracies round by round."""
    doc = json.loads((Path(out) / "results.json").read_text())
    runs = {main: doc, **doc["baselines"]}
    got: dict[str, object] = {
        name: [(c["id"], c["personal_acc"], c["global_acc"]) for c in run["clients"]]
        for name, run in runs.items()
    }
    got["rounds"] = [(r["round"], r["failed"], r["client_acc"]) for r in doc["rounds"]]
    return got
