"""A simulation sharded over torch.distributed ranks (gloo, real processes) gives one process's
results; shards are balanced by work; bad launches and a dead rank stop with clear errors.

The launches are few and each runs every algorithm: the algorithm (FedMe, which needs its held-out
set) and the eight others as its baselines, on one split, 4 clients of two architectures on 8×8
digits, 2 rounds."""

from __future__ import annotations

import importlib
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests_helpers import every_algorithm_args, needs_cuda, per_client_results
from typer.testing import CliRunner

from coordinator.broker import free_port
from coordinator.cli import app
from coordinator.distributed import (
    PACKAGES,
    disagreement,
    machine,
    on_machine,
    rank_gpu,
    rank_threads,
    source_digest,
)
from coordinator.fleet.ranks import (
    DONE,
    RankFleet,
    Ranks,
    ShardFleet,
    balance,
    client_cost,
    dumps,
    loads,
)
from coordinator.results import device_record
from coordinator.run_config import RunConfig
from edge_sdk.algorithms import algorithm_names
from edge_sdk.device import DeviceChoice
from model_zoo import ArchSpec

ROOT = Path(__file__).resolve().parents[2]
# Every algorithm's own machinery (FedMe as the run, the eight others as its baselines), 4
# clients of two architectures.
ARGS = every_algorithm_args(max_samples=400, clients=4, rounds=2)


