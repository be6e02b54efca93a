"""Plugins: user modules imported before a command runs, so that what they register (model
families, datasets, partition schemes, algorithms) can be named like the built-in ones.

Three ways to name them, all loaded by `load_plugins`, each module once:

* `--plugin NAME` on the commands (repeatable, or comma-separated);
* the environment variable `EDGEFL_PLUGINS` (comma-separated);
* Python entry points in the group `edgefl.plugins` of any installed distribution
  (`[project.entry-points."edgefl.plugins"] mine = "my_package.edgefl_plugin"`).

A NAME is a module name (`my_package.plugin`, imported as Python imports it, with the current
directory on the path as `python -m` has it) or the path of a `.py` file
(`examples/plugin/edgefl_example_plugin.py`; its folder goes on the path, so it may import its
siblings). A module registers on import, with `model_zoo.register`,
`model_zoo.data.register_dataset`, `model_zoo.data.register_scheme`,
`edge_sdk.algorithms.register_algorithm` and `coordinator.strategies.register_strategy`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterable
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Final

__all__ = [
    "ENTRY_POINT_GROUP",
    "PLUGINS_ENV",
    "PluginError",
    "load_plugins",
    "loaded_plugins",
    "plugin_names",
]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP: Final[str] = "edgefl.plugins"
PLUGINS_ENV: Final[str] = "EDGEFL_PLUGINS"

_LOADED: dict[str, ModuleType] = {}  # plugin name as given -> its module


class PluginError(ImportError):
    """A plugin that cannot be found or fails while it is imported; the message says which."""


def plugin_names(given: Iterable[str] = ()) -> list[str]:
    """The plugins named on the command line and in `EDGEFL_PLUGINS`, in that order, once each
    (entry points are not included: `load_plugins` finds them)."""
    names: list[str] = []
    for chunk in [*given, os.environ.get(PLUGINS_ENV, "")]:
        for name in chunk.split(","):
            name = name.strip()
            if name and name not in names:
                names.append(name)
    return names


def _is_path(name: str) -> bool:
    return name.endswith(".py") or os.sep in name or "/" in name


def _import_file(name: str) -> ModuleType:
    path = Path(name).expanduser().resolve()
    if path.is_dir():
        path = path / "__init__.py"
    if not path.is_file():
        raise PluginError(f"plugin {name!r}: no such file ({path})")
    folder = str(path.parent.parent if path.name == "__init__.py" else path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_name = path.parent.name if path.name == "__init__.py" else path.stem
    if module_name in sys.modules:
        existing = getattr(sys.modules[module_name], "__file__", None)
        if existing and Path(existing).resolve() == path:
            return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"plugin {name!r}: {path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _import_name(name: str) -> ModuleType:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # as `python -m` has it, after the installed packages
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and name.split(".")[0] == exc.name.split(".")[0]:
            raise PluginError(
                f"plugin {name!r}: no module named {exc.name!r} (searched the current "
                f"directory and the installed packages); pass a module that Python can import "
                "or the path of a .py file"
            ) from exc
        raise


def _load_one(name: str, load: object) -> ModuleType:
    try:
        module = load() if callable(load) else None
    except PluginError:
        raise
    except Exception as exc:
        raise PluginError(
            f"plugin {name!r} failed while loading: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(module, ModuleType):
        raise PluginError(f"plugin {name!r} is not a module")
    return module


def load_plugins(
    names: Iterable[str] = (), *, entry_point_group: str = ENTRY_POINT_GROUP
) -> list[str]:
    """Import the plugins `names` (module names or .py paths), those in `EDGEFL_PLUGINS` and
    those installed under the entry-point group; each once per process. Returns the names of
    the plugins loaded by this call, in load order. Raises `PluginError` naming the plugin."""
    loaded: list[str] = []
    for name in plugin_names(names):
        if name in _LOADED:
            continue
        importer = _import_file if _is_path(name) else _import_name
        _LOADED[name] = _load_one(name, lambda name=name, importer=importer: importer(name))
        loaded.append(name)
    for ep in entry_points(group=entry_point_group):
        key = f"{ep.name} ({ep.value})"
        if key in _LOADED:
            continue
        _LOADED[key] = _load_one(key, ep.load)
        loaded.append(key)
    if loaded:
        log.info("plugins loaded: %s", ", ".join(loaded))
    return loaded


def loaded_plugins() -> list[str]:
    """Every plugin this process has loaded, in load order."""
    return list(_LOADED)
