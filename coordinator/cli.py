"""The `edgefl` command line: thin commands that parse settings and call one library function.

The commands that run a federation live here (simulate, demo, coordinator, client); the tools
(export, split, zoo, settings, broker-acl, keys, bench) in `coordinator.cli_tools`; what they
all share in `coordinator.cli_common` (common options, error handling) and
`coordinator.cli_settings` (the options that set settings); what a run prints at its end in
`coordinator.cli_summary`.
"""

from __future__ import annotations

import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from coordinator.cli_common import (
    ConfigOpt,
    SetOpt,
    app,
    common,
    current,
    fail,
    guard,
)
from coordinator.cli_settings import (
    DATA,
    TRAINING_FLAGS,
    Flag,
    load,
    settings_options,
    tune_malloc,
)
from coordinator.cli_summary import print_summary, round_rules

if TYPE_CHECKING:  # the CLI imports the library lazily: `edgefl --help` stays fast
    from collections.abc import Callable

    from coordinator.results_model import Results

__all__ = ["app", "command_paths", "main", "tune_malloc"]


def _version(show: bool) -> None:
    if show:
        try:
            typer.echo(f"edgefl {version('edgefl')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            typer.echo("edgefl (not installed: no version)")
        raise typer.Exit()


@app.callback()
def _main(
    show_version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="print the version"),
    ] = False,
) -> None:
    """edgefl: personalized federated learning on heterogeneous edge devices."""


_ONNX_INT8_HELP = (
    "after the run, also write each personalized model as int8 ONNX: dynamic (any model) or "
    "static (calibrated on the client's own training data; not for LSTMs), checked against "
    "PyTorch. Smaller, but at batch 1 not always faster than fp32 (dynamic int8 convolutions and "
    "the guard's mixtures were slower): `edgefl bench onnx FILES` measures yours"
)

# The commands that run a federation end with this in their help (docs/reference/failures.md).
EXIT_STATUS = (
    "Exit status: 0 when every round got its quorum; 4 when some rounds did not and 3 when none "
    "did (the last line and results.json's summary.outcome say so); 2 for a bad setting or "
    "input; 130 when interrupted."
)

# The settings each command takes as flags, in the order of its --help: each flag's type, help
# and default come from the setting's field (cli_settings.settings_options); a `Flag` says only
# what differs from it. Shared groups first.
DEPLOY: tuple[Flag | str, ...] = (
    Flag("deploy.allow", name="--deploy"),
    Flag("deploy.max_params", name="--deploy-max-params"),
)
BROKER: tuple[Flag | str, ...] = (
    Flag("broker.url", name="--broker"),
    "run_id",
    "broker.connect_timeout_s",
)

SIMULATE: tuple[Flag | str, ...] = (
    "algorithm",
    *DATA,
    "models",
    "global_model",
    "clients",
    "clients_per_round",
    "rounds",
    *TRAINING_FLAGS,
    "seed",
    "device",
    "baselines",
    "parallel",
    "threads",
    "fleet",
    Flag("broker.url", name="--broker"),
    Flag("out", short="-o", type=Path, none="runs/<algorithm>-<date>-<time>"),
    "export_onnx",
    *DEPLOY,
)
# The demo's options mean what the settings mean, with defaults of its own (coordinator.demo).
DEMO: tuple[Flag | str, ...] = (
    Flag("algorithm", default="fml"),
    Flag("rounds", default=10),
    Flag("clients", default=6),
    Flag("data.dataset", default=None, none="fashion_mnist when installed, else digits"),
    Flag("out", short="-o", type=Path, default=Path("runs/demo")),
    Flag("seed", default=0),
    Flag("device", default="cpu"),
    Flag("broker.url", name="--broker", default=None, none="start one"),
)
COORDINATOR: tuple[Flag | str, ...] = (
    *BROKER,
    "algorithm",
    "clients",
    "allow",
    "round.min_clients",
    "round.register_timeout_s",
    "round.deadline_s",
    "clients_per_round",
    "rounds",
    "global_model",
    *TRAINING_FLAGS,
    "seed",
    "metrics_port",
    Flag("out", short="-o", type=Path, none="runs/<run-id>"),
)
CLIENT: tuple[Flag | str, ...] = (
    *BROKER,
    "client.index",
    "client.id",
    "client.model",
    *DATA,
    "clients",
    "seed",
    "device",
    Flag("threads", none="one per core"),
    Flag("client.state_dir", type=Path),
    "client.late",
    *DEPLOY,
)


