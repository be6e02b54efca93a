"""What the commands that run a federation print: a run's per-client accuracies and means, and
what a round waits for, in words."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from coordinator.results_model import Results

__all__ = ["print_summary", "round_rules"]


def print_summary(results: Results, out: str | None) -> None:
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
    from coordinator.report.comparison import deployed as deployed_cell

    deployed = {c.id: deployed_cell(c) for c in clients}
    wide = max(10, *(len(d) + 2 for d in deployed.values()))
    header = f"{'client':<8}{'arch':<10}{'deployed':<{wide}}"
    header += "".join(f"{h:>{max(10, len(h) + 2)}}" for h, _ in shown)
    typer.echo(f"\n{results.algorithm}: per-client accuracy on each client's own test split (%)")
    typer.echo(header + ("  device" if mixed else ""))
    for c in clients:
        cells = "".join(f"{pct(getattr(c, k)):>{max(10, len(h) + 2)}}" for h, k in shown)
        row = f"{c.id:<8}{c.arch or '—':<10}{deployed[c.id]:<{wide}}{cells}"
        typer.echo(row + (f"  {c.device}" if mixed else ""))
    told = results.deployed()
    if told["devices"]:
        typer.echo(
            f"deployed: {told['own_architecture']} of {told['devices']} devices a model of their "
            "own architecture (the report's client details say why each deployed what it did)"
        )
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
        shown_metrics = {
            k: round(v, 3) if isinstance(v, float) else v
            for k in ("PUI", "PUD", "API", "APD", "JI")
            if k in m
            for v in [m[k]]
        }
        typer.echo("metrics: " + json.dumps(shown_metrics))
    if results.device is not None:
        typer.echo(f"device: {results.device.describe()}")
    if results.summary.wall_seconds is not None:
        typer.echo(f"wall time: {results.summary.wall_seconds:.1f} s")
    if out:
        typer.echo(f"results: {Path(out) / 'results.json'}  report: {Path(out) / 'report.md'}")


def round_rules(cfg: Any) -> str:
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
        f"{rc.deadline_s:g} s per phase (round.deadline_s), {rc.reconnect_grace_s:g} s for a "
        f"client whose connection dropped (round.reconnect_grace_s), retried {rc.retries}x; {keys}"
    )
