"""Never silent (#29, #30): every warning category under the filters users set, and who says it under torchrun.

Each case is an interpreter on diffusers 0.39.0 (forked from one that imported torch: ``releases.run``, which gives
it the filters a fresh one would make of its ``PYTHONWARNINGS``) with the filters given the way users give them
(``PYTHONWARNINGS``, which is what ``python -W`` sets; a real pytest run with ``filterwarnings = error``; a
``logging`` set-up). The rule (docs/behaviour.md, "Warnings"): an error filter never makes a warning vanish (met
on the user's own call it raises there; met inside an import it reaches stderr), an ignore filter silences it,
the log record is written whatever the filters say, and a notice is shown by rank 0 only while a problem is
said by every rank that meets it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from releases import ROOT, TESTS, release_dir, run

pytestmark = pytest.mark.slow

#: How each category is met. ``import``: inside the hook (diffusers' import); ``call``: on the user's call.
SCRIPT = """
import json, logging, os, sys, warnings
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append((record.levelname, record.getMessage()))
logging.getLogger("diffusers_cudnn_fix").addHandler(Keep())
logging.getLogger("diffusers_cudnn_fix").setLevel(logging.INFO)
if os.environ.get("LOG_SETUP"):
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="LOGGED %(levelname)s %(message)s")
how = os.environ["HOW"]
raised = None
try:
    import diffusers_cudnn_fix, subprocess_op_pair_grads as grads
    module = grads.import_in_order("package_first")
    import standin_kernels; standin_kernels.register()
    if how in ("mask", "misread"):
        if how == "misread":
            diffusers_cudnn_fix.set_mask_mode("warn")
        outcome = grads.run_case(module, "cudnn", ("b1_s64_h2", 1, 64, 64, 2, 64), False, mask="bool")
        if outcome["status"] == "raised":  # run_case turns what the step raised into its result
            raised = outcome["error"].partition(":")[0]
    elif how.startswith("report:"):
        _, name, may_raise = how.split(":")
        from diffusers_cudnn_fix import _warnings
        _warnings.report(f"test message of {name}", getattr(_warnings, name), may_raise=may_raise == "1")
except Warning as exc:
    raised = type(exc).__name__
