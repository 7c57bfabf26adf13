"""``diffusers-cudnn-fix run -- COMMAND`` (``diffusers_cudnn_fix/_launcher.py``): the package active in every
Python process COMMAND starts, without the script importing it.

* A two-process ``torchrun`` (gloo, CPU stand-in kernels, diffusers 0.39.0) of the tiny Flux Ulysses training
  step of ``scenario_cp_training``, from a script that never imports the package
  (``scenario_launcher_train.py``): started through the launcher, the summed gradients are within the CP
  tests' tolerance of the one-process fp32 reference; started without it, the same run is not (on the
  stand-ins the unpatched backward finds no log-sum-exp and raises; on a GPU it reads an undefined one).
* Cheap cases, each one launcher process: the exit status, a signal and the process itself pass through
  (``exec``: the command keeps the launcher's process id); the command's environment differs from the
  caller's only by the launcher's folder first on ``PYTHONPATH`` (the caller's entries after it); the
  user's own ``sitecustomize`` still runs and is the one ``import sitecustomize`` gives; the launcher's
  folder is not left on ``sys.path``; the package's import rules hold (no torch, one thread); an
  interpreter without the package runs on with one line on stderr; a missing command, a command that
  cannot be run and a usage error get their own exit statuses.
* The wheel ships the start-up hook and the licence.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
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
    command = [*torchrun, str(TESTS / "scenario_launcher_train.py"), str(out_dir)]
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
def test_the_wheel_ships_the_start_up_hook_and_the_licence(tmp_path: Path) -> None:
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} here; the build needs >= 77 (PEP 639 licence fields)")
    src = tmp_path / "src"
    package = ROOT / "diffusers_cudnn_fix"
    shutil.copytree(package, src / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    proc = subprocess.run([*build, "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        hook = zf.read("diffusers_cudnn_fix/site-bootstrap/sitecustomize.py")
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        licence = zf.read(next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))).decode()
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert hook == (_launcher.BOOTSTRAP_DIR / "sitecustomize.py").read_bytes()
    assert [n for n in names if "site-bootstrap" in n] == ["diffusers_cudnn_fix/site-bootstrap/sitecustomize.py"]
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence and "END OF TERMS" in licence
    assert "License-Expression: Apache-2.0" in metadata
    for version in ("3.10", "3.11", "3.12", "3.13"):
        assert f"Classifier: Programming Language :: Python :: {version}" in metadata
    assert "diffusers-cudnn-fix = diffusers_cudnn_fix.__main__:main" in entry_points