def _int8(value: str | None) -> str | None:
    if value is not None and value not in ("dynamic", "static"):
        raise typer.BadParameter(f"{value!r}: choose dynamic or static")
    return value


def _apply_threads(cfg: Any) -> None:
    if cfg.threads is not None:
        import torch

        torch.set_num_threads(cfg.threads)


@app.command(epilog=EXIT_STATUS)
@common()
@settings_options(*SIMULATE)
def simulate(
    config: ConfigOpt = None,
    *,
    flags: dict[str, Any],  # the settings given as flags, by key (settings_options)
    onnx_int8: Annotated[
        str | None, typer.Option(help=_ONNX_INT8_HELP + " (implies --export-onnx)", callback=_int8)
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help=(
                "local processes (torch.distributed ranks) that share the clients, started by "
                "torch's elastic launcher; across machines: torchrun ... -m coordinator simulate "
                "(docs: Distributed simulation) [default: 1, this process]"
            ),
        ),
    ] = 1,
    set_: SetOpt = None,
) -> None:
    """Simulate a federation.

    A coordinator and N clients: in this process (--fleet local, the default), or each an
    EdgeClient over the in-memory transport (--fleet network) or --broker, the code a deployment
    runs; or shared among --workers local processes (torch.distributed ranks), or the ranks
    torchrun starts (torchrun ... -m coordinator simulate). The algorithm and every baseline run
    on one split with the same local-training budget. OUT gets results.json, report.md,
    report.html and the plots.
    """
    from coordinator.simulator import simulate as run_simulation

    if onnx_int8:
        flags["export_onnx"] = True
    cfg = load(config, flags, set_ or [])
    if cfg.out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        cfg = cfg.model_copy(update={"out": str(Path("runs") / f"{cfg.algorithm}-{stamp}")})
        typer.echo(f"results go to {cfg.out} (--out DIR to choose)")
    from coordinator import distributed

    opts = current()
    if distributed.in_launch():  # one rank of torchrun's (or of --workers)
        results = guard(lambda: distributed.run_rank(cfg, progress=not opts.quiet))
        if results is None:  # rank 0 reports
            return
    else:
        results = _until_interrupted(
            cfg,
            lambda: (
                distributed.launch(
                    cfg,
                    workers,
                    level=opts.level,
                    libraries=opts.library_level,
                    fmt=opts.log_format,
                    progress=not opts.quiet,
                )
                if workers > 1
                else run_simulation(cfg, progress=not opts.quiet)
            ),
        )
    print_summary(results, cfg.out)
    if onnx_int8:
        # A sampled run's clients outside the sample were never finalized: no model deployed.
        sample = [c.id for c in results.clients] if results.population is not None else None
        _export_after_run(
            Path(cfg.out) / "state", cfg, onnx_int8, out=Path(cfg.out) / "onnx", clients=sample
        )
    _close(results)


def _until_interrupted(cfg: Any, call: Callable[[], Results]) -> Results:
    """`call`'s results; SIGTERM (a scheduler's stop) or Ctrl-C stop it as one: what it holds is
    released on the way out, one line says whether its checkpoint resumes it, and the exit
    status is 130."""
    from coordinator.demo_deploy import interruptible
    from coordinator.simulator import checkpoint_dir

    try:
        with interruptible():
            return guard(call)
    except KeyboardInterrupt:
        kept = checkpoint_dir(cfg)  # (the run's start checked that it has an OUT)
        if kept is not None:
            line = (
                f"interrupted: {kept} holds every round that finished; "
                "the same command resumes from there"
            )
        else:
            line = (
                "interrupted: nothing of this run was kept (with --set checkpoint=true a "
                "simulation stopped resumes where it stopped)"
            )
        typer.echo(line, err=True)
        raise typer.Exit(code=130) from None


def _close(results: Results) -> None:
    """A run that lost rounds to a missed quorum ends with a line that says so, and a non-zero
    exit status (`EXIT_STATUS`)."""
    line = results.closing_line()
    if line is not None:
        typer.secho(line, fg=typer.colors.RED, bold=True)
        raise typer.Exit(code=results.exit_code)


def _export_after_run(
    states: Path,
    cfg: Any,
    kind: str,
    *,
    out: Path | None = None,
    clients: list[str] | None = None,
) -> None:
    """`--onnx-int8`: the int8 model of every client whose state is at `states` (or of
    `clients`), made from the fp32 file the run wrote as it ended (exported again only where it
    is not there)."""
    from coordinator.cli_tools import print_export
    from coordinator.export import export_clients

    typer.echo(f"\nint8 ({kind}) ONNX, checked against PyTorch on each client's test split:")
    guard(
        lambda: export_clients(
            states,
            [f"int8-{kind}"],
            out=out,
            clients=clients,
            config=cfg,
            on_client=print_export,
            keep_fp32=True,
        )
    )


