"""Batch-1 latency of the small models under onnxruntime's session and calling options.

For `mlr` and `mlp` (where a call does ~10 µs of work and the call itself dominates), this
measures, side by side with PyTorch eager (`torch.inference_mode`, same thread count), one
onnxruntime session per option worth trying: graph optimisation levels, a fixed batch axis
(free-dimension override), no memory arena, intra-op spinning off, IO binding with pre-bound
input and output buffers (with and without copying a new sample in and reading the logits out),
`run_with_ort_values`, and the legacy exporter's graph. `edgefl bench onnx` times IO binding
with pre-bound buffers against PyTorch on a ready tensor; this shows what the other ways cost.

    python benchmarks/onnx_session_overhead.py                  # mlr and mlp, ~1 minute
    python benchmarks/onnx_session_overhead.py --families mlr --rounds 20 --json-out out.json

Every "ort:" variant calls `session.run` with numpy arrays unless its name says otherwise.
Prints one JSON object, then a table: p50/p99 in µs and p50 relative to PyTorch's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from edge_sdk.export import export_onnx
from edge_sdk.onnx_bench import BenchSettings, machine_info
from model_zoo import ArchSpec, build, example_input

Call = Callable[[], Any]


def _session(path: Path, threads: int, **options: Any) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL  # as edge_sdk.onnx_bench
    for key, value in options.pop("config", {}).items():
        so.add_session_config_entry(key, value)
    for name, size in options.pop("dims", {}).items():
        so.add_free_dimension_override_by_name(name, size)
    for key, value in options.items():
        setattr(so, key, value)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _variants(family: str, threads: int, workdir: Path) -> dict[str, Call]:
    spec = ArchSpec(family=family, num_classes=10, input_shape=(1, 28, 28))
    model = build(spec, seed=0).eval()
    dynamo = export_onnx(model, spec, workdir / f"{family}.onnx")
    legacy = export_onnx(model, spec, workdir / f"{family}.legacy.onnx", exporter="legacy")
    x = example_input(spec, 1, torch.Generator().manual_seed(0))
    xn = x.numpy()
    feed = {"input": xn}
    level = ort.GraphOptimizationLevel

    def torch_eager() -> Any:
        with torch.inference_mode():
            return model(x)

    def torch_numpy() -> Any:
        with torch.inference_mode():
            return model(torch.from_numpy(xn)).numpy()

    calls: dict[str, Call] = {"torch eager": torch_eager, "torch: numpy in, numpy out": torch_numpy}

    def plain(name: str, session: ort.InferenceSession) -> None:
        calls[name] = lambda: session.run(["logits"], feed)

    plain("ort: session.run, ORT_ENABLE_ALL", _session(dynamo, threads))
    plain(
        "ort: ORT_DISABLE_ALL",
        _session(dynamo, threads, graph_optimization_level=level.ORT_DISABLE_ALL),
    )
    plain(
        "ort: ORT_ENABLE_BASIC",
        _session(dynamo, threads, graph_optimization_level=level.ORT_ENABLE_BASIC),
    )
    plain("ort: batch axis fixed to 1", _session(dynamo, threads, dims={"batch": 1}))
    plain("ort: no memory arena", _session(dynamo, threads, enable_cpu_mem_arena=False))
    plain(
        "ort: intra-op spinning off",
        _session(dynamo, threads, config={"session.intra_op.allow_spinning": "0"}),
    )
    plain("ort: legacy exporter's graph", _session(legacy, threads))

    bound = _session(dynamo, threads)
    binding = bound.io_binding()
    x_value = ort.OrtValue.ortvalue_from_numpy(xn)
    out_value = ort.OrtValue.ortvalue_from_shape_and_type((1, 10), np.float32)
    binding.bind_ortvalue_input("input", x_value)
    binding.bind_ortvalue_output("logits", out_value)
    calls["ort: IO binding, buffers pre-bound (bench)"] = lambda: bound.run_with_iobinding(binding)

    def copy_in_read_out() -> Any:
        x_value.update_inplace(xn)  # a new sample written into the bound input
        bound.run_with_iobinding(binding)
        return out_value.numpy()

    calls["ort: IO binding + copy in + numpy out"] = copy_in_read_out
    run_options = ort.RunOptions()  # passing one costs ~40 µs a call in onnxruntime 1.32
    calls["ort: IO binding + a RunOptions"] = lambda: bound.run_with_iobinding(binding, run_options)
    calls["ort: run_with_ort_values"] = lambda: bound.run_with_ort_values(
        ["logits"], {"input": x_value}
    )
    return calls


def _measure(calls: dict[str, Call], rounds: int, per_round: int, warmup: int) -> dict[str, Any]:
    samples: dict[str, list[int]] = {name: [] for name in calls}
    for call in calls.values():
        for _ in range(warmup):
            call()
    names = list(calls)
    for r in range(rounds):  # interleaved, order rotating: a noisy machine hits all alike
        for name in names[r % len(names) :] + names[: r % len(names)]:
            call, out = calls[name], samples[name]
            for _ in range(per_round):
                start = time.perf_counter_ns()
                call()
                out.append(time.perf_counter_ns() - start)
    torch_p50 = float(np.percentile(samples["torch eager"], 50))
    result = {}
    for name, ns in samples.items():
        p50 = float(np.percentile(ns, 50))
        result[name] = {
            "p50_us": round(p50 / 1e3, 2),
            "p99_us": round(float(np.percentile(ns, 99)) / 1e3, 2),
            "vs_torch": round(p50 / torch_p50, 3),
            "calls": len(ns),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=["mlr", "mlp"])
    p.add_argument("--threads", type=int, default=1, help="torch and onnxruntime threads")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--per-round", type=int, default=300, help="timed calls per variant per round")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            calls = _variants(family, args.threads, Path(tmp))
            results[family] = _measure(calls, args.rounds, args.per_round, args.warmup)
    report = {
        "benchmark": "batch-1 latency of small models: onnxruntime options vs PyTorch eager",
        "machine": machine_info(BenchSettings(threads=args.threads)),
        "settings": {k: v for k, v in vars(args).items() if k != "json_out"},
        "families": results,
    }
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    print()
    for family, rows in results.items():
        width = max(len(n) for n in rows)
        print(f"{family}: p50 / p99 µs at batch 1, {args.threads} thread(s)")
        for name, r in rows.items():
            print(
                f"  {name:<{width}}  {r['p50_us']:8.2f}  {r['p99_us']:8.2f}  {r['vs_torch']:.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