def _edgefl(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run(
        [sys.executable, "-m", "coordinator", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _torchrun(node: int, port: int, *args: str) -> subprocess.Popen[str]:
    """One "node" of a two-node launch: torchrun's static rendezvous at 127.0.0.1:port."""
    launch = ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node)]
    launch += ["--rdzv-endpoint", f"127.0.0.1:{port}"]
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "coordinator", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The reference: the same simulation in this process, as today."""
    out = tmp_path_factory.mktemp("one")
    res = CliRunner().invoke(app, ["simulate", *ARGS, "--out", str(out)])
    assert res.exit_code == 0, res.output
    return per_client_results(out)


def test_two_workers_give_one_process_per_client_results_for_every_algorithm(one_process, tmp_path):
    # Execute: `edgefl simulate --workers 2`, two ranks started by torch's elastic launcher,
    # with rank 0's progress bars
    loud = [a for a in ARGS if a != "--quiet"]
    proc = _edgefl("simulate", *loud, "--workers", "2", "--out", str(tmp_path))

    # Assert: every algorithm, every client, the same accuracies (rank 0 wrote the results)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fedme: per-client accuracy" in proc.stdout
    sharded = per_client_results(tmp_path)
    assert sorted(sharded) == sorted([*algorithm_names(), "rounds"])
    for name, clients in one_process.items():
        assert sharded[name] == clients, name
    assert all(acc is not None for _, acc, _ in sharded["federico"])  # type: ignore[attr-defined]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert (
        doc["summary"]["coordinator_bytes_out"] > 0 and doc["summary"]["coordinator_bytes_in"] > 0
    )
    assert doc["device"]["used"] == "cpu ×2 (2 ranks)"
    # The bar counts both ranks' clients as they finalize (rank 1's from the store)
    states = proc.stderr.replace("\r", "\n").splitlines()
    counts = [m[1] for s in states if (m := re.search(r"^fedme:.*finalizing.*, (\d+) of 4", s))]
    assert counts and counts[-1] == "4", counts


def test_rank_0_counts_the_other_ranks_clients_as_their_tasks_end():
    # Prepare: the rendezvous's store (a TCPStore on a free port), rank 0's fleet and rank 1's
    # shard, each with its own connection to it, as `distributed.join` makes them
    port = free_port()
    wait = timedelta(seconds=10)
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=wait)

    def ranks(rank: int) -> Ranks:
        conn = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)
        return Ranks(rank, 2, store=dist.PrefixStore("edgefl", conn))

    fleet, other = RankFleet(ShardFleet([], ranks(0)), {}), ShardFleet([], ranks(1))
    told: list[int] = []
    fleet.finished = told.append

    # Execute: a phase in which rank 1's jobs end (3 clients, then 2) and rank 0's own (1)
    with fleet._counting():
        assert other.finished is not None and fleet.shard.finished is not None
        other.finished(3)
        deadline = time.monotonic() + 10
        while not told and time.monotonic() < deadline:
            time.sleep(0.01)
        during = list(told)
        fleet.shard.finished(1)
        other.finished(2)

    # Assert: rank 1's clients told while the phase ran, not only at its end; every one told
    assert during == [3]
    assert told[:2] == [3, 1] and sum(told) == 6
    assert server.add("edgefl/" + DONE, 0) == 5  # (rank 0's own are not in the store)


def test_two_nodes_meet_at_one_rendezvous_and_give_the_same_results(one_process, tmp_path):
    # Execute: two launches of torchrun, one "node" each, meeting at one endpoint
    port = free_port()
    nodes = [_torchrun(i, port, "simulate", *ARGS, "--out", str(tmp_path)) for i in (0, 1)]
    outputs = [p.communicate(timeout=120)[0] for p in nodes]

    # Assert
    assert [p.returncode for p in nodes] == [0, 0], outputs
    assert per_client_results(tmp_path) == one_process


def test_two_ranks_parking_their_clients_killed_mid_run_resume_and_end_as_one_process(tmp_path):
    # Prepare: FedMe (and the local baseline), 6 clients, 2 a round, 4 rounds, each rank's idle
    # clients parked on disk, a checkpoint kept; the reference in this process, all live.
    args = [*ARGS, "--clients", "6", "--clients-per-round", "2", "--rounds", "4"]
    args += ["--baselines", "local", "--set", "checkpoint=true"]
    res = CliRunner().invoke(app, ["simulate", *args, "--out", str(tmp_path / "one")])
    assert res.exit_code == 0, res.output
    out = tmp_path / "ranks"
    command = [sys.executable, "-m", "coordinator", "simulate", *args, "--workers", "2"]
    command += ["--set", "idle_state=disk", "--out", str(out)]

    # Execute: every rank killed at once when FedMe's first round is checkpointed...
    first = subprocess.Popen(command, cwd=ROOT, start_new_session=True)
    ckpt = out / "checkpoint" / "fedme.state"
    while not ckpt.exists() and first.poll() is None:
        time.sleep(0.02)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(30)
    assert not (out / "checkpoint" / "fedme.finished.json").exists()
    # ...and started again.
    second = _edgefl(*command[3:], timeout=300)

    # Assert
    assert second.returncode == 0, second.stdout + second.stderr
    assert per_client_results(out) == per_client_results(tmp_path / "one")


@needs_cuda
def test_ranks_on_cuda_take_a_gpu_each_in_turn_and_agree_with_one_process(tmp_path):
    # Prepare: FML with FedAvg and FedeRiCo beside it, on CUDA, in one process
    args = [a if a != "cpu" else "cuda" for a in ARGS]
    args += ["--algorithm", "fml", "--baselines", "fedavg,federico"]
    one = _edgefl("simulate", *args, "--out", str(tmp_path / "one"), timeout=300)
    assert one.returncode == 0, one.stdout + one.stderr

    # Execute: 3 ranks (more than one GPU machine has: they share the GPUs in turn)
    three = _edgefl("simulate", *args, "--workers", "3", "--out", str(tmp_path / "3"), timeout=300)

    # Assert: each rank on its GPU (its place on the machine mod GPUs), and the results of one
    # process, up to what other stack sizes change in a GPU's reduced-precision sums (a test
    # image or two)
    assert three.returncode == 0, three.stdout + three.stderr
    doc = json.loads((tmp_path / "3" / "results.json").read_text())
    gpus = Counter(f"cuda:{r % torch.cuda.device_count()}" for r in range(3))
    assert doc["device"]["used"] == ", ".join(f"{d} ×{n}" for d, n in sorted(gpus.items())) + (
        " (3 ranks)"
    )
    ranks, alone = (
        per_client_results(tmp_path / "3", "fml"),
        per_client_results(tmp_path / "one", "fml"),
    )
    for name in ("fml", "fedavg", "federico"):
        for (cid, pa, ga), (cid1, pa1, ga1) in zip(ranks[name], alone[name], strict=True):  # type: ignore[call-overload]
            assert cid == cid1
            assert abs(pa - pa1) <= 0.05 and (ga is None) == (ga1 is None), (name, cid, pa, pa1)


def test_ranks_that_disagree_on_the_config_stop_with_a_clear_error(tmp_path):
    # Execute: the second node was started with another round count
    port = free_port()
    base = ["--dataset", "digits", "--clients", "2", "--device", "cpu", "--out", str(tmp_path)]
    nodes = [_torchrun(i, port, "simulate", *base, "--rounds", str(2 + i)) for i in (0, 1)]
    outputs = [p.communicate(timeout=120)[0] for p in nodes]

    # Assert: both stop, saying which rank differs in what; nothing was written
    assert all(p.returncode != 0 for p in nodes)
    for out in outputs:
        assert "the ranks disagree on what they run: rank 1: the config" in out, out
    assert not (tmp_path / "results.json").exists()


def test_a_rank_alone_at_the_rendezvous_times_out_with_a_message(tmp_path):
    # Execute: rank 0 of 2, and no rank 1
    port = free_port()
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    args = ["--dataset", "digits", "--clients", "2", "--device", "cpu", "--out", str(tmp_path)]
    proc = _edgefl("simulate", *args, "--set", "round.register_timeout_s=2", env=env)

    # Assert
    assert proc.returncode == 2
    assert f"did not all meet at the rendezvous 127.0.0.1:{port} within 2 s" in proc.stderr


def test_more_workers_than_clients_and_the_network_fleet_are_refused_before_any_start():
    res = CliRunner().invoke(app, ["simulate", "--clients", "2", "--workers", "3", "-q"])
    assert res.exit_code == 2
    assert "3 ranks (--workers) for 2 clients" in res.output and "at most 2 workers" in res.output
    res = CliRunner().invoke(app, ["simulate", "--fleet", "network", "--workers", "2", "-q"])
    assert res.exit_code == 2
    assert "over several ranks runs the local fleet: drop --fleet network" in res.output


def test_an_error_in_the_ranks_reads_as_in_one_process_without_the_launchers_traceback(tmp_path):
    # Execute: a split the ranks find impossible (digits' 1,797 images for 200 clients of 10)
    args = ["simulate", "--dataset", "digits", "--clients", "200", "--models", "mlr"]
    args += ["--rounds", "1", "--baselines", "", "--out", str(tmp_path)]
    proc = _edgefl(*args, "--workers", "2")

    # Assert: the exit code and message of one process, naming the rank, and no traceback
    # (-v shows it)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said
    assert re.search(
        r"error: rank \d stopped \(exit code 1\): PartitionError: dirichlet: 1797 samples cannot "
        r"give 200 clients 10 each; lower min_size or num_clients; the run stopped with it "
        r"\(-v shows the rank's traceback\)",
        said,
    ), said
    assert "Traceback" not in said and "Terminating process" not in said, said


@pytest.mark.parametrize("stop", ["rank 1 dies", "SIGTERM"])
def test_a_rank_that_dies_or_a_sigterm_stops_the_run_and_says_so(stop, tmp_path):
    # Prepare: a long run over two ranks, each naming its pid as it starts
    args = ["--dataset", "digits", "--set", "data.options.size=8", "--max-samples", "400"]
    args += ["--clients", "4", "--rounds", "500", "--algorithm", "fedavg", "--models", "mlr"]
    args += ["--device", "cpu", "--out", str(tmp_path)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "simulate", *args, "--workers", "2", "-v"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # rank 1 says its pid once it holds its shard
        seen.append(line)
        found = re.search(r"rank 1 of 2 \(pid (\d+)\)", line)
        if found:
            break
    assert found, "".join(seen)
    rank_1 = int(found.group(1))

    # Execute: rank 1 dies, or the launcher is told to stop (as a scheduler does)
    if stop == "SIGTERM":
        proc.send_signal(signal.SIGTERM)
    else:
        os.kill(rank_1, signal.SIGKILL)
    rest = proc.communicate(timeout=60)[0]

    # Assert: the run stopped (well before its 500 rounds), saying why; no rank is left
    if stop == "SIGTERM":
        assert proc.returncode == 130
        assert "interrupted: nothing of this run was kept (with --set checkpoint=true" in rest
        assert "Traceback" not in rest, rest
    else:
        assert proc.returncode == 2
        assert "error: rank 1 stopped (killed by signal SIGKILL)" in rest, rest
    assert not (tmp_path / "results.json").exists()
    assert _ended(rank_1)


def _ended(pid: int) -> bool:
    """Whether process `pid` has ended: gone, or a zombie (ended, its exit status not yet
    collected by whoever adopted it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


# -- shards and what crosses ranks (in this process) ----------------------------------------------
def test_shards_balance_work_not_client_count():
    # Prepare: clients' costs (samples x parameters), two heavy among light ones
    costs = [4, 1, 3, 1, 1, 3, 1, 6]

    # Execute
    shards = balance(costs, 2)

    # Assert: costliest first, each to the least loaded rank (ties: the lower rank): 7 (6) to
    # rank 0, 0 (4) and 2 (3) to rank 1 (7), 5 (3) to rank 0 (9), 1 and 3 to rank 1 (9), 4 to
    # rank 0 (10), 6 to rank 1 (10): equal work, three clients against five
    assert shards == [[4, 5, 7], [0, 1, 2, 3, 6]]
    assert [sum(costs[i] for i in s) for s in shards] == [10, 10]
    assert balance(costs, 2) == shards  # the same on every rank


def test_a_rank_takes_its_machines_gpu_in_turn():
    assert [rank_gpu(r, 1) for r in range(4)] == [0, 0, 0, 0]  # four ranks share one GPU
    assert [rank_gpu(r, 4) for r in range(4)] == [0, 1, 2, 3]  # one rank per GPU
    assert [rank_gpu(r, 2) for r in range(5)] == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="no GPU to place rank 1 on"):
        rank_gpu(1, 0)


def test_ranks_on_one_machine_share_its_cores_and_gpus_however_they_were_launched(monkeypatch):
    # Two torchrun launches on one machine each see LOCAL_RANK=0 and LOCAL_WORLD_SIZE=1; their
    # host names say that they share it. A rank with all the cores would round its matmuls
    # otherwise than one process's jobs (MKL sums in an order that depends on the threads), and
    # results drift; both would train on GPU 0.
    hosts = ["gpu-a", "gpu-b", "gpu-a", "gpu-a"]
    assert [on_machine(hosts, r) for r in range(4)] == [(0, 3), (0, 1), (1, 3), (2, 3)]
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert machine() == f"{socket.gethostname()} {boot}"  # another machine has another boot id
    monkeypatch.setenv("OMP_NUM_THREADS", "12")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)))
    assert [rank_threads(RunConfig(), n) for n in (1, 3, 12, 13)] == [12, 4, 1, 1]
    assert rank_threads(RunConfig(threads=5), 3) == 5  # --threads is taken as given


