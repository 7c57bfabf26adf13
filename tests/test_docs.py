"""The README and the docs say nothing that drifts unnoticed.

* A count of tests, jobs or passed tests, or the length of CI ("36 jobs", "the same 75 tests", "the 8-minute
  CI"), is a measurement of one tree: the paragraph (or table row) that gives it names that run, by commit, by
  date or by the results file it comes from. Otherwise it goes stale the day a test is added.
* The README stays a page a newcomer reads top to bottom (at most 200 lines), and the release files it names
  are this version's.
"""

from __future__ import annotations

import re

from releases import ROOT

from diffusers_cudnn_fix import __version__

#: "75 tests", "36 jobs", "483 passed", "8-minute CI" (not "0.38.0 tests": a version is no count).
COUNT = re.compile(r"(?<![\d.])\d+[ -](?:tests?|jobs?|passed|minutes? CI|minute CI)\b", re.I)
#: What names the run a count was measured on: a commit, a date, a committed results file.
RUN = re.compile(r"\b[0-9a-f]{7,40}\b|\b20\d\d-\d\d-\d\d\b|(?:benchmarks/)?results/")
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "tests" / "README.md",
    ROOT / "benchmarks" / "results" / "README.md",
]


def _passages(text: str) -> list[str]:
    """Paragraphs, and each row of a table on its own (a table's rows are separate records)."""
    out = []
    for paragraph in re.split(r"\n\s*\n", text):
        rows = paragraph.splitlines()
        out += rows if rows and rows[0].lstrip().startswith("|") else [paragraph]
    return out


def test_counts_of_tests_and_ci_times_name_the_run_they_were_measured_on() -> None:
    stale = []
    for path in DOCS:
        for passage in _passages(path.read_text()):
            for match in COUNT.finditer(passage):
                if not RUN.search(passage):
                    stale.append(f"{path.relative_to(ROOT)}: {match.group(0)!r} in: {' '.join(passage.split())[:200]}")
    assert not stale, "counts that drift, with no run named:\n" + "\n".join(stale)


def test_the_readme_is_short_and_names_this_versions_files() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200, len(text.splitlines())
    named = set(re.findall(r"diffusers_cudnn_fix-(\d+\.\d+\.\d+)", text))
    assert named == {__version__}, named


def test_the_count_rule_catches_what_it_is_for() -> None:
    flagged = [p for p in ("The module runs 36 jobs.", "the same 75 tests", "for the 8-minute CI") if COUNT.search(p)]
    assert len(flagged) == 3
    assert not COUNT.search("the 0.37.0 and 0.38.0 tests fail")
    assert RUN.search("measured at 9d4e27e") and RUN.search("(`benchmarks/results/ci-clean-clone.txt`)")
