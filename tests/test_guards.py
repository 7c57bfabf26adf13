"""Guards: masks (#14342), q/k/v dtypes, ring attention on <= 0.39, 0.36.0's Ulysses backward.

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
import subprocess_op_pair_grads
import threaded_ring
from harness import op_pair, pair_config, stand_in_collectives, ulysses_attention, ulysses_config
from releases import ROOT, release_dir, run

import diffusers_cudnn_fix
from diffusers_cudnn_fix import FixNotAppliedWarning, UnsafeAttentionError

# In-process cases convert bool masks on purpose: the once-per-process notice is expected here (the
# subprocess cases assert it), not something to leave in the test summary.
pytestmark = pytest.mark.filterwarnings("ignore::diffusers_cudnn_fix.MaskConvertedWarning")

# (name, B, S_q, S_kv, H, D): num_heads == seq_len, a larger one, and S_q != S_kv.
MASK_CASES = (("heads_eq_seq", 2, 16, 16, 16, 32), ("b1_s64_h2", 1, 64, 64, 2, 64), ("sq_ne_skv", 1, 12, 20, 4, 32))


MODES = ("convert", "warn", "error")


@pytest.fixture()
def mask_mode():
    """Set the mask mode for one test; the default (convert) comes back afterwards."""
    yield diffusers_cudnn_fix.set_mask_mode
    diffusers_cudnn_fix.set_mask_mode("convert")


def _forward(module, *, dtypes=("bfloat16", "bfloat16", "bfloat16"), mask=None, case=MASK_CASES[0]):
    """diffusers' cuDNN CP forward op on (B, S, H, D) q/k/v of ``dtypes``, driven as in subprocess_op_pair_grads."""
    import torch

    _, batch, seq_q, seq_kv, heads, dim = case
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(batch, s, heads, dim, generator=gen).to(getattr(torch, dt))
        for s, dt in zip((seq_q, seq_kv, seq_kv), dtypes)
    )
    pair = op_pair(
        module._cudnn_attention_forward_op, module._cudnn_attention_backward_op, parallel_config=pair_config()
    )
    return pair.apply(q, k, v, mask)


def _keep_mask(case=MASK_CASES[0]):
    _, batch, seq_q, seq_kv, _, _ = case
    return subprocess_op_pair_grads.test_mask(batch, seq_q, seq_kv)


