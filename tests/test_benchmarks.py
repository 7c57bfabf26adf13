"""The GPU benchmarks still run: each one's set-up, dry-run on the CPU.

The GPU benchmarks (``benchmarks/``) run only in a GPU session, so a rename in the package or in the tests'
harness broke ``bench_gpu.py`` unseen (its op table could no longer be made) while the session's step exited 0.
Here each one runs on the CPU stand-in kernels (``tests/standin_kernels.py``): ``--dry-run`` builds and calls once,
untimed, what the benchmark times (``bench_gpu.py``, ``probe_first_call.py``, ``probe_dead_rows.py``,
``bench_mask_plan.py``),
``gpu_random_cases.py`` runs a few cases with ``--device cpu``, and ``trace_calls.py`` (a CPU benchmark) runs
whole. A benchmark whose section raises exits 1, and ``gpu_session.sh`` names only scripts and options that
exist."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from releases import ROOT, release_dir

BENCHMARKS = ROOT / "benchmarks"


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python benchmarks/ARGS...`` from the checkout, without the package's switches or a caller's paths."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "DIFFUSERS_CUDNN_FIX"))}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout, check=False
    )


@pytest.mark.parametrize(
    "args",
    [
        pytest.param((), id="0.39.0-every-section"),  # the `bench` step of `gpu_session.sh trust`
        pytest.param(("--sections", "keypad", "--release", "0.42.1"), id="0.42.1-keypad"),  # its `keypad` mode
    ],
)
def test_bench_gpu_builds_and_calls_what_it_times(args: tuple[str, ...]) -> None:
    release_dir("0.40.0")  # its op pair is read from source, beside the release imported
    proc = _run("benchmarks/bench_gpu.py", "--dry-run", *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sections = "probe_and_ops, mask, keypad" if not args else "keypad"
    assert f"dry run: sections {sections} built and called once each" in proc.stdout, proc.stdout[-2000:]


def test_a_failing_bench_gpu_section_fails_the_run() -> None:
    """0.35.2 has no cuDNN ops to time: the section raises, and the run says so and exits 1 (it used to print the
    traceback and exit 0, which the GPU session's step took for success)."""
    proc = _run("benchmarks/bench_gpu.py", "--dry-run", "--sections", "ops", "--release", "0.35.2")
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "section probe_and_ops failed" in proc.stderr and "AttributeError" in proc.stderr, proc.stderr[-2000:]
    assert "section(s) failed: probe_and_ops" in proc.stderr, proc.stderr[-2000:]


def test_probe_first_call_runs_each_step() -> None:
    proc = _run("benchmarks/probe_first_call.py", "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "whole probe, after all of the above" in proc.stdout, proc.stdout


def test_trace_calls_counts_every_path(tmp_path) -> None:
    """The call tracer (issue #40's hot-path budget): every path runs and counts the package's functions; the
    Ulysses paths with a mask run more of them than the op pair without one (the tracer sees the policies)."""
    out = tmp_path / "calls.json"
    proc = _run("benchmarks/trace_calls.py", "--release", "0.42.1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    paths = json.loads(out.read_text())["0.42.1"]
    assert len(paths) == 5 and all(found["calls"] > 0 for found in paths.values()), paths
    masked = paths["Ulysses forward, bool mask [B, 1, S, S]"]
    assert masked["calls"] > paths["op pair, no mask"]["calls"] and "mask_policy" in masked["by_function"], masked


def test_bench_mask_plan_runs_both_ways(tmp_path) -> None:
    """The mask-plan benchmark (issue #40, item 3) on the CPU stand-ins: both ways run, right, and the package's
    plans once per step where the per-layer way plans in every layer."""
    out = tmp_path / "mask-plan.json"
    proc = _run("benchmarks/bench_mask_plan.py", "--dry-run", "--release", "0.39.0", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(out.read_text())["0.39.0"]
    plans = {way: row["plans"] for way, row in found["ways"].items()}
    assert plans == {"package": 1, "per_gathered_tensor": found["stack"]["layers"]}, found


def test_probe_dead_rows_runs_its_first_cases(tmp_path) -> None:
    proc = _run("benchmarks/probe_dead_rows.py", "--dry-run", "--out", str(tmp_path / "dead-rows.json"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^4 cases, torch ", proc.stdout, re.M), proc.stdout
    assert (tmp_path / "dead-rows.json").exists()


def test_gpu_random_cases_runs_on_the_cpu() -> None:
    """A few cases through every path its worker sets up (the op pairs, Ulysses over a one-rank gloo group)."""
    proc = _run(
        "benchmarks/gpu_random_cases.py", "--release", "0.39.0", "--cases", "6", "--device", "cpu",
        "--max-seq", "7", "--jobs", "1", "--chunk", "6",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "wrong: 0" in proc.stdout and "harness error" not in proc.stdout, proc.stdout


#: A script ``gpu_session.sh`` runs, and the options it passes (up to the end of that command).
RUNS = re.compile(r"((?:benchmarks|tests|upstream)/[\w/]+\.py)([^|;]*)")


def test_gpu_session_runs_only_scripts_and_options_that_exist() -> None:
    """Every script ``benchmarks/gpu_session.sh`` names is there, and every option it passes to a benchmark is
    one that benchmark defines (its modes had gone on naming a deleted script and two dropped options)."""
    text = re.sub(r"\\\n\s*", " ", (BENCHMARKS / "gpu_session.sh").read_text())  # one line per command
    missing, seen = [], 0
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for script, rest in RUNS.findall(line):
            seen += 1
            if not (ROOT / script).is_file():
                missing.append(script)
            elif script.startswith("benchmarks/"):
                source = (ROOT / script).read_text()
                missing += [f"{script} {flag}" for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest)
                            if f'"{flag}"' not in source]  # fmt: skip
    assert seen >= 5, seen  # the pattern still finds what the session runs
    assert not missing, f"gpu_session.sh runs what is not there: {missing}"