@app.command(epilog=EXIT_STATUS)
@common()
@settings_options(*DEMO)
def demo(
    *,
    flags: dict[str, Any],  # the settings given as flags, by key (settings_options)
    keep_broker: Annotated[
        bool,
        typer.Option("--keep-broker", help="after the report, keep the broker up for your app"),
    ] = False,
) -> None:
    """Run a real federation on this machine, with a report.

    Takes 2-3 minutes on 2 cores. Starts an MQTT broker (mosquitto when installed, else the embedded
    one), a coordinator and one process per client, each client with its own architecture (mlr, mlp,
    lenet5, cnn1, a small vgg11, the row-LSTM), on a split where each client sees a few classes and
    about 100 training images. Then the local, FedAvg and FedAvg+FT baselines, an ONNX benchmark
    of every client's personalized model, and OUT/report.html. Every process logs to
    OUT/logs/<name>.log. Ctrl-C stops everything it started.
    """
    from coordinator.demo import DemoError, DemoOptions, run_demo

    opts = DemoOptions(
        algorithm=flags["algorithm"],
        rounds=flags["rounds"],
        clients=flags["clients"],
        dataset=flags["data.dataset"],
        out=flags["out"],
        seed=flags["seed"],
        device=flags["device"],
        broker=flags["broker.url"],
        keep_broker=keep_broker,
        child_args=tuple(current().child_args()),
    )
    try:
        results = guard(lambda: run_demo(opts, echo=typer.echo))
    except DemoError as exc:
        raise fail(str(exc)) from exc
    except KeyboardInterrupt:
        typer.echo("\ninterrupted: every process the demo started has been stopped", err=True)
        raise typer.Exit(code=130) from None
    _close(results)