@pytest.mark.parametrize("mask", ["bool", "float32"])
@pytest.mark.parametrize("case", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_convert_mode_gives_reference_outputs_and_gradients(patched, mask_mode, case, mask: str) -> None:
    mask_mode("convert")
    for return_lse in (False, True):
        result = subprocess_op_pair_grads.run_case(patched, "cudnn", case, return_lse, mask=mask)
        assert result["status"] == "pass", result


@pytest.mark.parametrize("mask", ["bool", "float32"])
def test_masks_go_wrong_without_the_conversion(patched, mask_mode, mask: str) -> None:
    """The control: the same masked case with the K/V and LSE fixes but the mask passed through."""
    mask_mode("warn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = subprocess_op_pair_grads.run_case(patched, "cudnn", MASK_CASES[1], False, mask=mask)
    assert result["status"] == "wrong", result
    assert result["errors"]["out"] > 0.1


def test_no_mask_no_warning(patched, mask_mode) -> None:
    for mode in MODES:
        mask_mode(mode)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            result = subprocess_op_pair_grads.run_case(patched, "cudnn", MASK_CASES[0], False)
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
import json, warnings, diffusers_cudnn_fix, subprocess_op_pair_grads as grads
module = grads.import_in_order("package_first")
import standin_kernels; standin_kernels.register()
case = ("b1_s64_h2", 1, 64, 64, 2, 64)
def go(mask):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        statuses = [grads.run_case(module, "cudnn", case, False, mask=mask)["status"] for _ in range(3)]
    ours = [(w.category.__name__, str(w.message), w.filename) for w in seen
            if issubclass(w.category, diffusers_cudnn_fix.DiffusersCudnnFixWarning)]
    return {"status": statuses, "warnings": ours}
out = {"default_bool": go("bool"), "default_float32": go("float32")}
diffusers_cudnn_fix.set_mask_mode("warn")
out["warn_bool"] = go("bool")
out["warn_float32"] = go("float32")
print(json.dumps(out))
""",
        preloaded=True,
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
    result = subprocess_op_pair_grads.run_case(patched, "cudnn", MASK_CASES[0], False, mask="bool")
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
import json, diffusers_cudnn_fix, subprocess_op_pair_grads
module = subprocess_op_pair_grads.import_in_order("package_first")
import standin_kernels; standin_kernels.register()
case = subprocess_op_pair_grads.CASES[0]
def cases():
    out = {m: subprocess_op_pair_grads.run_case(module, "cudnn", case, False, mask=m) for m in ("bool", "float32")}
    out["fp32_inputs"] = subprocess_op_pair_grads.run_case(module, "cudnn", case, False, dtype="float32")
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
        preloaded=True,
    )
    assert result["applied"] == [
        "cudnn_bool_mask",
        "cudnn_input_dtypes",
        "cudnn_masked_row_grads",
        "flash_input_alignment",
        "ring_grad_route",
        "ulysses_mask_grad",
    ]
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
    result = subprocess_op_pair_grads.run_case(
        patched, "cudnn", subprocess_op_pair_grads.CASES[0], False, dtype="float32"
    )
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


# ------------------------------------------------------------------------------------------------------------
# Ring attention on 0.39.0: corrected for the cuDNN and flash ops, refused elsewhere (threaded_ring: one
# thread per ring rank, so several ring chunks run in this one process)
# ------------------------------------------------------------------------------------------------------------
RING_FORWARD, RING_BACKWARD = "TemplatedRingAttention.forward", "TemplatedRingAttention.backward"


def _shipped(target: str):
    return diffusers_cudnn_fix.get_original(target).__func__


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_ring_is_corrected_for_every_ring_degree(patched: types.ModuleType, backend: str, world: int) -> None:
    assert diffusers_cudnn_fix.is_patched(RING_FORWARD) and diffusers_cudnn_fix.is_patched(RING_BACKWARD)
    result = threaded_ring.run(patched, backend, world)
    assert result["status"] == "pass", result
    fp32 = threaded_ring.run(patched, backend, world, convert_to_fp32=True)
    assert fp32["status"] == "pass", fp32


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_ring_as_shipped_is_wrong_with_the_corrected_ops(patched: types.ModuleType, backend: str) -> None:
    """The control: the corrected cuDNN / flash ops under diffusers' own ring forward and backward."""
    result = threaded_ring.run(
        patched, backend, 2, ring_forward=_shipped(RING_FORWARD), ring_backward=_shipped(RING_BACKWARD)
    )
    assert result["status"] == "wrong", result


def _ring_refusal(module: types.ModuleType, backend: str = "cudnn", **kwargs) -> str:
    result = threaded_ring.run(module, backend, 2, **kwargs)
    assert result["status"] == "raised" and result["raised"] == "UnsafeAttentionError", result
    return result["error"]


def _zeros_forward_op(ctx, query, *args, **kwargs):
    """A forward op returning (out, lse) of the right shapes, for cases that must be refused before any
    backward op runs."""
    import torch

    return torch.zeros_like(query), torch.zeros(query.shape[:3])


def test_ring_refuses_other_backends(patched: types.ModuleType) -> None:
    """Another backend's backward op (here diffusers' native one; its forward op cannot return a log-sum-exp,
    so a stand-in runs the forward): the backward refuses, naming the backends that work and the way out."""
    message = _ring_refusal(patched, "native", forward_op=_zeros_forward_op)
    assert "_native_cudnn" in message and "_native_flash" in message, message
    assert "_native_attention_backward_op" in message and "Ulysses" in message and "0.40" in message, message


def test_ring_refuses_the_shipped_cudnn_backward_op(patched: types.ModuleType) -> None:
    """With DIFFUSERS_CUDNN_FIX_SKIP=cudnn_backward_kv the shipped op is what the ring gets: refused, as it is
    not one of the ops the corrected ring drives (identity, not name)."""
    patched._cudnn_attention_backward_op = diffusers_cudnn_fix.get_original("_cudnn_attention_backward_op")
    try:
        message = _ring_refusal(patched)
    finally:
        diffusers_cudnn_fix.apply()  # puts the corrected op back
    assert "cudnn_backward_kv" in message, message


def test_ring_refuses_what_it_does_not_correct(patched: types.ModuleType) -> None:
    """A mask (diffusers applies the local mask to every ring step), dropout, causal attention, GQA. The forward
    op is a stand-in where the stand-in kernels would refuse first (dropout) or diffusers' op raises (GQA)."""
    import torch

    mask = torch.zeros(threaded_ring.BATCH, 1, threaded_ring.SEQ_PER_RANK, threaded_ring.SEQ_PER_RANK)
    cases = {
        "mask": {"attn_mask": mask.to(torch.bfloat16)},
        "dropout": {"dropout_p": 0.1, "forward_op": _zeros_forward_op},
        "is_causal": {"is_causal": True},
        "enable_gqa": {"enable_gqa": True, "forward_op": _zeros_forward_op},
    }
    for word, kwargs in cases.items():
        message = _ring_refusal(patched, **kwargs)
        assert word in message and "Ulysses" in message and "ring_grad_route" in message, (word, message)


def test_ring_refuses_a_forward_from_before_the_correction(patched: types.ModuleType) -> None:
    """A forward run by the shipped class (before apply()) kept nothing the corrected backward needs."""
    message = _ring_refusal(patched, ring_forward=_shipped(RING_FORWARD))
    assert "before the package corrected" in message, message


def test_ring_steps_are_found_right_on_040() -> None:
    """0.40.0+ per-step backward: the check sees each step's K/V (the route is what it finds wrong); Ulysses never
    guarded."""
    result = run(
        release_dir("0.40.0"),
        "import json, diffusers_cudnn_fix, diffusers.models.attention_dispatch\n"
        "print(json.dumps({f.id: [f.detected, f.applied, f.reason] for f in diffusers_cudnn_fix.status().fixes}))\n",
        preloaded=True,
    )
    assert result["ring_grad_route"][:2] == ["broken", True]
    assert "each ring step's backward sees its K/V and the merged output" in result["ring_grad_route"][2]
    assert "K gradient sums the chunks" in result["ring_grad_route"][2]
    assert result["ulysses_grad_count"][:2] == ["ok", False]


@pytest.mark.parametrize("order", ["package_first", "none"])
def test_ulysses_on_0_36_0(order: str) -> None:
    """0.36.0's Ulysses backward (11 gradients for 12 inputs) raises for every backend; padded, it is right."""
    result = run(release_dir("0.36.0"), f"import subprocess_ulysses_grads as s; s.main({order!r})", preloaded=True)
    cudnn = {k: v for k, v in result["cases"].items() if k.startswith("cudnn/")}
    if order == "none":
        assert all(v["status"] == "raised" for v in cudnn.values())
        assert any("incorrect number of gradients" in v["error"] for v in cudnn.values())
    else:
        assert {v["status"] for v in cudnn.values()} == {"pass"}, cudnn


def _ulysses(module, monkeypatch, mask, *, grad: bool = True):
    """diffusers' own ``TemplatedUlyssesAttention`` at Ulysses degree 1 (collectives stood in), cuDNN ops."""
    import torch

    config = ulysses_config(stand_in_collectives(module, monkeypatch), convert_to_fp32=False)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=gen).to(torch.bfloat16).requires_grad_(True) for _ in range(3))
    with torch.set_grad_enabled(grad):
        out = ulysses_attention(module, q, k, v, mask, config=config)
        if grad:
            out.float().sum().backward()
    return out


