"""`edgefl bench onnx`: every zoo family, trained briefly on real data, exported and measured.

For each family on its natural input (Fashion-MNIST images for the MLPs, CNNs, VGGs and the
row-reading LSTM; text for the character LSTM) the run

1. trains a freshly built zoo model briefly (Adam, one pass over a few thousand training
   samples), so that the accuracy deltas are those of a model that has learnt something;
2. exports it with `export_onnx` (dynamo exporter, legacy fallback; verified against PyTorch);
3. quantizes it to int8 dynamically, and statically (QDQ, calibrated on training images) when
   the family has convolutions;
4. measures PyTorch eager and every onnxruntime variant side by side with
   `edge_sdk.onnx_bench.benchmark_onnx` on held-out test samples;
5. checks the goals: onnxruntime fp32 batch-1 latency at most half of PyTorch's, and each int8
   file at least 3x smaller than the fp32 one with at most 1 point of accuracy lost.

Nothing is downloaded. Images: Fashion-MNIST from its IDX files (train files for training and
calibration, the t10k files for accuracy), or scikit-learn's digits when they are absent (the
report says which). Text: LEAF's Shakespeare when installed, else the English licence texts that
Debian-based systems ship in /usr/share/common-licenses; without either the character LSTM is
skipped, with the reason in the report.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from coordinator.bench_data import BenchData, image_data, text_data
from edge_sdk.client_data import ClientData
from edge_sdk.export import export_onnx
from edge_sdk.onnx_bench import (
    BenchRow,
    BenchSettings,
    benchmark_onnx,
    machine_info,
    torch_threads,
)
from edge_sdk.optim_config import OptimConfig
from edge_sdk.quantization import quantize_dynamic_int8, quantize_static_int8
from edge_sdk.trainer import Trainer
from model_zoo import ArchSpec, build, families

__all__ = [
    "CHAR_FAMILY",
    "OnnxBenchConfig",
    "bench_family_names",
    "bench_files",
    "check_goals",
    "format_goals",
    "run_onnx_benchmark",
]

logger = logging.getLogger(__name__)

CHAR_FAMILY = "lstm-char"
LATENCY_GOAL = 0.5  # onnxruntime fp32 p50 / PyTorch p50 at batch 1
SIZE_GOAL = 3.0  # fp32 bytes / int8 bytes
ACCURACY_GOAL = -0.01  # int8 accuracy minus PyTorch's


def bench_family_names() -> list[str]:
    """What `edgefl bench onnx` measures by default: every zoo family, plus the char LSTM."""
    return [*families(), CHAR_FAMILY]


@dataclass(frozen=True)
class OnnxBenchConfig:
    """What to measure; `quick` shrinks training, evaluation and repetitions to seconds."""

    families: tuple[str, ...]
    quick: bool = False
    threads: int = 1
    device: str = "cpu"
    data_root: str | None = None
    seed: int = 0

    def train_samples(self, family: str) -> int:
        """Training samples (one epoch): the character LSTM reads 80 steps per sample."""
        if family == CHAR_FAMILY:
            return 256 if self.quick else 2000
        return 1000 if self.quick else 8000

    def eval_samples(self, family: str) -> int:
        if family == CHAR_FAMILY:
            return 256 if self.quick else 2000
        return 1000 if self.quick else 10000

    @property
    def calibration_samples(self) -> int:
        return 128 if self.quick else 512

    @property
    def settings(self) -> BenchSettings:
        base = BenchSettings.quick() if self.quick else BenchSettings()
        return base.with_(threads=self.threads, device=self.device)


# --------------------------------------------------------------------------------------------
# one family


def _has_convolutions(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv1d | nn.Conv2d | nn.Conv3d) for m in model.modules())


def _train(
    model: nn.Module, data: BenchData, samples: int, device: torch.device, seed: int
) -> dict[str, Any]:
    n = min(samples, len(data.y_train))
    empty_x, empty_y = data.x_train[:0], data.y_train[:0]
    client = ClientData(
        x_train=data.x_train[:n],
        y_train=data.y_train[:n],
        x_val=empty_x,
        y_val=empty_y,
        x_test=empty_x,
        y_test=empty_y,
        num_classes=len(data.classes),
    ).to(device)
    trainer = Trainer(device, seed=seed)
    cfg = OptimConfig(local_epochs=1, batch_size=64, optimizer="adam", lr=3e-3, weight_decay=0)
    start = time.perf_counter()
    loss = trainer.train_epochs(trainer.prepare(model), client, cfg)
    return {
        "samples": n,
        "epochs": cfg.local_epochs,
        "optimizer": "adam lr 3e-3, batch 64",
        "final_mean_loss": round(loss, 4),
        "seconds": round(time.perf_counter() - start, 2),
    }


def _bench_family(
    label: str, data: BenchData, cfg: OnnxBenchConfig, workdir: Path
) -> tuple[list[BenchRow], dict[str, Any]]:
    if label == CHAR_FAMILY:
        spec = ArchSpec(
            family="lstm",
            num_classes=len(data.classes),
            input_shape=data.input_shape,
            kwargs={"mode": "char", "vocab_size": len(data.classes)},
        )
    else:
        spec = ArchSpec(family=label, num_classes=len(data.classes), input_shape=data.input_shape)
    device = torch.device(cfg.device)
    model = build(spec, seed=cfg.seed)
    info: dict[str, Any] = {"spec": str(spec), "data": data.name}
    info["training"] = _train(model, data, cfg.train_samples(label), device, cfg.seed)
    model = model.to("cpu").to(memory_format=torch.contiguous_format).eval()

    fp32 = export_onnx(
        model,
        spec,
        workdir / f"{label}.onnx",
        class_names=data.classes,
        normalization=data.normalization,
    )
    files = [fp32, workdir / f"{label}.int8-dynamic.onnx"]
    quantize_dynamic_int8(fp32, files[1])
    if _has_convolutions(model):
        files.append(workdir / f"{label}.int8-static.onnx")
        calibration = data.x_train[: cfg.calibration_samples]
        quantize_static_int8(fp32, files[2], calibration)
    n_eval = min(cfg.eval_samples(label), len(data.y_test))
    rows = benchmark_onnx(
        files,
        data.x_test[:n_eval],
        data.y_test[:n_eval],
        model=model,
        settings=cfg.settings,
    )
    return rows, info


# --------------------------------------------------------------------------------------------
# goals and the whole run


def check_goals(rows: Sequence[BenchRow]) -> list[dict[str, Any]]:
    """One entry per family and goal: the measured value, the target, and whether it is met."""
    goals: list[dict[str, Any]] = []
    by_family: dict[str, dict[str, BenchRow]] = {}
    for r in rows:
        by_family.setdefault(r.family, {})[r.variant] = r
    for fam, variants in by_family.items():
        fp32 = variants.get("ort_fp32")
        if fp32 is not None and fp32.latency_ratio_vs_torch is not None:
            ratio = fp32.latency_ratio_vs_torch
            goals.append(
                {
                    "family": fam,
                    "goal": "ort_fp32 p50 latency at batch 1 / torch's",
                    "value": ratio,
                    "target": f"<= {LATENCY_GOAL}",
                    "met": ratio <= LATENCY_GOAL,
                }
            )
        for name in ("ort_int8_dynamic", "ort_int8_static"):
            q = variants.get(name)
            if q is None or fp32 is None:
                continue
            smaller = round(fp32.size_bytes / q.size_bytes, 3)
            goals.append(
                {
                    "family": fam,
                    "goal": f"{name}: fp32 size / int8 size",
                    "value": smaller,
                    "target": f">= {SIZE_GOAL}",
                    "met": smaller >= SIZE_GOAL,
                }
            )
            if q.accuracy_delta is not None:
                goals.append(
                    {
                        "family": fam,
                        "goal": f"{name}: accuracy minus torch's (points)",
                        "value": round(100 * q.accuracy_delta, 2),
                        "target": f">= {100 * ACCURACY_GOAL:g}",
                        "met": q.accuracy_delta >= ACCURACY_GOAL,
                    }
                )
    return goals


def format_goals(goals: Sequence[dict[str, Any]]) -> str:
    width = max((len(g["family"]) for g in goals), default=6)
    goal_width = max((len(g["goal"]) for g in goals), default=4)
    lines = []
    for g in goals:
        met = "yes" if g["met"] else "NO"
        lines.append(
            f"{g['family']:<{width}}  {g['goal']:<{goal_width}}  {g['value']:>8}  "
            f"{g['target']:<7}  {met}"
        )
    return "\n".join(lines)


def run_onnx_benchmark(
    cfg: OnnxBenchConfig,
    *,
    workdir: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark for `cfg.families`; returns the JSON-ready report.

    The ONNX files go to `workdir` (kept) or to a temporary directory (removed).
    """
    known = bench_family_names()
    unknown = [f for f in cfg.families if f not in known]
    if unknown:
        raise ValueError(f"unknown families {', '.join(unknown)}; known: {', '.join(known)}")
    if not cfg.families:
        raise ValueError("no families to benchmark")
    say = progress or (lambda msg: logger.info("%s", msg))
    with tempfile.TemporaryDirectory(prefix="edgefl-bench-") as tmp:
        out = Path(workdir) if workdir is not None else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        images = text = None
        if any(f != CHAR_FAMILY for f in cfg.families):
            images = image_data(cfg.data_root, seed=cfg.seed)
        if CHAR_FAMILY in cfg.families:
            n = max(cfg.train_samples(CHAR_FAMILY), cfg.eval_samples(CHAR_FAMILY))
            text = text_data(n, seed=cfg.seed)
        rows: list[BenchRow] = []
        details: dict[str, Any] = {}
        skipped: dict[str, str] = {}
        for fam in cfg.families:
            data = text if fam == CHAR_FAMILY else images
            if data is None:
                skipped[fam] = "no text corpus: neither LEAF Shakespeare nor licence texts found"
                say(f"[{fam}] skipped: {skipped[fam]}")
                continue
            say(f"[{fam}] training on {data.name}, exporting, quantizing, measuring ...")
            # Training runs on the benchmark's fixed thread count too: on a busy machine more
            # threads than free cores slow every step down (OpenMP threads wait for each other).
            with torch_threads(cfg.threads):
                fam_rows, details[fam] = _bench_family(fam, data, cfg, out)
            rows += fam_rows
    goals = check_goals(rows)
    settings = cfg.settings
    data_desc = {}
    if images is not None:
        data_desc["images"] = images.description
    if text is not None:
        data_desc["characters"] = text.description
    return {
        "benchmark": "inference: PyTorch eager vs onnxruntime fp32 / int8 dynamic / int8 static",
        "machine": machine_info(settings),
        "settings": {
            **asdict(settings),
            "quick": cfg.quick,
            "throughput_batch": 64,
            "train_samples": {f: cfg.train_samples(f) for f in cfg.families},
            "eval_samples": {f: cfg.eval_samples(f) for f in cfg.families},
            "calibration_samples": cfg.calibration_samples,
            "seed": cfg.seed,
            "statistics": "latency p50/p99 over all timed batch-1 calls; throughput: median "
            "of rounds; variants interleaved round by round after an untimed warm-up",
        },
        "data": data_desc,
        "families": details,
        "skipped": skipped,
        # Files in a temporary directory are gone by now: no paths to them.
        "rows": [r.to_dict() | ({} if workdir is not None else {"path": None}) for r in rows],
        "goals": goals,
        "all_goals_met": all(g["met"] for g in goals),
    }


