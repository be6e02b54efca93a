"""The settings' dotted keys (`rounds`, `fml.alpha`, `round.deadline_s`), each one's field, and
the nearest valid keys to a typo, for a config file, an override or an `EDGEFL_*` variable."""

from __future__ import annotations

import difflib
import os
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from coordinator.run_config import RunConfig, run_config_model

__all__ = [
    "ENV_NOT_SETTINGS",
    "ENV_PREFIX",
    "error_text",
    "section_model",
    "setting_field",
    "setting_keys",
    "unknown_env_settings",
]

ENV_PREFIX = "EDGEFL_"
# EDGEFL_* variables that are not settings: read elsewhere, never warned about.
ENV_NOT_SETTINGS = frozenset({"EDGEFL_PLUGINS"})


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (through `X | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = section_model(arg)
            if found is not None:
                return found
    return None


def _model_at(model: type[BaseModel], path: Sequence[str]) -> type[BaseModel] | None:
    for part in path:
        field = model.model_fields.get(part)
        inner = section_model(field.annotation) if field is not None else None
        if inner is None:
            return None
        model = inner
    return model


def _keys(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        inner = section_model(field.annotation)
        if inner is None:
            yield prefix + name
        else:
            yield from _keys(inner, f"{prefix}{name}.")


def setting_field(key: str) -> FieldInfo:
    """The field of the dotted setting `key` (`rounds`, `round.deadline_s`) in `RunConfig`,
    whose `description` is the setting's help. The algorithms' sections are not there (they
    need torch): a KeyError names what is."""
    model: type[BaseModel] | None = RunConfig
    *path, leaf = key.split(".")
    for i, part in enumerate(path):
        field = model.model_fields.get(part) if model is not None else None
        model = section_model(field.annotation) if field is not None else None
        if model is None:
            raise KeyError(f"{'.'.join(path[: i + 1])} is not a section of RunConfig")
    assert model is not None
    field = model.model_fields.get(leaf)
    if field is None or section_model(field.annotation) is not None:
        raise KeyError(f"{key} is not a setting of RunConfig")
    return field


def setting_keys() -> list[str]:
    """Every setting's dotted key (`rounds`, `fml.alpha`, `round.deadline_s`...), sorted."""
    return sorted(_keys(run_config_model()))


def _nearest(typo: str) -> list[str]:
    """The valid dotted keys nearest to `typo`: close ones in its own section first, else close
    ones anywhere, and keys of the same name in other sections (`alpha` -> `fml.alpha`)."""
    keys = setting_keys()
    section = typo.rpartition(".")[0]
    siblings = [k for k in keys if k.startswith(section + ".")] if section else keys
    near = difflib.get_close_matches(typo, siblings, n=3, cutoff=0.6)
    if not near:
        near = difflib.get_close_matches(typo, keys, n=3, cutoff=0.6)
    leaf = typo.rpartition(".")[2]
    return near + [k for k in keys if k.rpartition(".")[2] == leaf and k not in near][:3]


def _hint(typo: str, near: Sequence[str]) -> str:
    if near:
        return "did you mean " + " or ".join(near) + "?"
    path = typo.split(".")[:-1]
    model = _model_at(run_config_model(), path)
    valid = sorted(model.model_fields) if model is not None else []
    where = ".".join(path) or "the top level"
    return f"valid keys in {where}: {', '.join(valid)}" if valid else "no such setting"


def error_text(err: Mapping[str, Any]) -> str:
    """One pydantic error as a user reads it: the key, then what is wrong, without pydantic's
    `Value error,` prefix; an unknown key comes with the nearest valid ones."""
    loc = [str(x) for x in err["loc"]]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        return f"{key}: unknown setting; {_hint(key, _nearest(key))}"
    msg = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
    return f"{key}: {msg}" if key else msg


def unknown_env_settings(environ: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each `EDGEFL_*` variable that names no setting (it would be ignored)."""
    env = os.environ if environ is None else environ
    model = run_config_model()
    warnings = []
    for var in sorted(env):
        upper = var.upper()
        if not upper.startswith(ENV_PREFIX) or upper in ENV_NOT_SETTINGS:
            continue
        path = upper[len(ENV_PREFIX) :].lower().split("__")
        node: type[BaseModel] | None = model
        for i, part in enumerate(path):
            assert node is not None
            field = node.model_fields.get(part)
            if field is None:
                typo = ".".join(path[: i + 1])
                near = [ENV_PREFIX + k.upper().replace(".", "__") for k in _nearest(typo)]
                warnings.append(f"{var} is not a setting and is ignored; {_hint(typo, near)}")
                break
            node = section_model(field.annotation)
            if node is None:  # a value (or a dict of them): whatever follows is its content
                break
    return warnings
