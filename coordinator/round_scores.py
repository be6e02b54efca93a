"""What a round's replies add up to: the mean personalized and global-model accuracy, each
client's score for the rollback check (coordinator.robust), and the mean training metrics."""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.strategies import FitReply

__all__ = ["accuracies", "client_score", "mean_metrics"]


def accuracies(
    scores: Mapping[str, FitReply | None],
) -> tuple[float | None, float | None, dict[str, tuple[float | None, float | None]]]:
    """The mean over clients of each client's personalized and global-model accuracy on its own
    test split (both averaged alike, one client one vote), and the per-client pairs."""
    per_client: dict[str, tuple[float | None, float | None]] = {}
    for cid, s in scores.items():
        if s is None:
            continue
        m = s.metrics
        p = m["personal_correct"] / m["personal_total"] if m.get("personal_total") else None
        g = m["global_correct"] / m["global_total"] if m.get("global_total") else None
        per_client[cid] = (p, g)
    ps = [p for p, _ in per_client.values() if p is not None]
    gs = [g for _, g in per_client.values() if g is not None]
    return (sum(ps) / len(ps) if ps else None, sum(gs) / len(gs) if gs else None, per_client)


def client_score(pair: tuple[float | None, float | None] | None) -> float | None:
    """What the rollback check compares: a client's global-model accuracy where it reports one
    (the aggregate itself), else its personalized accuracy; None without an evaluation."""
    if pair is None:
        return None
    personal, glob = pair
    return glob if glob is not None else personal


def mean_metrics(valid: Mapping[str, FitReply]) -> dict[str, float]:
    keys = {k for v in valid.values() for k in v.metrics}
    return {
        k: sum(v.metrics[k] for v in valid.values() if k in v.metrics)
        / sum(1 for v in valid.values() if k in v.metrics)
        for k in sorted(keys)
    }
