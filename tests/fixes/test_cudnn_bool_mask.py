"""``cudnn_bool_mask`` (fixes/cudnn_bool_mask.py, #14342): bool or wrongly typed masks reaching diffusers' cuDNN
context-parallel op are read as an additive bias; the package converts them (the default mask mode), passes them
through with a warning, or refuses them. Its key-padding plan (``diffusers_cudnn_fix/_key_padding.py``): a mask
that only pads keys runs the kernel on the valid keys alone.

* The check: broken on every release with the op (0.39.0 here), and the package's replacement passes it.
* The policy: convert mode gives reference outputs and gradients; warn and error modes; integer masks and masks
  requiring grad refused in every mode; the mask entering Ulysses (``ulysses_anything`` too) converted before
  the gather; key-padding masks on the valid keys alone, equal to the biased path.
* The control: the same masked cases without the conversion (warn mode, reverted, the package off) go wrong.

In-process cases run diffusers 0.39.0 (conftest); the 0.40-style forward (0.42.1) and whatever depends on
once-per-process state (the default mask mode, warn-once) run in fresh interpreters. The op pair is driven as
diffusers' templated attention drives it (``ctx.backward_op`` set before the forward op runs); for key padding the
biased path is the same call with a context whose backward op cannot scatter, which the forward must then leave
alone, and what reaches the kernel is read with a dispatch mode, which also counts host syncs outside the kernels.
The contract: docs/behaviour.md, "Masks reaching the cuDNN context-parallel op" and "Key-padding masks".
"""

from __future__ import annotations

import types
import warnings
from pathlib import Path

import pytest
import subprocess_op_pair_grads
from harness import op_pair, pair_config, stand_in_collectives, ulysses_attention, ulysses_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from releases import ROOT, WITH_OPS, fix_states, release_dir, run
from subprocess_key_padding import (
    CASES,
    MASK_KINDS,
    MASK_SHAPES,
    Seen,
    assert_same_as_biased,
    case_keep_rows,
    golden,
    inputs,
    keep_rows_of,
    make_mask,
    run_pair,
)

import diffusers_cudnn_fix
from diffusers_cudnn_fix import UnsafeAttentionError

FIX = "cudnn_bool_mask"
#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them).
CARRIES = WITH_OPS
CORRECTION = False  # a guard: the package refuses or converts the input (True: a correction)

# In-process cases convert bool masks on purpose: the once-per-process notice is expected here (the
# subprocess cases assert it), not something to leave in the test summary.
pytestmark = pytest.mark.filterwarnings("ignore::diffusers_cudnn_fix.MaskConvertedWarning")

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


# --- the check --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_check_finds_the_bug_and_passes_the_replacement() -> None:
    """Every release with the op carries it (none fixed as of 0.42.1): broken as shipped on 0.39.0 and 0.42.1,
    and the package's replacement passes the same check (``guarded``: a replacement that failed it would not be
    installed)."""
    for version in ("0.39.0", "0.42.1"):
        assert fix_states(version)[FIX] == ["broken", True, "guarded"], version
    assert fix_states("0.35.2")[FIX][0] == "absent"  # no context-parallel op at all


# --- the policy and its control: the mask modes ------------------------------------------------------------------


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
        "cp_gather_grads",
        "cp_no_accelerator",
        "cp_split_warning_once",
        "cudnn_bool_mask",
        "cudnn_input_dtypes",
        "cudnn_masked_row_grads",
        "flash_input_alignment",
        "ltx2_cp_plan",
        "ring_grad_route",
        "ulysses_head_mask",
        "ulysses_kv_length",
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


# --- the mask entering diffusers' ulysses_anything attention (0.39.0), converted before the gather ----------------


