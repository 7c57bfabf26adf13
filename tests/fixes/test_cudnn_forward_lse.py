"""``cudnn_forward_lse`` (fixes/cudnn_forward_lse.py, #14274): diffusers' cuDNN forward op computes the
log-sum-exp only when asked to return it; Ulysses trains with ``return_lse=False``, so the backward reads none and
returns garbage, silently. Releases 0.36.0-0.39.0; fixed in 0.40.0.

* The check: broken on 0.39.0, ok on 0.40.0 (fixed upstream).
* The policy: the corrected forward computes the log-sum-exp whenever a backward may follow: the op pair gives
  reference gradients with ``return_lse=False``. On CPU tensors (no cuDNN kernel) it says so plainly.
* The control: the fix skipped, the same call cannot be right (the corrected backward refuses the missing
  log-sum-exp rather than compute garbage; as shipped it is garbage: tests/test_release_matrix.py's control).

CPU tensors: the user's error must not read as the package's fault. In a fresh interpreter without the tests' CPU
stand-in kernels: on 0.39.0, where the package's corrected forward calls the op, the error is a
``NotImplementedError`` saying that the backend needs CUDA tensors and that diffusers' ``native`` backend runs on a
CPU, with torch's own error chained below it; on 0.42.1, where diffusers' own forward runs, torch's error surfaces
from diffusers' frame, as it would without the package. With a kernel registered for the device (the stand-ins,
in process), the kernel's own ``NotImplementedError`` passes through unchanged: the question is whether the op has
a kernel for the tensors' device, not which device it is.
"""

from __future__ import annotations

import types

import pytest
import subprocess_op_pair_grads
from releases import fix_states, release_dir, run

import diffusers_cudnn_fix
from diffusers_cudnn_fix import FixNotAppliedWarning

FIX = "cudnn_forward_lse"
#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them).
CARRIES = frozenset({"0.36.0", "0.37.0", "0.37.1", "0.38.0", "0.39.0"})
CORRECTION = True  # a correction: the package makes the result right (False: a guard)


@pytest.mark.slow
def test_the_check_finds_the_bug_on_0_39_0_and_not_on_0_40_0() -> None:
    assert fix_states("0.39.0")[FIX] == ["broken", True, "fixed"]
    assert fix_states("0.40.0")[FIX] == ["ok", False, "not_needed"]


@pytest.mark.parametrize("case", subprocess_op_pair_grads.CASES, ids=[c[0] for c in subprocess_op_pair_grads.CASES])
def test_the_training_path_gets_reference_gradients(patched: types.ModuleType, case) -> None:
    """``return_lse=False``, as Ulysses trains: the corrected forward computes the log-sum-exp all the same."""
    result = subprocess_op_pair_grads.run_case(patched, "cudnn", case, False)
    assert result["status"] == "pass", result


def test_without_the_fix_the_training_path_is_not_right(dispatch_module: types.ModuleType, monkeypatch) -> None:
    """The control: every other fix applied, this one skipped: ``return_lse=False`` no longer gives gradients."""
    diffusers_cudnn_fix.revert()
    monkeypatch.setenv("DIFFUSERS_CUDNN_FIX_SKIP", FIX)
    with pytest.warns(FixNotAppliedWarning, match=FIX):
        diffusers_cudnn_fix.apply()
    try:
        case = subprocess_op_pair_grads.CASES[0]
        skipped = subprocess_op_pair_grads.run_case(dispatch_module, "cudnn", case, False)
        with_lse = subprocess_op_pair_grads.run_case(dispatch_module, "cudnn", case, True)
    finally:
        diffusers_cudnn_fix.revert()
    assert skipped["status"] == "raised" and "saved no log-sum-exp" in skipped["error"], skipped
    assert with_lse["status"] == "pass", with_lse  # asked for, the shipped forward computes it


# --- CPU tensors, where torch has no cuDNN attention kernel ----------------------------------------------------


CALL = """
import json, traceback, types
import torch
import diffusers_cudnn_fix
import diffusers.models.attention_dispatch as module

assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_scaled_dot_product_cudnn_attention", "CPU")
ctx = types.SimpleNamespace(needs_input_grad=(True,) * 12)
ctx.save_for_backward = lambda *t: setattr(ctx, "saved_tensors", t)
q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
try:
    module._cudnn_attention_forward_op(ctx, q, k, v, None, 0.0, False, None, False, False, _save_ctx=True,
                                       _parallel_config=None)
    result = {"raised": None}
except Exception as exc:
    cause = exc.__cause__
    result = {
        "raised": type(exc).__name__,
        "message": str(exc),
        "cause": None if cause is None else f"{type(cause).__name__}: {cause}",
        # The last frame that is not torch's: where the call to the op was made.
        "last_frame": [f.filename for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename][-1],
        "patched": diffusers_cudnn_fix.is_patched("_cudnn_attention_forward_op"),
    }
print(json.dumps(result))
"""


@pytest.mark.slow
def test_cpu_tensors_get_a_plain_error_naming_the_backend_that_runs_there() -> None:
    result = run(release_dir("0.39.0"), CALL, env={"DIFFUSERS_CUDNN_FIX": "1"}, preloaded=True)
    assert result["patched"] is True, result  # the package's corrected forward made the call
    assert result["raised"] == "NotImplementedError", result
    message = result["message"]
    for words in ("_native_cudnn attention backend needs CUDA tensors", '"native" attention backend', "cpu"):
        assert words in message, (words, message)
    assert "not diffusers_cudnn_fix's doing" in message, message
    assert result["cause"].startswith("NotImplementedError: Could not run"), result["cause"]  # torch's, chained


@pytest.mark.slow
def test_on_a_release_where_diffusers_calls_the_op_its_frame_raises() -> None:
    result = run(release_dir("0.42.1"), CALL, env={"DIFFUSERS_CUDNN_FIX": "1"}, preloaded=True)
    assert result["raised"] == "NotImplementedError", result
    assert "Could not run" in result["message"], result
    assert result["last_frame"].replace("\\", "/").endswith("diffusers/models/attention_dispatch.py"), result


def test_a_kernel_for_the_device_raising_is_passed_on_unchanged(patched: types.ModuleType) -> None:
    import torch

    ctx = types.SimpleNamespace(needs_input_grad=(True,) * 12)
    ctx.save_for_backward = lambda *t: setattr(ctx, "saved_tensors", t)
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    # The CPU stand-in takes no dropout: its own NotImplementedError, not the package's "needs CUDA tensors".
    with pytest.raises(NotImplementedError, match="stand-in: dropout_p > 0") as raised:
        patched._cudnn_attention_forward_op(ctx, q, k, v, None, 0.1, False, None, False, False, _save_ctx=True)
    assert raised.value.__cause__ is None
