"""Crash-safe state files: nested state (tensors + plain values) as one safetensors file.

A coordinator checkpoint and a client's persisted algorithm state have the same shape: a tree of
dicts and lists whose leaves are tensors or JSON values. `save_state` writes the tensors as
safetensors and the rest as JSON in the file's metadata (never pickle), atomically: a temporary
file in the same folder, fsync, rename, fsync of the folder (`model_zoo.files`), readable by its
owner only. A reader sees the old file or the new one, never half of one. `load_state` is its
inverse.

Each file says the layout it was written in (`STATE_FORMAT`, in its metadata; files without it,
written before the stamp, are format 1). A reader refuses a format it does not read with an
error that says what to do, not a missing key: a device whose SDK was downgraded, or handed a
file from a newer coordinator. A change of what a state holds that today's reader cannot take
as it is raises `STATE_FORMAT`; one it can (a value added with a default) keeps it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from model_zoo.files import write_atomic

__all__ = [
    "STATE_FORMAT",
    "StateError",
    "load_state",
    "save_state",
    "state_bytes",
    "state_from_bytes",
]

_TREE = "edgefl.state"
_FORMAT = "edgefl.state_format"
_TENSOR = "__tensor__"
STATE_FORMAT = 1  # the layout this version writes, and the only one it reads


class StateError(ValueError):
    """A state file that is missing pieces, corrupt, or holds values that cannot be saved."""


def _flatten(node: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        key = f"t{len(tensors)}"
        # a contiguous CPU copy in the standard layout (channels_last models included)
        tensors[key] = torch.empty(node.shape, dtype=node.dtype).copy_(node.detach())
        return {_TENSOR: key}
    if isinstance(node, Mapping):
        if _TENSOR in node:
            raise StateError(f"{path}: the key {_TENSOR!r} is reserved")
        out = {}
        for k, v in node.items():
            if not isinstance(k, str):
                raise StateError(f"{path}: keys must be strings, got {k!r}")
            out[k] = _flatten(v, f"{path}.{k}", tensors)
        return out
    if isinstance(node, list | tuple):
        return [_flatten(v, f"{path}[{i}]", tensors) for i, v in enumerate(node)]
    if node is None or isinstance(node, bool | int | float | str):
        return node
    raise StateError(f"{path}: cannot save a {type(node).__name__} (tensors and JSON values only)")


def _unflatten(node: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(node, dict):
        if set(node) == {_TENSOR}:
            try:
                return tensors[node[_TENSOR]]
            except KeyError:
                raise StateError(f"the state file lacks tensor {node[_TENSOR]!r}") from None
        return {k: _unflatten(v, tensors) for k, v in node.items()}
    if isinstance(node, list):
        return [_unflatten(v, tensors) for v in node]
    return node


def state_bytes(state: Mapping[str, Any]) -> bytes:
    """`state` as the bytes of a state file (safetensors; its tensors copied to the host)."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _flatten(state, "state", tensors)
    return st_save(tensors, metadata={_TREE: json.dumps(tree), _FORMAT: str(STATE_FORMAT)})


def state_from_bytes(data: bytes, what: str = "the state") -> dict[str, Any]:
    """The state `state_bytes` wrote (its tensors on the host); `StateError` naming `what`
    when the bytes are not one."""
    try:
        tensors = st_load(data)
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
        tree = json.loads(meta[_TREE])
    except (SafetensorError, ValueError, KeyError, RuntimeError) as exc:
        raise StateError(f"{what} is not an edgefl state file: {exc}") from exc
    written = meta.get(_FORMAT, "1")
    if written != str(STATE_FORMAT):
        newer = written.isdigit() and int(written) > STATE_FORMAT
        raise StateError(
            f"{what} is in state format {written}, which this version of edgefl does not read "
            f"(it reads {STATE_FORMAT}): "
            + (
                "it was written by a newer edgefl; upgrade edgefl here to resume from it"
                if newer
                else "resume with the edgefl that wrote it, or remove the file to start afresh"
            )
        )
    state = _unflatten(tree, tensors)
    if not isinstance(state, dict):
        raise StateError(f"{what} holds no state mapping")
    return state


def save_state(path: str | os.PathLike[str], state: Mapping[str, Any]) -> Path:
    """Write `state` to `path` atomically (temp file, fsync, rename, fsync of the folder), mode
    0o600: a model trained on a device's data is that device's owner's alone."""
    return write_atomic(path, state_bytes(state), mode=0o600)


def load_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a file `save_state` wrote; `StateError` when it is not one."""
    return state_from_bytes(Path(path).read_bytes(), str(path))
