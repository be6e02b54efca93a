"""Options that set settings, made from the settings themselves (`settings_options`): a command
names the keys it exposes, and each becomes a flag with the field's type, its description as the
help, and the key and default after it; the command gets the values given, by key, and `load`
hands them to the run config."""

from __future__ import annotations

import functools
import inspect
import keyword
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import typer

from coordinator.cli_common import CSV, csv_list, guard, set_signature

__all__ = [
    "ALGORITHM",
    "DATA",
    "NONE",
    "TRAINING",
    "TRAINING_FLAGS",
    "Flag",
    "SettingOption",
    "load",
    "setting_default",
    "settings_options",
    "tune_malloc",
    "with_default",
]

F = TypeVar("F", bound=Callable[..., Any])


# -- settings' defaults, shown in --help -------------------------------------------------------
def setting_default(key: str) -> Any:
    """The default of the dotted setting `key` (`rounds`, `round.deadline_s`, `fml.lr`).

    Settings outside the algorithms' sections come from `RunConfig` alone, which loads neither
    torch nor paho: the help of every command shows them, and `--help` stays fast. An
    algorithm's section (`fml.lr`) needs its algorithm, and so torch."""
    from coordinator.run_config import RunConfig, run_config_model

    top = key.split(".")[0]
    node: Any = (
        RunConfig.model_construct() if top in RunConfig.model_fields else run_config_model()()
    )
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list | tuple):
        return ",".join(map(str, value)) or "none"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def with_default(text: str, key: str, *, none: str | None = None) -> str:
    """`text` followed by the setting's key and its default: what --help shows for a flag."""
    value = setting_default(key)
    shown = none if value is None and none is not None else _shown(value)
    return f"{text} [{key}; default: {shown}]"


# -- options that set settings ------------------------------------------------------------------
ALGORITHM = "<algorithm>"
# The local-training flags: `<algorithm>.KEY` sets KEY of the run's algorithm and of every
# baseline that has it (coordinator.config.load_config). Their type and words are written here:
# the algorithms' configs that hold them load torch, and --help must not.
TRAINING: dict[str, tuple[type, str]] = {
    "local_epochs": (int, "local epochs"),
    "batch_size": (int, "batch size"),
    "lr": (float, "learning rate"),
}
TRAINING_FLAGS = tuple(f"{ALGORITHM}.{key}" for key in TRAINING)
NONE = "; none: "  # a description's last clause: what its None default means
_CSV_NOTE = f" ({CSV})"
_UNSET: Any = object()


@dataclass(frozen=True)
class Flag:
    """A command's option that sets the setting `key`: a dotted key of `RunConfig`, or
    `<algorithm>.KEY` for a `TRAINING` flag. A plain key stands for `Flag(key)`; the rest is
    given only where it differs from what the field says.

    name: the flag; default: `--` and the key's last part, `_` as `-`, a seconds' `_s` dropped
        (`round.deadline_s`: `--deadline`).
    short: a short name (`-o`).
    none: how a None default reads in the help; default: the description's last clause
        `; none: ...` (which the help leaves out of the text), else "none".
    type: the option's type where it is not the field's (`Path` for a path held as a string).
    default: the command's own default: the value then goes to the command alone, not to the
        config (`edgefl demo`), and the option checks the field's bounds itself.
    """

    key: str
    name: str | None = None
    short: str | None = None
    none: str | None = None
    type: Any = None
    default: Any = _UNSET


# The data's settings, as every command that loads data takes them.
DATA: tuple[Flag | str, ...] = (
    "data.dataset",
    Flag("data.root", name="--data-root"),
    "data.max_samples",
    "data.partition",
)


@dataclass(frozen=True)
class SettingOption:
    """A `Flag` made into a command's parameter (what typer reads)."""

    key: str
    param: str  # the parameter's name in the command's signature
    names: tuple[str, ...]  # --name, and the short one
    kind: type  # the value's type on the command line (str for a comma-separated list)
    csv: bool  # a list setting, given comma-separated
    help: str
    default: Any  # the parameter's: None (False for an on/off flag), or the command's own
    own: bool  # the command's own default: the value is the command's, not the config's
    annotation: Any

    def value(self, given: Any) -> Any:
        """What the command gets for `given`. For a setting, None where the flag was not given:
        the config file, the environment or the default decide."""
        if self.csv:
            return csv_list(given)
        if self.own:
            return given
        if self.kind is bool:  # (an on/off flag only turns a setting on)
            return True if given else None
        if self.kind is Path and given is not None:  # the setting holds a string
            return str(given)
        return given


