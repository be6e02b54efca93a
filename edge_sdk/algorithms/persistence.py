"""An algorithm's private state as tensors and plain values, and back (no pickle).

`encode` turns what an algorithm lists in `persistent` (modules, optimizers, tensors, ArchSpecs,
WireModels, plain values, and dicts of any of these) into what a state file holds; `decode`
restores it, into the current modules and optimizers where they fit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from edge_sdk.algorithms.context import SPEC_ATTR, AlgorithmError
from edge_sdk.codec import WireModel, cpu_copies, state_of
from model_zoo import ArchSpec, build

__all__ = ["BASE_STATE", "copied", "decode", "encode"]

# What the base class saves besides `persistent`: the random generator, the count of training
# samples processed, and what the guard keeps.
BASE_STATE = ("__rng__", "__samples__", "__guard__")

# How an optimizer runs its step, not what the step computes: chosen for the tensors and the
# device it steps now (edge_sdk.optim.SGD's fused kernel on the CPU), never taken from a saved
# state, which may come from another device or from a version that chose otherwise.
_EXECUTION = ("fused", "foreach", "capturable")


def encode(value: Any, where: str, *, copies: bool = True) -> Any:
    """`value` as a state file holds it; `copies`: its tensors copied (else as they are)."""
    if isinstance(value, nn.Module):
        spec = getattr(value, SPEC_ATTR, None)
        if spec is None:
            raise AlgorithmError(f"{where}: a module not built by _build/_materialize")
        weights = state_of(value) if copies else dict(value.state_dict())  # detached either way
        return {"__module__": spec.to_json(), "weights": weights}
    if isinstance(value, torch.optim.Optimizer):
        saved = value.state_dict()  # its per-parameter state holds the live buffers
        state = {str(k): dict(v) for k, v in saved["state"].items()}
        opt = {"state": state, "param_groups": saved["param_groups"]}
        return {"__optimizer__": copy.deepcopy(opt) if copies else opt}
    if isinstance(value, ArchSpec):
        return {"__spec__": value.to_json()}
    if isinstance(value, WireModel):
        return {"__wire__": value.spec.to_json(), "weights": dict(value.weights)}
    if isinstance(value, dict):  # e.g. a table per peer, a cache of peers' models
        return {str(k): encode(v, f"{where}.{k}", copies=copies) for k, v in value.items()}
    return value


def copied(value: Any) -> Any:
    """An `encode(..., copies=False)` value as `encode` would have copied it: a module's
    weights as CPU copies (as `state_of` makes them), an optimizer's state copied where it is."""
    if isinstance(value, dict) and "__module__" in value:
        return {"__module__": value["__module__"], "weights": cpu_copies(value["weights"])}
    if isinstance(value, dict) and "__optimizer__" in value:
        return {"__optimizer__": copy.deepcopy(value["__optimizer__"])}
    if isinstance(value, dict) and "__wire__" not in value and "__spec__" not in value:
        return {k: copied(v) for k, v in value.items()}
    return value


def decode(
    current: Any, value: Any, *, prepare: Callable[[nn.Module], nn.Module], where: str
) -> Any:
    """`encode`'s output restored: into `current` where it is a module of the same architecture
    or an optimizer (`prepare` puts a module built anew on the client's device)."""
    if isinstance(value, dict) and "__module__" in value:
        spec = ArchSpec.from_json(value["__module__"])
        module = current
        if not (isinstance(current, nn.Module) and getattr(current, SPEC_ATTR, None) == spec):
            module = prepare(build(spec))
            setattr(module, SPEC_ATTR, spec)
        module.load_state_dict(value["weights"])
        return module
    if isinstance(value, dict) and "__optimizer__" in value:
        if not isinstance(current, torch.optim.Optimizer):
            raise AlgorithmError(f"{where}: an optimizer was saved where none exists now")
        saved = value["__optimizer__"]
        # torch's load_state_dict adopts the saved tensors (momentum, Adam's moments) as they
        # are, and the next step would change them in place: the saved state (a node's state
        # before a round, which a retry and a failed round load again) must stay as it was.
        current.load_state_dict(
            {
                "state": {
                    int(k): {
                        n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in entry.items()
                    }
                    for k, entry in saved["state"].items()
                },
                "param_groups": _with_execution_of(current, saved["param_groups"]),
            }
        )
        return current
    if isinstance(value, dict) and "__spec__" in value:
        return ArchSpec.from_json(value["__spec__"])
    if isinstance(value, dict) and "__wire__" in value:
        return WireModel(ArchSpec.from_json(value["__wire__"]), dict(value["weights"]))
    if isinstance(value, dict):
        old = current if isinstance(current, dict) else {}
        return {k: decode(old.get(k), v, prepare=prepare, where=where) for k, v in value.items()}
    return value


def _with_execution_of(
    current: torch.optim.Optimizer, groups: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The saved param `groups`, each with `current`'s group's `_EXECUTION` settings, and none it
    lacks (where the group counts differ, torch's load_state_dict refuses them as they are)."""
    if len(groups) != len(current.param_groups):
        return groups
    return [
        {k: v for k, v in g.items() if k not in _EXECUTION}
        | {k: now[k] for k in _EXECUTION if k in now}
        for g, now in zip(groups, current.param_groups, strict=True)
    ]