GATHER_SCRIPT = """
import json, tempfile, types, warnings, torch, torch.distributed as dist
import diffusers_cudnn_fix
import diffusers.models.attention_dispatch as module
import standin_kernels
from standin_kernels import reference_attention, max_abs_error
from torch.distributed.device_mesh import init_device_mesh
standin_kernels.register()
warnings.simplefilter("ignore")
dist.init_process_group("gloo", init_method="file://" + tempfile.mkstemp()[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
config = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(
    _ulysses_mesh=mesh, ulysses_degree=1, ring_degree=1, _world_size=1, ulysses_anything=True))
B, S, H, D = 2, 16, 4, 32
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(B, S, H, D, generator=gen).to(torch.bfloat16) for _ in range(3))
keep = torch.ones(B, 1, 1, S, dtype=torch.bool)
keep[1, ..., -4:] = False
gathered = []
real_gather = module.dist.all_gather
def spy(out, tensor, group=None):
    gathered.append(str(tensor.dtype))
    return real_gather(out, tensor, group=group)
module.dist = types.SimpleNamespace(**{n: getattr(dist, n) for n in dir(dist) if not n.startswith("__")})
module.dist.all_gather = spy
def attention(q, k, v, mask):
    return module.TemplatedUlyssesAnythingAttention.apply(
        q, k, v, mask, 0.0, False, None, False, False,
        module._cudnn_attention_forward_op, module._cudnn_attention_backward_op, config)
ref = reference_attention(*(x.float().transpose(1, 2) for x in (q, k, v)), bool_mask=keep).transpose(1, 2)
try:
    out = {"anything_patched": diffusers_cudnn_fix.is_patched("TemplatedUlyssesAnythingAttention.forward")}
except ValueError:  # a package that does not know the target
    out = {"anything_patched": None}
with torch.no_grad():
    out["eager"] = max_abs_error(attention(q, k, v, keep).float(), ref)
    out["gathered"] = gathered[:]
# A mask that requires grad: the backward raises, as shipped (nothing silent to guard).
try:
    attention(q, k, v, torch.zeros(B, 1, 1, S, dtype=torch.bfloat16, requires_grad=True)).float().sum().backward()
    out["backward"] = "returned"
except Exception as exc:
    out["backward"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
import os; os._exit(0)
"""


def _gather_run(env: dict[str, str] | None = None) -> dict:
    return run(release_dir("0.39.0"), GATHER_SCRIPT, env=env, timeout=600, preloaded=True)


def test_a_bool_mask_enters_ulysses_anything_converted_before_the_gather() -> None:
    """0.39.0: the mask diffusers' ulysses_anything attention all-gathers is an additive bf16 mask, not the bool
    one (as shipped: bool, which inductor gathers into a wrongly typed buffer); the output is right."""
    result = _gather_run()
    assert result["gathered"] == ["torch.bfloat16"], result
    assert result["anything_patched"] is True, result
    assert result["eager"] < 0.05, result
    assert result["backward"].startswith("NotImplementedError"), result


def test_shipped_ulysses_anything_gathers_the_bool_mask() -> None:
    """The control: with the package switched off, the bool mask is what diffusers gathers."""
    result = _gather_run(env={"DIFFUSERS_CUDNN_FIX": "0"})
    assert result["anything_patched"] is False, result
    assert result["gathered"] == ["torch.bool"], result
    assert result["backward"].startswith("NotImplementedError"), result


# --- the key-padding plan: key-padding masks run on the valid keys alone ------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_valid_keys_only_equal_the_biased_path(patched, case) -> None:
    """The kernel gets the valid keys only (a bias only for what a shorter element leaves), results equal the
    biased path and the fp32 reference within bf16 rounding, and the dropped keys get exactly zero dK/dV."""
    _, batch, seq_q, seq_kv, heads, dim, rows, shape, kind, expected = case
    keep_rows = case_keep_rows(batch, seq_kv, rows)
    mask = make_mask(keep_rows, shape, kind, heads, seq_q)
    q, k, v, g = inputs(batch, seq_q, seq_kv, heads, dim)
    fast, seen = run_pair(patched, q, k, v, mask, g)
    biased, seen_biased = run_pair(patched, q, k, v, mask, g, restoring=False)
    assert seen_biased.kernels == [(seq_kv, tuple(mask.shape))]  # the control: the whole K and the bias
    assert seen.kernels == [expected]
    assert_same_as_biased(fast, biased, golden(q, k, v, g, mask if kind == "bool" else mask == 0))
    dropped = ~keep_rows.expand(batch, seq_kv)
    for name in ("dk", "dv"):
        assert fast[name][dropped].eq(0).all(), name


