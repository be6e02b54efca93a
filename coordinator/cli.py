"""The `edgefl` command line: thin commands that parse settings and call one library function."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:  # the CLI imports the library lazily: `edgefl --help` stays fast
    from coordinator.results_model import Results

app = typer.Typer(
    help="edgefl: personalized federated learning on heterogeneous edge devices.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

_CSV = "comma-separated"


def _csv(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def _fail(msg: str) -> typer.Exit:
    typer.secho(f"error: {msg}", err=True, fg=typer.colors.RED)
    return typer.Exit(code=2)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@app.command()
def simulate(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML run config")] = None,
    algorithm: Annotated[str | None, typer.Option(help="fml, pfml, fedavg, ...")] = None,
    dataset: Annotated[
        str | None, typer.Option(help="digits, fashion_mnist, synthetic, ...")
    ] = None,
    data_root: Annotated[
        str | None, typer.Option(help="directory holding the dataset files")
    ] = None,
    max_samples: Annotated[int | None, typer.Option(help="use a seeded subset of the data")] = None,
    partition: Annotated[
        str | None, typer.Option(help="iid, shards, dirichlet, ds1..ds4, ...")
    ] = None,
    models: Annotated[str | None, typer.Option(help=f"{_CSV} families, round-robin")] = None,
    global_model: Annotated[str | None, typer.Option(help="global/meme family")] = None,
    clients: Annotated[int | None, typer.Option(help="number of clients")] = None,
    clients_per_round: Annotated[int | None, typer.Option(help="clients sampled per round")] = None,
    rounds: Annotated[int | None, typer.Option(help="communication rounds")] = None,
    local_epochs: Annotated[int | None, typer.Option(help="local epochs (all but pfml)")] = None,
    batch_size: Annotated[int | None, typer.Option(help="batch size (all algorithms)")] = None,
    lr: Annotated[float | None, typer.Option(help="learning rate (all algorithms)")] = None,
    seed: Annotated[int | None, typer.Option(help="seed for data, init and sampling")] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda")] = None,
    baselines: Annotated[str | None, typer.Option(help=f"{_CSV}, e.g. local,fedavg")] = None,
    parallel: Annotated[int | None, typer.Option(help="simulated clients training at once")] = None,
    fleet: Annotated[
        str | None,
        typer.Option(
            help="local: the clients in this process (default); network: each an EdgeClient "
            "over the in-memory transport, as a deployment runs them"
        ),
    ] = None,
    broker: Annotated[
        str | None, typer.Option(help="run the clients over this MQTT broker (mqtt://host:port)")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="output directory")] = None,
    export_onnx: Annotated[
        bool, typer.Option("--export-onnx", help="write DIR/onnx/<client>.onnx")
    ] = False,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="override any field: key=value, dotted (fml.alpha=0.3)"),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bars")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log INFO messages")] = False,
) -> None:
    """Simulate a federation: a coordinator and N clients, in this process or over a transport."""
    flags: dict[str, Any] = {
        "algorithm": algorithm,
        "data.dataset": dataset,
        "data.root": data_root,
        "data.max_samples": max_samples,
        "data.partition": partition,
        "models": _csv(models),
        "global_model": global_model,
        "clients": clients,
        "clients_per_round": clients_per_round,
        "rounds": rounds,
        "seed": seed,
        "device": device,
        "baselines": _csv(baselines),
        "parallel": parallel,
        "fleet": fleet,
        "broker.url": broker,
        "out": str(out) if out else None,
        "export_onnx": True if export_onnx else None,
    }
    training = {"local_epochs": local_epochs, "batch_size": batch_size, "lr": lr}
    _run(config, flags, training, set_ or [], quiet=quiet, verbose=verbose)


@app.command()
def demo(
    algorithm: Annotated[str, typer.Option(help="any registered algorithm")] = "fml",
    rounds: Annotated[int, typer.Option(min=1, help="communication rounds")] = 10,
    clients: Annotated[int, typer.Option(min=1, help="devices, one process each")] = 6,
    dataset: Annotated[
        str | None,
        typer.Option(help="default: fashion_mnist when installed, else digits"),
    ] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="output directory")] = Path("runs/demo"),
    seed: Annotated[int, typer.Option(help="seed for data, initialisation and sampling")] = 0,
    broker: Annotated[
        str | None, typer.Option(help="use this MQTT broker instead of starting one")
    ] = None,
    keep_broker: Annotated[
        bool,
        typer.Option("--keep-broker", help="after the report, keep the broker up for your app"),
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log INFO messages")] = False,
) -> None:
    """A real federation on this machine (2-3 minutes on 2 cores) and a report a person can read.

    Starts an MQTT broker (mosquitto when installed, else the embedded one), a coordinator and
    one process per device, each device with its own architecture (mlr, mlp, lenet5, cnn1, a
    small vgg11, the row-LSTM), on a split where each device sees a few classes and about 100
    training images. Then the local, FedAvg and FedAvg+FT baselines, an ONNX benchmark of every
    device's personalized model, and OUT/report.html. Ctrl-C stops everything it started.
    """
    from coordinator.demo import DemoError, DemoOptions, run_demo

    _setup_logging(verbose)
    opts = DemoOptions(
        algorithm=algorithm,
        rounds=rounds,
        clients=clients,
        dataset=dataset,
        out=out,
        seed=seed,
        broker=broker,
        keep_broker=keep_broker,
    )
    try:
        _guard(lambda: run_demo(opts, echo=typer.echo))
    except DemoError as exc:
        raise _fail(str(exc)) from exc
    except KeyboardInterrupt:
        typer.echo("\ninterrupted: every process the demo started has been stopped", err=True)
        raise typer.Exit(code=130) from None


_BROKER_HELP = "MQTT broker URL, mqtt[s]://[user@]host[:port] (password: EDGEFL_BROKER__PASSWORD)"


@app.command()
def coordinator(
    broker: Annotated[str | None, typer.Option(help=_BROKER_HELP)] = None,
    run_id: Annotated[
        str | None, typer.Option(help="the run's id (topics are named after it)")
    ] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML run config")] = None,
    algorithm: Annotated[str | None, typer.Option(help="fml, pfml, fedavg, ...")] = None,
    clients: Annotated[int | None, typer.Option(help="clients expected to register")] = None,
    allow: Annotated[str | None, typer.Option(help=f"{_CSV} client ids admitted")] = None,
    min_clients: Annotated[
        int | None, typer.Option(help="start with this many if the others do not come")
    ] = None,
    clients_per_round: Annotated[int | None, typer.Option(help="clients sampled per round")] = None,
    rounds: Annotated[int | None, typer.Option(help="communication rounds")] = None,
    global_model: Annotated[str | None, typer.Option(help="global/meme family")] = None,
    local_epochs: Annotated[int | None, typer.Option(help="local epochs")] = None,
    batch_size: Annotated[int | None, typer.Option(help="batch size")] = None,
    lr: Annotated[float | None, typer.Option(help="learning rate")] = None,
    seed: Annotated[int | None, typer.Option(help="seed for the global model and sampling")] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="serve Prometheus metrics on this port")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="output directory")] = None,
    fresh: Annotated[
        bool, typer.Option("--fresh", help="ignore (delete) this run's checkpoint; start over")
    ] = False,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="override any field: key=value, dotted (fml.alpha=0.3)"),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log INFO messages")] = False,
) -> None:
    """The coordinator daemon: run a federation with clients that connect over an MQTT broker.

    Writes OUT/rounds.jsonl as rounds complete, then results.json, report.md and the plots. It
    checkpoints after every round and, restarted with the same command, resumes at the next one.
    SIGTERM / Ctrl-C: stops (exit 0); run the same command to resume.
    """
    from coordinator.deploy import run_coordinator
    from coordinator.server import Interrupted

    flags: dict[str, Any] = {
        "broker.url": broker,
        "run_id": run_id,
        "algorithm": algorithm,
        "clients": clients,
        "allow": _csv(allow),
        "round.min_clients": min_clients,
        "clients_per_round": clients_per_round,
        "rounds": rounds,
        "global_model": global_model,
        "seed": seed,
        "metrics_port": metrics_port,
        "out": str(out) if out else None,
    }
    training = {"local_epochs": local_epochs, "batch_size": batch_size, "lr": lr}
    _setup_logging(verbose)
    cfg = _load(config, flags, training, set_ or [])

    def show(rec: Any) -> None:
        acc = "—" if rec.mean_personal_acc is None else f"{100 * rec.mean_personal_acc:.2f}%"
        state = "FAILED" if rec.failed else "ok"
        typer.echo(
            f"round {rec.round}/{cfg.rounds} {state}: {len(rec.replied)}/{len(rec.trained)} "
            f"replied, mean personalized accuracy {acc}, {rec.seconds:.1f} s"
        )

    def resumed(done: int) -> None:
        typer.echo(f"coordinator {cfg.run_id}: resuming after round {done} (its checkpoint)")

    typer.echo(f"coordinator {cfg.run_id}: waiting for {cfg.clients} clients on {cfg.broker.url}")
    typer.echo(_round_rules(cfg))
    try:
        results = _guard(
            lambda: run_coordinator(cfg, fresh=fresh, on_round=show, on_resume=resumed)
        )
    except Interrupted as exc:
        typer.echo(f"coordinator {cfg.run_id}: {exc}; run the same command to resume")
        raise typer.Exit(code=0) from exc
    if fresh:
        typer.echo("(started over: --fresh)")
    _print_summary(results, cfg.out or f"runs/{cfg.run_id}")


@app.command()
def client(
    broker: Annotated[str | None, typer.Option(help=_BROKER_HELP)] = None,
    run_id: Annotated[str | None, typer.Option(help="the run's id")] = None,
    id_: Annotated[str | None, typer.Option("--id", help="this client's id")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML run config")] = None,
    model: Annotated[str | None, typer.Option(help="this device's architecture family")] = None,
    dataset: Annotated[str | None, typer.Option(help="digits, fashion_mnist, ...")] = None,
    data_root: Annotated[
        str | None, typer.Option(help="directory holding the dataset files")
    ] = None,
    max_samples: Annotated[int | None, typer.Option(help="use a seeded subset of the data")] = None,
    partition: Annotated[str | None, typer.Option(help="iid, shards, dirichlet, ...")] = None,
    clients: Annotated[int | None, typer.Option(help="clients the data is split among")] = None,
    index: Annotated[int | None, typer.Option(help="which client of the split this is")] = None,
    seed: Annotated[int | None, typer.Option(help="the federation's seed")] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option(help="its persisted state and, after the run, its personalized ONNX model"),
    ] = None,
    late: Annotated[
        bool,
        typer.Option(help="join a finished run: personalize from its archive (PersFL)"),
    ] = False,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="override any field: key=value")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log INFO messages")] = False,
) -> None:
    """One edge device over an MQTT broker: the data the simulator would give client INDEX of
    the split; trains when asked; exports its personalized model to STATE_DIR/<id>.onnx."""
    from coordinator.deploy import run_device

    flags: dict[str, Any] = {
        "broker.url": broker,
        "run_id": run_id,
        "client.id": id_,
        "client.model": model,
        "client.index": index,
        "client.state_dir": str(state_dir) if state_dir else None,
        "client.late": late or None,
        "data.dataset": dataset,
        "data.root": data_root,
        "data.max_samples": max_samples,
        "data.partition": partition,
        "clients": clients,
        "seed": seed,
        "device": device,
    }
    _setup_logging(verbose)
    cfg = _load(config, flags, {}, set_ or [])
    if threads is not None:
        import torch

        torch.set_num_threads(threads)

    def show(t: Any) -> None:
        acc = t.metrics.get("personal_correct"), t.metrics.get("personal_total")
        score = f", personalized accuracy {100 * acc[0] / acc[1]:.2f}%" if acc[1] else ""
        status = "ok" if t.ok else f"error: {t.error}"
        typer.echo(f"round {t.round}/{t.rounds} {t.phase}: {status}{score}")

    def started(dev: Any) -> None:
        if dev.resumed_after is not None:
            typer.echo(
                f"{dev.client_id}: resumed from {dev.state_path} (round {dev.resumed_after})"
            )

    from edge_sdk.client import RegistrationRefused

    try:
        dev = _guard(lambda: run_device(cfg, on_task=show, on_start=started))
    except RegistrationRefused as exc:
        raise _fail(str(exc)) from exc
    if not dev.finished:
        typer.echo(
            f"{dev.client_id}: stopped; its state is in {dev.state_path}; run again to resume"
        )
        return
    typer.echo(f"{dev.client_id}: done; personalized model: {dev.exported}")


@app.command("broker-acl")
def broker_acl(
    clients: Annotated[str, typer.Option(help=f"{_CSV} client ids (their broker user names)")],
    out: Annotated[Path, typer.Option("--out", "-o", help="directory for the files")],
    coordinator_user: Annotated[str, typer.Option(help="the coordinator's user")] = "coordinator",
    run_id: Annotated[str, typer.Option(help="restrict the rules to one run ('+': any)")] = "+",
    port: Annotated[int, typer.Option(help="the broker's listener port")] = 8883,
    tls_dir: Annotated[
        Path | None,
        typer.Option(help="directory with ca.pem, broker.pem, broker.key (default: no TLS)"),
    ] = None,
) -> None:
    """Write a mosquitto config, password file (hashed), ACL, per-user credentials and keys.

    Client X may publish only on its own up and peer topics and read only its own down topic, the
    broadcast and status topics and the peer topics meant for it; the coordinator has its own user.
    Each user's MQTT client id is its user name, so no credential can take another's session. Every
    participant also gets its own signing key (see `edgefl keys`).
    """
    from coordinator.acl import write_broker_files

    ids = _csv(clients) or []
    paths = _guard(
        lambda: write_broker_files(
            out, ids, coordinator_user=coordinator_user, run=run_id, port=port, tls_dir=tls_dir
        )
    )
    typer.echo(
        f"wrote {paths['mosquitto.conf']} (run it as: mosquitto -c {paths['mosquitto.conf']})"
    )
    typer.echo(f"  {paths['passwd']}, {paths['acl']}: {paths['owner_note']}")
    typer.echo(f"  each user's broker password: {paths['credentials']}/<user> (mode 600)")
    typer.echo(f"  each participant's signing key: {paths['keys']}/<id>.key (mode 600),")
    typer.echo(f"  the run's public keys: {paths['keys']}/roster.json")
    typer.echo("give every device its own password and key and the roster:")
    typer.echo("  broker.username = its id, broker.password_file, auth.key_file, auth.roster")


@app.command()
def keys(
    clients: Annotated[str, typer.Option(help=f"{_CSV} client ids")],
    out: Annotated[Path, typer.Option("--out", "-o", help="directory for the keys")],
) -> None:
    """Issue signing keys: OUT/<id>.key for the coordinator and each client (mode 600) and
    OUT/roster.json, the public keys everyone checks messages against. Keys already in OUT
    are kept (add clients by running it again with more ids)."""
    from edge_sdk.auth import issue_keys

    paths = _guard(lambda: issue_keys(out, _csv(clients) or []))
    typer.echo(f"wrote {len(paths) - 1} keys and {paths['roster']}")
    typer.echo("give each participant its own key and the roster, e.g. for c0:")
    typer.echo(f"  --set auth.key_file={out}/c0.key --set auth.roster={paths['roster']}")


def _round_rules(cfg: Any) -> str:
    """What a round waits for and how messages are checked, in words (printed at start)."""
    import math

    rc, n = cfg.round, cfg.clients
    need = max(1, math.ceil(rc.quorum * n))
    keys = (
        "OPEN MODE: messages are not signed (anyone on the broker can forge them)"
        if cfg.auth.open
        else f"messages signed and checked against {cfg.auth.roster}"
    )
    return (
        f"rounds close with {need} of {n} valid replies (round.quorum {rc.quorum:g}) or after "
        f"{rc.deadline_s:g} s per phase (round.deadline_s), retried {rc.retries}x; {keys}"
    )


def _load(
    config: Path | None, flags: dict[str, Any], training: dict[str, Any], sets: list[str]
) -> Any:
    from coordinator.config import ConfigError, load_config, parse_overrides

    try:
        cfg = load_config(config, flags, parse_overrides(sets), training=training)
    except ConfigError as exc:
        raise _fail(str(exc)) from exc
    tune_malloc(cfg)
    return cfg


def tune_malloc(cfg: Any) -> bool:
    """A process that talks to a broker keeps paho's chunk scratch memory in its heap
    (edge_sdk.malloc) unless `broker.tune_malloc` is false. True if the allocator was tuned."""
    if cfg.broker.url is None or not cfg.broker.tune_malloc:
        return False
    from edge_sdk.malloc import tune_for_streams

    return tune_for_streams()


def _guard(call: Any) -> Any:
    """Run a library call; its errors become a clean CLI error with a non-zero exit code."""
    from coordinator.config import ConfigError
    from coordinator.server import CoordinatorError
    from edge_sdk.transport import TransportError

    try:
        return call()
    except (ConfigError, CoordinatorError, TransportError, ValueError, FileNotFoundError) as exc:
        raise _fail(str(exc)) from exc


def _run(
    config: Path | None,
    flags: dict[str, Any],
    training: dict[str, Any],
    sets: list[str],
    *,
    quiet: bool,
    verbose: bool,
) -> None:
    from coordinator.config import ConfigError
    from coordinator.server import CoordinatorError
    from coordinator.simulator import simulate as run_simulation

    _setup_logging(verbose)
    cfg = _load(config, flags, training, sets)
    try:
        results = run_simulation(cfg, progress=not quiet)
    except (ConfigError, CoordinatorError, ValueError, FileNotFoundError, KeyError) as exc:
        raise _fail(str(exc)) from exc
    _print_summary(results, cfg.out)


def _print_summary(results: Results, out: str | None) -> None:
    def pct(v: float | None) -> str:
        return "—" if v is None else f"{100 * v:.2f}"

    clients = results.clients
    columns = [
        ("personal", "personal_acc"),
        ("local", "local_acc"),
        ("fedavg", "fedavg_acc"),
        ("fedavg_ft", "fedavg_ft_acc"),
        (f"{results.algorithm} global", "global_acc"),
    ]
    # A column per accuracy some client has (a baseline that did not run gets none).
    shown = [(h, k) for h, k in columns if any(getattr(c, k) is not None for c in clients)]
    mixed = len({c.device for c in clients}) > 1
    header = f"{'client':<8}{'arch':<10}" + "".join(f"{h:>{max(10, len(h) + 2)}}" for h, _ in shown)
    typer.echo(f"\n{results.algorithm}: per-client accuracy on each client's own test split (%)")
    typer.echo(header + ("  device" if mixed else ""))
    for c in clients:
        cells = "".join(f"{pct(getattr(c, k)):>{max(10, len(h) + 2)}}" for h, k in shown)
        typer.echo(f"{c.id:<8}{c.arch or '—':<10}{cells}" + (f"  {c.device}" if mixed else ""))
    means = ", ".join(
        f"{name} {pct(value)}%"
        for name, value in (
            ("personalized", results.client_mean("personal_acc")),
            ("local", results.client_mean("local_acc")),
            ("FedAvg global model", results.client_mean("fedavg_acc")),
            ("FedAvg+FT", results.client_mean("fedavg_ft_acc")),
            (f"{results.algorithm} global model", results.client_mean("global_acc")),
        )
        if value is not None
    )
    typer.echo(f"mean over clients (final): {means}")
    typer.echo(f"mean personalized accuracy: {pct(results.summary.mean_personal_acc)}%")
    against = [
        (c.id, c.personal_acc - best[1], best[0])
        for c in clients
        if c.personal_acc is not None and (best := c.best_baseline()) is not None
    ]
    if against:
        lost = sorted((d, cid, name) for cid, d, name in against if d < 0)
        worse = "; worse on " + ", ".join(
            f"{cid} ({100 * d:+.2f} vs {name})" for d, cid, name in lost
        )
        won = sum(d > 0 for _, d, _ in against)
        typer.echo(
            f"against each client's best baseline: better on {won} of {len(against)}"
            + (worse if lost else "")
        )
    if results.summary.metrics:
        m = results.summary.metrics
        shown_metrics = {k: m[k] for k in ("PUI", "PUD", "API", "APD", "JI") if k in m}
        typer.echo("metrics: " + json.dumps(shown_metrics))
    if results.device is not None:
        typer.echo(f"device: {results.device.describe()}")
    if results.summary.wall_seconds is not None:
        typer.echo(f"wall time: {results.summary.wall_seconds:.1f} s")
    if out:
        typer.echo(f"results: {Path(out) / 'results.json'}  report: {Path(out) / 'report.md'}")


@app.command()
def split(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML run config")] = None,
    dataset: Annotated[str | None, typer.Option(help="dataset name")] = None,
    data_root: Annotated[
        str | None, typer.Option(help="directory holding the dataset files")
    ] = None,
    max_samples: Annotated[int | None, typer.Option(help="use a seeded subset of the data")] = None,
    partition: Annotated[str | None, typer.Option(help="partition scheme")] = None,
    clients: Annotated[int | None, typer.Option(help="number of clients")] = None,
    seed: Annotated[int | None, typer.Option(help="partition seed")] = None,
    plot: Annotated[Path | None, typer.Option(help="write the label distribution PNG here")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="override any field: key=value")
    ] = None,
) -> None:
    """Show how a dataset would be split across clients (no training)."""
    from coordinator.config import ConfigError, load_config, parse_overrides
    from coordinator.federation import prepare_federation, split_table
    from model_zoo.data import plot_label_distribution

    flags = {
        "data.dataset": dataset,
        "data.root": data_root,
        "data.max_samples": max_samples,
        "data.partition": partition,
        "clients": clients,
        "seed": seed,
    }
    try:
        cfg = load_config(config, flags, parse_overrides(set_ or []))
        fed = prepare_federation(cfg)
    except (ConfigError, ValueError, FileNotFoundError, KeyError) as exc:
        raise _fail(str(exc)) from exc
    typer.echo(split_table(fed))
    if plot is not None:
        labels = fed.dataset.y.numpy()
        plot_label_distribution(fed.partition, labels, plot, class_names=fed.dataset.classes)
        typer.echo(f"label distribution: {plot}")


@app.command()
def zoo() -> None:
    """List the model families and algorithms."""
    from edge_sdk.algorithms import algorithm_names
    from model_zoo import families

    typer.echo("families:   " + ", ".join(families()))
    typer.echo("algorithms: " + ", ".join(algorithm_names()))


bench_app = typer.Typer(help="Measure the SDK's building blocks.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("onnx")
def bench_onnx(
    families: Annotated[
        str | None,
        typer.Option(help=f"{_CSV} families (default: every zoo family and lstm-char)"),
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="seconds: less training, data and repetitions")
    ] = False,
    threads: Annotated[
        int, typer.Option(min=1, help="PyTorch and onnxruntime intra-op threads")
    ] = 1,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    data_root: Annotated[
        str | None, typer.Option(help="directory holding the Fashion-MNIST IDX files")
    ] = None,
    seed: Annotated[int, typer.Option(help="seed for initialisation and training")] = 0,
    workdir: Annotated[
        Path | None, typer.Option(help="keep the ONNX files here (default: a temporary dir)")
    ] = None,
    json_out: Annotated[Path | None, typer.Option(help="also write the JSON report here")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log INFO messages")] = False,
) -> None:
    """PyTorch eager vs onnxruntime fp32 and int8, for every zoo family.

    Latency, throughput, size and accuracy of briefly trained models on real data, measured side
    by side. Prints JSON, then tables.
    """
    from coordinator.bench import (
        OnnxBenchConfig,
        bench_family_names,
        format_goals,
        run_onnx_benchmark,
    )
    from edge_sdk.device import resolve_device
    from edge_sdk.onnx_bench import format_rows

    _setup_logging(verbose)
    try:
        cfg = OnnxBenchConfig(
            families=tuple(_csv(families) or bench_family_names()),
            quick=quick,
            threads=threads,
            device=resolve_device(device).type,
            data_root=data_root,
            seed=seed,
        )
        report = run_onnx_benchmark(
            cfg, workdir=workdir, progress=lambda msg: typer.echo(msg, err=True)
        )
    except (ValueError, FileNotFoundError) as exc:
        raise _fail(str(exc)) from exc
    text = json.dumps(report, indent=2)
    typer.echo(text)
    if json_out is not None:
        from model_zoo.files import write_atomic

        write_atomic(json_out, text + "\n")
    m = report["machine"]
    typer.echo(
        f"\n{m['cpu']} ({m['cpu_count']} cores), device {m['device']}, {m['torch_threads']} "
        f"thread(s); torch {m['versions']['torch']}, onnxruntime {m['versions']['onnxruntime']}"
    )
    for kind, desc in report["data"].items():
        typer.echo(f"{kind}: {desc}")
    typer.echo(format_rows(report["rows"]))
    typer.echo("\ngoals:\n" + format_goals(report["goals"]))
    for fam, why in report["skipped"].items():
        typer.echo(f"skipped {fam}: {why}")


def main() -> None:
    app()
