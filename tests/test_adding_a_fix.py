"""Every fix has what docs/adding-a-fix.md lists: a record, a module with a short docstring and a check, a policy
in a target's replacement, a line in the test-side table, its test file ``tests/fixes/test_<id>.py`` (the tests
mirror the package: tests/fixes/ holds one file per fix and nothing else), listed first in tests/README.md's index,
and its docs. No torch needed for the table; the modules are read as text."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from expected_fixes import CARRIES

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
    assert f"`{fix.id}`" in (ROOT / "docs" / "behaviour.md").read_text(), f"docs/behaviour.md misses {fix.id}"
    tests = [p for p in (ROOT / "tests").rglob("test_*.py") if p.name not in ("test_adding_a_fix.py",)]
    assert any(fix.id in p.read_text() for p in tests), f"no test file names {fix.id}"


@pytest.mark.parametrize("fix", IDS)
def test_each_fix_has_its_test_file(fix: str) -> None:
    """``tests/fixes/test_<id>.py``: the fix's check, its policy and the control that fails without it."""
    path = FIX_TESTS / f"test_{fix}.py"
    assert path.is_file(), f"no {path.relative_to(ROOT)}: a fix's tests go there (docs/adding-a-fix.md)"
    assert fix in path.read_text(), f"{path.relative_to(ROOT)} never names {fix}"


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


def test_the_tests_index_names_every_fix_and_no_other() -> None:
    assert sorted(_tests_index()) == sorted(IDS), "tests/README.md, 'The tests of each fix': one row per fix id"


@pytest.mark.parametrize("fix", IDS)
def test_each_fix_has_its_tests_in_the_index(fix: str) -> None:
    """tests/README.md lists at least one test file for ``fix``, and every file and test it lists exists."""
    listed = _tests_index().get(fix, [])
    assert listed, f"tests/README.md lists no test file for {fix}"
    assert listed[0] == f"tests/fixes/test_{fix}.py", f"{fix}: its own file first in tests/README.md's row"
    for entry in listed:
        path, _, name = entry.partition("::")
        assert (ROOT / path).is_file(), f"{fix}: {path} does not exist"
        if name:
            tree = ast.parse((ROOT / path).read_text())
            tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            assert name in tests, f"{fix}: {path} has no test {name}"
