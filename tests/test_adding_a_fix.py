"""Every fix has what docs/adding-a-fix.md lists, six files: a record, a module with a short docstring and a check,
a policy in a target's replacement, its test file ``tests/fixes/test_<id>.py`` (the tests mirror the package:
tests/fixes/ holds one file per fix and nothing else) declaring ``CARRIES`` and ``CORRECTION`` (collected by
tests/expected_fixes.py), its section in docs/fixes.md, and a CHANGELOG line (not checked). A row in tests/README.md's
index is optional; one that is there lists the fix's own file first and only files and tests that exist. No torch
needed for the table; the modules are read as text."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import expected_fixes
import pytest
from expected_fixes import CARRIES, CORRECTIONS

from diffusers_cudnn_fix.fixes import ALL_FIXES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "diffusers_cudnn_fix"
IDS = [fix.id for fix in ALL_FIXES]
FIX_TESTS = ROOT / "tests" / "fixes"


def _policies() -> dict[str, set[str]]:
    """Target module -> the fix ids it names, as its policy steps do (``if <id>.FIX_ID in broken``: the fix's
    module by name); read from the source: no torch."""
    return {
        path.stem: set(re.findall(r"\b([a-z0-9_]+)\.FIX_ID\b", path.read_text()))
        for path in (PACKAGE / "targets").glob("*.py")
    }


def test_the_table_and_the_test_table_name_the_same_fixes() -> None:
    assert sorted(IDS) == sorted(CARRIES)


@pytest.mark.parametrize("fix", ALL_FIXES, ids=IDS)
def test_each_fix_has_what_adding_a_fix_lists(fix) -> None:
    module = PACKAGE / "fixes" / f"{fix.id}.py"
    assert module.exists(), f"no module fixes/{fix.id}.py"
    tree = ast.parse(module.read_text())
    doc = ast.get_docstring(tree) or ""
    assert 0 < len(doc.splitlines()) <= 8, f"fixes/{fix.id}.py: the docstring is {len(doc.splitlines())} lines"
    assert any(isinstance(n, ast.FunctionDef) and n.name == "check" for n in tree.body), f"{fix.id}: no check()"
    assert any(fix.id in ids for ids in _policies().values()), f"{fix.id}: no target module takes its policy"
    docs = (ROOT / "docs" / "fixes.md").read_text()
    assert f"## `{fix.id}`" in docs, f"docs/fixes.md has no section for {fix.id}"
    tests = [p for p in (ROOT / "tests").rglob("test_*.py") if p.name not in ("test_adding_a_fix.py",)]
    assert any(fix.id in p.read_text() for p in tests), f"no test file names {fix.id}"


@pytest.mark.parametrize("fix", IDS)
def test_each_fix_has_its_test_file(fix: str) -> None:
    """``tests/fixes/test_<id>.py``: the fix's check, its policy and the control that fails without it."""
    path = FIX_TESTS / f"test_{fix}.py"
    assert path.is_file(), f"no {path.relative_to(ROOT)}: a fix's tests go there (docs/adding-a-fix.md)"
    assert fix in path.read_text(), f"{path.relative_to(ROOT)} never names {fix}"


@pytest.mark.parametrize("fix", ALL_FIXES, ids=IDS)
def test_each_fix_test_file_declares_the_releases_and_the_kind(fix) -> None:
    """``CARRIES`` (the releases carrying the bug) and ``CORRECTION`` at the top of its test file, as
    tests/expected_fixes.py reads them (a file without them fails that module's import, naming the file); the
    kind agrees with the record's (the releases: tests/test_release_table.py)."""
    facts = expected_fixes.declarations(FIX_TESTS / f"test_{fix.id}.py")
    assert facts["CARRIES"] == CARRIES[fix.id]
    assert facts["CORRECTION"] is (fix.id in CORRECTIONS)
    assert facts["CORRECTION"] is (fix.kind == "correction"), f"{fix.id}: CORRECTION says otherwise than its record"


def test_the_fix_tests_folder_holds_one_file_per_fix_and_no_other() -> None:
    """tests/fixes/ is the index of the fixes' tests: a file there that is not a fix's is a test of something else
    (tests spanning several fixes stay in tests/)."""
    files = {p.name for p in FIX_TESTS.glob("*.py") if p.name != "conftest.py"}
    expected = {f"test_{fix}.py" for fix in IDS}
    assert files <= expected, f"tests/fixes/ holds files for no fix id: {sorted(files - expected)}"
    assert expected == files, f"fixes with no file in tests/fixes/: {sorted(expected - files)}"


def _tests_index() -> dict[str, list[str]]:
    """tests/README.md's table "The tests of each fix": fix id -> the test files (``path`` or ``path::test``)."""
    text = (ROOT / "tests" / "README.md").read_text()
    table = text.partition("## The tests of each fix")[2]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \|(.*)\|\s*$", table, flags=re.MULTILINE)
    return {fix: re.findall(r"`(tests/[^`]+)`", cells) for fix, cells in rows}


def test_the_tests_index_names_only_fixes() -> None:
    """A fix's row is optional (the folder tests/fixes/ is the index); a row for no fix id is a mistake."""
    others = sorted(set(_tests_index()) - set(IDS))
    assert not others, f"tests/README.md, 'The tests of each fix': rows for no fix id: {others}"


@pytest.mark.parametrize("fix", IDS)
def test_a_fix_row_in_the_index_lists_its_own_file_first_and_only_what_exists(fix: str) -> None:
    """Where tests/README.md has a row for ``fix``: its own file first, and every file and test it lists exists."""
    listed = _tests_index().get(fix)
    if listed is None:
        return  # no row: the fix's own file is its index entry
    assert listed, f"tests/README.md's row for {fix} lists no test file"
    assert listed[0] == f"tests/fixes/test_{fix}.py", f"{fix}: its own file first in tests/README.md's row"
    for entry in listed:
        path, _, name = entry.partition("::")
        assert (ROOT / path).is_file(), f"{fix}: {path} does not exist"
        if name:
            tree = ast.parse((ROOT / path).read_text())
            tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            assert name in tests, f"{fix}: {path} has no test {name}"
