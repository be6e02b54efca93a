"""What the guard may deploy: a candidate (an architecture and its model), the names of the
candidates the guard itself makes or looks for, and the mixture of two candidates as one model
(`blend`) or of several, equally (`mixed`)."""

from __future__ import annotations

from torch import nn

from model_zoo import ArchSpec
from model_zoo.models.mixture import Mixture, mixture_spec

__all__ = ["BLEND", "DISTILLED", "FINETUNED", "PEERS", "PERSONAL", "Candidate", "blend", "mixed"]

# What the guard may deploy: a name ("personal", "meme"...) → (architecture, model).
Candidate = tuple[ArchSpec, nn.Module]

# The name of the algorithm's own personalized model among the candidates.
PERSONAL = "personal"
# The federation's final model fine-tuned on the client's data, and its mixture with PERSONAL.
FINETUNED = "finetuned"
BLEND = f"{PERSONAL}+{FINETUNED}"
# A student of the device's own architecture distilled from a candidate its budget refuses.
DISTILLED = "distilled"
# The mixture of the clients' trained copies of the global model that do best on this client's
# validation split, its own or its peers' (`guard_peers`: edge_sdk.algorithms.deployment).
PEERS = "peers"


def blend(a: Candidate, b: Candidate, weight: float = 0.5) -> Candidate:
    """The mixture weight·a + (1 − weight)·b of two candidates' predicted probabilities, as one
    `mixture` model built around the same modules (a mixture's members are taken as members,
    their weights scaled, so that a mixture never holds a mixture). 0 < weight < 1."""
    if not 0 < weight < 1:
        raise ValueError(f"a blend's weight is strictly between 0 and 1, got {weight}")
    members: list[tuple[ArchSpec, nn.Module, float]] = []
    for (spec, model), share in ((a, weight), (b, 1 - weight)):
        if isinstance(model, Mixture):
            weights = spec.kwargs["weights"]
            inner = [ArchSpec.model_validate(m) for m in spec.kwargs["members"]]
            total = float(sum(weights))
            members += [
                (s, m, share * w / total)
                for s, m, w in zip(inner, model.members, weights, strict=True)
            ]
        else:
            members.append((spec, model, share))
    weights = [w for _, _, w in members]
    spec = mixture_spec([s for s, _, _ in members], weights)
    mixture = Mixture([m for _, m, _ in members], weights)
    device = next(a[1].parameters()).device
    return spec, mixture.to(device)


def mixed(cands: list[Candidate]) -> Candidate:
    """The equal mixture of `cands`' predicted probabilities as one `mixture` model (one
    candidate alone is itself)."""
    if len(cands) == 1:
        return cands[0]
    weights = [1.0 / len(cands)] * len(cands)
    spec = mixture_spec([s for s, _ in cands], weights)
    device = next(cands[0][1].parameters()).device
    return spec, Mixture([m for _, m in cands], weights).to(device)