@app.command(epilog=EXIT_STATUS)
@common()
@settings_options(*COORDINATOR)
def coordinator(
    config: ConfigOpt = None,
    *,
    flags: dict[str, Any],  # the settings given as flags, by key (settings_options)
    fresh: Annotated[
        bool, typer.Option("--fresh", help="ignore (delete) this run's checkpoint; start over")
    ] = False,
    set_: SetOpt = None,
) -> None:
    """Run the coordinator daemon of a federation over MQTT.

    Clients connect over an MQTT broker. It waits for the clients to register
    (round.register_timeout_s), writes OUT/rounds.jsonl as rounds complete, then results.json,
    report.md and the plots. It checkpoints after every round and, restarted with the same command,
    resumes at the next one. SIGTERM / Ctrl-C: stops (exit 0); run the same command to resume.
    """
    from coordinator.deploy import run_coordinator
    from coordinator.server import Interrupted

    cfg = load(config, flags, set_ or [])
    from edge_sdk import topics
    from edge_sdk.auth import Keyring

    # Keys first: a coordinator without them says how to issue them before anything else.
    guard(lambda: Keyring.load(cfg.auth, topics.COORDINATOR))

    finalized: list[int] = []  # after the last round: how many clients have finalized

    def show(rec: Any) -> None:
        acc = "—" if rec.mean_personal_acc is None else f"{100 * rec.mean_personal_acc:.2f}%"
        state = "FAILED" if rec.failed else "ok"
        typer.echo(
            f"round {rec.round}/{cfg.rounds} {state}: {rec.n_replied}/{rec.n_trained} "
            f"replied, mean personalized accuracy {acc}, {rec.seconds:.1f} s"
        )
        if rec.round == cfg.rounds:  # the finalize phase can outlast the rounds
            wait = cfg.round.finalize_deadline_s or cfg.round.deadline_s
            typer.echo(
                f"coordinator {cfg.run_id}: the clients finalize (each chooses, distils and "
                f"exports the model it deploys), up to {wait:.0f} s"
            )
            finalized.append(0)

    def answered(n: int) -> None:
        # Said at each tenth of the clients (every one of a fleet of ten or fewer)
        if finalized:
            before = finalized[0]
            finalized[0] += n
            tenth = max(1, cfg.clients // 10)
            if finalized[0] // tenth > before // tenth or finalized[0] == cfg.clients:
                typer.echo(
                    f"coordinator {cfg.run_id}: {finalized[0]} of {cfg.clients} clients finalized"
                )

    def resumed(done: int) -> None:
        typer.echo(f"coordinator {cfg.run_id}: resuming after round {done} (its checkpoint)")

    out_dir = Path(cfg.out or f"runs/{cfg.run_id}")
    typer.echo(f"coordinator {cfg.run_id}: logs: {current().where()}")
    typer.echo(f"coordinator {cfg.run_id}: rounds: {out_dir / 'rounds.jsonl'}")
    typer.echo(
        f"coordinator {cfg.run_id}: waiting up to {cfg.round.register_timeout_s:.0f} s for "
        f"{cfg.clients} clients on {cfg.broker.url}"
    )
    typer.echo(round_rules(cfg))
    try:
        results = guard(
            lambda: run_coordinator(
                cfg, fresh=fresh, on_round=show, on_resume=resumed, on_clients=answered
            )
        )
    except Interrupted as exc:
        typer.echo(f"coordinator {cfg.run_id}: {exc}; run the same command to resume")
        raise typer.Exit(code=0) from exc
    if fresh:
        typer.echo("(started over: --fresh)")
    print_summary(results, cfg.out or f"runs/{cfg.run_id}")
    _close(results)


@app.command()
@common()
@settings_options(*CLIENT)
def client(
    config: ConfigOpt = None,
    *,
    flags: dict[str, Any],  # the settings given as flags, by key (settings_options)
    onnx_int8: Annotated[str | None, typer.Option(help=_ONNX_INT8_HELP, callback=_int8)] = None,
    set_: SetOpt = None,
) -> None:
    """Run one client of a federation over MQTT (on its edge device).

    It trains when the coordinator asks. Its data is what the simulator would give client INDEX of
    the configured split. It persists its state in STATE_DIR after every task, resumes from it when
    restarted, and exports its personalized model to STATE_DIR/<id>.onnx after the run.
    """
    from coordinator.config import write_config
    from coordinator.deploy import run_client
    from coordinator.export import RUN_CONFIG_SUFFIX

    cfg = load(config, flags, set_ or [])
    _apply_threads(cfg)

    def show(t: Any) -> None:
        acc = t.metrics.get("personal_correct"), t.metrics.get("personal_total")
        score = f", personalized accuracy {100 * acc[0] / acc[1]:.2f}%" if acc[1] else ""
        status = "ok" if t.ok else f"error: {t.error}"
        typer.echo(f"round {t.round}/{t.rounds} {t.phase}: {status}{score}")

    def started(dev: Any) -> None:
        # What `edgefl export` needs to rebuild this client's data from its state.
        own = cfg.model_copy(update={"client": cfg.client.model_copy(update={"id": dev.client_id})})
        write_config(own, Path(cfg.client.state_dir) / f"{dev.client_id}{RUN_CONFIG_SUFFIX}")
        typer.echo(f"{dev.client_id}: logs: {current().where()}")
        if dev.resumed_after is not None:
            typer.echo(
                f"{dev.client_id}: resumed from {dev.state_path} (round {dev.resumed_after})"
            )
        typer.echo(
            f"{dev.client_id}: waiting for the coordinator of run {cfg.run_id} on "
            f"{cfg.broker.url} (Ctrl-C stops; the state stays in {cfg.client.state_dir})"
        )

    from edge_sdk.client import RegistrationRefused

    try:
        dev = guard(lambda: run_client(cfg, on_task=show, on_start=started))
    except RegistrationRefused as exc:
        raise fail(str(exc)) from exc
    if not dev.finished:
        typer.echo(
            f"{dev.client_id}: stopped; its state is in {dev.state_path}; run again to resume"
        )
        return
    deployed = dev.deployed
    chosen = f" (deployed: {deployed.choice}, {deployed.arch})" if deployed is not None else ""
    typer.echo(f"{dev.client_id}: done; personalized model: {dev.exported}{chosen}")
    if onnx_int8 and dev.state_path is not None:
        _export_after_run(dev.state_path, cfg, onnx_int8)


from coordinator import cli_tools as _tools  # noqa: E402, F401  (registers the tool commands)


def command_paths() -> list[list[str]]:
    """Every command as a user types it after `edgefl` (`[]`: the app itself, `["bench",
    "onnx"]`): what the docs' reference, the start-up benchmark and its test walk."""

    def walk(command: Any, path: list[str]) -> list[list[str]]:
        found = [path]
        for name, sub in getattr(command, "commands", {}).items():
            found += walk(sub, [*path, name])
        return found

    return walk(typer.main.get_command(app), [])


def main() -> None:
    app()
