"""``diffusers-cudnn-fix run -- COMMAND`` (``diffusers_cudnn_fix/_launcher.py``): the package active in every
Python process COMMAND starts, without the script importing it.

* A two-process ``torchrun`` (gloo, CPU stand-in kernels, diffusers 0.39.0) of the tiny Flux Ulysses training
  step of ``subprocess_cp_training``, from a script that never imports the package
  (``torchrun_train_script.py``): started through the launcher, the summed gradients are within the CP
  tests' tolerance of the one-process fp32 reference; started without it, the same run is not (on the
  stand-ins the unpatched backward finds no log-sum-exp and raises; on a GPU it reads an undefined one).
* Cheap cases, each one launcher process: the exit status, a signal and the process itself pass through
  (``exec``: the command keeps the launcher's process id); the command's environment differs from the
  caller's only by the launcher's folder first on ``PYTHONPATH`` (the caller's entries after it); the
  user's own ``sitecustomize`` still runs and is the one ``import sitecustomize`` gives; the launcher's
  folder is not left on ``sys.path``; the package's import rules hold (no torch, one thread); an
  interpreter without the package runs on with one line on stderr; a missing command, a command that
  cannot be run and a usage error get their own exit statuses.
* Packaging: the release command (``.ci/release``) builds the sdist and its wheel, passes ``twine check
  --strict`` and builds the same bytes twice; the sdist carries every path the README names; the wheel
  ships the start-up hook, the licence, ``py.typed`` and its metadata, and installs from a direct reference.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest
from releases import ROOT, TESTS, release_dir
from test_cp_training import TOLERANCE

from diffusers_cudnn_fix import _launcher

SCRIPT = Path(sys.executable).with_name("diffusers-cudnn-fix")  # the console script (pip install -e .)
MODULE = [sys.executable, "-m", "diffusers_cudnn_fix"]
ENTRY_POINTS = {
    "python -m diffusers_cudnn_fix": MODULE,
    "diffusers-cudnn-fix": [str(SCRIPT)],
}
EXIT_USAGE = 64

# The child reports what it saw before importing anything itself.
PROBE_CHILD = """
import sys
at_start = sorted(m for m in ("diffusers_cudnn_fix", "torch", "diffusers") if m in sys.modules)
import builtins, json, os, threading
user = sys.modules.get("sitecustomize")
print(json.dumps({
    "at_start": at_start,
    "pid": os.getpid(),
    "threads": threading.active_count(),
    "user_sitecustomize_ran": getattr(builtins, "_user_sitecustomize_ran", 0),
    "sitecustomize_file": getattr(user, "__file__", None),
    "bootstrap_on_sys_path": [p for p in sys.path if "site-bootstrap" in p],
    "environ": dict(os.environ),
}))
sys.exit(7)
"""


def _entry(name: str) -> list[str]:
    if name == "diffusers-cudnn-fix" and not SCRIPT.exists():
        pytest.skip(f"the console script is not installed next to {sys.executable} (pip install -e .)")
    return ENTRY_POINTS[name]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "DIFFUSERS_CUDNN_FIX"))}
    return {**env, **extra}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_status_process_environment_and_sitecustomize_pass_through(entry: str, tmp_path: Path) -> None:
    user_site = tmp_path / "user site"  # a space, to see the path survive as one entry
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text(
        "import builtins\nbuiltins._user_sitecustomize_ran = getattr(builtins, '_user_sitecustomize_ran', 0) + 1\n"
    )
    pythonpath = os.pathsep.join([str(user_site), str(ROOT)])
    env = _clean_env(PYTHONPATH=pythonpath, LAUNCHER_TEST_MARKER="kept")
    caller_before = dict(os.environ)
    proc = subprocess.Popen(
        [*_entry(entry), "run", "--", sys.executable, "-c", PROBE_CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(tmp_path),
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7, (proc.returncode, out, err)
    child = json.loads(out.splitlines()[-1])
    assert child["pid"] == proc.pid  # exec: the launcher became the command
    assert child["at_start"] == ["diffusers_cudnn_fix"], child["at_start"]  # active, and nothing heavy loaded
    assert child["threads"] == 1
    # The user's sitecustomize ran once, and it is the module `import sitecustomize` gives the program.
    assert child["user_sitecustomize_ran"] == 1
    assert Path(child["sitecustomize_file"]).resolve() == (user_site / "sitecustomize.py").resolve()
    assert child["bootstrap_on_sys_path"] == []
    # Only PYTHONPATH differs: our folder first, the caller's entries after it, in their order.
    seen = child["environ"]
    assert seen.pop("PYTHONPATH") == os.pathsep.join([str(_launcher.BOOTSTRAP_DIR), pythonpath])
    assert seen == {k: v for k, v in env.items() if k != "PYTHONPATH"}
    assert dict(os.environ) == caller_before
    assert err == "", err


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_signal_passes_through(entry: str) -> None:
    child = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    proc = subprocess.run(
        [*_entry(entry), "run", "--", sys.executable, "-c", child],
        capture_output=True,
        text=True,
        env=_clean_env(PYTHONPATH=str(ROOT)),
        timeout=60,
    )
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr)


def test_an_interpreter_without_the_package_runs_on(tmp_path: Path) -> None:
    """The command's Python is another interpreter, where the package is not installed: one line on stderr
    saying so and naming that interpreter, and the command runs as it would have."""
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False, system_site_packages=False)
    python = bare / "bin" / "python"
    child = "import sys; print('ran', 'diffusers_cudnn_fix' in sys.modules); sys.exit(3)"
    # The launcher itself finds the package through its working directory; the command does not.
    proc = subprocess.run(
        [*MODULE, "run", "--", str(python), "-c", child],
        capture_output=True,
        text=True,
        env=_clean_env(),
        cwd=str(ROOT),
        timeout=60,
    )
    assert proc.returncode == 3, (proc.returncode, proc.stderr)
    assert proc.stdout.strip() == "ran False", proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "not active" in lines[0] and str(python) in lines[0] and "diffusers_cudnn_fix" in lines[0], lines[0]


def test_commands_that_cannot_run_and_usage_errors(tmp_path: Path) -> None:
    not_executable = tmp_path / "train.sh"
    not_executable.write_text("#!/bin/sh\necho never\n")
    not_executable.chmod(0o644)
    cases = {
        "missing": (["run", "--", "no-such-command-here", "--flag"], _launcher.EXIT_NOT_FOUND, "no-such-command-here"),
        "not executable": (["run", "--", str(not_executable)], _launcher.EXIT_NOT_EXECUTABLE, str(not_executable)),
        "no command": (["run", "--"], EXIT_USAGE, "COMMAND"),
        "unknown run switch": (["run", "--bogus", "python"], EXIT_USAGE, "--bogus"),
    }
    codes = {_launcher.EXIT_NOT_FOUND, _launcher.EXIT_NOT_EXECUTABLE, EXIT_USAGE}
    assert len(codes) == 3 and not codes & {0, 1, 2, 3}  # apart from each other and from the doctor's
    for name, (args, code, named) in cases.items():
        proc = subprocess.run(
            [*MODULE, *args], capture_output=True, text=True, env=_clean_env(PYTHONPATH=str(ROOT)), timeout=60
        )
        assert proc.returncode == code, (name, proc.returncode, proc.stderr)
        assert named in proc.stderr, (name, proc.stderr)
        assert proc.stdout == "", (name, proc.stdout)


def test_child_environment_leaves_the_callers_mapping_alone() -> None:
    parent = {"PYTHONPATH": os.pathsep.join(["/a", "", "/b"]), "X": "1"}
    frozen = dict(parent)
    child = _launcher.child_environment(parent)
    assert parent == frozen
    assert child == {"PYTHONPATH": os.pathsep.join([str(_launcher.BOOTSTRAP_DIR), "/a", "/b"]), "X": "1"}
    # Launched from within a launched command: our folder is not added twice.
    assert _launcher.child_environment(child) == child
    assert _launcher.child_environment({})["PYTHONPATH"] == str(_launcher.BOOTSTRAP_DIR)


# ------------------------------------------------------------------------------------------------------------
# torchrun, two processes
# ------------------------------------------------------------------------------------------------------------
def _torchrun(tmp_path: Path, through_launcher: bool) -> list[dict]:
    out_dir = tmp_path / ("with" if through_launcher else "without")
    out_dir.mkdir()
    paths = [str(release_dir("0.39.0")), str(ROOT), str(TESTS)]
    env = _clean_env(PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command = [*torchrun, str(TESTS / "torchrun_train_script.py"), str(out_dir)]
    if through_launcher:
        command = [*MODULE, "run", "--", *command]
    # Its own process group, so that a run past the deadline takes its workers with it.
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(tmp_path),
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this test started, by its id
        stdout, stderr = proc.communicate()
        raise AssertionError(f"torchrun ran past 240 s:\n{stderr[-3000:]}") from None
    assert proc.returncode == 0, (proc.returncode, stdout[-3000:], stderr[-3000:])
    ranks = []
    for rank in range(2):
        path = out_dir / f"rank{rank}.json"
        assert path.exists(), stderr[-3000:]
        result = json.loads(path.read_text())
        assert "fatal" not in result, result.get("traceback", result.get("fatal"))
        assert result["world_size"] == 2 and result["diffusers_version"] == "0.39.0", result
        ranks.append(result)
    return ranks


@pytest.mark.slow
def test_torchrun_through_the_launcher_trains_right_and_without_it_does_not(tmp_path: Path) -> None:
    launched = _torchrun(tmp_path, through_launcher=True)
    for rank in launched:
        assert rank["package_at_start"] is True and rank["status_ok"] is True, rank
        assert "cudnn_forward_lse" in rank["applied"] and "cudnn_backward_kv" in rank["applied"], rank
        case = rank["case"]
        assert case["status"] == "ok", case
        calls = case["kernel_calls"][0]  # the step went through the (stand-in) cuDNN ops, both ways
        assert calls.get("_scaled_dot_product_cudnn_attention") == 2, calls
        assert calls.get("_scaled_dot_product_cudnn_attention_backward") == 2, calls
    assert launched[0]["case"]["compare_worst"] <= TOLERANCE, launched[0]["case"]
    assert launched[0]["case"]["loss"] == pytest.approx(launched[1]["case"]["loss"], rel=1e-6)

    plain = _torchrun(tmp_path, through_launcher=False)
    for rank in plain:
        assert rank["package_at_start"] is False and rank["package_at_end"] is False, rank
    cases = [rank["case"] for rank in plain]
    raised = all(case["status"] == "raised" for case in cases)
    wrong = cases[0]["status"] == "ok" and cases[0]["compare_worst"] > TOLERANCE
    assert raised or wrong, cases


# ------------------------------------------------------------------------------------------------------------
# Packaging
# ------------------------------------------------------------------------------------------------------------
#: Paths the README names in backticks (docs, tests, benchmarks and their results, CI's entry points).
README_PATH = re.compile(r"`((?:docs|tests|benchmarks|results|\.ci)/[^`*<> ]*[^`*<> /.])`")
IGNORE_IN_COPY = shutil.ignore_patterns(
    ".git", ".venv", ".cache", ".whl", "__pycache__", "build", "dist", "*.egg-info", ".pytest_cache", ".hypothesis"
)


def _pip(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr


def _have(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _release(src: Path, out: Path) -> dict[str, str]:
    """`bash .ci/release OUT` in the copy ``src``: the files it made and their sha256."""
    env = _clean_env(PYTHON=sys.executable, SOURCE_DATE_EPOCH="1796300000")  # the copy has no .git
    proc = subprocess.run(
        ["bash", str(src / ".ci" / "release"), str(out)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert proc.stdout.count("PASSED") == 2, proc.stdout  # twine check --strict, sdist and wheel
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}


def _build_without_build(src: Path, tmp_path: Path) -> tuple[Path, Path]:
    """What `python -m build --no-isolation` does, with setuptools and pip only: the sdist, then the wheel
    from the unpacked sdist."""
    sdist_dir, wheel_dir = tmp_path / "sdist", tmp_path / "dist"
    build_sdist = f"from setuptools import build_meta; print(build_meta.build_sdist({str(sdist_dir)!r}))"
    proc = subprocess.run([sys.executable, "-c", build_sdist], capture_output=True, text=True, cwd=src, timeout=180)
    assert proc.returncode == 0, proc.stderr
    sdist = sdist_dir / proc.stdout.split()[-1]
    with tarfile.open(sdist) as tf:
        tf.extractall(tmp_path / "from-sdist", filter="data")
    (unpacked,) = (tmp_path / "from-sdist").iterdir()
    _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheel_dir), str(unpacked))
    (wheel,) = wheel_dir.glob("*.whl")
    return sdist, wheel


def test_the_release_files_ship_what_the_readme_names_and_install_as_it_says(tmp_path: Path) -> None:
    """The release command (`bash .ci/release DIR`) builds the sdist and its wheel, passes `twine check
    --strict`, and builds the same bytes a second time. The sdist carries every path the README names; the
    wheel carries the start-up hook, the licence, py.typed and the metadata, and installs from the README's
    direct reference (`diffusers-cudnn-fix @ file:///...`), after which `--version` names it. Where `build`
    or `twine` is missing, the same files are built with setuptools and pip (no twine check, one build)."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} here; the build needs >= 77 (PEP 639 licence fields)")
    import diffusers_cudnn_fix

    version = diffusers_cudnn_fix.__version__
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE_IN_COPY)
    expected = [f"diffusers_cudnn_fix-{version}-py3-none-any.whl", f"diffusers_cudnn_fix-{version}.tar.gz"]
    if _have("build") and _have("twine"):
        first = _release(src, tmp_path / "a")
        assert sorted(first) == expected, first
        os.utime(src / "README.md")  # a file touched between the builds changes nothing
        assert _release(src, tmp_path / "b") == first  # reproducible
        sdist, wheel = (tmp_path / "a" / expected[1]), (tmp_path / "a" / expected[0])
    else:
        sdist, wheel = _build_without_build(src, tmp_path)
        assert [wheel.name, sdist.name] == expected

    with tarfile.open(sdist) as tf:
        in_sdist = {name.partition("/")[2] for name in tf.getnames()}
    named = sorted(set(README_PATH.findall((ROOT / "README.md").read_text())))
    assert "docs/behaviour.md" in named and any(n.startswith("benchmarks/results/") for n in named), named
    missing = [n for n in named if n not in in_sdist]
    assert not missing, f"the README names paths the sdist lacks: {missing}"

    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        hook = zf.read("diffusers_cudnn_fix/site-bootstrap/sitecustomize.py")
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        licence = zf.read(next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))).decode()
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert hook == (_launcher.BOOTSTRAP_DIR / "sitecustomize.py").read_bytes()
    assert [n for n in names if "site-bootstrap" in n] == ["diffusers_cudnn_fix/site-bootstrap/sitecustomize.py"]
    assert "diffusers_cudnn_fix/py.typed" in names
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence and "END OF TERMS" in licence
    assert "License-Expression: Apache-2.0" in metadata
    assert f"\nVersion: {version}\n" in metadata
    assert "Classifier: Development Status :: " in metadata and "Classifier: Typing :: Typed" in metadata
    for py in ("3.10", "3.11", "3.12", "3.13"):
        assert f"Classifier: Programming Language :: Python :: {py}" in metadata
    assert "Description-Content-Type: text/markdown" in metadata
    assert "diffusers-cudnn-fix = diffusers_cudnn_fix.__main__:main" in entry_points

    # Installed as the README says: a direct reference in a requirements file.
    target = tmp_path / "site"
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"diffusers-cudnn-fix @ {wheel.resolve().as_uri()}\n")
    _pip("install", "-q", "--no-deps", "--no-index", "--target", str(target), "-r", str(requirements))
    env = _clean_env(PYTHONPATH=str(target))
    code = "import diffusers_cudnn_fix as d, sys; print(d.__file__); sys.argv = ['x', '--version']; " + (
        "from diffusers_cudnn_fix.__main__ import main; main()"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    where, said = proc.stdout.splitlines()
    assert Path(where).is_relative_to(target), where
    assert said == f"diffusers-cudnn-fix {version}"


def test_pytest_runs_where_pytest_xdist_is_not_installed(tmp_path: Path) -> None:
    """The configured options (pyproject.toml's addopts) need no plugin: `python -m pytest` where xdist is
    absent (here: disabled) collects instead of stopping with "unrecognized arguments"."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "--co", "tests/test_structure.py"],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        env=_clean_env(),
        timeout=120,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
