"""edge_sdk.malloc: a process that streams chunks stops faulting their scratch memory back in.

The allocator is process-wide, so everything that tunes it runs in a child process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from coordinator.cli import tune_malloc
from coordinator.config import load_config
from edge_sdk.malloc import glibc, tune_for_streams

glibc_only = pytest.mark.skipif(glibc() is None, reason="the C library is not glibc")

# What paho does with each 1 MiB chunk on its network thread: the packet grows in a bytearray,
# then a copy per header field; everything is freed before the next chunk arrives.
CHURN = textwrap.dedent(
    """
    import resource, sys, threading
    from edge_sdk.malloc import tune_for_streams

    if sys.argv[1] == "tuned":
        assert tune_for_streams()
    MiB = 1 << 20

    def chunk():
        packet = bytearray()
        packet += b"x" * (MiB + 200)
        payload = bytes(packet)[2:]
        return len(payload[100:])

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def network_thread():
        for _ in range(5):
            chunk()
        before = faults()
        for _ in range(40):
            chunk()
        print(faults() - before)

    t = threading.Thread(target=network_thread)
    t.start()
    t.join()
    """
)


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout)


@glibc_only
def test_tuned_process_keeps_chunk_scratch_memory_in_its_heap():
    plain, tuned = _faults("plain"), _faults("tuned")
    # Untuned, glibc trims the freed scratch memory after every chunk and faults it back in:
    # at least one page per 4 KiB of each 1 MiB chunk. Tuned, it stays mapped.
    assert plain >= 40 * 256, plain
    assert tuned < plain / 20, (tuned, plain)


@pytest.mark.parametrize("bad", [-1, 2**31])
def test_thresholds_out_of_range_are_refused_before_anything_changes(bad):
    with pytest.raises(ValueError, match="mmap_threshold"):
        tune_for_streams(mmap_threshold=bad)
    with pytest.raises(ValueError, match="trim_threshold"):
        tune_for_streams(trim_threshold=bad)


def test_the_commands_tune_only_runs_over_a_broker_unless_told_not_to(monkeypatch):
    calls: list[bool] = []
    monkeypatch.setattr("edge_sdk.malloc.tune_for_streams", lambda: calls.append(True) or True)
    in_memory = load_config(None, {})
    over_mqtt = load_config(None, {"broker.url": "mqtt://127.0.0.1:1883"})
    opted_out = load_config(
        None, {"broker.url": "mqtt://127.0.0.1:1883"}, {"broker.tune_malloc": False}
    )
    assert [tune_malloc(c) for c in (in_memory, over_mqtt, opted_out)] == [False, True, False]
    assert calls == [True]
