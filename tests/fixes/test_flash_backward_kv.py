"""``flash_backward_kv`` (fixes/flash_backward_kv.py, #14274): diffusers' native-flash backward op transposes
the saved K/V a second time, so its K/V gradients are wrong (or the kernel refuses the shapes). Releases
0.37.0-0.39.0; fixed in 0.40.0.

* The check: broken on 0.39.0, ok on 0.40.0 (fixed upstream).
* The policy: the corrected backward (``_native_flash_attention_backward_op``) gives reference gradients, with and
  without ``return_lse``, for every shape (num_heads == seq_len too, where the wrong layout has the right shape).
* The control: the fix skipped, the same case comes out wrong, silently (num_heads == seq_len).

In process on diffusers 0.39.0 (conftest). Every release, both import orders: tests/test_release_matrix.py.
"""

from __future__ import annotations

import types

import pytest
import subprocess_op_pair_grads
from releases import fix_states

import diffusers_cudnn_fix
from diffusers_cudnn_fix import FixNotAppliedWarning

FIX = "flash_backward_kv"
#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them).
CARRIES = frozenset({"0.37.0", "0.37.1", "0.38.0", "0.39.0"})
CORRECTION = True  # a correction: the package makes the result right (False: a guard)
BACKEND = "flash"
CASES = subprocess_op_pair_grads.CASES


@pytest.mark.slow
def test_the_check_finds_the_bug_on_0_39_0_and_not_on_0_40_0() -> None:
    assert fix_states("0.39.0")[FIX] == ["broken", True, "fixed"]
    assert fix_states("0.40.0")[FIX] == ["ok", False, "not_needed"]


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_corrected_backward_gives_reference_gradients(patched: types.ModuleType, case, return_lse: bool) -> None:
    result = subprocess_op_pair_grads.run_case(patched, BACKEND, case, return_lse)
    assert result["status"] == "pass", result


def test_without_the_fix_the_gradients_are_wrong(dispatch_module: types.ModuleType, monkeypatch) -> None:
    """The control: every other fix applied, this one skipped."""
    diffusers_cudnn_fix.revert()
    monkeypatch.setenv("DIFFUSERS_CUDNN_FIX_SKIP", FIX)
    with pytest.warns(FixNotAppliedWarning, match=FIX):
        diffusers_cudnn_fix.apply()
    try:
        results = [subprocess_op_pair_grads.run_case(dispatch_module, BACKEND, CASES[0], lse) for lse in (False, True)]
    finally:
        diffusers_cudnn_fix.revert()
    for result in results:
        assert result["status"] == "wrong", result