def test_a_mask_needing_grad_is_refused_by_ulysses_attention(dispatch_module, monkeypatch) -> None:
    """0.39+'s Ulysses forward all-gathers the mask into a fresh tensor, so the op-level guard cannot see that
    it requires grad; its backward gives it none. As shipped the mask's gradient silently stays None; with
    the package the forward refuses it (under no_grad too: inside the forward the two cannot be told apart),
    and the detached mask runs as shipped."""
    import torch

    def mask():
        return torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16).requires_grad_(True)

    # Every other fix in (the shipped 0.39.0 backward needs them), this guard left out.
    diffusers_cudnn_fix.revert()
    monkeypatch.setenv("DIFFUSERS_CUDNN_FIX_SKIP", "ulysses_mask_grad")
    with pytest.warns(FixNotAppliedWarning, match="ulysses_mask_grad"):
        diffusers_cudnn_fix.apply()
    try:
        shipped_mask = mask()
        _ulysses(dispatch_module, monkeypatch, shipped_mask)
        assert shipped_mask.grad is None  # the bug: no gradient, no error
        shipped_eval = _ulysses(dispatch_module, monkeypatch, mask(), grad=False)
    finally:
        diffusers_cudnn_fix.revert()

    monkeypatch.delenv("DIFFUSERS_CUDNN_FIX_SKIP")
    diffusers_cudnn_fix.apply()
    try:
        with pytest.raises(UnsafeAttentionError, match=r"requires grad.*no gradient.*detach"):
            _ulysses(dispatch_module, monkeypatch, mask())
        with pytest.raises(UnsafeAttentionError, match=r"detach"):
            _ulysses(dispatch_module, monkeypatch, mask(), grad=False)
        assert torch.equal(_ulysses(dispatch_module, monkeypatch, mask().detach(), grad=False), shipped_eval)
        _ulysses(dispatch_module, monkeypatch, mask().detach())
    finally:
        diffusers_cudnn_fix.revert()


