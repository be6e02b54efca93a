"""Shared test helpers: tiny configs and federations that run in seconds on 2 cores."""

from __future__ import annotations

from typing import Any

from coordinator.config import load_config


def tiny_config(**flags: Any) -> Any:
    """A run config on 8×8 digits (no files needed): 4 clients, 3 rounds, mlr, CPU."""
    base: dict[str, Any] = {
        "algorithm": "fedavg",
        "data.dataset": "digits",
        "data.options": {"size": 8},
        "data.max_samples": 800,
        "data.partition": "iid",
        "models": ["mlr"],
        "clients": 4,
        "rounds": 3,
        "device": "cpu",
        "round.deadline_s": 60,
        "round.register_timeout_s": 30,
    }
    training = {"local_epochs": 2, "batch_size": 32, "lr": 0.1}
    for key in ("local_epochs", "batch_size", "lr"):
        if key in flags:
            training[key] = flags.pop(key)
    overrides = flags.pop("overrides", {})
    base.update(flags)
    return load_config(None, base, overrides, training=training)