def test_the_results_name_each_ranks_device():
    cpu = DeviceChoice("auto", torch.device("cpu"), "auto: CUDA is not available")
    assert device_record(cpu).used == "cpu"
    assert device_record(cpu, ["cpu"]).used == "cpu"  # one rank: as one process
    two = device_record(cpu, ["cuda:1", "cuda:0", "cuda:1", "cpu"])
    assert two.used == "cpu ×1, cuda:0 ×1, cuda:1 ×2 (4 ranks)"
    assert two.reason == (
        "auto: CUDA is not available; a rank per GPU of its machine (its place there mod its GPUs)"
    )
    assert device_record(cpu, ["cpu", "cpu"]).reason == "auto: CUDA is not available"


def test_every_rank_gets_a_client_and_too_many_ranks_are_refused():
    assert balance([100, 1, 1], 3) == [[0], [1], [2]]
    with pytest.raises(ValueError, match=r"3 ranks \(--workers\) for 2 clients.*at most 2 workers"):
        balance([1, 1], 3)


def test_a_clients_cost_is_its_samples_times_its_parameters():
    spec = ArchSpec(family="mlr", num_classes=10, input_shape=(1, 8, 8))
    assert client_cost(spec, 50) == 50 * (64 * 10 + 10)
    mlp = spec.with_(family="mlp")
    assert client_cost(mlp, 50) > client_cost(spec, 50)


