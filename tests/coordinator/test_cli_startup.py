"""`edgefl --help` and every command's `--help` start fast: they import neither torch nor paho.

The helps run in a fresh interpreter, as a user's shell runs them, one after the other; after
each, the test reads which modules that process has loaded. (How long they take is measured in
benchmarks/cli_startup.py, never asserted here.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = r"""
import json, sys
from coordinator.cli import app, command_paths

seen = {}
for args in command_paths():
    try:
        app([*args, "--help"], standalone_mode=True)
    except SystemExit as exc:
        assert exc.code in (0, None), (args, exc.code)
    seen[" ".join(args)] = sorted(
        m for m in sys.modules if m.split(".")[0] in ("torch", "paho", "onnxruntime")
    )
print(json.dumps(seen))
"""


def test_every_help_imports_neither_torch_nor_paho():
    # Execute: every command of the app, --help, in one fresh interpreter.
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])

    # Assert: every command was asked (the app's commands, found from the app itself), and
    # none of them loaded a heavy module.
    assert {"", "simulate", "client", "coordinator", "demo", "bench onnx"} <= set(seen)
    loaded = {cmd or "edgefl": mods[:3] for cmd, mods in seen.items() if mods}
    assert not loaded, f"--help imported heavy modules: {loaded}"
