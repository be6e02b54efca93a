"""Loading the run's config (`RunConfig`, coordinator.run_config) from TOML, the environment
and flags, every field overridable, and writing it back; the config's names are all imported
from here.

Precedence, written once here: field defaults < TOML file < environment variables `EDGEFL_*`
(pydantic-settings; `__` separates nested fields: `EDGEFL_FML__ALPHA=0.3`,
`EDGEFL_BROKER__PASSWORD=...`) < CLI flags < `--set key=value` overrides (dotted keys for nested
fields, e.g. `fml.alpha=0.3`, `data.partition_params.alpha=0.1`; values parse as JSON when they
can, e.g. `models=["mlp","lenet5"]`, else as strings). The broker password may come only from the
environment or `broker.password_file`: never from a flag (it would show in `ps`) or a TOML file.
The simulator, the coordinator daemon and `edgefl client` all read this one config.
Every algorithm registered in `edge_sdk.algorithms` gets a section named after it, holding its
config with the defaults from algorithms.md; adding an algorithm adds its section by itself
(one registered by a plugin too, when the plugin is loaded before the config).

Typos are caught: an unknown key (`--set fml.alpah=0.3`, a TOML key, `EDGEFL_ROUNDZ=1`) is
refused or, for environment variables, warned about, naming the valid keys nearest to it.
"""

from __future__ import annotations

import copy
import json
import logging
import tomllib
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from coordinator.config_keys import (
    ENV_PREFIX,
    error_text,
    section_model,
    setting_field,
    setting_keys,
    unknown_env_settings,
)
from coordinator.config_sections import (
    ClientConfig,
    DataConfig,
    DeployConfig,
    RobustConfig,
    RoundConfig,
)
from coordinator.run_config import RunConfig, run_config_model

# The config's public names, wherever they are defined (coordinator.run_config, .config_sections,
# .config_keys): import them from here.
__all__ = [
    "ENV_PREFIX",
    "ClientConfig",
    "ConfigError",
    "DataConfig",
    "DeployConfig",
    "RobustConfig",
    "RoundConfig",
    "RunConfig",
    "load_config",
    "parse_overrides",
    "run_config_model",
    "setting_field",
    "setting_keys",
    "unknown_env_settings",
    "write_config",
]

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config file or override that does not validate; the message names the field."""


def parse_overrides(pairs: Iterable[str]) -> dict[str, Any]:
    """`["fml.alpha=0.3", "models=[\\"mlp\\"]"]` → {"fml.alpha": 0.3, "models": ["mlp"]}."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {pair!r} is not of the form key=value")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[key.strip()] = value
    return out


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if not isinstance(child, dict):
            child = node[p] = {} if child is None else _as_dict(child, dotted)
        node = child
    node[parts[-1]] = value


def _as_dict(value: Any, dotted: str) -> dict[str, Any]:
    if isinstance(value, BaseModel):
        return value.model_dump()
    raise ConfigError(f"cannot set {dotted!r}: {value!r} is not a section")


def _apply_training(tree: dict[str, Any], algorithms: list[str], key: str, value: Any) -> None:
    """Set one common training flag on every algorithm of the run whose config has it."""
    from edge_sdk.algorithms import algorithm_class, algorithm_names

    known = set(algorithm_names())
    takers = [
        n for n in algorithms if n in known and key in algorithm_class(n).config_cls.model_fields
    ]
    if not takers and any(n in known for n in algorithms):
        raise ConfigError(
            f"--{key.replace('_', '-')}: no algorithm of this run ({', '.join(algorithms)}) has a "
            f"{key!r} setting (federico takes one gradient step per round: give it more rounds)"
        )
    skipped = [n for n in algorithms if n in known and n not in takers]
    if skipped:
        log.warning("%s=%s applies to %s, not to %s", key, value, takers, skipped)
    for name in takers:
        _set_dotted(tree, f"{name}.{key}", value)


def _env_tree() -> dict[str, Any]:
    """What the environment says (`EDGEFL_*`), as a nested dict of raw values; variables that
    name no setting are left out (`unknown_env_settings` warns about them)."""

    class _FromEnv(BaseSettings, run_config_model()):  # type: ignore[misc]
        model_config = SettingsConfigDict(
            env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid"
        )

    return _known(dict(EnvSettingsSource(_FromEnv)()), run_config_model())


