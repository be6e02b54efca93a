"""What a client app gets back from its EdgeClient: the outcome of each task, what it deployed
after the run, the final metrics, and the error that says its registration was refused."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_sdk.protocol import Phase

__all__ = ["Deployed", "FinalMetrics", "RegistrationRefused", "TaskOutcome"]


class RegistrationRefused(RuntimeError):
    """The coordinator refused this client's registration (the reason is the message)."""


@dataclass(frozen=True)
class TaskOutcome:
    """What a client app's per-round callback receives after each task."""

    round: int
    rounds: int
    phase: Phase
    ok: bool
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    # After the finalize task: what the client deployed, and why.
    deployed: Deployed | None = None


@dataclass(frozen=True)
class Deployed:
    """What a client deploys after the run, as its finalize reply said: which model (its
    guard's label, e.g. "personal (final, lenet5)", "distilled (final, mlp)"), its architecture
    ("mixture of mlr+mlp" for several models), its parameters and the size of its weights, its
    own architecture's parameters (the budget's yardstick, edge_sdk.budget), why it was chosen
    (a sentence), a better model its budget refused (`outside_budget`), and its ONNX file."""

    choice: str
    arch: str
    params: int
    kib: float
    own_params: int
    reason: str
    outside_budget: str | None = None
    val_acc: float | None = None  # on the client's validation split (where the guard chose)
    onnx_path: Path | None = None  # None when the client exports no ONNX file

    @classmethod
    def from_details(
        cls, details: Mapping[str, Any], onnx_path: Path | None = None
    ) -> Deployed | None:
        """The record in a finalize reply's details; None where they hold none."""
        if "deployed_arch" not in details:
            return None
        val, outside = details.get("guard_val_acc"), details.get("deployed_outside_budget")
        return cls(
            choice=str(details.get("deployed", "")),
            arch=str(details["deployed_arch"]),
            params=int(details["deployed_params"]),
            kib=float(details["deployed_kib"]),
            own_params=int(details["own_params"]),
            reason=str(details.get("deployed_reason", "")),
            outside_budget=None if outside is None else str(outside),
            val_acc=float(val) if isinstance(val, int | float) else None,
            onnx_path=onnx_path,
        )

    def describe(self) -> str:
        where = f", {self.onnx_path}" if self.onnx_path else ""
        return f"{self.choice}: {self.arch}, {self.params:,} parameters ({self.kib:.1f} KiB{where})"


class FinalMetrics(dict[str, float]):
    """What `EdgeClient.run()` returns: the final metrics, a dict as before, and `deployed`,
    what the client deploys (None when the run did not reach its end)."""

    deployed: Deployed | None = None
