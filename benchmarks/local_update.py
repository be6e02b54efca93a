"""Samples per second of ONE FML local epoch: the SDK's code path against a plain reference loop.

"Ours" is the real SDK path: the FML client algorithm's `fit` for one round with
`local_epochs=1` (data moved to the device once, index batches drawn on the device, one forward
per model per batch and one backward of the summed losses, see `edge_sdk/algorithms/fml.py`).

"Reference" is the way reimplementations usually write the same epoch, written here plainly: a
`TensorDataset` + `DataLoader(shuffle=True)` built anew each epoch over CPU tensors with
`.to(device)` per batch, two SGD optimizers, and per batch two separate backward passes:

    z_p, z_m = personal(x), meme(x)
    loss_p = α·CE(z_p, y) + (1−α)·KL(softmax(z_m).detach() || softmax(z_p))  → backward, step
    z_p = personal(x)                      # recomputed with the updated personal model
    loss_m = β·CE(z_m, y) + (1−β)·KL(softmax(z_p).detach() || softmax(z_m))  → backward, step

Both sides use the same architectures (same seeds), the same data, batch size, optimizer
settings and number of samples per epoch; both include the per-round set-up (meme reset to the
global weights, fresh meme optimizer) and a per-batch loss read-back. Repetitions are interleaved
(ours, ref, ours, ref, ...) after one warm-up of each, and the median of `--repeats` is reported.

    python benchmarks/local_update.py                       # all five families, CPU or CUDA
    python benchmarks/local_update.py --families mlr lenet5 --repeats 5 --json-out out.json

Prints one JSON object, then a plain-text table. Numbers from a shared machine are noisy: only
the side-by-side ratios (speedup) mean anything.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ended, machine, save

from edge_sdk.algorithms import ClientContext, algorithm_class
from edge_sdk.client_data import ClientData
from edge_sdk.codec import WireModel
from edge_sdk.device import resolve_device
from edge_sdk.trainer import Trainer
from model_zoo import ArchSpec, build

FAMILIES = ("mlr", "mlp", "lenet5", "cnn2", "vgg11")
# The target: ours ≥ 2× the reference for the small models on CPU, no slower for the rest.
SMALL = frozenset({"mlr", "mlp", "lenet5"})
# Default samples per epoch: the two slow families run on fewer so that the default run stays
# under ~3 minutes on 2 CPU cores (samples per second do not depend on the epoch length beyond
# noise, as long as there are several batches).
DEFAULT_SAMPLES = {"mlr": 2048, "mlp": 2048, "lenet5": 2048, "cnn2": 512, "vgg11": 1024}
FALLBACK_SAMPLES = 2048
INPUT_SHAPE = (1, 28, 28)
NUM_CLASSES = 10
SEED = 0
ROUND, ROUNDS = 1, 10


# -- the two sides ---------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Ours:
    """The SDK: FML's `fit` for one round of one local epoch."""

    def __init__(
        self,
        spec: ArchSpec,
        x: torch.Tensor,
        y: torch.Tensor,
        glob: WireModel,
        device: torch.device,
        batch_size: int,
    ) -> None:
        empty_x, empty_y = x[:0], y[:0]
        data = ClientData(
            x_train=x,
            y_train=y,
            x_val=empty_x,
            y_val=empty_y,
            x_test=empty_x,
            y_test=empty_y,
            num_classes=NUM_CLASSES,
        ).to(device)
        cls = algorithm_class("fml")
        cfg = cls.config_cls(local_epochs=1, batch_size=batch_size, lr_schedule="none")
        ctx = ClientContext(
            client_id="bench",
            spec=spec,
            data=data,
            device=device,
            seed=SEED,
            trainer=Trainer(device, seed=SEED),
        )
        self.algo = cls(ctx, cfg)
        self.glob = glob
        self.config = cfg

    def epoch(self) -> float:
        result = self.algo.fit(ROUND, ROUNDS, {"global": self.glob})
        return result.metrics["loss_personal"]


def kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    return F.kl_div(
        F.log_softmax(student, 1), F.softmax(teacher.detach(), 1), reduction="batchmean"
    )