@pytest.mark.parametrize("mode", ["warn", "error"])
def test_only_in_convert_mode(patched, mode) -> None:
    """warn mode is diffusers as shipped (the bool mask goes on as it is); error mode refuses bool masks, and
    an additive mask of q's dtype goes on untouched: no trimming in either."""
    import torch

    keep_rows = keep_rows_of(1, 16, [12])
    q, k, v, g = inputs(1, 12, 16, 2, 16)
    diffusers_cudnn_fix.set_mask_mode(mode)
    try:
        additive = make_mask(keep_rows, "key", "bfloat16", 2, 12)
        _, seen = run_pair(patched, q, k, v, additive, g)
        assert seen.kernels == [(16, (1, 1, 1, 16))]
        if mode == "warn":
            with warnings.catch_warnings():  # MaskMisreadWarning, once per process (tests/test_guards.py has it)
                warnings.simplefilter("ignore")
                _, seen = run_pair(patched, q, k, v, make_mask(keep_rows, "key", "bool", 2, 12), g)
            assert seen.kernels == [(16, (1, 1, 1, 16))]
    finally:
        diffusers_cudnn_fix.set_mask_mode("convert")
    _, seen = run_pair(patched, q, k, v, additive, g)
    assert seen.kernels == [(12, None)]
    assert torch.equal(additive, make_mask(keep_rows, "key", "bfloat16", 2, 12))  # the mask itself untouched


def test_one_host_sync_per_mask_object(patched) -> None:
    """Every layer reuses the mask: the plan is made once (one sync), again only for a changed or new mask."""
    keep_rows = keep_rows_of(2, 16, [9, 13])
    mask = make_mask(keep_rows, "key", "bool", 2, 12)
    q, k, v, g = inputs(2, 12, 16, 2, 16)
    syncs = [run_pair(patched, q, k, v, mask, g)[1].syncs for _ in range(4)]
    assert syncs == [1, 0, 0, 0]
    mask[1, ..., 13] = True  # in place: its version counter moves
    _, seen = run_pair(patched, q, k, v, mask, g)
    assert (seen.syncs, seen.kernels) == (1, [(14, (2, 1, 1, 14))])
    other = make_mask(keep_rows_of(2, 16, [3, 5], offset=1), "rows", "bool", 2, 12)
    assert [run_pair(patched, q, k, v, other, g)[1].syncs for _ in range(2)] == [1, 0]
    # A mask that is not key padding: planned once too, then the bias path at no further sync.
    rows = make_mask(keep_rows, "rows", "bool", 2, 12)
    rows[0, 0, 0, 0] = not bool(rows[0, 0, 0, 0])
    seen_twice = [run_pair(patched, q, k, v, rows, g)[1] for _ in range(2)]
    assert [(s.syncs, s.kernels) for s in seen_twice] == [(1, [(16, (2, 1, 12, 16))]), (0, [(16, (2, 1, 12, 16))])]


def test_compile_capture_inference_dropout_ring_and_no_scatter_keep_the_bias(patched, monkeypatch) -> None:
    """Where no plan may be made or used, the op gets the whole K/V and the bias, as before."""
    import torch

    keep_rows = keep_rows_of(1, 16, [12])
    mask = make_mask(keep_rows, "key", "bool", 2, 12)
    q, k, v, g = inputs(1, 12, 16, 2, 16)
    biased = (16, (1, 1, 1, 16))
    ring = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(_world_size=2, ring_degree=2))
    assert run_pair(patched, q, k, v, mask, g, config=ring)[1].kernels == [biased]
    assert run_pair(patched, q, k, v, mask, g, restoring=False)[1].kernels == [biased]
    with torch.inference_mode():
        inference_mask = mask.clone()
    assert run_pair(patched, q, k, v, inference_mask, g)[1].kernels == [biased]
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_initialized", lambda: True)
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert run_pair(patched, q, k, v, mask, g)[1].kernels == [biased]
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert run_pair(patched, q, k, v, mask, g)[1].kernels == [biased]
    assert run_pair(patched, q, k, v, mask, g)[1].kernels == [(12, None)]  # the control


def test_b1_with_no_valid_key_keeps_the_bias_path(patched) -> None:
    q, k, v, g = inputs(1, 12, 16, 2, 16)
    mask = make_mask(keep_rows_of(1, 16, [0]), "key", "bool", 2, 12)
    fast, seen = run_pair(patched, q, k, v, mask, g)
    assert seen.kernels == [(16, (1, 1, 1, 16))]
    assert all(t.eq(0).all() for t in fast.values())