def test_flash_inputs_off_16_bytes_are_copied_before_the_kernel(dispatch_module) -> None:
    """With one head the flash op's ``transpose(1, 2).contiguous()`` copies nothing, so a view one element
    into its buffer reached the flash kernel as it is: "misaligned address" on a GPU, which ends the CUDA
    context (the stand-in raises the same). The guard hands the op dense copies; the result is unchanged."""
    import torch

    shape = (2, 5, 1, 16)  # (B, S, H, D)
    gen = torch.Generator().manual_seed(0)
    buffers = [torch.randn(2 * 5 * 16 + 1, generator=gen).to(torch.bfloat16) for _ in range(3)]
    offset = [b[1:].view(shape) for b in buffers]  # off 16 bytes
    dense = [x.clone() for x in offset]

    def forward(q, k, v):
        ctx = types.SimpleNamespace(save_for_backward=lambda *t: None)
        return dispatch_module._native_flash_attention_forward_op(ctx, q, k, v, None, 0.0, False, None, False, False)

    diffusers_cudnn_fix.revert()
    with pytest.raises(RuntimeError, match="misaligned address"):
        forward(*offset)
    expected = forward(*dense)
    diffusers_cudnn_fix.apply()
    try:
        assert torch.equal(forward(*offset), expected)
    finally:
        diffusers_cudnn_fix.revert()


# ------------------------------------------------------------------------------------------------------------
# Ring attention on 0.40.0 and later (fixes/ring_grad_route.py): diffusers' own ring backward routes the K/V
# gradients wrong from ring degree 3; the package installs its corrected ring there (diffusers' own ops)
# ------------------------------------------------------------------------------------------------------------
def test_ring_gradients_right_at_every_degree_on_040_and_later() -> None:
    """0.42.x's ``enable_parallelism`` fails on a CPU-only torch, so its ring runs here in one process, a
    thread per ring rank (``threaded_ring``), on diffusers' own cuDNN and flash ops as installed (0.42.0's
    ring is 0.42.1's; 0.40.0 and 0.41.0 train at ring degree 4 in tests/test_cp_training.py)."""
    result = run(
        release_dir("0.42.1"),
        """
import json, functools, torch, diffusers_cudnn_fix, threaded_ring, standin_kernels
import diffusers.models.attention_dispatch as module
standin_kernels.register()
shipped = {n: diffusers_cudnn_fix.get_original(f"TemplatedRingAttention.{n}").__func__ for n in ("forward", "backward")}
result = {f"{b}/{w}": threaded_ring.run(module, b, w) for b in ("cudnn", "flash") for w in (2, 3, 4)}
# The control: diffusers' own ring with the same ops.
for w in (2, 3, 4):
    result[f"shipped/{w}"] = threaded_ring.run(
        module, "cudnn", w, ring_forward=shipped["forward"], ring_backward=shipped["backward"]
    )
result["unified-shape/2"] = threaded_ring.run(module, "cudnn", 2, convert_to_fp32=True)
# Refused: a mask at ring degree > 1 (dropout too: the stand-in kernels have none); a backward op of another
# backend from ring degree 3.
key_mask = torch.zeros(threaded_ring.BATCH, 1, 1, threaded_ring.SEQ_PER_RANK, dtype=torch.bfloat16)
result["mask/2"] = threaded_ring.run(module, "cudnn", 2, attn_mask=key_mask)
installed = module._cudnn_attention_backward_op
def other_backward_op(ctx, grad_out, *args, **kwargs):  # not one of diffusers' cuDNN / flash ops
    return installed(ctx, grad_out, *args, **kwargs)
module._cudnn_attention_backward_op = other_backward_op
result["other/2"] = threaded_ring.run(module, "cudnn", 2)
result["other/3"] = threaded_ring.run(module, "cudnn", 3)
module._cudnn_attention_backward_op = installed
fixes = diffusers_cudnn_fix.status().fixes
result["status"] = {f.id: [f.detected, f.applied, f.reason.split(":")[0]] for f in fixes if f.id.startswith("ring")}
result["patched"] = [diffusers_cudnn_fix.is_patched(f"TemplatedRingAttention.{n}") for n in ("forward", "backward")]
print(json.dumps(result))
""",
        preloaded=True,
    )
    tolerance = threaded_ring.TOLERANCE
    assert result["status"] == {"ring_grad_route": ["broken", True, "fixed"]}, result["status"]
    assert result["patched"] == [True, True]
    # As shipped: degree 2 right; from degree 3 wrong K/V gradients, the output and the query gradient right.
    assert result["shipped/2"]["status"] == "pass", result["shipped/2"]
    for world in (3, 4):
        shipped = result[f"shipped/{world}"]
        assert shipped["status"] == "wrong", shipped
        assert shipped["errors"]["out"] <= tolerance and shipped["errors"]["dq"] <= tolerance, shipped
        assert max(shipped["errors"]["dk"], shipped["errors"]["dv"]) > 10 * tolerance, shipped
    # With the package: right at every degree, with both backends.
    for backend in ("cudnn", "flash"):
        for world in (2, 3, 4):
            case = result[f"{backend}/{world}"]
            assert case["status"] == "pass", (backend, world, case)
    assert result["unified-shape/2"]["status"] == "pass", result["unified-shape/2"]
    for case, words in (
        ("mask/2", ("an attention mask", "Ulysses", "DIFFUSERS_CUDNN_FIX_SKIP=ring_grad_route")),
        ("other/3", ("ring_degree 3", "other_backward_op", "_native_cudnn", "ring_degree=2", "Ulysses")),
    ):
        refused = result[case]
        assert refused["status"] == "raised" and refused["raised"] == "UnsafeAttentionError", (case, refused)
        for word in words:
            assert word in refused["error"], (case, word, refused["error"])
    # Another backend at ring degree 2: diffusers' own route is right there, and so is the package's.
    assert result["other/2"]["status"] == "pass", result["other/2"]


