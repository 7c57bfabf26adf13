"""The README and the docs say nothing that drifts unnoticed.

* A count of tests, jobs or passed tests, or the length of CI ("36 jobs", "the same 75 tests", "the 8-minute
  CI"), is a measurement of one tree: the paragraph (or table row) that gives it names that run, by commit, by
  date or by the results file it comes from. Otherwise it goes stale the day a test is added.
* The README stays a page a newcomer reads top to bottom (at most 200 lines), and names no release file by a
  number that goes stale (main carries a development version; its commands use globs).
* Every `benchmarks/results/...` path the docs cite exists (an anchor into `RESULTS.md` names one of its headings);
  `benchmarks/results/RESULTS.md` names only files that exist, and every file in that folder is named by it (one
  index of the measurements, and no raw file that no figure needs).
"""

from __future__ import annotations

import re
from pathlib import Path

from releases import ROOT

#: "75 tests", "36 jobs", "483 passed", "8-minute CI" (not "0.38.0 tests": a version is no count).
COUNT = re.compile(r"(?<![\d.])\d+[ -](?:tests?|jobs?|passed|minutes? CI|minute CI)\b", re.I)
#: What names the run a count was measured on: a commit, a date, a committed results file.
RUN = re.compile(r"\b[0-9a-f]{7,40}\b|\b20\d\d-\d\d-\d\d\b|(?:benchmarks/)?results/")
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "tests" / "README.md",
    ROOT / "benchmarks" / "results" / "RESULTS.md",
]
RESULTS = ROOT / "benchmarks" / "results"
#: Where the docs cite results: the README, the changelog, docs/, the tests' README, the upstream reports.
CITING = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "tests" / "README.md",
    *sorted((ROOT / "upstream").glob("*/*.md")),
    RESULTS / "RESULTS.md",
]
#: A cited results path, to the first space, backtick, bracket or quote; "<release>" in it stands for any name.
CITED = re.compile(r"benchmarks/results/[^\s`)\]'\"]*")
#: A path RESULTS.md names in backticks (relative to its folder, or to the repository): a file with an extension
#: of the results' kinds, or a folder ("compile/"); commands (with spaces) and `$OUT/...` are not paths here.
NAMED = re.compile(r"`([\w.*<>/-]+(?:\.(?:log|json|txt|md|err)|/))`")


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


def test_the_readme_is_short_and_names_no_release_file_by_number() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200, len(text.splitlines())
    named = set(re.findall(r"diffusers_cudnn_fix-(\d[^\s`/]*?)(?:-py3-none-any\.whl|\.tar\.gz)", text))
    assert not named, named


def test_the_count_rule_catches_what_it_is_for() -> None:
    flagged = [p for p in ("The module runs 36 jobs.", "the same 75 tests", "for the 8-minute CI") if COUNT.search(p)]
    assert len(flagged) == 3
    assert not COUNT.search("the 0.37.0 and 0.38.0 tests fail")
    assert RUN.search("measured at 9d4e27e") and RUN.search("(`benchmarks/results/ci-clean-clone.txt`)")


def _matches(pattern: str, base: Path) -> list[Path]:
    """The files or folders a cited path names under `base`: '<release>' and '*' match any name."""
    return sorted(base.glob(re.sub(r"<[^>]*>", "*", pattern.rstrip("/")))) if pattern.rstrip("/") else [base]


def _headings(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    return {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in text.splitlines()
        if line.startswith("#")
    }


def test_every_cited_result_exists() -> None:
    anchors = _headings((RESULTS / "RESULTS.md").read_text())
    missing = []
    for path in CITING:
        for cited in CITED.findall(path.read_text()):
            target, _, anchor = cited.rstrip(".,:;").partition("#")
            if not _matches(target.removeprefix("benchmarks/results/"), RESULTS):
                missing.append(f"{path.relative_to(ROOT)}: {cited}")
            elif anchor and (target != "benchmarks/results/RESULTS.md" or anchor not in anchors):
                missing.append(f"{path.relative_to(ROOT)}: {cited} (no such heading)")
    assert not missing, "cited results that are not there:\n" + "\n".join(missing)


def test_results_md_names_exactly_the_files_kept() -> None:
    named = NAMED.findall((RESULTS / "RESULTS.md").read_text())
    absent = [n for n in named if not (_matches(n, RESULTS) or _matches(n, ROOT))]
    assert not absent, f"RESULTS.md names paths that do not exist: {absent}"
    covered = {p for n in named for p in _matches(n, RESULTS) if p.is_file()}
    files = {p for p in RESULTS.rglob("*") if p.is_file() and p.name != "RESULTS.md"}
    unnamed = sorted(str(p.relative_to(RESULTS)) for p in files - covered)
    assert not unnamed, f"files in benchmarks/results/ that RESULTS.md does not name (name or git rm them): {unnamed}"


def test_the_citation_checks_catch_what_they_are_for() -> None:
    assert CITED.findall("(`benchmarks/results/gone.log`, x)") == ["benchmarks/results/gone.log"]
    assert not _matches("gone.log", RESULTS) and _matches("ring-gpu/ring-<release>.json", RESULTS)
    assert "ci-time" in _headings("## CI time\n") and "dead-rows" in _headings("## Dead rows")
    assert NAMED.findall("`compile/` and `a/b.log` not `python x.py --out $OUT/b.json`") == ["compile/", "a/b.log"]
