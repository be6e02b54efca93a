"""What every `edgefl` command shares: the app, one vocabulary of common options, settings'
defaults in the help, and the turning of library errors into clean CLI errors.

Common options, with one meaning wherever they appear (added by the `common` decorator, so no
command spells them differently):

    -v / --verbose      more log output: -v INFO, -vv DEBUG
    -q / --quiet        errors only, and no progress bars
    --log-level LEVEL   DEBUG, INFO, WARNING, ERROR (wins over -v/-q)
    --log-format FMT    text, or json (one object per line)
    --log-file PATH     logs go to this file instead of stderr
    --plugin NAME       import a module that registers models, datasets, algorithms (repeatable)
    -h / --help, and `edgefl --version`

Options that set a setting come from the setting itself (`settings_options`): a command names
the keys it exposes, and each becomes a flag with the field's type, its description as the help,
and the key and default after it; the command gets the values given, by key.
"""

from __future__ import annotations

import functools
import inspect
import keyword
import logging
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import typer

__all__ = [
    "ALGORITHM",
    "CSV",
    "DATA",
    "TRAINING",
    "TRAINING_FLAGS",
    "CommonOptions",
    "ConfigOpt",
    "Flag",
    "SetOpt",
    "SettingOption",
    "app",
    "common",
    "csv_list",
    "current",
    "fail",
    "guard",
    "key_values",
    "load",
    "setting_default",
    "settings_options",
    "tune_malloc",
    "with_default",
]

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

app = typer.Typer(
    help="edgefl: personalized federated learning on heterogeneous edge devices.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings=CONTEXT,
    rich_markup_mode=None,  # help text is plain: [default: ...] is text, not a markup tag
)

CSV = "comma-separated"
log = logging.getLogger("edgefl")


def csv_list(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def key_values(pairs: list[str] | None) -> list[str] | None:
    """`--set`'s callback: every value is key=value. `--set fml.alpha 0.3` would otherwise end
    in "unexpected extra argument (0.3)", which does not say what --set takes."""
    for pair in pairs or []:
        key, sep, _ = pair.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(
                f"{pair!r} is not key=value: write --set {pair.strip() or 'KEY'}=VALUE, with no "
                "space around '=' (e.g. --set fml.alpha=0.3; `edgefl settings` lists the keys)",
                param_hint="'--set'",
            )
    return pairs


def fail(msg: str) -> typer.Exit:
    typer.secho(f"error: {msg}", err=True, fg=typer.colors.RED)
    return typer.Exit(code=2)


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


# Options several commands share, each defined once.
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="a TOML run config (see examples/)")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="any setting, dotted: fml.alpha=0.3 (repeatable; `edgefl settings` lists them all)",
        callback=key_values,
    ),
]


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

        _sign(wrapper, own, params)
        wrapper.settings_options = options  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def _sign(wrapper: Any, own: inspect.Signature, params: list[inspect.Parameter]) -> None:
    """Give `wrapper` the signature typer reads: `own` with `params`."""
    wrapper.__signature__ = own.replace(parameters=params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params} | {
        "return": own.return_annotation
    }


# -- the common options ------------------------------------------------------------------------
@dataclass
class CommonOptions:
    verbose: int = 0
    quiet: bool = False
    log_level: str | None = None
    log_format: str = "text"
    log_file: Path | None = None
    plugins: list[str] = field(default_factory=list)

    @property
    def level(self) -> int:
        if self.log_level is not None:
            return int(getattr(logging, self.log_level.upper()))
        if self.quiet:
            return logging.ERROR
        return {0: logging.WARNING, 1: logging.INFO}.get(self.verbose, logging.DEBUG)

    def child_args(self) -> list[str]:
        """The same options for a child process (`edgefl demo`'s coordinator and devices)."""
        args = ["--log-level", logging.getLevelName(self.level), "--log-format", self.log_format]
        for p in self.plugins:
            args += ["--plugin", p]
        return args

    def where(self) -> str:
        """Where this process's log records go, in words."""
        level = logging.getLevelName(self.level)
        if self.log_file is not None:
            return f"{self.log_file} ({self.log_format}, {level} and above)"
        return f"stderr ({self.log_format}, {level} and above; --log-file FILE keeps them)"


_CURRENT = CommonOptions()


