"""A simulated population far larger than a round's cohort: clients parked between their tasks
(`idle_state = "host"` or `"disk"`, `ClientNode.park`) and phases run a cohort at a time end
exactly as clients kept live, for every algorithm; memory holds the cohort, not the population."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from tests_helpers import every_algorithm_args, per_client_results, tiny_config
from typer.testing import CliRunner

from coordinator.cli import app
from coordinator.config import ConfigError
from coordinator.distributed import machine
from coordinator.fleet.local import IDLE_OWNER, IDLE_PREFIX, LocalFleet, sweep_idle_scratch
from coordinator.server import Coordinator
from coordinator.simulator import simulate
from edge_sdk.algorithms import algorithm_names
from edge_sdk.node import ClientNode

# Every algorithm's own machinery (FedMe as the run, the eight others as its baselines), 6
# clients of two architectures, 2 trained a round, every round evaluated.
ARGS = every_algorithm_args(max_samples=500, clients=6, clients_per_round=2, rounds=2)


def _simulate(out: Path, *extra: str) -> dict[str, object]:
    res = CliRunner().invoke(app, ["simulate", *ARGS, *extra, "--out", str(out)])
    assert res.exit_code == 0, res.output
    return per_client_results(out)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return _simulate(tmp_path_factory.mktemp("live"))


@pytest.mark.parametrize("where", ["disk"])
def test_parked_clients_end_exactly_as_live_ones_for_every_algorithm(live, where, tmp_path):
    # Execute
    parked = _simulate(
        tmp_path / "out", "--set", f"idle_state={where}", "--set", f"idle_dir={tmp_path / 'idle'}"
    )

    # Assert: every run, every client, every round's accuracies
    assert sorted(parked) == sorted([*algorithm_names(), "rounds"])
    for name, clients in live.items():
        assert parked[name] == clients, name
    files = sorted(p.name for p in (tmp_path / "idle").glob("*.state"))
    assert files == ([f"c{i}.state" for i in range(6)] if where == "disk" else [])


def test_a_sample_evaluated_ends_as_in_a_run_that_evaluates_everyone(live, tmp_path):
    # Execute: the same run, 3 of its 6 clients (mlr and mlp, round-robin) evaluated and
    # finalized; parked on disk, as a population would be.
    out = tmp_path / "out"
    sampled = _simulate(out, "--set", "round.eval_clients=3", "--set", "idle_state=disk")

    # Assert: every run (FedMe and its eight baselines, of one architecture or two) evaluated the
    # same clients, of both architectures, and each ended exactly as when everyone was evaluated.
    doc = json.loads((out / "results.json").read_text())
    ids = [c["id"] for c in doc["clients"]]
    assert len(ids) == 3 and doc["population"] == 6
    assert {c["arch"] for c in doc["clients"]} == {"mlr", "mlp"}
    assert sorted(sampled) == sorted([*algorithm_names(), "rounds"])
    for name, clients in live.items():
        if name == "rounds":
            continue
        assert [c[0] for c in sampled[name]] == ids, name
        assert sampled[name] == [c for c in clients if c[0] in ids], name
    assert sampled["rounds"] == [
        (r, failed, {cid: acc for cid, acc in accs.items() if cid in ids})
        for r, failed, accs in live["rounds"]
    ]
    # ... and the report says whose they are, and how closely the sample's mean estimates the
    # population's: one standard error, corrected for drawing 3 of 6 without replacement
    accs = [c["personal_acc"] for c in doc["clients"]]
    mean = sum(accs) / 3
    se = (sum((a - mean) ** 2 for a in accs) / 2 / 3 * (6 - 3) / (6 - 1)) ** 0.5
    report = (out / "report.md").read_text()
    assert "Evaluated and finalized: 3 of the 6 clients" in report
    assert f"estimates the population's to ±{100 * se:.2f} points" in report
    # its data per client: the sample's rows (split.txt has everyone's)
    data = report.split("## Data per client")[1].split("\n## ")[0]
    assert "The 3 clients evaluated; split.txt has all 6." in data
    rows = [line.split(" | ")[0].removeprefix("| ") for line in data.splitlines()]
    assert sorted(r for r in rows if r.startswith("c")) == ids


@pytest.mark.parametrize(("where", "most"), [("memory", 6), ("host", 2), ("disk", 2)])
def test_a_phase_holds_at_most_a_cohort_of_live_clients(where, most, monkeypatch, tmp_path):
    # Prepare: watch every node: how many hold a live algorithm whenever one executes.
    nodes: list[ClientNode] = []
    live: list[int] = []
    init, execute = ClientNode.__init__, ClientNode.execute

    def watched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        nodes.append(self)

    def watched_execute(self, task):
        live.append(sum(n.algorithm is not None for n in nodes))
        return execute(self, task)

    monkeypatch.setattr(ClientNode, "__init__", watched_init)
    monkeypatch.setattr(ClientNode, "execute", watched_execute)
    cfg = tiny_config(
        clients=6, clients_per_round=2, rounds=3, cohort=False, idle_state=where,
        idle_dir=str(tmp_path / "idle"), baselines=[],
    )  # fmt: skip

    # Execute
    results = simulate(cfg, progress=False)

    # Assert: parked, never more than the cohort at once (the 6 evaluations run 2 by 2); live,
    # the whole population once everyone was evaluated.
    assert max(live) == most
    assert all(c.personal_acc is not None for c in results.clients)


def test_parking_clients_of_the_network_fleet_is_refused_with_what_to_do():
    cfg = tiny_config(clients=2, rounds=1, fleet="network", idle_state="host", baselines=[])
    with pytest.raises(
        ConfigError, match="set fleet = local and no broker, or idle_state = memory"
    ):
        simulate(cfg, progress=False)


class _Stopped(RuntimeError):
    pass


@pytest.mark.parametrize(("idle", "stop"), [("memory", "crash"), ("disk", "SIGTERM")])
def test_a_checkpointed_simulation_stopped_mid_run_resumes_and_ends_the_same(
    live, idle, stop, monkeypatch, tmp_path
):
    # Prepare: the first start stops after the main run's round-1 checkpoint, so FedMe resumes
    # at round 2 and every baseline runs in the second start. It stops as a process that
    # crashed would, or on SIGTERM (a scheduler's stop), which says how to resume.
    out = tmp_path / "out"
    extra = ("--set", "checkpoint=true", "--set", f"idle_state={idle}")
    save = Coordinator._save_checkpoint

    def stop_after_round_1(self):
        save(self)
        if self.algorithm == "fedme" and len(self.records) == 1:
            if stop == "crash":
                raise _Stopped("stopped")
            # (SIGTERM's default action would end this test's process)
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Coordinator, "_save_checkpoint", stop_after_round_1)
    first = CliRunner().invoke(app, ["simulate", *ARGS, *extra, "--out", str(out)])
    if stop == "crash":
        assert isinstance(first.exception, _Stopped), first.output
    else:
        assert first.exit_code == 130, first.output
        said = f"interrupted: {out / 'checkpoint'} holds every round that finished; the same"
        assert said in first.stderr
    assert not (out / "results.json").exists()
    monkeypatch.setattr(Coordinator, "_save_checkpoint", save)

    # Execute: the same command again
    assert _simulate(out, *extra) == live

    # Assert: and a third start finds every run finished (no coordinator runs again) and
    # writes the same results, with another ONNX exporter too (a setting of the files, not of
    # the results); other settings are refused.
    def never(self):
        raise AssertionError(f"{self.algorithm} ran again")

    monkeypatch.setattr(Coordinator, "run", never)
    (out / "results.json").unlink()
    assert _simulate(out, *extra, "--set", "onnx_exporter=legacy") == live
    res = CliRunner().invoke(app, ["simulate", *ARGS, *extra, "--lr", "0.1", "--out", str(out)])
    assert res.exit_code == 2 and "was written by a simulation with other settings" in res.output


def test_a_parked_client_is_written_again_only_after_a_task_that_changed_it(monkeypatch, tmp_path):
    # Prepare: count the state files parking writes, per phase.
    writes: list[str] = []
    park = ClientNode.park

    def counted(self, where=None, *, changed=True):
        before = where.stat().st_mtime_ns if where is not None and where.exists() else None
        park(self, where, changed=changed)
        if where is not None and where.stat().st_mtime_ns != before:
            writes.append("changed" if changed else "unchanged")

    monkeypatch.setattr(ClientNode, "park", counted)
    cfg = tiny_config(
        clients=4, rounds=2, idle_state="disk", idle_dir=str(tmp_path / "idle"), baselines=[]
    )

    # Execute: FedAvg, every client trains and is evaluated every round, then finalized.
    simulate(cfg, progress=False)

    # Assert: the evaluation of the initial models (round 0, before the rollback can judge
    # round 1) parks each client a first time; then 4 fits × 2 rounds and 4 finalizes are
    # written, and the 8 evaluations after a fit are not (the fit's bytes stay).
    assert writes[:4] == ["unchanged"] * 4
    assert writes[4:] == ["changed"] * (4 * 2 + 4)


def test_a_checkpoint_continues_under_settings_an_edgefl_of_another_version_adds(
    monkeypatch, tmp_path, caplog
):
    # Prepare: a finished checkpointed run (FedAvg, the local baseline); its settings file as
    # an edgefl of another version would have written it: a section of an algorithm it does
    # not run gone, a setting added to another, and a setting of its own missing.
    cfg = tiny_config(checkpoint=True, out=str(tmp_path / "out"), baselines=["local"])
    first = simulate(cfg, progress=False)
    path = tmp_path / "out" / "checkpoint" / "settings.json"
    written = json.loads(path.read_text())
    edited = {k: v for k, v in written.items() if k != "persfl"}
    edited["fml"] = {**edited["fml"], "a_setting_of_another_version": 1}
    edited["local"] = {k: v for k, v in edited["local"].items() if k != "lr_gamma"}
    path.write_text(json.dumps(edited))

    def never(self):
        raise AssertionError(f"{self.algorithm} ran again")

    monkeypatch.setattr(Coordinator, "run", never)

    # Execute
    again = simulate(cfg, progress=False)

    # Assert: both runs read back as they finished, the missing setting said and taken at its
    # default, and the settings written as this version's
    assert [c.personal_acc for c in again.clients] == [c.personal_acc for c in first.clients]
    assert "without the settings local.lr_gamma" in caplog.text
    assert json.loads(path.read_text()) == written
    # ... while another value of a setting of a run it runs, a missing setting not at its
    # default, or a file that is not settings, is refused, naming the setting.
    for changed in (
        {**written, "local": {**written["local"], "lr": 0.5}},
        {**written, "local": {k: v for k, v in written["local"].items() if k != "lr"}},
    ):
        path.write_text(json.dumps(changed))
        with pytest.raises(ConfigError, match=r"with other settings \(local\.lr\)"):
            simulate(cfg, progress=False)
    path.write_text("{")
    with pytest.raises(ConfigError, match=r"settings.json is not the JSON a simulation writes"):
        simulate(cfg, progress=False)


def test_the_temporary_folder_of_a_killed_process_is_removed_by_the_next_one(monkeypatch, tmp_path):
    # Prepare: a process parking on disk in a temporary folder of its own, killed (SIGKILL: it
    # cannot remove the folder), and one that still runs
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    code = (
        "from coordinator.fleet.local import LocalFleet; f = LocalFleet([], idle='disk'); "
        "print(f._idle_dir, flush=True); import time; time.sleep(120)"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    killed, running = (Path(p.stdout.readline().strip()) for p in procs)  # type: ignore[union-attr]
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait(30)
    (killed / "c0.state").write_bytes(b"x" * 1000)
    assert killed.is_dir()

    # Execute: the next fleet that parks on disk
    try:
        fleet = LocalFleet([], idle="disk")
        ours = fleet._idle_dir
    finally:
        procs[1].kill()
        procs[1].wait(30)

    # Assert: the killed process's folder is gone; the running one's and the new one stay
    assert not killed.exists()
    assert running.is_dir() and ours is not None and ours.is_dir()
    assert (ours / IDLE_OWNER).read_text() == f"{machine()} {os.getpid()}"


def test_only_folders_stamped_by_a_gone_process_of_this_machine_are_swept(tmp_path):
    # Prepare: the pid of a process that has ended
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait(30)
    here = machine()
    stamps = {
        "gone": f"{here} {ended.pid}",
        "alive": f"{here} {os.getpid()}",
        "other-host": f"not-{here} {ended.pid}",
        # one host name, another machine (another boot id)
        "other-boot": f"{socket.gethostname()} another-boot-id {ended.pid}",
        "garbled": "nonsense",
        "unstamped": None,
    }
    for name, stamp in stamps.items():
        (tmp_path / (IDLE_PREFIX + name)).mkdir()
        if stamp is not None:
            (tmp_path / (IDLE_PREFIX + name) / IDLE_OWNER).write_text(stamp)
    (tmp_path / "not-ours").mkdir()
    (tmp_path / "not-ours" / IDLE_OWNER).write_text(f"{here} {ended.pid}")

    # Execute
    gone = sweep_idle_scratch(tmp_path)

    # Assert
    assert gone == [tmp_path / (IDLE_PREFIX + "gone")]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["not-ours", *(IDLE_PREFIX + n for n in stamps if n != "gone")])