class Reference:
    """The usual reimplementation: DataLoader each epoch, two optimizers, two backward passes."""

    def __init__(
        self,
        spec: ArchSpec,
        x: torch.Tensor,
        y: torch.Tensor,
        glob: WireModel,
        device: torch.device,
        batch_size: int,
        *,
        alpha: float,
        beta: float,
        lr: float,
        momentum: float,
        weight_decay: float,
    ) -> None:
        self.x, self.y = x.cpu(), y.cpu()  # the dataset stays on the CPU
        self.device = device
        self.batch_size = batch_size
        self.alpha, self.beta = alpha, beta
        self.sgd = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        # Same initial weights as the SDK's personalized model (seed·1009 + 0) and meme.
        self.personal = build(spec, seed=SEED * 1009).to(device)
        self.meme = build(spec, seed=SEED * 1009 + 1).to(device)
        self.opt_personal = torch.optim.SGD(self.personal.parameters(), **self.sgd)
        self.glob = glob
        self.generator = torch.Generator().manual_seed(SEED)
        self.last_loss_meme = float("nan")

    def epoch(self) -> float:
        device, a, b = self.device, self.alpha, self.beta
        personal, meme, opt_p = self.personal, self.meme, self.opt_personal
        meme.load_state_dict(self.glob.weights)  # the round's global model
        opt_m = torch.optim.SGD(meme.parameters(), **self.sgd)
        personal.train()
        meme.train()
        loader = DataLoader(
            TensorDataset(self.x, self.y),
            batch_size=self.batch_size,
            shuffle=True,
            generator=self.generator,
        )
        total_p, total_m, batches = 0.0, 0.0, 0
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            z_p = personal(xb)
            z_m = meme(xb)
            loss_p = a * F.cross_entropy(z_p, yb) + (1 - a) * kl(z_p, z_m)
            opt_p.zero_grad()
            loss_p.backward()
            opt_p.step()
            # The updated personal model teaches the meme; the meme's own output from above is
            # reused (its weights have not changed yet, and loss_p did not backpropagate into it).
            z_p = personal(xb)
            loss_m = b * F.cross_entropy(z_m, yb) + (1 - b) * kl(z_m, z_p)
            opt_m.zero_grad()
            loss_m.backward()
            opt_m.step()
            total_p += loss_p.item()
            total_m += loss_m.item()
            batches += 1
        self.last_loss_meme = total_m / max(1, batches)
        return total_p / max(1, batches)


# -- measurement -----------------------------------------------------------------------------
def _timed(fn: Callable[[], float], n: int, device: torch.device) -> tuple[float, float]:
    """(samples per second, returned loss) of one call."""
    _sync(device)
    t0 = time.perf_counter()
    loss = fn()
    _sync(device)
    return n / (time.perf_counter() - t0), loss


def make_data(n: int, real: bool) -> tuple[torch.Tensor, torch.Tensor, str]:
    if real:
        from model_zoo.data import load_dataset

        try:
            ds = load_dataset("fashion_mnist", max_samples=n, seed=SEED)
        except FileNotFoundError as exc:  # DatasetNotFound: says where it looked and what to do
            raise SystemExit(f"--real: {exc}") from None
        if len(ds) < n:
            raise SystemExit(f"fashion_mnist: only {len(ds)} samples available, asked for {n}")
        return ds.x[:n].contiguous(), ds.y[:n].contiguous(), "fashion_mnist (real, normalised)"
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(n, *INPUT_SHAPE, generator=g)
    y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    return x, y, "random tensors (torch.randn inputs, uniform labels), Fashion-MNIST-shaped"


def bench_family(
    family: str,
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device,
    batch_size: int,
    repeats: int,
) -> dict[str, Any]:
    spec = ArchSpec(family=family, num_classes=NUM_CLASSES, input_shape=INPUT_SHAPE, kwargs={})
    glob = WireModel.of(spec, build(spec, seed=1))
    ours = Ours(spec, x, y, glob, device, batch_size)
    cfg = ours.config
    ref = Reference(
        spec,
        x,
        y,
        glob,
        device,
        batch_size,
        alpha=cfg.alpha,
        beta=cfg.beta,
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
    )
    n = len(y)
    _timed(ours.epoch, n, device)  # warm-up
    _timed(ref.epoch, n, device)
    ours_sps, ref_sps, ours_loss, ref_loss = [], [], [], []
    for _ in range(repeats):
        s, loss = _timed(ours.epoch, n, device)
        ours_sps.append(s)
        ours_loss.append(loss)
        s, loss = _timed(ref.epoch, n, device)
        ref_sps.append(s)
        ref_loss.append(loss)
    o, r = statistics.median(ours_sps), statistics.median(ref_sps)
    return {
        "params": sum(p.numel() for p in ours.algo.personal.parameters()),
        "samples": n,
        "ours_sps": round(o, 1),
        "ref_sps": round(r, 1),
        "speedup": round(o / r, 3),
        "paired_speedup_median": round(
            statistics.median(a / b for a, b in zip(ours_sps, ref_sps, strict=True)), 3
        ),
        "target": 2.0 if family in SMALL else 1.0,
        "ours_sps_all": [round(v, 1) for v in ours_sps],
        "ref_sps_all": [round(v, 1) for v in ref_sps],
        # Sanity: both sides train (mean personal-model loss over the last epoch).
        "ours_last_loss_personal": round(ours_loss[-1], 4),
        "ref_last_loss_personal": round(ref_loss[-1], 4),
    }


