"""Write docs/api/<package>.md: the public API of each package, from its code.

Every module of a package that declares `__all__` gets a section: its docstring's first paragraph,
then each public name with its signature and the first paragraph of its docstring (classes also
list their own public methods). Run it after changing a public signature or docstring:

    .venv/bin/python tools/api_docs.py            # rewrite docs/api/
    .venv/bin/python tools/api_docs.py --check    # exit 1 if docs/api/ is out of date

`tests/test_api_docs.py` runs the check.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PACKAGES = {
    "model_zoo": "What is trained: architectures (`ArchSpec` and the family registry), datasets "
    "and federated partitions. Imports neither of the other packages.",
    "edge_sdk": "What runs on a device: the algorithms' device halves, the trainer and losses, "
    "the wire protocol and transports, `EdgeClient`, ONNX export, quantization and inference, "
    "logging helpers. Never imports `coordinator`.",
    "coordinator": "What runs on a server: the round loop and the strategies (the algorithms' "
    "server halves), the run config, the simulator, deployment entry points, plugins, results, "
    "metrics, reports and the `edgefl` command line.",
}
OUT = ROOT / "docs" / "api"
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _first_paragraph(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _signature(obj: Any) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    return _ADDRESS.sub("", sig)


def _modules(package: str) -> list[ModuleType]:
    root = importlib.import_module(package)
    found = [root]
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        found.append(importlib.import_module(info.name))
    return sorted((m for m in found if getattr(m, "__all__", None)), key=lambda m: m.__name__)


def _entry(name: str, obj: Any, module: ModuleType) -> list[str]:
    defined_here = getattr(obj, "__module__", module.__name__) == module.__name__
    if inspect.isclass(obj):
        lines = [f"- **class `{name}{_signature(obj)}`**"]
        if not defined_here:
            return [f"- `{name}`: from `{obj.__module__}`"]
        text = _first_paragraph(obj)
        if text and obj.__doc__ and not text.startswith(f"{obj.__name__}("):  # not dataclass's
            lines[0] += f": {text}"
        for attr, member in vars(obj).items():
            if attr.startswith("_") or not callable(getattr(obj, attr, None)):
                continue
            fn = member.__func__ if isinstance(member, classmethod | staticmethod) else member
            if not inspect.isfunction(fn):
                continue
            line = f"  - `{attr}{_signature(fn)}`"
            if text := _first_paragraph(fn):
                line += f": {text}"
            lines.append(line)
        return lines
    if callable(obj):
        if not defined_here:
            return [f"- `{name}`: from `{obj.__module__}`"]
        line = f"- `{name}{_signature(obj)}`"
        if text := _first_paragraph(obj):
            line += f": {text}"
        return [line]
    return [f"- `{name}`: a constant ({type(obj).__name__})"]


def render(package: str) -> str:
    lines = [
        f"# `{package}` API",
        "",
        PACKAGES[package],
        "",
        "Generated from the code by `tools/api_docs.py`; every name below is in its module's "
        "`__all__`. Signatures are as written in the source (`from __future__ import "
        "annotations`).",
    ]
    for module in _modules(package):
        lines += ["", f"## `{module.__name__}`", ""]
        if text := _first_paragraph(module):
            lines += [text, ""]
        for name in module.__all__:
            lines += _entry(name, getattr(module, name), module)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if docs/api/ is out of date")
    args = ap.parse_args(argv)
    stale = []
    for package in PACKAGES:
        path = OUT / f"{package}.md"
        text = render(package)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run .venv/bin/python tools/api_docs.py")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
