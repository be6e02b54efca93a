"""int8 from the command line: `simulate --onnx-int8` and `edgefl export`, each file checked
against PyTorch, with what they print checked against onnxruntime run here directly."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from typer.testing import CliRunner

from coordinator.cli import app
from coordinator.config import run_config_model
from coordinator.federation import prepare_federation

runner = CliRunner()
ROW = re.compile(
    r"^(?P<fmt>fp32|fp16|int8-dynamic|int8-static)\s+(?P<kib>[\d.]+)\s+(?P<acc>[\d.]+)%\s+"
    r"(?P<torch>[\d.]+)%\s+(?P<agree>[\d.]+)%\s+(?P<diff>\S+)\s+(?P<file>\S+)$"
)


def _tables(output: str) -> dict[str, dict[str, dict[str, str]]]:
    """client -> format -> the printed row."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    client = None
    for line in output.splitlines():
        head = re.match(r"^(c\d+) \((\w+)\):$", line)
        if head:
            client = head.group(1)
            out[client] = {}
        elif client and (m := ROW.match(line)):
            out[client][m["fmt"]] = m.groupdict()
    return out


def _logits(path: str | Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def _check_row(row: dict[str, str], fp32_path: Path, x: np.ndarray, y: np.ndarray) -> None:
    """A printed row against onnxruntime run here: the fp32 file stands in for PyTorch (the
    export verified it to 1e-4), so agreement and |Δ| are measured against it."""
    reference, got = _logits(fp32_path, x), _logits(row["file"], x)
    assert float(row["acc"]) == pytest.approx(100 * np.mean(got.argmax(1) == y), abs=0.006)
    agree = np.mean(got.argmax(1) == reference.argmax(1))
    assert float(row["agree"]) == pytest.approx(100 * agree, abs=0.006)
    diff = float(np.abs(got - reference).max())
    assert float(row["diff"]) == pytest.approx(diff, rel=0.01, abs=2e-4)
    assert float(row["kib"]) == pytest.approx(Path(row["file"]).stat().st_size / 1024, abs=0.05)


def _client_data(out: Path) -> tuple[dict, list]:
    results = json.loads((out / "results.json").read_text())
    fed = prepare_federation(run_config_model().model_validate(results["config"]))
    return results, fed.client_data


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """The run's output folder and console, and how many ONNX files it exported."""
    import edge_sdk.export

    out = tmp_path_factory.mktemp("run")
    exports: list[Path] = []
    export = edge_sdk.export.export_onnx

    def counted(model, spec, path, **kw):
        exports.append(Path(path))
        return export(model, spec, path, **kw)

    with pytest.MonkeyPatch.context() as mp:
        for module in ("edge_sdk.export", "edge_sdk.variants"):
            mp.setattr(f"{module}.export_onnx", counted)
        res = _simulate(out)
    assert res.exit_code == 0, res.output
    return out, res.output, exports


def _simulate(out: Path):
    return runner.invoke(
        app,
        [
            "simulate",
            "--algorithm",
            "fml",
            "--dataset",
            "digits",
            "--max-samples",
            "400",
            "--partition",
            "iid",
            "--models",
            "mlr,lenet5,lstm",
            "--global-model",
            "mlr",
            "--clients",
            "3",
            "--rounds",
            "1",
            "--local-epochs",
            "1",
            "--lr",
            "0.1",
            "--batch-size",
            "32",
            "--device",
            "cpu",
            "--onnx-int8",
            "static",
            "-o",
            str(out),
            "-q",
            # Each client deploys its own architecture (the guard could pick the mlr meme over
            # the LSTM, which is the client these tests need).
            "--set",
            "fml.guard=false",
        ],
    )


def test_simulate_onnx_int8_writes_and_checks_every_client(simulated):
    out, output, exports = simulated
    results, data = _client_data(out)
    tables = _tables(output)
    assert sorted(tables) == ["c0", "c1", "c2"]
    # Each client's fp32 file was exported once, as the run ended; the int8 files were made
    # from it.
    assert sorted(exports) == [out / "onnx" / f"c{i}.onnx" for i in range(3)]
    # The LSTM (c2) cannot be static int8 in onnxruntime: skipped, with the reason.
    assert sorted(tables["c2"]) == ["fp32"]
    assert "int8-static skipped: onnxruntime has no static int8 LSTM kernel" in output
    for i, client in enumerate(results["clients"][:2]):
        rows = tables[client["id"]]
        assert sorted(rows) == ["fp32", "int8-static"]
        fp32 = out / "onnx" / f"{client['id']}.onnx"
        assert rows["int8-static"]["file"] == str(fp32.with_suffix(".int8-static.onnx"))
        # fp32: what the federation measured for this client's personalized model.
        assert float(rows["fp32"]["acc"]) == pytest.approx(100 * client["personal_acc"], abs=0.01)
        assert float(rows["fp32"]["agree"]) == 100.0 and float(rows["fp32"]["diff"]) < 1e-4
        x, y = data[i].x_test.numpy(), data[i].y_test.numpy()
        _check_row(rows["int8-static"], fp32, x, y)


def test_export_writes_fp16_and_dynamic_int8_from_a_runs_output(simulated, tmp_path):
    out, _, _ = simulated
    res = runner.invoke(
        app,
        [
            "export",
            str(out),
            "--format",
            "fp16,int8-dynamic",
            "--client",
            "c0",
            "-o",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 0, res.output
    rows = _tables(res.output)["c0"]
    assert sorted(rows) == ["fp16", "fp32", "int8-dynamic"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "c0.fp16.onnx",
        "c0.int8-dynamic.onnx",
        "c0.onnx",
    ]
    _, data = _client_data(out)
    for fmt in ("fp16", "int8-dynamic"):
        _check_row(rows[fmt], tmp_path / "c0.onnx", data[0].x_test.numpy(), data[0].y_test.numpy())
    fp16 = onnx.load(str(tmp_path / "c0.fp16.onnx"))
    props = {p.key: p.value for p in fp16.metadata_props}
    assert props["edgefl.quantization"] == "fp16"
    assert fp16.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert {i.data_type for i in fp16.graph.initializer} >= {onnx.TensorProto.FLOAT16}
    assert float(rows["fp16"]["kib"]) < 0.6 * float(rows["fp32"]["kib"])


def test_export_says_what_is_missing(tmp_path):
    res = runner.invoke(app, ["export", str(tmp_path)])
    assert res.exit_code == 2
    assert f"no client state (<id>.state) under {tmp_path}" in res.output
    res = runner.invoke(app, ["export", str(tmp_path), "--format", "int4"])
    assert res.exit_code == 2
    assert "'int4': choose from fp32, fp16, int8-dynamic, int8-static" in res.output


def test_static_int8_is_refused_for_an_lstm_before_anything_is_written(tmp_path):
    import torch

    from edge_sdk.variants import export_variants
    from model_zoo import ArchSpec, build

    spec = ArchSpec(family="lstm", num_classes=3, input_shape=(1, 8, 8))
    x = torch.randn(4, 1, 8, 8)
    with pytest.raises(ValueError, match=r"int8-static for lstm.*no static int8 LSTM kernel"):
        export_variants(
            build(spec, seed=0),
            spec,
            tmp_path / "m.onnx",
            ["int8-static"],
            eval_inputs=x,
            calibration_inputs=x,
        )
    assert list(tmp_path.iterdir()) == []


def test_an_fp32_file_of_the_model_is_kept_only_where_asked_and_onnxruntime_reproduces_it(
    monkeypatch, tmp_path
):
    import torch

    import edge_sdk.variants
    from edge_sdk.export import export_onnx
    from edge_sdk.variants import export_variants
    from model_zoo import ArchSpec, build

    # Prepare: a model, its file as a run writes it, and exports counted (TorchScript's
    # exporter throughout: fast)
    spec = ArchSpec(family="mlp", num_classes=3, input_shape=(1, 8, 8))
    model, other = build(spec, seed=0), build(spec, seed=1)
    x = torch.randn(16, 1, 8, 8)
    path = tmp_path / "m.onnx"
    exported: list[Path] = []

    def counted(model, spec, path, **kw):
        exported.append(path)
        return export_onnx(model, spec, path, **kw)

    monkeypatch.setattr(edge_sdk.variants, "export_onnx", counted)

    def variants(keep_fp32):
        exported.clear()
        reports = export_variants(
            model,
            spec,
            path,
            ["int8-dynamic"],
            eval_inputs=x,
            exporter="legacy",
            keep_fp32=keep_fp32,
        )
        assert [r.format for r in reports] == ["fp32", "int8-dynamic"]
        assert reports[0].agreement == 1.0 and reports[0].max_abs_diff < 1e-4
        return exported

    export_onnx(model, spec, path, exporter="legacy")
    written = path.read_bytes()

    # Execute / Assert: kept, and the int8 file made from it
    assert variants(keep_fp32=True) == []
    assert path.read_bytes() == written
    # ... not where not asked (`edgefl export`)
    assert variants(keep_fp32=False) == [path]
    # ... nor where the file there is another model's, or no ONNX at all
    for stranger in (
        lambda: export_onnx(other, spec, path, exporter="legacy"),
        lambda: path.write_text("not ONNX"),
    ):
        stranger()
        assert variants(keep_fp32=True) == [path]
    # ... nor where there is none
    path.unlink()
    assert variants(keep_fp32=True) == [path]


def test_a_rerun_into_the_same_output_starts_from_scratch(tmp_path):
    # The clients' states kept in OUT/state for `edgefl export` must not become the starting
    # point of the next run written to the same OUT: the rerun gives the same results.
    args = ["simulate", "--algorithm", "local", "--dataset", "digits", "--max-samples", "200",
            "--partition", "iid", "--models", "mlr", "--clients", "2", "--rounds", "2",
            "--local-epochs", "1", "--lr", "0.1", "--device", "cpu", "--export-onnx", "-q",
            "--set", 'data.options={"size": 8}', "-o", str(tmp_path)]  # fmt: skip
    accuracies = []
    for _ in range(2):
        res = runner.invoke(app, args)
        assert res.exit_code == 0, res.output
        results = json.loads((tmp_path / "results.json").read_text())
        accuracies.append([c["personal_acc"] for c in results["clients"]])
    assert accuracies[0] == accuracies[1]
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["c0.state", "c1.state"]


def test_onnx_exporter_chooses_the_torch_exporter_of_every_file_a_run_writes(simulated, tmp_path):
    from coordinator.export import export_clients
    from edge_sdk.export import EXPORTERS, read_metadata
    from edge_sdk.node import ClientNode
    from model_zoo import ArchSpec

    # The simulated run's files: torch.export's (auto, the default).
    out, _, _ = simulated
    assert read_metadata(out / "onnx" / "c0.onnx").exporter == "dynamo"
    # `edgefl export` with the setting, set on the config the run wrote (no --config), by --set
    # or by the environment as for every command: TorchScript's. A value it cannot take is
    # refused naming the key, and the file only where the value came from the file.
    export = ["export", str(out), "--format", "fp32", "--client", "c0", "--out"]
    res = runner.invoke(app, [*export, str(tmp_path / "x"), "--set", "onnx_exporter=legacy"])
    assert res.exit_code == 0, res.output
    assert read_metadata(tmp_path / "x" / "c0.onnx").exporter == "legacy"
    res = runner.invoke(app, [*export, str(tmp_path / "e")], env={"EDGEFL_ONNX_EXPORTER": "legacy"})
    assert res.exit_code == 0, res.output
    assert read_metadata(tmp_path / "e" / "c0.onnx").exporter == "legacy"
    res = runner.invoke(app, [*export, str(tmp_path / "y"), "--set", "onnx_exporter=fast"])
    assert res.exit_code == 2
    assert "invalid config: onnx_exporter" in res.output and "results.json" not in res.output
    assert not (tmp_path / "y").exists()
    edited = tmp_path / "edited"
    shutil.copytree(out, edited)
    results = json.loads((edited / "results.json").read_text())
    results["config"]["onnx_exporter"] = "fast"
    (edited / "results.json").write_text(json.dumps(results))
    res = runner.invoke(
        app, ["export", str(edited), "--client", "c0", "--out", str(tmp_path / "w")]
    )
    assert res.exit_code == 2
    assert f"invalid config: {edited / 'results.json'}: onnx_exporter" in res.output
    assert not (tmp_path / "w").exists()
    # ... and on the --config given, from Python as well.
    results, data = _client_data(out)
    cfg = run_config_model().model_validate({**results["config"], "onnx_exporter": "legacy"})
    export_clients(out, ["fp32"], out=tmp_path / "z", clients=["c0"], config=cfg)
    assert read_metadata(tmp_path / "z" / "c0.onnx").exporter == "legacy"
    # A simulation's --export-onnx with it (the same path a deployed client exports through).
    args = ["simulate", "--algorithm", "local", "--dataset", "digits", "--max-samples", "200",
            "--partition", "iid", "--models", "mlr", "--clients", "2", "--rounds", "1",
            "--local-epochs", "1", "--device", "cpu", "--export-onnx", "-q",
            "--set", 'data.options={"size": 8}', "--set", "onnx_exporter=legacy",
            "-o", str(tmp_path / "run")]  # fmt: skip
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    files = sorted((tmp_path / "run" / "onnx").glob("c*.onnx"))
    assert [f.name for f in files] == ["c0.onnx", "c1.onnx"]
    assert {read_metadata(f).exporter for f in files} == {"legacy"}
    # The setting's choices are the exporter's; another is refused where a node is built.
    field = run_config_model().model_fields["onnx_exporter"]
    assert field.default == "auto" and tuple(field.annotation.__args__) == EXPORTERS
    res = runner.invoke(app, [*args[:-2], "--set", "onnx_exporter=fast", "-o", str(tmp_path)])
    assert res.exit_code == 2 and "onnx_exporter" in res.output
    spec = ArchSpec(family="mlr", num_classes=10, input_shape=(1, 28, 28))
    with pytest.raises(ValueError, match=r"onnx_exporter must be one of auto, dynamo, legacy"):
        ClientNode("c9", spec, data[0], onnx_exporter="fast")  # type: ignore[arg-type]


def test_a_sampled_simulation_exports_the_sample_it_finalized_and_no_other_client(tmp_path):
    # Execute: 4 clients, 2 evaluated and finalized (round.eval_clients)
    args = ["simulate", "--dataset", "digits", "--set", "data.options.size=8", "--clients", "4"]
    args += ["--rounds", "1", "--models", "mlr", "--device", "cpu", "--onnx-int8", "dynamic"]
    args += ["--set", "round.eval_clients=2", "-q", "-o", str(tmp_path)]
    res = runner.invoke(app, args)

    # Assert: the sample's fp32 and int8 files, printed and written; none of the two clients
    # whose models were never finalized (their states stay, for `edgefl export`)
    assert res.exit_code == 0, res.output
    sample = sorted(c["id"] for c in json.loads((tmp_path / "results.json").read_text())["clients"])
    assert len(sample) == 2 and sorted(_tables(res.output)) == sample
    written = sorted(p.name for p in (tmp_path / "onnx").iterdir())
    assert written == sorted(
        [f"{c}.onnx" for c in sample] + [f"{c}.int8-dynamic.onnx" for c in sample]
    )
    assert len(list((tmp_path / "state").glob("*.state"))) == 4


def test_export_leaves_out_the_clients_a_sampled_run_never_finalized_unless_named(tmp_path, caplog):
    # Arrange: 4 clients, 2 of them evaluated and finalized (round.eval_clients)
    args = ["simulate", "--dataset", "digits", "--set", "data.options.size=8", "--clients", "4"]
    args += ["--rounds", "1", "--models", "mlr", "--device", "cpu", "--export-onnx"]
    args += ["--set", "round.eval_clients=2", "-q", "-o", str(tmp_path / "run")]
    assert (res := runner.invoke(app, args)).exit_code == 0, res.output
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    sample = sorted(c["id"] for c in results["clients"])
    others = sorted({"c0", "c1", "c2", "c3"} - set(sample))

    # Act: export everything found, then one never finalized by name, then that one alone
    export = ["export", "--format", "fp32", "-o"]
    found = runner.invoke(app, [*export, str(tmp_path / "all"), str(tmp_path / "run")])
    named = runner.invoke(
        app, [*export, str(tmp_path / "one"), str(tmp_path / "run"), "--client", others[0]]
    )
    alone = runner.invoke(
        app, [*export, str(tmp_path / "x"), str(tmp_path / "run" / "state" / f"{others[0]}.state")]
    )

    # Assert: the sample exported and the two others said, not exported; by name it is
    # exported, with a warning; found alone, nothing is, and the error says how
    assert found.exit_code == 0, found.output
    assert sorted(_tables(found.output)) == sample
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == [f"{c}.onnx" for c in sample]
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        f"2 clients under {tmp_path / 'run'} never finalized (fml: {others[0]}, {others[1]})" in m
        and "Name one with --client" in m
        for m in said
    ), said
    assert named.exit_code == 0, named.output
    assert sorted(_tables(named.output)) == [others[0]]
    assert any(f"{others[0]} was never finalized" in m for m in said), said
    assert alone.exit_code != 0
    assert f"nothing exported: 1 client under {tmp_path / 'run' / 'state' / others[0]}" in (
        " ".join(alone.output.split())
    )
