"""benchmarks/reproduce.py: every registered row resolves to a valid run config."""

import importlib.util
import sys
from pathlib import Path

import pytest

from coordinator.config import load_config

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "reproduce.py"
_spec = importlib.util.spec_from_file_location("reproduce", SCRIPT)
assert _spec is not None and _spec.loader is not None
reproduce = importlib.util.module_from_spec(_spec)
sys.modules["reproduce"] = reproduce  # dataclasses look their module up
_spec.loader.exec_module(reproduce)


@pytest.mark.parametrize("name", sorted(reproduce.ROWS))
def test_every_row_resolves_to_the_algorithm_and_rounds_it_names(name):
    row = reproduce.ROWS[name]
    cfg = load_config(
        reproduce.ROOT / row.config if row.config else None, reproduce._nest(row.flags)
    )
    assert cfg.algorithm in name and f"T={cfg.rounds}" in row.title


def _summary(row, personal):
    return {"row": row, "ours": {"personal_final": personal}}


def test_fedme_tuning_line_compares_the_automatic_choice_with_the_best_fixed_architecture():
    summaries = [
        _summary("fedme-fmnist-dirichlet", 0.850),
        _summary("fedme-fmnist-fixed-mlp", 0.862),
        _summary("fedme-fmnist-fixed-cnn1", 0.855),
    ]
    line = reproduce._fedme_tuning(summaries)
    assert "85.00 against the best fixed one, mlp 86.20 (-1.20 points; within 1 point: no)" in line
    summaries[0] = _summary("fedme-fmnist-dirichlet", 0.855)
    assert "(-0.70 points; within 1 point: yes)" in reproduce._fedme_tuning(summaries)
    assert reproduce._fedme_tuning(summaries[:1]) == ""


def test_table_on_a_fresh_clone_says_to_run_a_row_first(tmp_path, capsys):
    # Before: FileNotFoundError writing summary.json into the missing runs/reproduce.
    assert reproduce.main(["table", "--out", str(tmp_path / "runs" / "reproduce")]) == 0
    said = capsys.readouterr().out
    assert "no row has been run yet under" in said
    assert "python benchmarks/reproduce.py run pfml-synthetic-mlr" in said


def test_pooled_accuracy_weighs_each_client_by_its_test_samples():
    sizes = {"a": 10, "b": 30, "c": 5}
    # c has no accuracy, d no size: neither counts
    got = reproduce._pooled({"a": 1.0, "b": 0.5, "c": None, "d": 0.0}, sizes)
    assert got == pytest.approx((10 * 1.0 + 30 * 0.5) / 40)
    assert reproduce._pooled({}, sizes) is None