def test_through_diffusers_ulysses_attention(patched, monkeypatch) -> None:
    """diffusers' own TemplatedUlyssesAttention (collectives stood in) sets ctx.backward_op itself: the fast
    path runs there, and its gradients match the fp32 reference."""
    import torch
    from standin_kernels import max_abs_error

    module = patched
    config = ulysses_config(stand_in_collectives(module, monkeypatch), convert_to_fp32=False)
    keep_rows = case_keep_rows(1, 16, "qwen")
    mask = make_mask(keep_rows, "key", "bool", 2, 16)
    q, k, v, g = inputs(1, 16, 16, 2, 16, seed=1)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    with Seen() as seen:
        out = ulysses_attention(module, *leaves, mask, config=config)
        out.backward(g)
    assert seen.kernels == [(13, None)]
    ref = golden(q, k, v, g, mask)
    got = {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    for name, tensor in got.items():
        assert max_abs_error(tensor.float(), ref[name]) <= 2**-6 * float(ref[name].abs().max()), name
    assert torch.equal(got["dk"][:, 4:7], torch.zeros_like(got["dk"][:, 4:7]))


@st.composite
def random_case(draw):
    batch = draw(st.integers(1, 3))
    heads, seq_q = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    seq_kv = draw(st.integers(1 if seq_q > 1 else 2, 12))  # cuDNN refuses S_q = S_kv = 1
    shape, kind = draw(st.sampled_from(MASK_SHAPES)), draw(st.sampled_from(MASK_KINDS))
    rows = 1 if shape == "shared" else batch
    keep = [[draw(st.booleans()) for _ in range(seq_kv)] for _ in range(rows)]
    padded = draw(st.lists(st.integers(0, rows - 1), max_size=rows))  # fully padded elements
    not_padding = draw(st.booleans()) and seq_q > 1  # one row differs: not key padding, the bias stays
    return batch, heads, seq_q, seq_kv, shape, kind, keep, padded, not_padding, draw(st.integers(0, 99))


@settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(random_case())
def test_random_masks_equal_the_biased_path(patched, case) -> None:
    import torch

    batch, heads, seq_q, seq_kv, shape, kind, keep, padded, not_padding, seed = case
    keep_rows = torch.tensor(keep, dtype=torch.bool)
    keep_rows[padded] = False
    mask = make_mask(keep_rows, shape, kind, heads, seq_q)
    if not_padding:
        mask = mask.expand(mask.shape[0], mask.shape[1], seq_q, seq_kv).contiguous()
        mask[..., 0, 0] = ~mask[..., 0, 0] if kind == "bool" else torch.where(mask[..., 0, 0] == 0, -torch.inf, 0)
    q, k, v, g = inputs(batch, seq_q, seq_kv, heads, 8, seed)
    fast, seen = run_pair(patched, q, k, v, mask, g)
    biased, _ = run_pair(patched, q, k, v, mask, g, restoring=False)
    bool_mask = mask if kind == "bool" else mask == 0
    assert_same_as_biased(fast, biased, golden(q, k, v, g, bool_mask))
    ((seen_kv, _),) = seen.kernels
    if not not_padding:
        valid = keep_rows.expand(batch, seq_kv)
        dropped = ~valid
        for name in ("dk", "dv"):
            assert fast[name][dropped].eq(0).all(), name
        longest = int(valid.sum(dim=1).max())
        if longest and not (longest == 1 and seq_q == 1):
            assert seen_kv == longest
    else:
        assert seen_kv == seq_kv


def test_diffusers_own_ops_on_0_42_1() -> None:
    """0.40+: diffusers' own forward / backward ops behind the package's wrappers get the trimmed K/V, and the
    backward wrapper scatters the gradients back."""
    results = run(release_dir("0.42.1"), "import subprocess_key_padding as s; s.main_cases()", preloaded=True)
    results.pop("_stderr")
    assert set(results) == {case[0] for case in CASES}
    for name, result in results.items():
        kernels = [[n, list(bias) if bias else None] for n, bias in result["kernels"]]
        expected = [[n, list(bias) if bias else None] for n, bias in result["expected"]]
        assert kernels == expected, (name, result)
        assert result["biased_kernels"][0][0] != result["kernels"][0][0] or name == "b2_all_valid", (name, result)
        assert result["ok"], (name, result)  # equal to the biased path, dropped keys' dK/dV exactly 0, no NaN
