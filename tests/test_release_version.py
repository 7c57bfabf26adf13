"""A release is what it says: the version in the package, the CHANGELOG's top released section and the README agree,
and ``.ci/release`` refuses to build (exit 1, saying why) where the package's version is not the CHANGELOG's top
released section (files built then would carry other changes under that number)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from releases import ROOT

from diffusers_cudnn_fix import __version__

#: A released section of the CHANGELOG: ``## [0.3.0] - 2026-12-04`` (``## [Unreleased]`` is not one).
RELEASED = re.compile(r"^## \[(\d[^\]]*)\] - (\d{4}-\d{2}-\d{2})\s*$", re.M)


def test_the_version_is_the_changelogs_top_release_and_the_readmes() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    released = RELEASED.findall(changelog)
    assert released and released[0][0] == __version__, (released[:1], __version__)
    assert changelog.index("## [Unreleased]") < changelog.index(f"## [{__version__}]")
    dates = [date for _, date in released]
    assert dates == sorted(dates, reverse=True), dates  # newest first
    assert f"version **{__version__}**" in (ROOT / "README.md").read_text()


def _release_in(tmp_path: Path, version: str, changelog: str) -> subprocess.CompletedProcess:
    """`bash .ci/release` in a copy holding only the script, the package's ``__init__.py`` saying ``version`` and
    ``changelog``: the check comes before the build, so nothing else is needed to see the refusal."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "release", tmp_path / ".ci" / "release")
    (tmp_path / "diffusers_cudnn_fix").mkdir()
    (tmp_path / "diffusers_cudnn_fix" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (tmp_path / "CHANGELOG.md").write_text(changelog)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHON=sys.executable, SOURCE_DATE_EPOCH="1796300000")
    return subprocess.run(
        ["bash", str(tmp_path / ".ci" / "release"), str(tmp_path / "dist")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


CHANGELOG = """# Changelog

## [Unreleased]

## [0.3.0] - 2026-12-04

### Added
- something

## [0.2.0] - 2026-12-03
"""


def test_release_refuses_a_version_that_is_not_the_changelogs_top_release(tmp_path: Path) -> None:
    proc = _release_in(tmp_path, "0.2.0", CHANGELOG)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "refusing to build" in proc.stderr and "0.2.0" in proc.stderr and "0.3.0" in proc.stderr, proc.stderr
    assert "CHANGELOG.md" in proc.stderr, proc.stderr
    assert not (tmp_path / "dist").exists() or not any((tmp_path / "dist").iterdir())
    # No released section at all: refused too.
    other = tmp_path / "other"
    other.mkdir()
    proc = _release_in(other, "0.3.0", "# Changelog\n\n## [Unreleased]\n\n- a change\n")
    assert proc.returncode == 1 and "refusing to build" in proc.stderr and "missing" in proc.stderr, proc.stderr