def test_a_view_crosses_as_its_own_elements():
    stack = torch.arange(4000, dtype=torch.float32).reshape(40, 100)
    row = stack[3]
    got = loads(dumps({"w": row}))["w"]
    assert torch.equal(got, row)
    assert len(dumps(row)) < 100 * 4 + 300 < len(pickle.dumps(row))


class _Shell:
    def __reduce__(self):
        return os.system, ("echo pwned",)


@pytest.mark.parametrize(
    "blob",
    [
        pytest.param(pickle.dumps(_Shell()), id="os.system"),
        pytest.param(pickle.dumps(torch.load), id="a torch function"),
        pytest.param(pickle.dumps(balance), id="a function of ours"),
        pytest.param(pickle.dumps(getattr), id="a builtin"),
    ],
)
def test_a_blob_naming_anything_but_what_crosses_ranks_is_refused(blob):
    with pytest.raises(pickle.UnpicklingError, match="which nothing that crosses ranks holds"):
        loads(blob)


def test_what_crosses_ranks_loads_as_it_was():
    spec = ArchSpec(family="mlr", num_classes=3, input_shape=(4,))
    sent = {"spec": spec, "n": Counter(a=2), "ids": frozenset({"c0"}), "dtype": torch.int64}
    assert loads(dumps(sent)) == sent


