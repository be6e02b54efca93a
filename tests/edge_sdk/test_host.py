"""What a benchmark records of its host: the CPU's name, read without loading torch."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

from edge_sdk.host import cpu_name


def test_the_cpu_is_named_by_its_model_and_by_platform_where_proc_cpuinfo_is_missing(
    tmp_path, monkeypatch
):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: Acme\nmodel name\t: Acme Z9 8-Core  \n")

    def at(path):  # /proc/cpuinfo, here or missing
        return info if path == "/proc/cpuinfo" else Path(path)

    monkeypatch.setattr("edge_sdk.host.Path", at)
    assert cpu_name() == "Acme Z9 8-Core"
    info.unlink()
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    assert cpu_name() == "riscv64"


def test_naming_the_cpu_loads_no_torch():
    # A benchmark of start-up (benchmarks/cli_startup.py) records its machine without torch.
    probe = "import json, sys; from edge_sdk.host import cpu_name; cpu_name(); "
    probe += "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
