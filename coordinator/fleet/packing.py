"""How a phase's models become blobs: each distinct model encoded once, a model that several
tasks carry sent once on the broadcast topic, and the blobs of a task sent again under new ids.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from edge_sdk.codec import WireModel
from edge_sdk.ids import unique_id
from edge_sdk.model_blobs import pack_models
from edge_sdk.protocol import ModelRef, Task

__all__ = ["Packed", "pack_plan", "renew"]

# Per client: the refs its task carries, and the blobs that ride with it (not shared).
Packed = tuple[dict[str, ModelRef], dict[str, bytes]]


def pack_plan(
    plan: Mapping[str, Mapping[str, WireModel]], *, share: bool, max_bytes: int
) -> tuple[dict[str, Packed], dict[str, bytes]]:
    """Encode each distinct model of `plan` once. With `share`, a model that several tasks
    carry becomes one blob for the broadcast topic (its refs marked shared); the others ride
    with their own task. Returns each client's refs and own blobs, and the shared blobs."""
    uses: Counter[tuple[str, int]] = Counter()
    for models in plan.values():
        uses.update({_model_key(m) for m in models.values()})
    packed: dict[tuple[str, int], tuple[ModelRef, bytes]] = {}
    shared_blobs: dict[str, bytes] = {}
    out: dict[str, Packed] = {}
    for cid, models in plan.items():
        refs: dict[str, ModelRef] = {}
        own: dict[str, bytes] = {}
        for name, m in models.items():
            key = _model_key(m)
            if key not in packed or not share:
                shared = uses[key] > 1 and share
                one_ref, one_blob = pack_models({name: m}, max_bytes=max_bytes, shared=shared)
                ref = one_ref[name]
                packed[key] = (ref, one_blob[ref.blob.id])
                if shared:
                    shared_blobs[ref.blob.id] = one_blob[ref.blob.id]
            ref, data = packed[key]
            refs[name] = ref
            if not ref.blob.shared:
                own[ref.blob.id] = data
        out[cid] = (refs, own)
    return out, shared_blobs


def renew(
    tasks: dict[str, tuple[Task, dict[str, bytes]]], cids: list[str], shared: dict[str, bytes]
) -> dict[str, bytes]:
    """Give the blobs of these clients' tasks new ids (in `tasks`; a receiver drops a blob id it
    already delivered, and a process that ignored the first copy of a task has delivered its
    blobs). `shared` (blob id -> bytes) learns the new ids of shared blobs; returns those to
    publish on the broadcast topic again. No bytes are copied."""
    renamed: dict[str, str] = {}
    again: dict[str, bytes] = {}
    for cid in cids:
        task, own = tasks[cid]
        refs, blobs = {}, {}
        for name, ref in task.models.items():
            new = renamed.setdefault(ref.blob.id, unique_id())
            refs[name] = ref.model_copy(update={"blob": ref.blob.model_copy(update={"id": new})})
            if ref.blob.shared:
                again[new] = shared[new] = shared[ref.blob.id]
            else:
                blobs[new] = own[ref.blob.id]
        tasks[cid] = (task.model_copy(update={"models": refs}), blobs)
    return again


def _model_key(m: WireModel) -> tuple[str, int]:
    """Identity of a model in a plan: the same weights object under the same architecture."""
    return (m.spec.to_json(), id(m.weights))