def test_disagreement_names_the_rank_and_what_differs():
    same = ("1.0", "2.14.1", "c0de", "abc")
    assert disagreement([same, same]) is None
    why = disagreement([same, same, ("1.1", "2.14.1", "c0de", "abc")])
    assert why is not None and "rank 2: the edgefl version 1.1 where rank 0 has 1.0" in why
    assert "rank 1" not in why
    why = disagreement([same, ("1.0", "2.14.1", "e1se", "abc")])
    assert why is not None and "rank 1: the code e1se where rank 0 has c0de" in why
    assert "the edgefl version" not in why and "the config" not in why


def test_the_code_digest_is_of_edgefls_sources_wherever_they_are(tmp_path):
    # Prepare: a copy of the three packages, elsewhere
    for package in PACKAGES:
        here = Path(importlib.import_module(package).__file__).parent
        shutil.copytree(here, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    copies = [tmp_path / package for package in PACKAGES]

    # Execute and assert: the copy's digest is the code's; a file that is not Python changes
    # nothing; a changed source or a source under another name does
    assert source_digest(copies) == source_digest()
    (tmp_path / "edge_sdk" / "notes.txt").write_text("not code")
    assert source_digest(copies) == source_digest()
    edited = tmp_path / "model_zoo" / "spec.py"
    text = edited.read_text()
    edited.write_text(text + "\n# edited\n")
    assert source_digest(copies) != source_digest()
    edited.write_text(text)
    assert source_digest(copies) == source_digest()
    edited.rename(tmp_path / "model_zoo" / "spec_renamed.py")
    assert source_digest(copies) != source_digest()
