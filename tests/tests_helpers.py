"""Shared test helpers: tiny configs and federations that run in seconds on 2 cores."""

from __future__ import annotations

from typing import Any

from coordinator.config import load_config
from edge_sdk.algorithms import algorithm_class
from model_zoo import ArchSpec, families


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
    if "local_epochs" not in algorithm_class(base["algorithm"]).config_cls.model_fields:
        del training["local_epochs"]  # pfml counts iterations (set pfml.local_iterations)
    return load_config(None, base, overrides, training=training)


IMAGE = (1, 28, 28)
# Small enough for 2 CPU cores: one spec per registered family, plus the char LSTM.
_SMALL_KWARGS: dict[str, dict] = {
    "vgg11": {"width": 0.125},
    "vgg13": {"width": 0.125},
    "vgg16": {"width": 0.125},
    "vgg19": {"width": 0.125},
    "cnn2": {"width": 32},
}
CHAR_SPEC = ArchSpec(
    family="lstm",
    num_classes=20,
    input_shape=(12,),
    kwargs={"mode": "char", "vocab_size": 20, "embed": 8, "hidden": 64, "layers": 2},
)
ZOO_SPECS = [
    ArchSpec(family=f, num_classes=10, input_shape=IMAGE, kwargs=_SMALL_KWARGS.get(f, {}))
    for f in families()
] + [CHAR_SPEC]


def spec_id(spec: ArchSpec) -> str:
    return f"{spec.family}-{spec.kwargs['mode']}" if "mode" in spec.kwargs else spec.family
