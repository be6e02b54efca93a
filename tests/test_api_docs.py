"""docs/api/ documents the code as it is: regenerated, it does not change."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_api_pages_match_the_code():
    res = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "api_docs.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
