"""The `edgefl` tools: export, split, zoo, settings, broker-acl, keys and bench (registered on
the app that `coordinator.cli` runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from coordinator.cli_common import (
    CONTEXT,
    CSV,
    ConfigOpt,
    SetOpt,
    app,
    common,
    csv_list,
    fail,
    guard,
    key_values,
)
from coordinator.cli_settings import DATA, load, settings_options

__all__ = ["bench_app", "print_export"]


def print_export(done: Any) -> None:
    """One client's exported formats, as `edgefl export` and `--onnx-int8` print them."""
    from edge_sdk.variants import format_variant_table

    typer.echo(f"\n{done.client_id} ({done.arch}):")
    typer.echo(format_variant_table(done.reports))
    for fmt, why in done.skipped.items():
        typer.echo(f"{fmt} skipped: {why}")


def _formats(value: str) -> list[str]:
    from edge_sdk.variants import FORMATS

    chosen = csv_list(value) or []
    bad = [f for f in chosen if f not in FORMATS]
    if bad or not chosen:
        raise typer.BadParameter(
            f"{', '.join(map(repr, bad)) or repr(value)}: choose from {', '.join(FORMATS)}"
        )
    return chosen


@app.command()
@common()
def export(
    source: Annotated[
        Path,
        typer.Argument(
            metavar="SOURCE",
            help="a client state (<id>.state), a client's --state-dir, or a run's output folder",
        ),
    ],
    formats: Annotated[
        str,
        typer.Option(
            "--format",
            help=f"{CSV}: fp32, fp16, int8-dynamic, int8-static (fp32 always). int8 is smaller "
            "but at batch 1 not always faster than fp32 (dynamic int8 convolutions and the "
            "guard's mixtures were slower): `edgefl bench onnx FILES` measures the files",
        ),
    ] = "fp32,fp16,int8-dynamic,int8-static",
    client_ids: Annotated[
        str | None, typer.Option("--client", help=f"{CSV} client ids [default: every one found]")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="folder for the files [default: next to each state]"),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="the run's config [default: <id>.run.toml, demo.toml or results.json by it]",
        ),
    ] = None,
    calibration_samples: Annotated[
        int, typer.Option(min=1, help="training inputs static int8 is calibrated on")
    ] = 256,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="override a setting of the run's config (--config or the one found): key=value",
            callback=key_values,
        ),
    ] = None,
) -> None:
    """Export a trained client's model to ONNX, fp32 to int8.

    Formats: fp32, fp16, int8 dynamic or static. The model comes from the client's saved state; its
    data from the run's config (static int8 is calibrated on the client's own training data). Every
    file is checked against PyTorch on the client's test split: its size, accuracy, how often its
    prediction agrees with PyTorch's and the largest logit difference are printed. The files are
    <id>.onnx (fp32) and <id>.<format>.onnx.
    """
    from coordinator.config import load_config, parse_overrides
    from coordinator.export import export_clients

    chosen = guard(lambda: _formats(formats))
    overrides = guard(lambda: parse_overrides(set_ or []))
    cfg = None if config is None else guard(lambda: load_config(config, None, overrides))
    done = guard(
        lambda: export_clients(
            source,
            chosen,
            out=out,
            clients=csv_list(client_ids),
            config=cfg,
            overrides=overrides,
            calibration_samples=calibration_samples,
            on_client=print_export,
        )
    )
    typer.echo(f"\n{len(done)} client(s) exported; accuracy on each client's own test split")


@app.command()
@common()
@settings_options(*DATA, "clients", "seed")
def split(
    config: ConfigOpt = None,
    *,
    flags: dict[str, Any],  # the settings given as flags, by key (settings_options)
    plot: Annotated[Path | None, typer.Option(help="write the label distribution PNG here")] = None,
    set_: SetOpt = None,
) -> None:
    """Show how a dataset would be split, without training."""
    from coordinator.federation import prepare_federation, split_table
    from model_zoo.data import plot_label_distribution

    cfg = load(config, flags, set_ or [])
    fed = guard(lambda: prepare_federation(cfg))
    typer.echo(split_table(fed))
    if plot is not None:
        labels = fed.dataset.y.numpy()
        plot_label_distribution(fed.partition, labels, plot, class_names=fed.dataset.classes)
        typer.echo(f"label distribution: {plot}")


