"""The fleet benchmark's emulator: devices that are real EdgeClients, many per process on one
thread, against the real coordinator process over mosquitto (small: 12 devices, 2 rounds)."""

import argparse

import pytest
from tests_helpers import load_benchmark

from coordinator.broker import mosquitto_path
from edge_sdk.state import load_state

bench = load_benchmark("fleet_scale", "fleet_scale_bench")


@pytest.mark.skipif(mosquitto_path() is None, reason="needs mosquitto (apt-get install mosquitto)")
def test_a_dozen_emulated_devices_on_one_thread_register_train_and_survive_a_drop(tmp_path):
    # 12 devices in one worker process, 6 a round, 3 rounds; in round 2 one device in ten
    # (here 1) loses its connection without a DISCONNECT and is back 1 s later. Every round gets
    # its 6 replies, the drop round included, and the figures are per device and per round.
    args = argparse.Namespace(
        per_round=6, rounds=3, eval_every=None, procs=1, train_ms=0.0, drop=2, down_s=1.0,
        deadline=120.0, profile=False, set=["round.client_history=24"],
    )  # fmt: skip
    row = bench.run_one(12, args, tmp_path)
    assert row["replied_per_round"] == [6, 6, 6] and row["rounds_failed"] == 0
    assert row["drop"] == {
        "round": 2, "devices_dropped": 1, "down_s": 1.0, "round_s": row["round_s"][1],
        "replied": 6, "planned": 6,
    }  # fmt: skip
    assert "went offline" in (tmp_path / "coordinator.log").read_text()  # its will fired
    # device-rounds: 6 a round, plus the 12 evaluations of the last round
    assert row["device_rounds"] == 6 * 3 + 12
    assert 0 < row["coord_cpu_ms_per_device_round"] < 1000
    assert row["register_s"] > 0 and row["coord_rss_mb"] > 0
    # A setting passed through (12 devices × 3 rounds over 24): rounds.jsonl still has every
    # client's line, the checkpoint compact rounds.
    assert row["ckpt_kb_end"] > 0
    kept = load_state(tmp_path / "out" / f"checkpoint-{bench.RUN}.state")["records"]
    assert [(r["n_replied"], r["replied"]) for r in kept] == [(6, [])] * 3
    assert "| 12 | 6 |" in bench.table([row])
