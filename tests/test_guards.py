"""Guards: masks (#14342), fp32 inputs, ring backward on <= 0.39, 0.36.0's Ulysses backward.

In-process cases run diffusers 0.39.0 (conftest); the 0.40-style forward (0.42.1) and 0.36.0 run in fresh
interpreters. Each guard is also shown to matter: the same case without it goes wrong.
"""

from __future__ import annotations

import types
import warnings

import pytest
import scenario_grads
from releases import release_dir, run

import diffusers_cudnn_fix
from diffusers_cudnn_fix import UnsafeAttentionError
from diffusers_cudnn_fix.fixes import cudnn_bool_mask

# (name, B, S_q, S_kv, H, D): num_heads == seq_len, a larger one, and S_q != S_kv.
MASK_CASES = (("heads_eq_seq", 2, 16, 16, 16, 32), ("b1_s64_h2", 1, 64, 64, 2, 64), ("sq_ne_skv", 1, 12, 20, 4, 32))


@pytest.fixture()
def mask_mode():
    """Set the mask mode for one test; the default comes back afterwards."""
    yield diffusers_cudnn_fix.set_mask_mode
    diffusers_cudnn_fix.set_mask_mode("warn")
    cudnn_bool_mask._warned = False


@pytest.mark.parametrize("mask", ["bool", "float32"])
@pytest.mark.parametrize("case", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_convert_mode_gives_reference_outputs_and_gradients(patched, mask_mode, case, mask: str) -> None:
    mask_mode("convert")
    for return_lse in (False, True):
        result = scenario_grads.run_case(patched, "cudnn", case, return_lse, mask=mask)
        assert result["status"] == "pass", result


@pytest.mark.parametrize("mask", ["bool", "float32"])
def test_masks_go_wrong_without_the_conversion(patched, mask_mode, mask: str) -> None:
    """The control: the same masked case with the K/V and LSE fixes but the mask passed through."""
    mask_mode("warn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = scenario_grads.run_case(patched, "cudnn", MASK_CASES[1], False, mask=mask)
    assert result["status"] == "wrong", result
    assert result["errors"]["out"] > 0.1


def test_warn_mode_warns_once_naming_the_issue_the_switch_and_the_call_site(patched, mask_mode) -> None:
    mask_mode("warn")
    cudnn_bool_mask._warned = False
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            scenario_grads.run_case(patched, "cudnn", MASK_CASES[0], False, mask="bool")
    ours = [w for w in seen if issubclass(w.category, diffusers_cudnn_fix.DiffusersCudnnFixWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    assert "#14342" in message and "DIFFUSERS_CUDNN_FIX_MASK" in message
    # The call site is the first frame outside diffusers/torch/the package: the scenario helper here.
    assert ours[0].filename.endswith("scenario_grads.py") and "scenario_grads.py" in message


def test_no_mask_no_warning(patched, mask_mode) -> None:
    cudnn_bool_mask._warned = False
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        scenario_grads.run_case(patched, "cudnn", MASK_CASES[0], False)
    assert not [w for w in seen if issubclass(w.category, diffusers_cudnn_fix.DiffusersCudnnFixWarning)]


def test_error_mode_raises_naming_the_way_out(patched, mask_mode) -> None:
    mask_mode("error")
    result = scenario_grads.run_case(patched, "cudnn", MASK_CASES[0], False, mask="bool")
    assert result["status"] == "raised"
    assert "UnsafeAttentionError" in result["error"] and "DIFFUSERS_CUDNN_FIX_MASK=convert" in result["error"]


def test_mask_mode_rejects_unknown_values() -> None:
    with pytest.raises(ValueError):
        diffusers_cudnn_fix.set_mask_mode("maybe")


def test_mask_mode_from_the_environment_and_on_a_fixed_release() -> None:
    """0.42.1: the gradient fixes are not needed, the mask guard is; convert mode from the environment."""
    result = run(
        release_dir("0.42.1"),
        """
import json, diffusers_cudnn_fix, scenario_grads
module = scenario_grads.import_in_order("package_first")
import standin_kernels; standin_kernels.register()
case = scenario_grads.CASES[0]
out = {m: scenario_grads.run_case(module, "cudnn", case, False, mask=m)["status"] for m in ("bool", "float32")}
applied = sorted(f.id for f in diffusers_cudnn_fix.status().fixes if f.applied)
print(json.dumps({"results": out, "applied": applied}))
""",
        env={"DIFFUSERS_CUDNN_FIX_MASK": "convert"},
    )
    assert result["results"] == {"bool": "pass", "float32": "pass"}
    assert result["applied"] == ["cudnn_bool_mask", "cudnn_fp32_inputs"]


def test_fp32_inputs_raise_instead_of_garbage(patched) -> None:
    result = scenario_grads.run_case(patched, "cudnn", scenario_grads.CASES[0], False, dtype="float32")
    assert result["status"] == "raised"
    assert "UnsafeAttentionError" in result["error"] and "bfloat16" in result["error"]


def test_fp32_inputs_give_garbage_without_the_guard(dispatch_module) -> None:
    diffusers_cudnn_fix.revert()
    try:
        shipped = {n: getattr(dispatch_module, n) for n in ("_cudnn_attention_forward_op", "_cudnn_attention_backward_op")}
        # Keep the K/V and LSE corrections, drop only the dtype guard: the fp32 case then returns garbage.
        diffusers_cudnn_fix.apply()
        guarded = dispatch_module._cudnn_attention_forward_op
        inner = guarded.__wrapped__  # the fp32 guard wraps the mask guard, which wraps the corrected op
        dispatch_module._cudnn_attention_forward_op = inner
        result = scenario_grads.run_case(dispatch_module, "cudnn", scenario_grads.CASES[0], True, dtype="float32")
        dispatch_module._cudnn_attention_forward_op = guarded
        assert result["status"] == "wrong", result
        assert shipped["_cudnn_attention_forward_op"] is not guarded
    finally:
        diffusers_cudnn_fix.revert()


def test_ring_backward_raises_a_clear_error_on_affected_releases(patched: types.ModuleType) -> None:
    ctx = types.SimpleNamespace()
    with pytest.raises(UnsafeAttentionError) as err:
        patched.TemplatedRingAttention.backward(ctx, None)
    message = str(err.value)
    assert "ring" in message and "0.40" in message and "Ulysses" in message and "ring_backward" in message
    # The forward is untouched: ring inference keeps working.
    assert "forward" not in patched.TemplatedRingAttention.__dict__ or diffusers_cudnn_fix.get_original(
        "TemplatedRingAttention.forward"
    ) is patched.TemplatedRingAttention.__dict__["forward"]


def test_ring_backward_is_left_alone_where_it_is_right() -> None:
    """0.40.0+ per-step backward: the check sees each step's K/V and installs nothing; Ulysses never guarded."""
    result = run(
        release_dir("0.40.0"),
        "import json, diffusers_cudnn_fix, diffusers.models.attention_dispatch\n"
        "print(json.dumps({f.id: [f.detected, f.applied] for f in diffusers_cudnn_fix.status().fixes}))\n",
    )
    assert result["ring_backward"] == ["ok", False]
    assert result["ulysses_grad_count"] == ["ok", False]


@pytest.mark.parametrize("order", ["package_first", "none"])
def test_ulysses_on_0_36_0(order: str) -> None:
    """0.36.0's Ulysses backward (11 gradients for 12 inputs) raises for every backend; padded, it is right."""
    result = run(release_dir("0.36.0"), f"import scenario_ulysses; scenario_ulysses.main({order!r})")
    cudnn = {k: v for k, v in result["cases"].items() if k.startswith("cudnn/")}
    if order == "none":
        assert all(v["status"] == "raised" for v in cudnn.values())
        assert any("incorrect number of gradients" in v["error"] for v in cudnn.values())
    else:
        assert {v["status"] for v in cudnn.values()} == {"pass"}, cudnn