@app.command()
@common()
def zoo() -> None:
    """List model families, datasets, partitions, algorithms.

    Everything a run can name, plugins' registrations included.
    """
    from coordinator.plugins import loaded_plugins
    from edge_sdk.algorithms import algorithm_names
    from model_zoo import families
    from model_zoo.data import dataset_names, partition_schemes

    typer.echo("families:   " + ", ".join(families()))
    typer.echo("datasets:   " + ", ".join(dataset_names()))
    typer.echo("partitions: " + ", ".join(partition_schemes()))
    typer.echo("algorithms: " + ", ".join(algorithm_names()))
    plugins = loaded_plugins()
    typer.echo("plugins:    " + (", ".join(plugins) if plugins else "none"))


@app.command()
@common()
def settings(
    prefix: Annotated[
        str | None,
        typer.Argument(metavar="PREFIX", help="only the keys that start with this (fml, round)"),
    ] = None,
) -> None:
    """List every setting with its default.

    The keys --set, TOML files and EDGEFL_* variables take.
    """
    from coordinator.config_keys import ENV_PREFIX, setting_keys
    from coordinator.run_config import run_config_model

    defaults = run_config_model()()
    keys = [k for k in setting_keys() if prefix is None or k.startswith(prefix)]
    if not keys:
        raise fail(f"no setting starts with {prefix!r}; try `edgefl settings`")
    for key in keys:
        node: Any = defaults
        for part in key.split("."):
            node = getattr(node, part)
        value = json.dumps(node.model_dump() if hasattr(node, "model_dump") else node)
        typer.echo(f"{key} = {value}")
    typer.echo(
        f"\n--set key=value, a TOML file (`key = value` under [section]), or "
        f"{ENV_PREFIX}KEY (nested: {ENV_PREFIX}FML__ALPHA); `broker.password` only from "
        f"{ENV_PREFIX}BROKER__PASSWORD or broker.password_file"
    )