def current() -> CommonOptions:
    """The common options of the command being run."""
    return _CURRENT


def _level(value: str | None) -> str | None:
    from edge_sdk.logs import LOG_LEVELS

    if value is not None and value.upper() not in LOG_LEVELS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(LOG_LEVELS)}")
    return value


def _format(value: str) -> str:
    from edge_sdk.logs import LOG_FORMATS

    if value not in LOG_FORMATS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(LOG_FORMATS)}")
    return value


_LOGGING_PARAMS: dict[str, tuple[Any, Any]] = {
    "verbose": (
        Annotated[
            int,
            typer.Option("--verbose", "-v", count=True, help="more log output: -v INFO, -vv DEBUG"),
        ],
        0,
    ),
    "quiet": (
        Annotated[bool, typer.Option("--quiet", "-q", help="errors only, and no progress bars")],
        False,
    ),
    "log_level": (
        Annotated[
            str | None,
            typer.Option(
                help="DEBUG, INFO, WARNING, ERROR (wins over -v/-q) [default: WARNING]",
                callback=_level,
            ),
        ],
        None,
    ),
    "log_format": (
        Annotated[str, typer.Option(help="text, or json: one object per line", callback=_format)],
        "text",
    ),
    "log_file": (
        Annotated[
            Path | None, typer.Option(help="write the log here instead of stderr (appended)")
        ],
        None,
    ),
}
_PLUGIN_PARAM: tuple[Any, Any] = (
    Annotated[
        list[str] | None,
        typer.Option(
            "--plugin",
            help=(
                "import this module (a name or a .py path) first: it may register models, "
                "datasets, partitions and algorithms; repeatable; also EDGEFL_PLUGINS and the "
                "'edgefl.plugins' entry points"
            ),
        ),
    ],
    None,
)

F = TypeVar("F", bound=Callable[..., Any])


def common(*, plugins: bool = True) -> Callable[[F], F]:
    """Add the common options to a command: its signature (what typer reads) gets them, the
    wrapper sets up logging, loads the plugins, then calls the command with its own options."""

    def decorate(func: F) -> F:
        own = inspect.signature(func, eval_str=True)
        added = dict(_LOGGING_PARAMS)
        if plugins:
            added["plugin"] = _PLUGIN_PARAM
        params = list(own.parameters.values()) + [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=a)
            for name, (a, d) in added.items()
        ]

        @functools.wraps(func)
        def wrapper(**kwargs: Any) -> Any:
            global _CURRENT
            _CURRENT = CommonOptions(
                verbose=kwargs.pop("verbose"),
                quiet=kwargs.pop("quiet"),
                log_level=kwargs.pop("log_level"),
                log_format=kwargs.pop("log_format"),
                log_file=kwargs.pop("log_file"),
                plugins=list(kwargs.pop("plugin", None) or []),
            )
            _setup(_CURRENT, plugins=plugins)
            return func(**kwargs)

        _sign(wrapper, own, params)
        return wrapper  # type: ignore[return-value]

    return decorate


def _setup(opts: CommonOptions, *, plugins: bool) -> None:
    from coordinator.plugins import PluginError, load_plugins
    from edge_sdk.logs import configure_logging

    try:
        configure_logging(opts.level, fmt=opts.log_format, file=opts.log_file)  # type: ignore[arg-type]
    except OSError as exc:
        raise fail(f"cannot write the log file {opts.log_file}: {exc}") from exc
    if plugins:
        try:
            load_plugins(opts.plugins)
        except PluginError as exc:
            raise fail(str(exc)) from exc


# -- errors and config -------------------------------------------------------------------------
def guard(call: Callable[[], Any]) -> Any:
    """Run a library call; its errors become a clean CLI error with a non-zero exit code."""
    from coordinator.config import ConfigError
    from coordinator.distributed import RankFailed
    from coordinator.fleet.ranks import RankLost
    from coordinator.plugins import PluginError
    from coordinator.server import CoordinatorError
    from edge_sdk.transport import TransportError

    try:
        return call()
    except (
        ConfigError,
        CoordinatorError,
        RankFailed,
        RankLost,
        TransportError,
        PluginError,
        ValueError,
        FileNotFoundError,
        KeyError,
    ) as exc:
        raise fail(str(exc).strip("'\"") if isinstance(exc, KeyError) else str(exc)) from exc


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
