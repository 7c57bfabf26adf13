"""The test harness's preloaded interpreter (``releases.run(preloaded=True)``) forks only with one thread.

A fork copies the memory of every thread but runs only one: whatever another thread was changing is copied
half-changed. numpy's OpenBLAS starts a thread server when torch imports it, so the preloaded interpreter runs
with ``OPENBLAS_NUM_THREADS=1`` and refuses to start if any import left a second thread.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import releases


def test_a_preloaded_script_starts_with_one_thread() -> None:
    result = releases.run(
        None,
        "import json, os; print(json.dumps({'threads': len(os.listdir('/proc/self/task'))}))",
        preloaded=True,
    )
    assert result["threads"] == 1, result


@pytest.mark.parametrize("options", ["default", "error", "ignore", "error,ignore::DeprecationWarning", ""])
def test_a_preloaded_script_has_the_warning_filters_of_a_fresh_one(options: str) -> None:
    """A request for other warning options than the preloaded interpreter's gets the filters a fresh interpreter
    makes of its ``PYTHONWARNINGS`` (tests/test_warning_filters.py relies on it)."""
    script = (
        "import json, warnings, " + ", ".join(releases.PRELOAD) + "\n"
        "print(json.dumps({'filters': [repr(f) for f in warnings.filters]}))"
    )
    env = {"PYTHONWARNINGS": options}
    forked = releases.run(None, script, env=env, preloaded=True)["filters"]
    fresh = releases.run(None, script, env=env)["filters"]
    assert forked == fresh, (forked, fresh)


def test_the_preloaded_interpreter_refuses_to_fork_with_a_second_thread(tmp_path: Path) -> None:
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", releases._ZYGOTE, "starts_a_thread"],
        input="",
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)},
        timeout=60,
    )
    assert proc.returncode != 0 and "ready" not in proc.stdout, (proc.stdout, proc.stderr)
    assert "2 threads" in proc.stderr, proc.stderr


def test_a_gpu_result_is_kept_where_the_session_asks(tmp_path: Path, monkeypatch) -> None:
    """``releases.keep``: the GPU tests' raw JSON goes to ``DIFFUSERS_CUDNN_FIX_RESULTS`` (made if missing), and
    nowhere without it."""
    monkeypatch.delenv("DIFFUSERS_CUDNN_FIX_RESULTS", raising=False)
    releases.keep("nowhere.json", {"a": 1})
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("DIFFUSERS_CUDNN_FIX_RESULTS", str(tmp_path / "out"))
    releases.keep("gpu-x.json", {"a": 1, "b": Path("p")})
    assert json.loads((tmp_path / "out" / "gpu-x.json").read_text()) == {"a": 1, "b": "p"}