# --- a fully masked query row with one key/value position (cudnn_masked_row_grads) --------------------------


def _one_key_pair(module, backward_op, mask, *, seq_q: int = 5, dtype: str = "bfloat16"):
    """Output and (dq, dk, dv) of the cuDNN CP op pair with S_kv = 1, and the fp32 reference's."""
    import torch
    from standin_kernels import reference_attention

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, seq_q, 3, 8, generator=gen).to(getattr(torch, dtype))
    k, v = (torch.randn(2, 1, 3, 8, generator=gen).to(q.dtype) for _ in range(2))
    grad_out = torch.randn(2, seq_q, 3, 8, generator=gen).to(q.dtype)
    pair = op_pair(module._cudnn_attention_forward_op, backward_op, parallel_config=pair_config())
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = pair.apply(*leaves, mask)
    out.backward(grad_out)
    got = [out.detach(), *(x.grad for x in leaves)]
    ref_leaves = [x.detach().float().transpose(1, 2).requires_grad_(True) for x in (q, k, v)]
    # The kernels count finfo(bf16).min as masked too (docs/kernel-facts.md): the reference takes the keep mask.
    keep = mask if mask.dtype == torch.bool else mask.float() > -1e38
    ref = reference_attention(*ref_leaves, bool_mask=keep)
    ref.backward(grad_out.float().transpose(1, 2))
    want = [ref.detach().transpose(1, 2), *(x.grad.transpose(1, 2) for x in ref_leaves)]
    # One key: the true dQ and dK are 0, so every error is taken relative to the largest reference value.
    scale = max(w.abs().max().item() for w in want)
    return {
        name: (g.float() - w).abs().max().item() / scale
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True)
    }


def _one_key_masks():
    import torch

    keep = torch.ones(2, 1, 5, 1, dtype=torch.bool)
    keep[:, :, 2] = False  # query row 2 sees no key
    keep[1, :, 4] = False
    additive = torch.zeros(keep.shape, dtype=torch.bfloat16)
    return {
        "bool": keep,
        "-inf": additive.masked_fill(~keep, float("-inf")),
        "finfo.min": additive.masked_fill(~keep, torch.finfo(torch.bfloat16).min),
    }


