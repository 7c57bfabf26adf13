"""CI leaves the user's training environment alone: ``bash .ci/run env`` (the part of ``.ci/run`` that makes CI's
environment) installs into ``.cache/ci-venv``, and the checkout's ``.venv``, where the README's set-up puts the torch
and diffusers the user trains with, is the same before and after (``pip freeze`` and every file in it).

Cheap and offline: it runs in a copy holding ``.ci/run`` and a tiny project of the same shape (a ``test`` extra),
whose build backend is a file of its own (no download); pip installs itself from the wheel Python bundles."""

from __future__ import annotations

import ensurepip
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from releases import ROOT

#: A PEP 517 / PEP 660 backend in one file: the project's wheel, and its editable wheel (a ``.pth`` file).
BACKEND = """
import os, zipfile

NAME, VERSION = "ci_env_probe", "0"
INFO = f"{NAME}-{VERSION}.dist-info"


def _wheel(directory, files):
    metadata = f"Metadata-Version: 2.1\\nName: ci-env-probe\\nVersion: {VERSION}\\nProvides-Extra: test\\n"
    files = {
        **files,
        f"{INFO}/METADATA": metadata,
        f"{INFO}/WHEEL": "Wheel-Version: 1.0\\nGenerator: test\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n",
    }
    name = f"{NAME}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(directory, name), "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
        zf.writestr(f"{INFO}/RECORD", "".join(f"{path},,\\n" for path in [*files, f"{INFO}/RECORD"]))
    return name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel(wheel_directory, {})


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel(wheel_directory, {f"{NAME}.pth": os.getcwd() + "\\n"})
"""
PYPROJECT = """[build-system]
requires = []
build-backend = "backend"
backend-path = ["."]

[project]
name = "ci-env-probe"
version = "0"

[project.optional-dependencies]
test = []
"""


def _python3() -> str:
    """The interpreter the test runs on, outside any virtual environment."""
    return str(getattr(sys, "_base_executable", sys.executable))


def _freeze(python3: str, venv: Path, env: dict[str, str]) -> list[str]:
    proc = subprocess.run(
        [python3, "-m", "pip", "--python", str(venv / "bin" / "python"), "freeze", "--all"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def _files(folder: Path) -> dict[str, str]:
    """Every file and link under ``folder``: its content's sha256, or the link's target."""
    found = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            found[key] = "-> " + os.readlink(path)
        elif path.is_file():
            found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def test_ci_env_leaves_the_checkouts_venv_alone(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    (repo / "pyproject.toml").write_text(PYPROJECT)
    (repo / "backend.py").write_text(BACKEND)
    # `python3` for the script: this interpreter, first on a PATH that holds nothing else of this machine's.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = _python3()
    (bin_dir / "python3").symlink_to(python3)
    bundled = Path(ensurepip.__file__).parent / "_bundled"  # pip's own wheel, which the script installs
    env = {
        "PATH": os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"]),
        "HOME": str(tmp_path / "home"),
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(bundled),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    # The user's training environment: a venv in the checkout with a distribution installed in it.
    venv = repo / ".venv"
    subprocess.run([python3, "-m", "venv", "--without-pip", str(venv)], check=True, env=env, timeout=120)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    info = site / "users_training_stack-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: users-training-stack\nVersion: 1.0\n")
    (info / "RECORD").write_text("")
    before, files_before = _freeze(python3, venv, env), _files(venv)
    assert "users-training-stack==1.0" in before, before

    proc = subprocess.run(
        ["bash", str(repo / ".ci" / "run"), "env"], capture_output=True, text=True, env=env, cwd=repo, timeout=300
    )

    assert _freeze(python3, venv, env) == before, "bash .ci/run env changed the packages of the checkout's .venv"
    assert _files(venv) == files_before, "bash .ci/run env changed files in the checkout's .venv"
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    ci_venv = repo / ".cache" / "ci-venv"
    installed = _freeze(python3, ci_venv, env)
    assert f"-e {repo}" in installed, installed  # the checkout, editable, with its test extra
    assert any(line.startswith("pip==") for line in installed), installed