def _known(tree: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """`tree` without the keys `model` has no field for (recursively, through sections)."""
    out = {}
    for key, value in tree.items():
        field = model.model_fields.get(key)
        if field is None:
            continue
        inner = section_model(field.annotation)
        out[key] = _known(value, inner) if inner and isinstance(value, dict) else value
    return out


def _deep_merge(tree: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(tree.get(key), dict):
            _deep_merge(tree[key], value)
        else:
            tree[key] = value


def _refuse_secrets(tree: Mapping[str, Any], source: str) -> None:
    broker = tree.get("broker")
    if isinstance(broker, Mapping):
        url = str(broker.get("url") or "")
        if "password" in broker or ("@" in url and ":" in url.split("@")[0].split("//")[-1]):
            raise ConfigError(
                f"the broker password cannot come from {source}: set {ENV_PREFIX}BROKER__PASSWORD "
                "or broker.password_file (a file readable only by you)"
            )


def load_config(
    path: str | Path | None = None,
    flags: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    training: Mapping[str, Any] | None = None,
    environ: bool = True,
    written: Mapping[str, Any] | None = None,
) -> RunConfig:
    """Defaults < TOML at `path` < `EDGEFL_*` environment < `flags` (dotted keys, None = not
    given) < `overrides`.

    `written`: a config a run wrote (results.json's `config`), taken in place of the TOML
    file; `path` then only names where it came from, in errors.

    `training` holds the common local-training flags (local_epochs, batch_size, lr): each
    applies to the run's algorithm and to every baseline whose config has that field, so all are
    compared on the same budget. They resolve against the final algorithm and baselines, after
    `overrides` (e.g. `--set algorithm=pfml --lr 0.05` sets pfml.lr), and an override of the
    same field in a section (`--set pfml.lr=0.02`) still wins. A flag that no algorithm of the
    run takes is an error (federico takes one gradient step per round, not epochs).
    """
    tree: dict[str, Any] = {}
    if written is not None:
        tree = copy.deepcopy(dict(written))
        _refuse_secrets(tree, f"the written config {path}")
    elif path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            tree = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: invalid TOML: {exc}") from exc
        _refuse_secrets(tree, f"the config file {p}")
    file_tree = copy.deepcopy(tree)
    if environ:
        for warning in unknown_env_settings():
            log.warning(warning)
        _deep_merge(tree, _env_tree())
    given: dict[str, Any] = {}
    for key, value in (flags or {}).items():
        if value is not None:
            _set_dotted(given, key, value)
    for key, value in (overrides or {}).items():
        _set_dotted(given, key, value)
    _refuse_secrets(given, "a command-line flag (it would show in ps)")
    for key, value in (flags or {}).items():
        if value is not None:
            _set_dotted(tree, key, value)
    final = copy.deepcopy(tree)  # where the overrides leave the algorithm and the baselines
    for key, value in (overrides or {}).items():
        _set_dotted(final, key, value)
    algorithms = [final.get("algorithm", RunConfig.model_fields["algorithm"].default)]
    algorithms += [b for b in final.get("baselines", []) if b not in algorithms]
    for key, value in (training or {}).items():
        if value is not None:
            _apply_training(tree, algorithms, key, value)
    for key, value in (overrides or {}).items():
        _set_dotted(tree, key, value)
    try:
        return run_config_model().model_validate(tree)
    except ValidationError as exc:
        # A bad value that came from the file (nothing later set that key) names the file.
        later = set(_dotted(_env_tree() if environ else {})) | set(_dotted(given))
        from_file = set(_dotted(file_tree)) - later
        msgs = "; ".join(
            f"{path}: {text}" if ".".join(map(str, e["loc"])) in from_file else text
            for e in exc.errors()
            for text in [error_text(e)]
        )
        raise ConfigError(f"invalid config: {msgs}") from exc


def _dotted(tree: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Every key of a nested dict, dotted (`data.partition`), sections included."""
    for key, value in tree.items():
        yield prefix + key
        if isinstance(value, Mapping):
            yield from _dotted(value, f"{prefix}{key}.")


def _without_nulls(value: Any) -> Any:
    """TOML has no null: drop None fields (their defaults are None) recursively."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def write_config(cfg: RunConfig, path: str | Path, header: str = "") -> Path:
    """`cfg` as TOML that `load_config` reads back to the same config (never the password);
    `header` lines go first, as comments."""
    import tomli_w

    from model_zoo.files import write_atomic

    tree = _without_nulls(cfg.model_dump(mode="json", exclude={"broker": {"password"}}))
    comments = "".join(f"# {line}\n" for line in header.splitlines())
    return write_atomic(path, comments + tomli_w.dumps(tree))


def __getattr__(name: str) -> Any:
    # Names kept for code written before the vocabulary was settled (client: the participant;
    # device: where tensors compute).
    if name == "DeviceConfig":
        warnings.warn(
            "coordinator.config.DeviceConfig is deprecated: it is ClientConfig",
            DeprecationWarning,
            stacklevel=2,
        )
        return ClientConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