def _flag_type(annotation: Any, key: str) -> tuple[type, bool]:
    """The command line's type of a field's annotation (`int | None`: int; `Literal["a", "b"]`:
    str; `list[str]`: str, comma-separated), and whether it is a list."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return type(typing.get_args(annotation)[0]), False
    if origin in (list, tuple) and str in typing.get_args(annotation):
        return str, True
    if annotation in (bool, int, float, str, Path):
        return annotation, False
    raise TypeError(f"setting {key} ({annotation}) cannot be a flag: give it with --set")


def _setting_option(flag: Flag | str) -> SettingOption:
    from coordinator.config_keys import setting_field

    flag = Flag(flag) if isinstance(flag, str) else flag
    section, _, leaf = flag.key.rpartition(".")
    own = flag.default is not _UNSET
    bounds: dict[str, Any] = {}
    if section == ALGORITHM:
        if leaf not in TRAINING:
            raise KeyError(f"{flag.key}: the training flags are {', '.join(TRAINING)}")
        kind, what = TRAINING[leaf]
        csv = False
        text = f"{what}, for the algorithm and every baseline that has it"
        # The algorithms' defaults would load torch into every --help: `edgefl settings` shows
        # them.
        help_ = f"{text} [{flag.key}; default: the algorithm's own: `edgefl settings fml.{leaf}`]"
    else:
        field_ = setting_field(flag.key)
        if not field_.description:
            raise ValueError(f"setting {flag.key} has no description to be its flag's help")
        kind, csv = _flag_type(field_.annotation, flag.key)
        text, _, means = field_.description.partition(NONE)
        text += _CSV_NOTE if csv else ""
        none = flag.none or means or None
        if not own:
            help_ = with_default(text, flag.key, none=none)
        elif flag.default is None and none:
            help_ = f"{text} [default: {none}]"
        else:
            help_ = text  # (typer shows the default)
        if own:  # the config does not check the value: the option does
            for bound in field_.metadata:
                if getattr(bound, "ge", None) is not None:
                    bounds["min"] = bound.ge
                if getattr(bound, "le", None) is not None:
                    bounds["max"] = bound.le
    kind = flag.type or kind
    name = flag.name or "--" + leaf.removesuffix("_s").replace("_", "-")
    param = name.lstrip("-").replace("-", "_")
    if not param.isidentifier() or keyword.iskeyword(param):
        raise ValueError(f"flag {name} of {flag.key} makes no parameter name")
    names = (name, flag.short) if flag.short else (name,)
    default = flag.default if own else (False if kind is bool else None)
    # An on/off setting is a flag that turns it on (`--late`, not `--late/--no-late`).
    typed = kind if default is not None else kind | None
    return SettingOption(
        key=flag.key,
        param=param,
        names=names,
        kind=kind,
        csv=csv,
        help=help_,
        default=default,
        own=own,
        annotation=Annotated[typed, typer.Option(*names, help=help_, **bounds)],
    )


def settings_options(*flags: Flag | str) -> Callable[[F], F]:
    """Give a command an option for each setting of `flags` (dotted keys, or `Flag`s where
    something differs from what the field says). The command's `flags` parameter stands where
    they go in its signature (and in its --help); it receives the values given, by key, None for
    each flag not given (`load` hands them to the config). A key that names no setting, or a
    setting without a description, fails here, at import."""
    options = tuple(_setting_option(f) for f in flags)
    seen: dict[str, str] = {}
    for opt in options:
        for name in opt.names:
            if name in seen:
                raise ValueError(f"{name} is the flag of both {seen[name]} and {opt.key}")
            seen[name] = opt.key

    def decorate(func: F) -> F:
        own = inspect.signature(func, eval_str=True)
        if "flags" not in own.parameters:
            raise TypeError(f"{func.__name__} has no `flags` parameter for its settings' options")
        clash = {o.param for o in options} & set(own.parameters)
        if clash:
            raise TypeError(f"{func.__name__}: {', '.join(sorted(clash))} is a setting's flag")
        params: list[inspect.Parameter] = []
        for p in own.parameters.values():
            if p.name != "flags":
                params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))
                continue
            params += [
                inspect.Parameter(
                    o.param,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=o.default,
                    annotation=o.annotation,
                )
                for o in options
            ]

        @functools.wraps(func)
        def wrapper(**kwargs: Any) -> Any:
            given = {o.key: o.value(kwargs.pop(o.param)) for o in options}
            return func(flags=given, **kwargs)

        set_signature(wrapper, own, params)
        wrapper.settings_options = options  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def load(config: Path | None, flags: dict[str, Any], sets: list[str]) -> Any:
    """The run config: defaults < TOML < EDGEFL_* < flags < --set (coordinator.config). `flags`
    by setting key; `<algorithm>.KEY` are the training flags."""
    from coordinator.config import load_config, parse_overrides

    training = {k.partition(".")[2]: v for k, v in flags.items() if k.startswith(ALGORITHM + ".")}
    settings = {k: v for k, v in flags.items() if not k.startswith(ALGORITHM + ".")}
    cfg = guard(lambda: load_config(config, settings, parse_overrides(sets), training=training))
    tune_malloc(cfg)
    return cfg


def tune_malloc(cfg: Any) -> bool:
    """A process that talks to a broker keeps paho's chunk scratch memory in its heap
    (edge_sdk.malloc) unless `broker.tune_malloc` is false. True if the allocator was tuned."""
    if cfg.broker.url is None or not cfg.broker.tune_malloc:
        return False
    from edge_sdk.malloc import tune_for_streams

    return tune_for_streams()
