"""Real diffusers releases for the tests, each installed into its own folder, and fresh-subprocess runs.

Every release goes to ``.cache/diffusers/<version>`` with ``pip install --no-deps --target`` (their shared
dependencies come from the ``test`` extra), so one test session can run each release in its own
interpreter: ``run(version, script)`` starts ``python`` with that folder first on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
CACHE = ROOT / ".cache" / "diffusers"

#: Every release the package knows of, oldest first (0.35.2 predates the ops; 0.40.0+ ship them fixed).
RELEASES = ("0.35.2", "0.36.0", "0.37.0", "0.37.1", "0.38.0", "0.39.0", "0.40.0", "0.41.0", "0.42.0", "0.42.1")
#: Releases whose cuDNN context-parallel ops are broken as shipped.
BROKEN_CUDNN = ("0.36.0", "0.37.0", "0.37.1", "0.38.0", "0.39.0")
#: Releases whose native-flash context-parallel backward is broken as shipped.
BROKEN_FLASH = ("0.37.0", "0.37.1", "0.38.0", "0.39.0")


def release_dir(version: str) -> Path:
    """The folder holding diffusers ``version`` (installed on first use)."""
    target = CACHE / version
    if (target / "diffusers" / "__init__.py").exists():
        return target
    partial = CACHE / f".{version}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    # pip compiles the bytecode here, once: the suite starts hundreds of interpreters that import diffusers, and
    # where PYTHONDONTWRITEBYTECODE is set (as on the CI machines) each would otherwise compile it again.
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(partial)]
    wheels = os.environ.get("DIFFUSERS_WHEELS")  # a folder of wheels, for machines without an index
    if wheels:
        cmd += ["--no-index", "--find-links", wheels]
    subprocess.run([*cmd, f"diffusers=={version}"], check=True)
    partial.rename(target)
    return target


def relabelled_copy(source_version: str, label: str) -> Path:
    """A copy of release ``source_version`` whose version string says ``label`` (a mislabelled build)."""
    target = CACHE / f"relabelled-{source_version}-as-{label}"
    if (target / "diffusers" / "__init__.py").exists():
        return target
    partial = CACHE / f".relabelled-{source_version}-as-{label}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(release_dir(source_version), partial)
    init = partial / "diffusers" / "__init__.py"
    text = init.read_text()
    old = f'__version__ = "{source_version}"'
    assert old in text, f"cannot find {old!r} in {init}"
    init.write_text(text.replace(old, f'__version__ = "{label}"', 1))
    for info in partial.glob("diffusers-*.dist-info"):
        meta = info / "METADATA"
        meta.write_text(meta.read_text().replace(f"Version: {source_version}", f"Version: {label}", 1))
        info.rename(partial / f"diffusers-{label}.dist-info")
    partial.rename(target)
    return target


def run(
    site: Path | None,
    script: str,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> dict:
    """Run ``script`` in a fresh interpreter with ``site`` (a release folder) first on the path.

    The script prints one JSON object as its last line of stdout; that object is returned. A non-zero exit
    fails with the script's output.
    """
    paths = [str(site)] if site is not None else []
    paths += [str(ROOT), str(TESTS)]
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([*paths, full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full_env.setdefault("PYTHONWARNINGS", "default")
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=str(ROOT),
    )
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if not lines:
        raise AssertionError(f"subprocess printed nothing:\n{proc.stderr}")
    result = json.loads(lines[-1])
    result["_stderr"] = proc.stderr
    return result


if __name__ == "__main__":
    # python tests/releases.py [VERSION ...]: install the given releases (default: all) into the cache, four
    # pip processes at a time (each spends most of its time waiting on the download); any failure fails.
    with ThreadPoolExecutor(max_workers=4) as pool:
        for installed in pool.map(release_dir, sys.argv[1:] or RELEASES):
            print(installed)
