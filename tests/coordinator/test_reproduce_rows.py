"""benchmarks/reproduce.py: every registered row resolves to a valid run config."""

import importlib.util
import json
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


def test_where_a_row_runs_reaches_its_config_and_is_not_a_shortening(tmp_path, monkeypatch):
    # Device, data root and checkpoint say where and how a row runs: its row.json says so, and
    # only --rounds and the like mark it shortened.
    seen = []

    def simulate(cfg, progress):  # what the row would run, not run: the run writes OUT/<row>
        seen.append(cfg)
        Path(cfg.out).mkdir(parents=True, exist_ok=True)

    monkeypatch.setattr(reproduce, "simulate", simulate)
    monkeypatch.setattr(reproduce, "table", lambda out: "")
    row, root = "fml-fmnist-p6-lenet5", str(tmp_path / "fm")
    where = ["--device", "cuda", "--data-root", root, "--checkpoint", "--out", str(tmp_path)]
    assert reproduce.main(["run", row, *where]) == 0
    cfg = seen[-1]
    assert (cfg.device, cfg.data.root, cfg.checkpoint, cfg.rounds) == ("cuda", root, True, 200)
    meta = json.loads((tmp_path / row / "row.json").read_text())
    assert (meta["device"], meta["shortened"], meta["overrides"]) == ("cuda", False, {})
    assert reproduce.main(["run", row, "--rounds", "3", "--out", str(tmp_path)]) == 0
    assert (seen[-1].device, seen[-1].checkpoint, seen[-1].rounds) == ("cpu", False, 3)
    assert json.loads((tmp_path / row / "row.json").read_text())["shortened"] is True