@pytest.mark.parametrize("fill", ["bool", "-inf", "finfo.min"])
def test_a_fully_masked_row_with_one_key_gets_right_gradients(patched, fill: str) -> None:
    """cuDNN's backward (stand-in faithful to the H200 measurement) gets such a row wrong; the guard hands it
    no gradient for the row, which is exact, and the gradients come out right. The control: the backward
    the guard wraps, on the same inputs, is wrong."""
    mask = _one_key_masks()[fill]
    installed = patched._cudnn_attention_backward_op
    guarded = _one_key_pair(patched, installed, mask)
    assert max(guarded.values()) < 0.02, guarded
    from diffusers_cudnn_fix.targets import cudnn

    # The control: the replacement built without the masked-row policy (the K/V correction only).
    unguarded_op = cudnn.backward_op(
        diffusers_cudnn_fix.get_original(cudnn.CUDNN_BACKWARD), frozenset({"cudnn_backward_kv"})
    )
    unguarded = _one_key_pair(patched, unguarded_op, mask)
    assert unguarded["out"] < 0.02 and max(unguarded["dq"], unguarded["dk"], unguarded["dv"]) > 0.2, unguarded


def test_one_key_rows_that_see_their_key_and_fp16_masks_are_left_alone(patched) -> None:
    """Only rows whose key is masked as the kernel reads it lose their gradient: fp16's -65504 is an
    ordinary (large) bias there, and a row that sees its key keeps its gradient."""
    import torch

    from diffusers_cudnn_fix.fixes.cudnn_masked_row_grads import without_masked_rows

    grad_out = torch.ones(2, 5, 3, 8)
    fp16_min = torch.zeros(2, 1, 5, 1, dtype=torch.float16).masked_fill_(~_one_key_masks()["bool"], -65504.0)
    assert torch.equal(without_masked_rows(grad_out, fp16_min), grad_out)
    for fill in ("-inf", "finfo.min"):
        zeroed = without_masked_rows(grad_out, _one_key_masks()[fill])
        assert zeroed[:, 2].eq(0).all() and zeroed[1, 4].eq(0).all() and zeroed[0, 4].eq(1).all()
        assert zeroed[:, :2].eq(1).all() and zeroed[:, 3].eq(1).all()
    wider = torch.zeros(2, 1, 5, 4).masked_fill_(torch.ones(2, 1, 5, 4, dtype=torch.bool), float("-inf"))
    assert torch.equal(without_masked_rows(grad_out, wider), grad_out)  # S_kv > 1: the kernel is right
    assert without_masked_rows(grad_out, None) is grad_out


# QwenImage's joint mask under Ulysses on 0.36 - 0.38 (qwen_joint_mask_order): tests/fixes/.


# --- torch.autocast: q/k/v cast as F.scaled_dot_product_attention's autocast rule casts them ------------------


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_autocast_casts_q_k_v_as_sdpa_does(patched, compiled: bool) -> None:
    """Under ``torch.autocast(bf16)`` with fp32 weights a model's norms hand attention fp32 q/k beside bf16 v
    (QwenImage's RMSNorm under CUDA autocast). ``F.scaled_dot_product_attention`` casts them to the autocast
    dtype; the raw cuDNN op has no autocast rule, and the dtype guard refused them. The package now casts them,
    so the result is the bf16 one (up to bf16 rounding: autocast reaches the stand-in kernel's own arithmetic
    on the CPU), with or without ``torch.compile``; without autocast they are still refused."""
    import subprocess_compile_matrix
    import torch

    one = subprocess_compile_matrix.attention_fn(patched, "pair", None)
    fn = torch.compile(one, backend="aot_eager", fullgraph=True) if compiled else one
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 32, 4, 32, generator=gen) for _ in range(4))
    keep = torch.ones(2, 1, 1, 32, dtype=torch.bool)
    keep[1, ..., -8:] = False

    def run(inputs: list, autocast: bool) -> list:
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn(*leaves, keep)
        out.backward(grad.to(out.dtype))
        return [out.detach(), *(x.grad for x in leaves)]

    want = run([x.to(torch.bfloat16) for x in (q, k, v)], autocast=False)
    got = run([q, k, v.to(torch.bfloat16)], autocast=True)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32  # autograd casts q's grad back
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2, msg=name)
    # Compiled with fullgraph=True, a refusal reaches the caller as dynamo's error carrying the package's message.
    with pytest.raises((UnsafeAttentionError, torch._dynamo.exc.Unsupported), match=r"q/k/v of dtypes torch\.float32"):
        run([q, k, v.to(torch.bfloat16)], autocast=False)
