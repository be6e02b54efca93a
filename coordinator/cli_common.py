"""What every `edgefl` command shares: the app, one vocabulary of common options, and the
turning of library errors into clean CLI errors.

Common options, with one meaning wherever they appear (added by the `common` decorator, so no
command spells them differently):

    -v / --verbose      more log output: -v INFO, -vv DEBUG (other libraries INFO), -vvv all DEBUG
    -q / --quiet        errors only, and no progress bars
    --log-level LEVEL   DEBUG, INFO, WARNING, ERROR (wins over -v/-q)
    --log-format FMT    text, or json (one object per line)
    --log-file PATH     logs go to this file instead of stderr
    --plugin NAME       import a module that registers models, datasets, algorithms (repeatable)
    -h / --help, and `edgefl --version`

Options that set a setting come from the setting itself (coordinator.cli_settings).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

__all__ = [
    "CSV",
    "CommonOptions",
    "ConfigOpt",
    "SetOpt",
    "app",
    "common",
    "csv_list",
    "current",
    "fail",
    "guard",
    "key_values",
    "set_signature",
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
    def counted(self) -> bool:
        """The levels come from -v's count: neither --log-level nor --quiet was given."""
        return self.log_level is None and not self.quiet

    @property
    def level(self) -> int:
        if self.log_level is not None:
            return int(getattr(logging, self.log_level.upper()))
        if self.quiet:
            return logging.ERROR
        return {0: logging.WARNING, 1: logging.INFO}.get(self.verbose, logging.DEBUG)

    @property
    def library_level(self) -> int:
        """Other libraries' level (outside edge_sdk.logs.OWN_PACKAGES): INFO at -vv, where their
        DEBUG is hundreds of lines (matplotlib's fonts, markdown-it's rules) around edgefl's few
        dozen; -vvv and --log-level DEBUG show it."""
        if self.counted and self.verbose == 2:
            return logging.INFO
        return self.level

    def child_args(self) -> list[str]:
        """The same options for a child process (`edgefl demo`'s coordinator and devices)."""
        if self.counted and self.verbose:
            args = ["-" + "v" * self.verbose]
        else:
            args = ["--log-level", logging.getLevelName(self.level)]
        args += ["--log-format", self.log_format]
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
            typer.Option(
                "--verbose",
                "-v",
                count=True,
                help="more log output: -v INFO, -vv DEBUG (other libraries INFO), -vvv all DEBUG",
            ),
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

        set_signature(wrapper, own, params)
        return wrapper  # type: ignore[return-value]

    return decorate


def _setup(opts: CommonOptions, *, plugins: bool) -> None:
    from coordinator.plugins import PluginError, load_plugins
    from edge_sdk.logs import configure_logging

    try:
        configure_logging(
            opts.level,
            fmt=opts.log_format,  # type: ignore[arg-type]
            file=opts.log_file,
            libraries=opts.library_level,
        )
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


def set_signature(wrapper: Any, own: inspect.Signature, params: list[inspect.Parameter]) -> None:
    """Give `wrapper` the signature typer reads: `own` with `params`."""
    wrapper.__signature__ = own.replace(parameters=params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params} | {
        "return": own.return_annotation
    }
