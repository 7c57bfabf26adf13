"""A version says what the files carry. ``.ci/release`` holds the rules (exit 1, saying why and what to do, where
one is broken; ``--check``: the rules only):

* a release, ``X.Y.Z``, is the CHANGELOG's top released section, and only while ``[Unreleased]`` lists nothing
  (a change listed there is not in ``X.Y.Z``, and files built then would carry it under that number);
* between releases the package carries a development version, ``X.Y.Z.devN`` (PEP 440), after the top released
  section: it builds, and says it is a development build of what ``[Unreleased]`` lists.

This checkout obeys them, and the README names its version."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from releases import ROOT

from diffusers_cudnn_fix import __version__

#: A released section of the CHANGELOG: ``## [0.3.0] - 2026-12-04`` (``## [Unreleased]`` is not one).
RELEASED = re.compile(r"^## \[(\d[^\]]*)\] - (\d{4}-\d{2}-\d{2})\s*$", re.M)


def _run_release(where: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHON=sys.executable, SOURCE_DATE_EPOCH="1796300000")
    return subprocess.run(
        ["bash", str(where / ".ci" / "release"), *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_this_checkout_obeys_the_version_rules_and_the_readme_names_its_version() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    released = RELEASED.findall(changelog)
    dates = [date for _, date in released]
    assert dates == sorted(dates, reverse=True), dates  # newest first
    assert changelog.index("## [Unreleased]") < changelog.index(f"## [{released[0][0]}]")
    proc = _run_release(ROOT, "--check")
    assert proc.returncode == 0, proc.stderr
    assert not (ROOT / "--check").exists()  # the flag was read as a flag, not as an output folder
    # The README says which version it describes, and names no other one so.
    said = set(re.findall(r"version \*\*([^*]+)\*\*", (ROOT / "README.md").read_text()))
    assert said == {__version__}, said


def _release_in(tmp_path: Path, version: str, changelog: str, *args: str) -> subprocess.CompletedProcess:
    """`bash .ci/release` in a copy holding only the script, the package's ``__init__.py`` saying ``version`` and
    ``changelog``: the rules come before the build, so nothing else is needed to see a refusal."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "release", tmp_path / ".ci" / "release")
    (tmp_path / "diffusers_cudnn_fix").mkdir()
    (tmp_path / "diffusers_cudnn_fix" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (tmp_path / "CHANGELOG.md").write_text(changelog)
    return _run_release(tmp_path, *(args or (str(tmp_path / "dist"),)))


def _said(proc: subprocess.CompletedProcess) -> str:
    """What the script said on stderr, in one line (it folds its messages)."""
    return " ".join(proc.stderr.split())


def _nothing_built(tmp_path: Path) -> bool:
    return not (tmp_path / "dist").exists() or not any((tmp_path / "dist").iterdir())


CHANGELOG = """# Changelog

## [Unreleased]

## [0.3.0] - 2026-12-04

### Added
- something

## [0.2.0] - 2026-12-03
"""
#: The same with a change listed under [Unreleased]: not in 0.3.0.
PENDING = CHANGELOG.replace("## [Unreleased]\n", "## [Unreleased]\n\n### Fixed\n- a later change\n- another\n")


def test_release_refuses_a_version_that_is_not_the_changelogs_top_release(tmp_path: Path) -> None:
    proc = _release_in(tmp_path, "0.2.0", CHANGELOG)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    said = _said(proc)
    assert "refusing to build" in said and "0.2.0" in said and "0.3.0" in said and "CHANGELOG.md" in said, said
    assert _nothing_built(tmp_path)
    # No released section at all: refused too.
    other = tmp_path / "other"
    other.mkdir()
    proc = _release_in(other, "0.3.0", "# Changelog\n\n## [Unreleased]\n\n- a change\n")
    assert proc.returncode == 1 and "refusing to build" in _said(proc) and "missing" in _said(proc), proc.stderr


def test_release_refuses_a_release_while_unreleased_lists_changes(tmp_path: Path) -> None:
    """0.3.0 is the top release, but [Unreleased] lists two changes it does not have: refused, naming the count
    and the ways out (cut 0.4.0, build a development version, or build 0.3.0's own commit)."""
    proc = _release_in(tmp_path, "0.3.0", PENDING)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    said = _said(proc)
    assert "refusing to build 0.3.0" in said and "[Unreleased]" in said and "2 change(s)" in said, said
    assert "'## [0.4.0] - YYYY-MM-DD'" in said and "0.4.0.dev0" in said and "v0.3.0" in said, said
    assert _nothing_built(tmp_path)


def test_a_development_version_passes_and_says_what_it_is(tmp_path: Path) -> None:
    proc = _release_in(tmp_path, "0.4.0.dev2", PENDING, "--check")
    assert proc.returncode == 0, proc.stderr
    said = _said(proc)
    assert "development build 0.4.0.dev2" in said and "0.3.0" in said, said
    assert "2 change(s)" in said and "[Unreleased]" in said, said
    assert "not a git checkout" in said, said  # the copy has no commit to name
    assert _nothing_built(tmp_path)


@pytest.mark.parametrize(
    ("version", "said"),
    [
        ("0.3.0.dev0", "would sort before"),  # a development version of a release already made
        ("0.2.1.dev0", "would sort before"),
        ("0.4.0rc1", "X.Y.Z.devN"),  # not a form this project releases
        ("0.4.0-dev", "X.Y.Z.devN"),  # not PEP 440's normal form: the file names would not match
    ],
)
def test_release_refuses_a_version_out_of_order_or_form(tmp_path: Path, version: str, said: str) -> None:
    proc = _release_in(tmp_path, version, PENDING)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "refusing to build" in _said(proc) and said in _said(proc), proc.stderr
    assert _nothing_built(tmp_path)


#: What a checkout holds that is not the project's: left out of the copy that is built.
LOCAL = (".git", ".venv", ".cache", ".whl", "__pycache__", "build", "dist", "*.egg-info", ".pytest_cache", ".hypo*")


def test_a_development_version_builds(tmp_path: Path) -> None:
    """The whole build of a development version, in a copy of the checkout without git: the sdist and the wheel
    carry the version as written, under the names the script checks."""
    for module in ("build", "twine"):
        pytest.importorskip(module)
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} here; the build needs >= 77 (PEP 639 licence fields)")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*LOCAL))
    init = src / "diffusers_cudnn_fix" / "__init__.py"
    init.write_text(re.sub(r'(?m)^__version__ = ".*"$', '__version__ = "0.4.0.dev1"', init.read_text()))
    (src / "CHANGELOG.md").write_text(PENDING)
    proc = _run_release(src, str(tmp_path / "dist"))
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "development build 0.4.0.dev1" in _said(proc), proc.stderr
    built = sorted(p.name for p in (tmp_path / "dist").iterdir())
    assert built == ["diffusers_cudnn_fix-0.4.0.dev1-py3-none-any.whl", "diffusers_cudnn_fix-0.4.0.dev1.tar.gz"]
