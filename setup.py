"""One build step pyproject.toml cannot say: the docs pages and the upstream reports go inside the built package.

``diffusers-cudnn-fix explain`` prints them from ``diffusers_cudnn_fix/_docs/`` of an installed wheel. Git keeps one
copy, ``docs/`` and ``upstream/`` at the top of the source tree (the sdist carries both: MANIFEST.in); this copies
them into the package as it is built, so a wheel built from the checkout or from the sdist has them. A tree without
them builds no wheel: its messages would name topics it cannot print. Everything else is in pyproject.toml.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.errors import FileError

HERE = Path(__file__).resolve().parent
#: What ships, relative to the source tree: the pages, and per fix its ISSUE.md, fix.patch, reproducer and test.
SHIPPED = ("docs/*.md", "upstream/README.md", "upstream/*/ISSUE.md", "upstream/*/fix.patch", "upstream/*/*.py")


class BuildPyWithDocs(build_py):
    """``build_py``, then the files of :data:`SHIPPED` under ``diffusers_cudnn_fix/_docs/`` (same layout)."""

    def run(self) -> None:
        super().run()
        found = sorted({path for pattern in SHIPPED for path in HERE.glob(pattern) if path.is_file()})
        for needed in ("docs/fixes.md", "upstream/README.md"):
            if HERE / needed not in found:
                raise FileError(f"{needed} is missing from {HERE}: build from a checkout or the sdist")
        target = Path(self.build_lib, "diffusers_cudnn_fix", "_docs")
        for path in found:
            destination = target / path.relative_to(HERE)
            self.mkpath(str(destination.parent))
            self.copy_file(str(path), str(destination), preserve_times=False)


setup(cmdclass={"build_py": BuildPyWithDocs})
