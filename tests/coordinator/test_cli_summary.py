"""What `edgefl simulate` and `edgefl coordinator` print at the end of a run: a row per client,
or, above `ROWS_MAX` clients, a row per architecture."""

from __future__ import annotations

import re
import statistics

import pytest

from coordinator.cli_summary import ROWS_MAX, print_summary
from coordinator.results_model import ClientEntry, Results


def _client(i: int, arch: str, personal: float, local: float) -> ClientEntry:
    kib = {"mlp": 311, "lenet5": 241}[arch]
    return ClientEntry.model_validate(
        {
            "id": f"c{i:03d}",
            "arch": arch,
            "n_train": 50,
            "personal_acc": personal,
            "local_acc": local,
            "deployed_arch": arch if i % 7 else "mixture of mlp+lenet5",
            "deployed_kib": kib if i % 7 else 552,
        }
    )


def _results(n: int) -> Results:
    # Personalized accuracies spread over the clients, local training a fixed 0.8: the clients
    # below 0.8 did worse than training alone.
    clients = [
        _client(i, "mlp" if i % 2 else "lenet5", round(0.5 + 0.45 * (i / n) ** 2, 4), 0.8)
        for i in range(n)
    ]
    return Results(algorithm="fml", clients=clients)


def test_a_fleet_of_up_to_rows_max_clients_prints_a_row_per_client(capsys):
    print_summary(_results(ROWS_MAX), None)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"c\d{3} ", line)]
    assert len(rows) == ROWS_MAX
    assert rows[3].split()[:4] == ["c003", "mlp", "mlp,", "311"]


@pytest.mark.parametrize("n", [ROWS_MAX + 1, 500])
def test_a_larger_fleet_prints_a_row_per_architecture_and_names_the_worst_ten(capsys, n):
    results = _results(n)
    print_summary(results, "runs/big")
    out = capsys.readouterr().out
    assert not [line for line in out.splitlines() if re.match(r"c\d{3} ", line)]
    assert f"fml: {n} clients" in out and "every client's row: runs/big/report.md" in out
    for arch in ("mlp", "lenet5"):
        group = [c for c in results.clients if c.arch == arch]
        (row,) = [line for line in out.splitlines() if line.startswith(f"{arch} ")]
        personal = [c.personal_acc or 0.0 for c in group]
        mixtures = sum(c.details["deployed_arch"] != arch for c in group)
        assert row.split()[1] == str(len(group))
        assert f"mixture of mlp+lenet5, 552 KiB ×{mixtures}" in row
        assert f"{arch}, {311 if arch == 'mlp' else 241} KiB ×{len(group) - mixtures}" in row
        expect = (
            f"{100 * statistics.mean(personal):.2f} "
            f"[{100 * min(personal):.1f}-{100 * max(personal):.1f}]"
        )
        assert expect in row
        assert "80.00 [80.0-80.0]" in row  # local training
    # The clients below their best baseline, at most ten named, the farthest first.
    lost = sorted(results.clients, key=lambda c: c.personal_acc or 0.0)
    lost = [c for c in lost if (c.personal_acc or 0.0) < 0.8]
    (line,) = [line for line in out.splitlines() if "worse on" in line]
    named = re.findall(r"(c\d{3}) \(", line)
    assert named == [c.id for c in lost[:10]]
    assert f"and {len(lost) - 10} more" in line