print(json.dumps({"raised": raised, "records": records}))
"""

#: Category -> (how it is met, extra environment, whether it is a notice, met where it may raise).
CATEGORIES = {
    "FixNotAppliedWarning": ("import", {"DIFFUSERS_CUDNN_FIX_SKIP": "cudnn_backward_kv"}, False, False),
    "SwitchValueWarning": ("import", {"DIFFUSERS_CUDNN_FIX_PROBE": "bogus"}, False, False),
    "MaskConvertedWarning": ("mask", {}, True, True),
    "MaskMisreadWarning": ("misread", {}, False, True),
    "ProbeFailedWarning": ("report:ProbeFailedWarning:1", {}, False, True),
    "StaleReferenceWarning": ("report:StaleReferenceWarning:0", {}, False, False),
    "ReleaseTableMismatchWarning": ("report:ReleaseTableMismatchWarning:0", {}, True, False),
}
FILTERS = ("default", "error", "ignore", "logging")


def _case(category: str, filters: str, rank: str | None = None) -> dict:
    how, extra, _, _ = CATEGORIES[category]
    env = {"HOW": how, **extra, "PYTHONWARNINGS": "ignore" if filters == "ignore" else "default"}
    if filters == "error":
        # What ``python -W error`` sets. (``-W error::diffusers_cudnn_fix.<Category>`` does not work from the
        # command line: Python resolves the category before site-packages is on the path and ignores it.)
        env["PYTHONWARNINGS"] = "error"
    if filters == "logging":
        env["LOG_SETUP"] = "1"
    env["RANK"] = rank if rank is not None else "0"
    result = run(release_dir("0.39.0"), SCRIPT, env=env, preloaded=True)
    result["shown"] = f"{category}:" in result["_stderr"]
    return result


@pytest.mark.parametrize("filters", FILTERS)
@pytest.mark.parametrize("category", sorted(CATEGORIES))
def test_every_category_under_every_filter(category: str, filters: str) -> None:
    _, _, _, may_raise = CATEGORIES[category]
    result = _case(category, filters)
    warned = [message for level, message in result["records"] if level == "WARNING"]
    assert warned, f"no log record of {category}: {result}"  # written whatever the filters say
    if filters == "error" and may_raise:
        assert result["raised"] == category, result  # raised at the user's call, as Python's own warnings are
    else:
        assert result["raised"] is None, result  # never out of an import
    if filters == "ignore":
        assert not result["shown"], result["_stderr"]
    elif not (filters == "error" and may_raise):
        assert result["shown"], f"{category} vanished under {filters}: {result['_stderr']}"
    if filters == "logging":
        assert "LOGGED WARNING diffusers_cudnn_fix" in result["_stderr"].replace("test message", "diffusers_cudnn_fix")


@pytest.mark.parametrize("category", ["MaskConvertedWarning", "FixNotAppliedWarning", "MaskMisreadWarning"])
def test_rank_0_shows_notices_and_every_rank_shows_problems(category: str) -> None:
    _, _, notice, may_raise = CATEGORIES[category]
    other = _case(category, "default", rank="1")
    assert other["shown"] is not notice, (category, other["_stderr"])
    levels = {level for level, _ in other["records"]}
    assert ("WARNING" in levels) is not notice, other["records"]  # rank 1 logs a notice at INFO only
    if may_raise:
        # An error filter is the user asking every rank to stop: a notice is no exception there.
        assert _case(category, "error", rank="1")["raised"] == category


def test_under_an_error_filter_every_misread_call_raises() -> None:
    """Caught and carried on, a run in ``warn`` mask mode must not go on wrong quietly: the next call raises too."""
    script = SCRIPT.replace(
        '        outcome = grads.run_case(module, "cudnn", ("b1_s64_h2", 1, 64, 64, 2, 64), False, mask="bool")\n',
        '        grads.run_case(module, "cudnn", ("b1_s64_h2", 1, 64, 64, 2, 64), False, mask="bool")\n'
        '        outcome = grads.run_case(module, "cudnn", ("b1_s64_h2", 1, 64, 64, 2, 64), False, mask="bool")\n',
    )
    assert script != SCRIPT
    env = {"HOW": "misread", "PYTHONWARNINGS": "error", "RANK": "0"}
    result = run(release_dir("0.39.0"), script, env=env, preloaded=True)
    assert result["raised"] == "MaskMisreadWarning", result


def test_the_notice_names_the_callers_line_once() -> None:
    result = _case("MaskConvertedWarning", "default")
    assert result["_stderr"].count("MaskConvertedWarning:") == 1, result["_stderr"]
    assert "Called from" not in result["_stderr"], result["_stderr"]  # the warning's header says where
    assert any("Called from" in m for _, m in result["records"]), result["records"]  # the log record says it


PYTEST_CASE = """
import diffusers_cudnn_fix, subprocess_op_pair_grads as grads

def test_training_step_with_a_bool_mask():
    module = grads.import_in_order("package_first")
    import standin_kernels; standin_kernels.register()
    outcome = grads.run_case(module, "cudnn", ("b1_s64_h2", 1, 64, 64, 2, 64), False, mask="bool")
    assert outcome["status"] == "pass", outcome
"""


def test_pytest_filterwarnings_error_fails_the_test_that_meets_a_warning(tmp_path) -> None:
    (tmp_path / "test_user.py").write_text(textwrap.dedent(PYTEST_CASE))
    env_path = [str(release_dir("0.39.0")), str(ROOT), str(TESTS)]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "filterwarnings=error", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(env_path), "PYTHONWARNINGS": "default"},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "MaskConvertedWarning" in proc.stdout, proc.stdout


def test_with_no_stderr_an_error_filter_at_import_breaks_nothing() -> None:
    """pythonw and some daemons run with ``sys.stderr = None``: the warning met inside diffusers' import then has
    nowhere to be written, and the import must still succeed (the log record keeps it)."""
    script = """
import json, sys
sys.stderr = None
import diffusers_cudnn_fix, diffusers.models.attention_dispatch
print(json.dumps({"ok": diffusers_cudnn_fix.status().ok}))
"""
    env = {"DIFFUSERS_CUDNN_FIX_SKIP": "cudnn_backward_kv", "PYTHONWARNINGS": "error"}
    assert run(release_dir("0.39.0"), script, env=env, preloaded=True)["ok"] is False