@app.command("broker-acl")
@common(plugins=False)
def broker_acl(
    clients: Annotated[str, typer.Option(help=f"{CSV} client ids (their broker user names)")],
    out: Annotated[Path, typer.Option("--out", "-o", help="directory for the files")],
    coordinator_user: Annotated[str, typer.Option(help="the coordinator's user")] = "coordinator",
    run_id: Annotated[str, typer.Option(help="restrict the rules to one run ('+': any)")] = "+",
    port: Annotated[int, typer.Option(help="the broker's listener port")] = 8883,
    tls_dir: Annotated[
        Path | None,
        typer.Option(help="directory with ca.pem, broker.pem, broker.key (default: no TLS)"),
    ] = None,
) -> None:
    """Write a mosquitto config, users, ACL and signing keys.

    The password file is hashed; every user gets its own credentials file. Client X may publish
    only on its own up and peer topics and read only its own down topic, the broadcast and status
    topics and the peer topics meant for it; the coordinator has its own user. Each user's MQTT
    client id is its user name, so no credential can take another's session. Every participant
    also gets its own signing key (see `edgefl keys`).
    """
    from coordinator.acl import write_broker_files

    ids = csv_list(clients) or []
    paths = guard(
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
    typer.echo("give every client its own password and key and the roster:")
    typer.echo("  broker.username = its id, broker.password_file, auth.key_file, auth.roster")


@app.command()
@common(plugins=False)
def keys(
    clients: Annotated[str, typer.Option(help=f"{CSV} client ids")],
    out: Annotated[Path, typer.Option("--out", "-o", help="directory for the keys")],
) -> None:
    """Issue a signing key to the coordinator and each client.

    OUT/<id>.key for each (mode 600) and OUT/roster.json, the public keys everyone checks
    messages against. Keys already in OUT are kept (add clients by running it again with more
    ids)."""
    from edge_sdk.auth import issue_keys

    ids = csv_list(clients) or []
    paths = guard(lambda: issue_keys(out, ids))
    typer.echo(f"wrote {len(paths) - 1} keys and {paths['roster']}")
    first = ids[0] if ids else "coordinator"  # the example names a key this command wrote
    typer.echo(f"give each participant its own key and the roster, e.g. for {first}:")
    typer.echo(f"  --set auth.key_file={paths[first]} --set auth.roster={paths['roster']}")


bench_app = typer.Typer(
    help="Measure the SDK's building blocks.", no_args_is_help=True, context_settings=CONTEXT
)
app.add_typer(bench_app, name="bench")


@bench_app.command("onnx")
@common(plugins=False)
def bench_onnx(
    files: Annotated[
        list[Path] | None,
        typer.Argument(
            metavar="[FILES]...",
            help="measure these ONNX files of one model instead (edgefl export's fp32, fp16 and "
            "int8 files of a client), on --data or --dataset",
            show_default=False,
        ),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(help="FILES' test data: an .npz with inputs x (preprocessed) and labels y"),
    ] = None,
    dataset: Annotated[
        str | None, typer.Option(help="FILES' test data: a seeded subset of this dataset")
    ] = None,
    samples: Annotated[int, typer.Option(min=1, help="test samples for FILES")] = 1000,
    families: Annotated[
        str | None,
        typer.Option(help=f"{CSV} families [default: every zoo family and lstm-char]"),
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="seconds: less training, data and repetitions")
    ] = False,
    threads: Annotated[
        int, typer.Option(min=1, help="CPU threads, for PyTorch and onnxruntime alike")
    ] = 1,
    device: Annotated[str, typer.Option(help="auto (CUDA if there is one), cpu, cuda")] = "auto",
    data_root: Annotated[
        str | None,
        typer.Option(help="directory of the dataset files (the zoo's: Fashion-MNIST IDX files)"),
    ] = None,
    seed: Annotated[int, typer.Option(help="seed for initialisation and training")] = 0,
    workdir: Annotated[
        Path | None, typer.Option(help="keep the ONNX files here [default: a temporary dir]")
    ] = None,
    json_out: Annotated[Path | None, typer.Option(help="also write the JSON report here")] = None,
) -> None:
    """Measure PyTorch against onnxruntime fp32 and int8, or your files.

    For every zoo family: latency, throughput, size and accuracy of briefly trained models on real
    data, measured side by side. With FILES: those files (fp32, fp16, int8), side by side on
    --data or --dataset. Prints JSON, then tables. At batch 1, int8 is not always faster than
    fp32 (dynamic int8 convolutions and the guard's mixtures were slower): measure before
    deploying it.
    """
    from coordinator.bench import (
        OnnxBenchConfig,
        bench_family_names,
        bench_files,
        format_goals,
        run_onnx_benchmark,
    )
    from edge_sdk.device import resolve_device
    from edge_sdk.onnx_bench import BenchSettings, format_rows

    def run() -> Any:
        if files:
            if families:
                raise ValueError("give FILES or --families, not both")
            base = BenchSettings.quick() if quick else BenchSettings()
            return bench_files(
                files,
                data=data,
                dataset=dataset,
                data_root=data_root,
                samples=samples,
                seed=seed,
                settings=base.with_(threads=threads, device=resolve_device(device).type),
            )
        cfg = OnnxBenchConfig(
            families=tuple(csv_list(families) or bench_family_names()),
            quick=quick,
            threads=threads,
            device=resolve_device(device).type,
            data_root=data_root,
            seed=seed,
        )
        return run_onnx_benchmark(
            cfg, workdir=workdir, progress=lambda msg: typer.echo(msg, err=True)
        )

    report = guard(run)
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
    if "goals" in report:  # the zoo's run (not your files)
        typer.echo("\ngoals:\n" + format_goals(report["goals"]))
    for fam, why in report.get("skipped", {}).items():
        typer.echo(f"skipped {fam}: {why}")
