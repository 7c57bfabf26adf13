"""Guards: masks (#14342), q/k/v dtypes, ring backward on <= 0.39, 0.36.0's Ulysses backward.

In-process cases run diffusers 0.39.0 (conftest); the 0.40-style forward (0.42.1), 0.36.0 and whatever
depends on once-per-process state (the default mask mode, warn-once) run in fresh interpreters. Each guard
is also shown to matter: the same case without it goes wrong. The contract: docs/behaviour.md, "Masks
reaching the cuDNN context-parallel op" and "q / k / v".
"""

from __future__ import annotations

import re
import types
import warnings
from pathlib import Path

import pytest
import scenario_grads
from releases import ROOT, release_dir, run

import diffusers_cudnn_fix
from diffusers_cudnn_fix import UnsafeAttentionError

# (name, B, S_q, S_kv, H, D): num_heads == seq_len, a larger one, and S_q != S_kv.
MASK_CASES = (("heads_eq_seq", 2, 16, 16, 16, 32), ("b1_s64_h2", 1, 64, 64, 2, 64), ("sq_ne_skv", 1, 12, 20, 4, 32))


MODES = ("convert", "warn", "error")


@pytest.fixture()
def mask_mode():
    """Set the mask mode for one test; the default (convert) comes back afterwards."""
    yield diffusers_cudnn_fix.set_mask_mode
    diffusers_cudnn_fix.set_mask_mode("convert")


def _forward(module, *, dtypes=("bfloat16", "bfloat16", "bfloat16"), mask=None, case=MASK_CASES[0]):
    """diffusers' cuDNN CP forward op on (B, S, H, D) q/k/v of ``dtypes``, driven as in scenario_grads."""
    import torch

    _, batch, seq_q, seq_kv, heads, dim = case
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(batch, s, heads, dim, generator=gen).to(getattr(torch, dt))
        for s, dt in zip((seq_q, seq_kv, seq_kv), dtypes)
    )
    parallel_config = types.SimpleNamespace(
        context_parallel_config=types.SimpleNamespace(_world_size=2, ring_degree=1, ulysses_degree=2)
    )

    class Harness(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value):
            query, key, value = (x.clone() for x in (query, key, value))
            return module._cudnn_attention_forward_op(
                ctx,
                query,
                key,
                value,
                mask,
                0.0,
                False,
                None,
                False,
                False,
                _save_ctx=True,
                _parallel_config=parallel_config,
            )

        @staticmethod
        def backward(ctx, grad):
            return module._cudnn_attention_backward_op(ctx, grad)[:3]

    return Harness.apply(q, k, v)


def _keep_mask(case=MASK_CASES[0]):
    _, batch, seq_q, seq_kv, _, _ = case
    return scenario_grads.test_mask(batch, seq_q, seq_kv)


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


def test_no_mask_no_warning(patched, mask_mode) -> None:
    for mode in MODES:
        mask_mode(mode)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            result = scenario_grads.run_case(patched, "cudnn", MASK_CASES[0], False)
        assert result["status"] == "pass", (mode, result)
        assert not [w for w in seen if issubclass(w.category, diffusers_cudnn_fix.DiffusersCudnnFixWarning)], mode