def bench_files(
    files: Sequence[str | Path],
    *,
    data: str | Path | None = None,
    dataset: str | None = None,
    data_root: str | None = None,
    samples: int = 1000,
    seed: int = 0,
    settings: BenchSettings | None = None,
) -> dict[str, Any]:
    """Measure ONNX files a user exported (one model: `edgefl export`'s fp32, fp16 and int8
    files of one client) side by side, on `samples` inputs: from `data` (an .npz with arrays
    `x`, preprocessed as in training, and `y`) or from the registered `dataset`."""
    import numpy as np

    from edge_sdk.onnx_format import read_metadata
    from model_zoo.data import load_dataset

    if (data is None) == (dataset is None):
        raise ValueError("measuring files needs their test data: --data FILE.npz or --dataset NAME")
    spec = read_metadata(files[0]).spec
    if data is not None:
        with np.load(data) as arrays:
            if not {"x", "y"} <= set(arrays.files):
                raise ValueError(f"{data} must hold arrays x and y; it holds {arrays.files}")
            x, y = arrays["x"][:samples], arrays["y"][:samples]
        where = f"{data}, {len(x)} samples"
    else:
        assert dataset is not None
        ds = load_dataset(dataset, data_root, max_samples=samples, seed=seed)
        x, y = ds.x.numpy(), ds.y.numpy()
        where = f"{ds.name}, {len(x)} samples (a seeded subset; normalised as in training)"
    if tuple(x.shape[1:]) != tuple(spec.input_shape):
        raise ValueError(
            f"the inputs are shaped {tuple(x.shape[1:])}, but {files[0]} takes "
            f"{tuple(spec.input_shape)}"
        )
    settings = settings or BenchSettings()
    rows = benchmark_onnx(list(files), x, y, settings=settings)
    return {
        "benchmark": "inference: onnxruntime, your files side by side",
        "machine": machine_info(settings),
        "settings": {**asdict(settings), "samples": len(x)},
        "data": {"inputs": where},
        "rows": [r.to_dict() for r in rows],
    }