def machine_info(device: torch.device) -> dict[str, Any]:
    info = machine(
        device=str(device),
        threads=torch.get_num_threads(),
        interop_threads=torch.get_num_interop_threads(),
    )
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["note"] = "ours runs under bf16/fp16 autocast on CUDA (the SDK's default); ref in fp32"
    return info


def format_table(results: dict[str, dict[str, Any]], device: torch.device) -> str:
    header = (
        "family",
        "params",
        "samples",
        "ours sps",
        "ref sps",
        "speedup",
        "paired",
        "target",
        "met",
    )
    rows = [header]
    for fam, r in results.items():
        met = "yes" if r["speedup"] >= r["target"] else "NO"
        if device.type != "cpu":
            met += " (target is for CPU)"
        rows.append(
            (
                fam,
                f"{r['params']:,}",
                str(r["samples"]),
                f"{r['ours_sps']:.0f}",
                f"{r['ref_sps']:.0f}",
                f"{r['speedup']:.2f}x",
                f"{r['paired_speedup_median']:.2f}x",
                f">={r['target']:.1f}x",
                met,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for i, row in enumerate(rows):
        cells = [
            c.ljust(w) if j == 0 else c.rjust(w)
            for j, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--families",
        nargs="+",
        default=list(FAMILIES),
        help=f"model families, space- or comma-separated (default: {' '.join(FAMILIES)})",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="samples per epoch, for every family (default: 2048, but 512 for cnn2 and 1024 "
        "for vgg11 to keep the run short)",
    )
    p.add_argument("--batch-size", type=int, default=128, help="batch size (default 128, FML's)")
    p.add_argument("--repeats", type=int, default=3, help="timed epochs per side (default 3)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: stable on shared machines, where several "
        "OpenMP threads fighting other jobs for the cores make timings meaningless; "
        "0 keeps torch's own default, one per core)",
    )
    p.add_argument("--real", action="store_true", help="use the real Fashion-MNIST (installed)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    args.families = [f for item in args.families for f in item.split(",") if f]
    if args.threads < 0:
        p.error("--threads must be >= 0")
    for name in ("samples", "batch_size", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    start = machine_info(device)  # the load before the run, as every record here
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        print(f"warning: {', '.join(unknown)} not among {FAMILIES}; trying anyway", file=sys.stderr)

    def samples_for(family: str) -> int:
        if args.samples is not None:
            return args.samples
        return DEFAULT_SAMPLES.get(family, FALLBACK_SAMPLES)

    n_max = max(samples_for(f) for f in args.families)
    x_all, y_all, data_desc = make_data(n_max, args.real)
    results: dict[str, dict[str, Any]] = {}
    for fam in args.families:
        n = samples_for(fam)
        print(f"[{fam}] {n} samples x (1 warm-up + {args.repeats}) per side ...", file=sys.stderr)
        results[fam] = bench_family(
            fam, x_all[:n], y_all[:n], device, args.batch_size, args.repeats
        )
    report = {
        "benchmark": "one FML local epoch (alpha=beta=0.5), samples/second",
        "machine": start,
        "settings": {
            "data": data_desc,
            "input_shape": list(INPUT_SHAPE),
            "num_classes": NUM_CLASSES,
            "samples": {f: samples_for(f) for f in args.families},
            "batch_size": args.batch_size,
            "repeats": args.repeats,
            "warmup": 1,
            "statistic": "median of interleaved repeats (ours, ref, ours, ref, ...)",
            "optimizer": "SGD lr 0.01, momentum 0.9, weight decay 5e-4 (both sides)",
        },
        "families": results,
    }
    ended(report)
    print(save(report, args.json_out))
    print()
    print(
        f"FML local epoch, {device}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(f"data: {data_desc}")
    print(format_table(results, device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
