"""Score of the last `mutmut run`, against the equivalent mutants listed in mutation-equivalent.txt.

    python tools/mutation_score.py            # after `mutmut run`; `make mutation` runs both
    python tools/mutation_score.py 'edge_sdk.algorithms.guard.*'   # those mutants alone

Prints killed / (all − equivalent) and every survivor that is not listed as equivalent; exits 1
when there is one (it needs a test) or when the score is below 90%. Given mutmut's name patterns
(`make mutation MUTANTS=...`), it scores the mutants they match among themselves, as
`mutmut run PATTERNS` ran them.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL = 0.90
DETECTED = {"killed", "timeout"}


def report(
    status: Mapping[str, str], equivalent: set[str], patterns: Sequence[str] = ()
) -> tuple[list[str], int]:
    """The lines to print and the exit code for mutmut's `status` (name: outcome) against the
    `equivalent` names listed, restricted to the names `patterns` match (fnmatch, as mutmut's
    `run` matches them; none: every mutant)."""
    if patterns:
        status = {n: s for n, s in status.items() if any(fnmatch(n, p) for p in patterns)}
        equivalent = {n for n in equivalent if any(fnmatch(n, p) for p in patterns)}
    counts = Counter(status.values())
    # A timeout is a mutant under which the tests ran past mutmut's limit (ten times the
    # baseline): mutmut counts it as killed, and so does this score. Whether a mutant that
    # makes a loop run far longer finishes failing or times out depends on the machine's speed.
    detected = {name for name, s in status.items() if s in DETECTED}
    not_killed = set(status) - detected
    unexplained = sorted(not_killed - equivalent)
    stale = sorted(equivalent - not_killed)
    denominator = len(status) - len(not_killed & equivalent)
    score = len(detected) / denominator if denominator else 0.0
    lines = [
        f"mutants: {len(status)}  " + "  ".join(f"{k}: {v}" for k, v in sorted(counts.items())),
        f"equivalent (listed): {len(not_killed & equivalent)}",
        f"score: {len(detected)}/{denominator} = {100 * score:.1f}% killed (goal {GOAL:.0%})",
    ]
    lines += [f"NEEDS A TEST: {name} ({status[name]})" for name in unexplained]
    lines += [
        f"listed as equivalent but killed or gone (update the list): {name}" for name in stale
    ]
    return lines, 1 if unexplained or score < GOAL else 0


def main(patterns: Sequence[str]) -> int:
    listed = ROOT / "mutation-equivalent.txt"
    equivalent = {
        line.split()[0]
        for line in listed.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    mutmut = Path(sys.executable).with_name("mutmut")
    out = subprocess.run(
        [str(mutmut), "results", "--all", "true"], capture_output=True, text=True, check=True
    ).stdout
    status = dict(line.strip().rsplit(": ", 1) for line in out.splitlines() if ": " in line)
    lines, code = report(status, equivalent, patterns)
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
