"""What the commands that run a federation print: a run's per-client accuracies and means, and
what a round waits for, in words."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from coordinator.results_model import ClientEntry, Results

__all__ = ["ROWS_MAX", "print_summary", "round_rules"]

# Above this many clients the console gives a row per architecture, not per client (report.md
# and results.json keep every client's); and it names at most ROWS_WORSE clients that ended
# below their best baseline, the farthest first.
ROWS_MAX = 40
ROWS_WORSE = 10


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
    if len(clients) > ROWS_MAX:
        _per_architecture(results.algorithm, clients, shown, deployed, out)
    else:
        wide = max(10, *(len(d) + 2 for d in deployed.values()))
        header = f"{'client':<8}{'arch':<10}{'deployed':<{wide}}"
        header += "".join(f"{h:>{max(10, len(h) + 2)}}" for h, _ in shown)
        typer.echo(
            f"\n{results.algorithm}: per-client accuracy on each client's own test split (%)"
        )
        typer.echo(header + ("  device" if mixed else ""))
        for c in clients:
            cells = "".join(f"{pct(getattr(c, k)):>{max(10, len(h) + 2)}}" for h, k in shown)
            row = f"{c.id:<8}{c.arch or '—':<10}{deployed[c.id]:<{wide}}{cells}"
            typer.echo(row + (f"  {c.device}" if mixed else ""))
    if (line := results.sample_line()) is not None:
        typer.echo(line)
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
            f"{cid} ({100 * d:+.2f} vs {name})" for d, cid, name in lost[:ROWS_WORSE]
        )
        if len(lost) > ROWS_WORSE:
            worse += f" and {len(lost) - ROWS_WORSE} more (report.md has every client)"
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


def _per_architecture(
    algorithm: str,
    clients: Sequence[ClientEntry],
    shown: Sequence[tuple[str, str]],
    deployed: Mapping[str, str],
    out: str | None,
) -> None:
    """One row per architecture: its clients, what they deployed (architecture and size, how
    many of each) and each accuracy's mean over them with its lowest and highest."""
    by_arch: dict[str, list[ClientEntry]] = {}
    for c in clients:
        by_arch.setdefault(c.arch or "—", []).append(c)
    cells: dict[str, list[str]] = {}
    for arch, group in by_arch.items():
        kinds = Counter(deployed[c.id] for c in group).most_common()
        told = ", ".join(f"{d} ×{n}" for d, n in kinds[:2])
        told += f", {sum(n for _, n in kinds[2:])} other" if len(kinds) > 2 else ""
        row = [arch, str(len(group)), told]
        for _, key in shown:
            values = [v for c in group if (v := getattr(c, key)) is not None]
            row.append(
                f"{100 * statistics.mean(values):.2f} [{100 * min(values):.1f}-"
                f"{100 * max(values):.1f}]"
                if values
                else "—"
            )
        cells[arch] = row
    header = ["arch", "clients", "deployed", *(h for h, _ in shown)]
    wide = [max(len(r[i]) for r in [header, *cells.values()]) for i in range(len(header))]
    where = f"{Path(out) / 'report.md'}" if out else "results.json"
    typer.echo(
        f"\n{algorithm}: {len(clients)} clients, each one's accuracy on its own test split (%), "
        f"mean [lowest-highest] over the clients of each architecture; every client's row: {where}"
    )
    for row in [header, *cells.values()]:
        typer.echo(
            "  ".join(
                f"{v:<{w}}" if i < 3 else f"{v:>{w}}"
                for i, (v, w) in enumerate(zip(row, wide, strict=True))
            )
        )


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
