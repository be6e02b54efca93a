"""Whether a group's stack pays where it would train: the rule behind `cohort = "auto"`.

On a GPU a stack runs each layer once for all its members, one kernel launch where client by
client takes one per member, and it always paid (43x for 100 MLR clients of PFML, 3.7x for 20
of FML on an H200). On the CPU the arithmetic is the same either way. A stack saves the Python
around each operation, and it costs the stacking of the members' state every phase and Python
of its own per step (each member's batches from its own generator). Two workers training at
once share the interpreter, and in small stacks that Python is most of the time. Measured on 2
cores with `benchmarks/stacking_contention.py --workloads grid` (FML, equal clients of 150
samples, one epoch a round: the smallest rounds, where the stacking weighs most), quiet and
beside two spinning processes (docs/benchmarks/stacking-contention.md):

- models of linear layers alone (mlr, mlp), with two workers: stacks of 24 and 32 clients
  gained at both loads (0.54-0.84 of one by one's time), 16 gained quiet and were level with
  the load, 4 and 8 lost (up to 2x);
- convolutional models (lenet5, cnn1), with two workers: level at 8 to 32 clients (0.92-1.16,
  as much as the tries vary), and a loss at 4. Each worker's stack does its members'
  arithmetic, which is most of a convolutional step, as they would one by one;
- with one worker (`parallel = 1`), stacks of 20 clients gained for all four at both loads
  (0.27-0.93): the stack spreads its larger operations over all the threads, where one
  client's small ones do not. Smaller stacks were not measured there.

A model is of a kind by its layers, whatever its family: one whose layers with parameters are
all nn.Linear is linear, one with nn.Conv2d besides is convolutional (cnn2 and a plugin's
architecture of such layers follow lenet5's and cnn1's measurements). Anything else (an LSTM,
any other layer) was not measured on the CPU and trains one by one there unless
`cohort = "always"`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from model_zoo import ArchSpec, build

__all__ = ["kind", "unpaid"]


# On the CPU: the fewest clients of a kind whose stack trained faster than they did one by one,
# with several workers and with one (None: not at any size measured, up to 32).
FEWEST_ON_CPU: dict[str, dict[str, int | None]] = {
    "linear": {"workers": 24, "one worker": 20},
    "convolutional": {"workers": None, "one worker": 20},
}


def kind(spec: ArchSpec) -> str | None:
    """ "linear" (every layer with parameters is nn.Linear), "convolutional" (nn.Conv2d and
    nn.Linear alone), or None for anything else (measured neither way)."""
    with torch.device("meta"):  # its layers alone, no memory for its weights
        model = build(spec, seed=0)
    layers = {type(m) for m in model.modules() if any(True for _ in m.parameters(recurse=False))}
    if layers <= {nn.Linear}:
        return "linear"
    if layers <= {nn.Linear, nn.Conv2d}:
        return "convolutional"
    return None


def unpaid(
    specs: Sequence[ArchSpec],
    device: torch.device,
    clients: int,
    parallel: int,
    known: dict[str, str | None] | None = None,
) -> str | None:
    """Why a stack of `clients` clients on `device` training models of architectures `specs`
    (their own, and those a round sends them: FML's meme, FedMe's exchanged models), with
    `parallel` jobs training at once, would not pay (a sentence for the log); None where it
    pays. A stack of several kinds is of the slowest to pay: convolutional over linear.
    `known`: each architecture's `kind` by its JSON, as the caller keeps them (filled here)."""
    if device.type != "cpu":
        return None
    known = {} if known is None else known
    kinds: dict[str, str | None] = {}
    for spec in specs:
        key = spec.to_json()
        if key not in known:
            known[key] = kind(spec)
        kinds[spec.family] = known[key]
    unknown = [family for family, k in kinds.items() if k is None]
    if unknown:
        return (
            f"on the CPU, stacking {', '.join(unknown)} was never measured to pay "
            '(cohort = "always" stacks it)'
        )
    slowest = "convolutional" if "convolutional" in kinds.values() else "linear"
    workers = "workers" if parallel > 1 else "one worker"
    fewest = FEWEST_ON_CPU[slowest][workers]
    if fewest is None:
        return (
            f"on the CPU with {parallel} workers, a stack of {slowest} models trains no faster "
            'than its clients one by one (cohort = "always" stacks it)'
        )
    if clients < fewest:
        return (
            f"on the CPU, a stack of {slowest} models pays from {fewest} clients on "
            '(cohort = "always" stacks it)'
        )
    return None
