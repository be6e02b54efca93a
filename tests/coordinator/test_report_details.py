"""report.md's sections for what algorithms report per client: details and architecture changes."""

from coordinator.report import REPORT_NAME, write_report
from coordinator.results_model import Results


def _results():
    clients = [
        {"id": "c0", "arch": "mlr", "personal_acc": 0.9, "arch_start": "mlr", "arch_end": "mlr"},
        {"id": "c1", "arch": "mlp", "personal_acc": 0.8, "arch_start": "mlp", "arch_end": "mlr"},
        {"id": "c2", "arch": "cnn1", "personal_acc": 0.7, "arch_start": "cnn1", "arch_end": "mlp"},
    ]
    rounds = [
        {
            "round": 1,
            "clients": {"c0": {"arch": "mlr"}, "c1": {"arch": "mlp"}, "c2": {"arch": "cnn1"}},
        },
        {
            "round": 2,
            "clients": {"c0": {"arch": "mlr"}, "c1": {"arch": "mlr"}, "c2": {"arch": "cnn1"}},
        },
        {
            "round": 3,
            "clients": {"c0": {"arch": "mlr"}, "c1": {"arch": "mlr"}, "c2": {"arch": "cnn1"}},
        },
        {
            "round": 4,
            "clients": {"c0": {"arch": "mlr"}, "c1": {"arch": "mlr"}, "c2": {"arch": "mlp"}},
        },
    ]
    return {"algorithm": "fedme", "rounds": rounds, "clients": clients}


def test_report_lists_each_clients_details(tmp_path):
    write_report(Results.parse(_results()), tmp_path)
    text = (tmp_path / REPORT_NAME).read_text()
    assert "| Client | arch_start | arch_end |" in text
    assert "| c1 | mlp | mlr |" in text


def test_report_shows_the_rounds_in_which_architectures_changed(tmp_path):
    write_report(Results.parse(_results()), tmp_path)
    text = (tmp_path / REPORT_NAME).read_text()
    section = text.split("## Architectures over rounds", 1)[1].split("##", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "Round" not in line]
    assert rows == [
        "| 1 | cnn1 ×1, mlp ×1, mlr ×1 | — |",
        "| 2 | cnn1 ×1, mlr ×2 | c1: mlp → mlr |",
        "| 4 | mlp ×1, mlr ×2 | c2: cnn1 → mlp |",
    ]


def test_report_has_no_architecture_section_when_nobody_reports_one(tmp_path):
    results = _results()
    for r in results["rounds"]:
        r.pop("clients")
    for c in results["clients"]:
        c.pop("arch_start")
        c.pop("arch_end")
    write_report(Results.parse(results), tmp_path)
    text = (tmp_path / REPORT_NAME).read_text()
    assert "Architectures over rounds" not in text and "Client details" not in text


def test_long_details_are_listed_in_full_below_the_table(tmp_path):
    # Prepare: a guard's choice (short) and its reason (a sentence longer than a cell should be).
    reason = "the personalized model scored 0.61 on validation, below local training's 0.74"
    results = _results()
    for c in results["clients"]:
        c.update(guard="local" if c["id"] == "c1" else "personalized", guard_reason=reason)

    # Execute
    write_report(Results.parse(results), tmp_path)

    # Assert: short details stay in the table, the long one is a list, in full, per client.
    section = (tmp_path / REPORT_NAME).read_text().split("## Client details", 1)[1]
    section = section.split("\n## ", 1)[0]
    assert "| Client | arch_start | arch_end | guard |" in section
    assert "| c1 | mlp | mlr | local |" in section
    assert "guard_reason |" not in section
    assert f"- c1: {reason}" in section and f"- c2: {reason}" in section
