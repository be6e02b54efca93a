"""tools/mutation_score.py: the score of a mutmut run against the listed equivalent mutants, for
every mutant or for those some name patterns match (`make mutation MUTANTS=...`)."""

from __future__ import annotations

from tests_helpers import load_tool

scorer = load_tool("mutation_score")

# A run of mutmut over two modules: the guard's mutants all killed or listed, the other
# module's with a survivor nobody listed and a listed one that is now killed
STATUS = {
    "pkg.guard.x_better__mutmut_1": "killed",
    "pkg.guard.x_better__mutmut_2": "survived",
    "pkg.guard.x_decide__mutmut_1": "timeout",
    "pkg.other.x_f__mutmut_1": "survived",
    "pkg.other.x_f__mutmut_2": "killed",
    "pkg.other.x_f__mutmut_3": "not checked",
}
LISTED = {"pkg.guard.x_better__mutmut_2", "pkg.other.x_f__mutmut_2"}


def test_every_mutant_is_scored_and_each_survivor_or_stale_listing_is_named():
    lines, code = scorer.report(STATUS, LISTED)
    # 3 detected (killed, timeout) of 6 less the 1 listed survivor
    assert "score: 3/5 = 60.0% killed (goal 90%)" in lines
    assert "NEEDS A TEST: pkg.other.x_f__mutmut_1 (survived)" in lines
    assert "NEEDS A TEST: pkg.other.x_f__mutmut_3 (not checked)" in lines
    assert any(line.endswith("(update the list): pkg.other.x_f__mutmut_2") for line in lines)
    assert code == 1


def test_patterns_score_the_mutants_they_match_among_themselves():
    lines, code = scorer.report(STATUS, LISTED, ["pkg.guard.*"])
    # 2 detected of the guard's 3, less its listed survivor; the other module's survivors,
    # unchecked mutant and stale listing are not this run's
    assert lines[:3] == [
        "mutants: 3  killed: 1  survived: 1  timeout: 1",
        "equivalent (listed): 1",
        "score: 2/2 = 100.0% killed (goal 90%)",
    ]
    assert not any("pkg.other" in line for line in lines)
    assert code == 0
    # and a pattern per function, as mutmut's run takes them
    assert scorer.report(STATUS, LISTED, ["pkg.other.x_f__mutmut_1"])[1] == 1