def test_a_mask_of_qs_dtype_is_passed_on_in_every_mode(patched, mask_mode) -> None:
    import torch

    keep = _keep_mask()
    additive = torch.zeros(keep.shape, dtype=torch.bfloat16).masked_fill_(~keep, float("-inf"))
    for mode in MODES:
        mask_mode(mode)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = _forward(patched, mask=additive)
        assert torch.isfinite(out).all() and out.dtype == torch.bfloat16, mode
        assert not [w for w in seen if issubclass(w.category, diffusers_cudnn_fix.DiffusersCudnnFixWarning)], mode


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8"])
@pytest.mark.parametrize("mode", MODES)
def test_integer_masks_raise_in_every_mode(patched, mask_mode, mode: str, dtype: str) -> None:
    import torch

    mask_mode(mode)
    mask = _keep_mask().to(getattr(torch, dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a warning instead of the error is a failure, not noise
        with pytest.raises(UnsafeAttentionError) as err:
            _forward(patched, mask=mask)
    assert "mask" in str(err.value), str(err.value)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_masks_requiring_grad_raise_in_every_mode(patched, mask_mode, mode: str, dtype: str) -> None:
    """The CP cuDNN path gives a mask no gradient: a mask that wants one is refused, whatever the mode."""
    import torch

    mask_mode(mode)
    keep = _keep_mask()
    # float32: a mask convert mode would cast; bfloat16 (q's dtype): one every mode would pass on.
    mask = torch.zeros(keep.shape, dtype=getattr(torch, dtype)).masked_fill_(~keep, -1e4).requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UnsafeAttentionError) as err:
            _forward(patched, mask=mask)
    assert "grad" in str(err.value), str(err.value)


def test_default_mode_converts_and_each_mode_warns_once_per_process() -> None:
    """Fresh interpreter (the mode's default and the once-per-process warnings are process state)."""
    result = run(
        release_dir("0.39.0"),
        """
import json, warnings, diffusers_cudnn_fix, scenario_grads
module = scenario_grads.import_in_order("package_first")
import standin_kernels; standin_kernels.register()
case = ("b1_s64_h2", 1, 64, 64, 2, 64)
def go(mask):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        statuses = [scenario_grads.run_case(module, "cudnn", case, False, mask=mask)["status"] for _ in range(3)]
    ours = [(w.category.__name__, str(w.message), w.filename) for w in seen
            if issubclass(w.category, diffusers_cudnn_fix.DiffusersCudnnFixWarning)]
    return {"status": statuses, "warnings": ours}
out = {"default_bool": go("bool"), "default_float32": go("float32")}
diffusers_cudnn_fix.set_mask_mode("warn")
out["warn_bool"] = go("bool")
out["warn_float32"] = go("float32")
print(json.dumps(out))
""",
    )
    # Default: convert, with one MaskConvertedWarning per process.
    assert result["default_bool"]["status"] == ["pass"] * 3, result["default_bool"]
    assert [c for c, _, _ in result["default_bool"]["warnings"]] == ["MaskConvertedWarning"], result["default_bool"]
    converted_at = result["default_bool"]["warnings"][0][2]
    # Both warnings point at the caller of diffusers' op, not at the package's own wrapper.
    assert not Path(converted_at).resolve().is_relative_to(ROOT / "diffusers_cudnn_fix"), converted_at
    assert result["default_float32"]["status"] == ["pass"] * 3, result["default_float32"]
    assert {c for c, _, _ in result["default_float32"]["warnings"]} <= {"MaskConvertedWarning"}
    assert len(result["default_float32"]["warnings"]) <= 1, result["default_float32"]
    # warn: passed through (wrong), one MaskMisreadWarning naming the issue and the switch.
    assert result["warn_bool"]["status"] == ["wrong"] * 3, result["warn_bool"]
    ours = result["warn_bool"]["warnings"]
    assert [c for c, _, _ in ours] == ["MaskMisreadWarning"], ours
    _, message, filename = ours[0]
    assert "#14342" in message and "DIFFUSERS_CUDNN_FIX_MASK" in message, message
    assert not Path(filename).resolve().is_relative_to(ROOT / "diffusers_cudnn_fix"), (filename, message)
    assert result["warn_float32"]["status"] == ["wrong"] * 3, result["warn_float32"]
    assert {c for c, _, _ in result["warn_float32"]["warnings"]} <= {"MaskMisreadWarning"}
    assert len(result["warn_float32"]["warnings"]) <= 1, result["warn_float32"]


def test_error_mode_raises_naming_the_way_out(patched, mask_mode) -> None:
    mask_mode("error")
    result = scenario_grads.run_case(patched, "cudnn", MASK_CASES[0], False, mask="bool")
    assert result["status"] == "raised"
    assert "UnsafeAttentionError" in result["error"] and "DIFFUSERS_CUDNN_FIX_MASK=convert" in result["error"]


def test_mask_mode_rejects_unknown_values_and_takes_any_case(mask_mode) -> None:
    with pytest.raises(ValueError):
        mask_mode("maybe")
    for mode in ("WARN", " Error ", "Convert"):
        mask_mode(mode)


def test_mask_mode_from_the_environment_and_the_guards_on_a_fixed_release() -> None:
    """0.42.1: the gradient fixes are not needed, the guards are. error mode from the environment, then the
    API's convert; fp32 inputs refused; reverted, the same cases go wrong (the guards are what helps)."""
    result = run(
        release_dir("0.42.1"),
        """
import json, diffusers_cudnn_fix, scenario_grads
module = scenario_grads.import_in_order("package_first")
import standin_kernels; standin_kernels.register()
case = scenario_grads.CASES[0]
def cases():
    out = {m: scenario_grads.run_case(module, "cudnn", case, False, mask=m) for m in ("bool", "float32")}
    out["fp32_inputs"] = scenario_grads.run_case(module, "cudnn", case, False, dtype="float32")
    return {k: v and {"status": v["status"], "error": v.get("error", "")} for k, v in out.items()}
result = {"env_error": cases()}
diffusers_cudnn_fix.set_mask_mode("convert")
result["api_convert"] = cases()
result["applied"] = sorted(f.id for f in diffusers_cudnn_fix.status().fixes if f.applied)
diffusers_cudnn_fix.revert()
result["reverted"] = cases()
print(json.dumps(result))
""",
        env={"DIFFUSERS_CUDNN_FIX_MASK": "error"},
    )
    assert result["applied"] == ["cudnn_bool_mask", "cudnn_input_dtypes"]
    for mask in ("bool", "float32"):
        assert result["env_error"][mask]["status"] == "raised", result["env_error"]
        assert "UnsafeAttentionError" in result["env_error"][mask]["error"], result["env_error"]
        assert result["api_convert"][mask]["status"] == "pass", result["api_convert"]
        assert result["reverted"][mask]["status"] == "wrong", result["reverted"]
    for mode in ("env_error", "api_convert"):
        fp32 = result[mode]["fp32_inputs"]
        assert fp32["status"] == "raised" and "UnsafeAttentionError" in fp32["error"], fp32
    assert result["reverted"]["fp32_inputs"]["status"] == "wrong", result["reverted"]


def test_fp32_inputs_raise_instead_of_garbage(patched) -> None:
    result = scenario_grads.run_case(patched, "cudnn", scenario_grads.CASES[0], False, dtype="float32")
    assert result["status"] == "raised"
    assert "UnsafeAttentionError" in result["error"] and "bfloat16" in result["error"]


@pytest.mark.parametrize(
    "dtypes",
    [
        ("bfloat16", "float16", "bfloat16"),
        ("float16", "bfloat16", "bfloat16"),
        ("bfloat16", "bfloat16", "float32"),
        ("float32", "float32", "float32"),
        ("float64", "float64", "float64"),
    ],
    ids="-".join,
)
def test_unsupported_or_mixed_qkv_dtypes_raise_naming_the_three(patched, dtypes) -> None:
    with pytest.raises(UnsafeAttentionError) as err:
        _forward(patched, dtypes=dtypes)
    message = str(err.value)
    for dtype in set(dtypes):
        # "float16" inside "bfloat16" does not count.
        assert re.search(rf"(?<![a-z]){dtype}", message), (dtype, message)


def test_ring_backward_raises_a_clear_error_on_affected_releases(patched: types.ModuleType) -> None:
    ctx = types.SimpleNamespace()
    with pytest.raises(UnsafeAttentionError) as err:
        patched.TemplatedRingAttention.backward(ctx, None)
    message = str(err.value)
    assert "ring" in message and "0.40" in message and "Ulysses" in message and "ring_backward" in message
    # The forward is untouched: ring inference keeps working.
    assert (
        "forward" not in patched.TemplatedRingAttention.__dict__
        or diffusers_cudnn_fix.get_original("TemplatedRingAttention.forward")
        is patched.TemplatedRingAttention.__dict__["forward"]
    )


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
