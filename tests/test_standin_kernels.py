"""Tests of the CPU stand-in kernels in tests/standin_kernels.py.

The stand-ins replace CUDA-only ATen ops in every other CPU test, so they are checked here against
fp32 math SDPA (forward and backward) and against the behaviour of the real ops recorded in
docs/kernel-facts.md, including the silent misbehaviours the stand-ins must reproduce.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:  # tests/ as a package (someone may add tests/__init__.py)
    from . import standin_kernels as sk
except ImportError:  # rootdir/prepend or importlib import modes
    _HERE = str(Path(__file__).resolve().parent)
    if _HERE not in sys.path:
        sys.path.insert(0, _HERE)
    import standin_kernels as sk

aten = torch.ops.aten
BF16 = torch.bfloat16
REL_TOL = 2e-2  # bf16-level error, relative to the reference magnitude


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    sk.register()


@pytest.fixture(autouse=True)
def _default_flags():
    """Every test starts and ends with the default (mimicking, non-strict) behaviour."""
    old_dtype = sk.strict_dtype(False)
    old_strides = sk.strict_grad_out_strides(False)
    yield
    sk.strict_dtype(old_dtype)
    sk.strict_grad_out_strides(old_strides)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def _randn(*shape: int, seed: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def _qkv(b: int, hq: int, sq: int, skv: int, d: int, hkv: int | None = None, dtype=BF16, seed=0):
    hkv = hq if hkv is None else hkv
    return (
        _randn(b, hq, sq, d, seed=seed, dtype=dtype),
        _randn(b, hkv, skv, d, seed=seed + 1, dtype=dtype),
        _randn(b, hkv, skv, d, seed=seed + 2, dtype=dtype),
    )


def _cudnn(q, k, v, *, bias=None, causal=False, lse=True, scale=None):
    return aten._scaled_dot_product_cudnn_attention(q, k, v, bias, lse, 0.0, causal, False, scale=scale)


def _cudnn_bwd(grad_out, q, k, v, fwd, *, bias=None, causal=False, lse="from_fwd", scale=None):
    out, logsumexp = fwd[0], fwd[1] if lse == "from_fwd" else lse
    return aten._scaled_dot_product_cudnn_attention_backward(
        grad_out,
        q,
        k,
        v,
        out,
        logsumexp,
        fwd[6],
        fwd[7],
        bias,
        fwd[2],
        fwd[3],
        fwd[4],
        fwd[5],
        0.0,
        causal,
        scale=scale,
    )


def _flash(q, k, v, *, causal=False, scale=None):
    return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)


def _flash_bwd(grad_out, q, k, v, fwd, *, causal=False, lse="from_fwd", scale=None):
    out, logsumexp = fwd[0], fwd[1] if lse == "from_fwd" else lse
    return aten._scaled_dot_product_flash_attention_backward(
        grad_out,
        q,
        k,
        v,
        out,
        logsumexp,
        fwd[2],
        fwd[3],
        fwd[4],
        fwd[5],
        0.0,
        causal,
        fwd[6],
        fwd[7],
        scale=scale,
    )


def _run(kind: str, q, k, v, grad_out, *, causal=False, bias=None):
    """Forward then backward through the raw ops; returns (out, lse (B,H,S_q), (dq, dk, dv))."""
    if kind == "cudnn":
        fwd = _cudnn(q, k, v, bias=bias, causal=causal)
        grads = _cudnn_bwd(grad_out, q, k, v, fwd, bias=bias, causal=causal)
        lse = fwd[1].squeeze(-1) if sk.LSE_IS_4D else fwd[1]
    else:
        assert bias is None
        fwd = _flash(q, k, v, causal=causal)
        grads = _flash_bwd(grad_out, q, k, v, fwd, causal=causal)
        lse = fwd[1]
    return fwd[0], lse, grads


def _sdpa_reference(q, k, v, grad_out, *, causal=False, attn_mask=None):
    """fp32 math-backend F.sdpa output, log-sum-exp and gradients for the same (bf16) values."""
    leaves = [t.detach().to(torch.float32).requires_grad_() for t in (q, k, v)]
    gqa = k.size(1) != q.size(1)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*leaves, attn_mask=attn_mask, is_causal=causal, enable_gqa=gqa)
    out.backward(grad_out.to(torch.float32))
    kx = leaves[1].detach().repeat_interleave(q.size(1) // k.size(1), dim=1)
    scores = leaves[0].detach() @ kx.transpose(-2, -1) / math.sqrt(q.size(-1))
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return out.detach(), lse, tuple(t.grad for t in leaves)


def _reference_grads(q, k, v, grad_out, **mask_kwargs):
    leaves = [t.detach().to(torch.float32).requires_grad_() for t in (q, k, v)]
    out = sk.reference_attention(*leaves, **mask_kwargs)
    out.backward(grad_out.to(torch.float32))
    return out.detach(), tuple(t.grad for t in leaves)


def _rel(err: float, ref: torch.Tensor) -> float:
    return err / max(ref.abs().max().item(), 1e-6)


def _assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float = REL_TOL) -> None:
    assert not torch.isnan(got).any(), f"{name}: NaN"
    rel = _rel(sk.max_abs_error(got, ref), ref)
    assert rel < tol, f"{name}: relative error {rel:.4g} >= {tol}"


def _bshd_view(b: int, s: int, h: int, d: int, seed: int) -> torch.Tensor:
    """(B, H, S, D)-shaped transpose view of (B, S, H, D) memory, as diffusers' model layout gives."""
    return _randn(b, s, h, d, seed=seed).transpose(1, 2)


# --------------------------------------------------------------------------------------------------
# correctness against fp32 math SDPA
# --------------------------------------------------------------------------------------------------
SHAPES = [
    pytest.param((2, 16, 16, 16, 64, 16, False), id="B2-H16-S16-D64-heads_eq_seq"),
    pytest.param((2, 8, 128, 128, 64, 8, False), id="B2-H8-S128-D64"),
    pytest.param((2, 4, 12, 20, 64, 4, False), id="H4-Sq12-Skv20"),
    pytest.param((2, 4, 12, 20, 64, 4, True), id="H4-Sq12-Skv20-causal"),
    pytest.param((2, 8, 32, 32, 64, 2, False), id="GQA-Hq8-Hkv2"),
]


@pytest.mark.parametrize("kind", ["cudnn", "flash"])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_backward_match_fp32_math_sdpa(kind, shape):
    b, hq, sq, skv, d, hkv, causal = shape
    q, k, v = _qkv(b, hq, sq, skv, d, hkv, seed=10)
    grad_out = _randn(b, hq, sq, d, seed=20)
    out, lse, grads = _run(kind, q, k, v, grad_out, causal=causal)
    ref_out, ref_lse, ref_grads = _sdpa_reference(q, k, v, grad_out, causal=causal)

    assert out.dtype == BF16 and out.shape == (b, hq, sq, d)
    assert lse.dtype == torch.float32
    _assert_close("out", out, ref_out)
    assert sk.max_abs_error(lse, ref_lse) < 1e-4
    for name, got, ref, like in zip(("dq", "dk", "dv"), grads, ref_grads, (q, k, v)):
        assert got.dtype == BF16 and got.shape == like.shape
        _assert_close(name, got, ref)


def test_lse_layout_and_compute_log_sumexp_false():
    q, k, v = _qkv(2, 4, 12, 20, 64)
    lse = _cudnn(q, k, v)[1]
    expected = (2, 4, 12, 1) if sk.LSE_IS_4D else (2, 4, 12)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == expected and lse.is_contiguous()
    assert _cudnn(q, k, v, lse=False)[1] is None  # the real op returns no log-sum-exp
    flash_lse = _flash(q, k, v)[1]
    assert flash_lse.dtype == torch.float32 and tuple(flash_lse.shape) == (2, 4, 12)


def test_lse_version_rule():
    assert not sk.lse_is_4d("2.8.0+cu128")
    assert sk.lse_is_4d("2.9.0")
    assert sk.lse_is_4d("2.10.0a0+git1234")
    assert sk.lse_is_4d("3.0")
    assert sk.LSE_IS_4D == sk.lse_is_4d(torch.__version__)


# --------------------------------------------------------------------------------------------------
# errors of the real ops
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["cudnn", "flash"])
@pytest.mark.parametrize("missing", ["none", "empty"])
def test_missing_lse_raises(kind, missing):
    q, k, v = _qkv(1, 2, 8, 8, 64)
    grad_out = _randn(1, 2, 8, 64, seed=5)
    lse = None if missing == "none" else torch.empty(0)
    with pytest.raises(RuntimeError, match="logsumexp is missing"):
        if kind == "cudnn":
            _cudnn_bwd(grad_out, q, k, v, _cudnn(q, k, v, lse=False), lse=lse)
        else:
            _flash_bwd(grad_out, q, k, v, _flash(q, k, v), lse=lse)


@pytest.mark.skipif(not sk.LSE_IS_4D, reason="the 3-D log-sum-exp is the valid form before 2.9")
def test_3d_lse_into_cudnn_backward_raises():
    q, k, v = _qkv(1, 2, 8, 8, 64)
    fwd = _cudnn(q, k, v)
    with pytest.raises(RuntimeError, match="cuDNN Frontend error: Stats dim is invalid"):
        _cudnn_bwd(_randn(1, 2, 8, 64, seed=5), q, k, v, fwd, lse=fwd[1].squeeze(-1))


def test_gqa_mismatch_raises_with_real_messages():
    # diffusers' buggy backward hands K/V over as (B, S, H, D): with S=128, H=8 their "heads" are 128.
    q, k, v = _qkv(2, 8, 128, 128, 64)
    k_bad, v_bad = (t.transpose(1, 2).contiguous() for t in (k, v))
    with pytest.raises(RuntimeError) as info:
        _cudnn(q, k_bad, v_bad)
    assert str(info.value).startswith(sk.CUDNN_GQA_MESSAGE)
    fwd = _cudnn(q, k, v)
    with pytest.raises(RuntimeError, match="For group-query attention, number of heads"):
        _cudnn_bwd(_randn(2, 8, 128, 64, seed=3), q, k_bad, v_bad, fwd)
    with pytest.raises(RuntimeError, match="Number of heads in key/value must divide"):
        _flash(q, k_bad, v_bad)
    # key and value head counts must agree even when both divide the query heads
    with pytest.raises(RuntimeError, match="For group-query attention"):
        _cudnn(q, k[:, :4], v[:, :2])


def test_other_shape_and_stride_checks_raise():
    q, k, v = _qkv(2, 4, 8, 8, 64)
    with pytest.raises(RuntimeError, match="head dims differ"):
        _cudnn(q, k[..., :32], v)
    with pytest.raises(RuntimeError, match="batch size"):
        _cudnn(q, k[:1], v[:1])
    with pytest.raises(RuntimeError, match="sequence lengths differ"):
        _cudnn(q, k, v[:, :, :4])
    with pytest.raises(RuntimeError, match="stride 1 in its last dimension"):
        _cudnn(_randn(2, 4, 64, 8, seed=1).transpose(-2, -1), k, v)
    with pytest.raises(RuntimeError, match="stride 1 in its last dimension"):
        _flash(q, k, _randn(2, 4, 64, 8, seed=1).transpose(-2, -1))
    with pytest.raises(NotImplementedError):
        aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.1)


# --------------------------------------------------------------------------------------------------
# the bug the stand-ins exist for
# --------------------------------------------------------------------------------------------------
def test_kv_transposed_into_backward_gives_wrong_gradients():
    """H == S hides the layout error from every shape check; the gradients must still be wrong."""
    b, h, s, d = 2, 16, 16, 64
    q, k, v = _qkv(b, h, s, s, d, seed=30)
    grad_out = _randn(b, h, s, d, seed=31)
    fwd = _cudnn(q, k, v)
    # what diffusers <= 0.39 does: K/V saved in (B, H, S, D), transposed once more in the backward
    k_bad, v_bad = (t.transpose(1, 2).contiguous() for t in (k, v))
    grads = _cudnn_bwd(grad_out, q, k_bad, v_bad, fwd)
    _, _, ref_grads = _sdpa_reference(q, k, v, grad_out)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert _rel(sk.max_abs_error(got, ref), ref) > 0.5, name
        if name != "dq":  # not merely the right numbers in the other layout either
            assert _rel(sk.max_abs_error(got.transpose(1, 2), ref), ref) > 0.5, name
    # and the same call with the layout the forward used is right
    for name, got, ref in zip(("dq", "dk", "dv"), _cudnn_bwd(grad_out, q, k, v, fwd), ref_grads):
        _assert_close(name, got, ref)


@pytest.mark.parametrize("kind", ["cudnn", "flash"])
def test_backward_uses_the_given_lse_and_out(kind):
    """The backward must not recompute what it is handed: a stale LSE or out must show."""
    q, k, v = _qkv(2, 4, 16, 16, 64, seed=35)
    grad_out = _randn(2, 4, 16, 64, seed=36)
    fwd = _cudnn(q, k, v) if kind == "cudnn" else _flash(q, k, v)
    bwd = _cudnn_bwd if kind == "cudnn" else _flash_bwd
    _, _, ref_grads = _sdpa_reference(q, k, v, grad_out)
    stale = bwd(grad_out, q, k, v, fwd, lse=fwd[1] + 0.5)
    assert all(_rel(sk.max_abs_error(g, r), r) > 0.2 for g, r in zip(stale, ref_grads))
    # a wrong out changes dQ/dK (through rowsum(dO * out)) but not dV = P^T dO
    wrong_out = list(fwd)
    wrong_out[0] = (fwd[0].float() + 1.0).to(BF16)
    dq, dk, dv = bwd(grad_out, q, k, v, tuple(wrong_out))
    assert _rel(sk.max_abs_error(dq, ref_grads[0]), ref_grads[0]) > 0.2
    assert _rel(sk.max_abs_error(dk, ref_grads[1]), ref_grads[1]) > 0.2
    _assert_close("dv", dv, ref_grads[2])


@pytest.mark.parametrize("kind", ["cudnn", "flash"])
def test_strided_views_give_correct_results(kind):
    b, h, s, d = 2, 4, 24, 64
    q = _bshd_view(b, s, h, d, seed=40)  # transpose view of (B, S, H, D) memory
    k = _randn(b, h, 2 * s, 2 * d, seed=41)[:, :, ::2, :d]  # every other row, half the columns
    v = _randn(s, b, h, d, seed=42).permute(1, 2, 0, 3)  # (S, B, H, D) memory order
    assert not any(t.is_contiguous() for t in (q, k, v)) and all(t.stride(-1) == 1 for t in (q, k, v))
    grad_values = _randn(b, h, s, d, seed=43)
    out_like = _cudnn(q, k, v)[0] if kind == "cudnn" else _flash(q, k, v)[0]
    grad_out = torch.empty_like(out_like).copy_(grad_values)  # in out's own layout
    out, _, grads = _run(kind, q, k, v, grad_out)
    ref_out, _, ref_grads = _sdpa_reference(q, k, v, grad_values)
    _assert_close("out", out, ref_out)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        _assert_close(name, got, ref)


def test_output_and_gradient_strides_follow_the_inputs():
    b, h, s, d = 2, 4, 12, 64
    q, k, v = (_bshd_view(b, s, h, d, seed=i) for i in (50, 51, 52))
    bshd = (s * h * d, d, h * d, 1)
    # cuDNN keeps query's memory order from torch 2.8; before, its output is dense (B, H, S, D).
    assert _cudnn(q, k, v)[0].stride() == (bshd if sk.CUDNN_OUT_MATCHES_QUERY else (s * h * d, s * d, d, 1))
    assert _flash(q, k, v)[0].stride() == bshd
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    assert _cudnn(qc, kc, vc)[0].is_contiguous() and _flash(qc, kc, vc)[0].is_contiguous()
    # value head dim differs from query's: cuDNN keeps query's dimension order for the new shape
    out_dv = _cudnn(q, k, _bshd_view(b, s, h, 32, seed=53))[0]
    assert out_dv.shape == (b, h, s, 32)
    assert out_dv.stride() == (s * h * 32, 32, h * 32, 1) if sk.CUDNN_OUT_MATCHES_QUERY else out_dv.is_contiguous()
    # gradients come back laid out like their inputs (empty_like in the real and meta kernels)
    fwd = _cudnn(q, k, v)
    grad_out = torch.empty_like(fwd[0]).copy_(_randn(b, h, s, d, seed=54))
    for grad, like in zip(_cudnn_bwd(grad_out, q, k, v, fwd), (q, k, v)):
        assert grad.stride() == like.stride()
    for grad, like in zip(_flash_bwd(grad_out, q, k, v, _flash(q, k, v)), (q, k, v)):
        assert grad.stride() == like.stride()


# --------------------------------------------------------------------------------------------------
# silent misbehaviours of the real ops
# --------------------------------------------------------------------------------------------------
def test_fp32_inputs_give_deterministic_garbage_or_raise():
    q, k, v = _qkv(2, 4, 12, 12, 64, dtype=torch.float32, seed=60)
    grad_out = _randn(2, 4, 12, 64, seed=61, dtype=torch.float32)
    ref_out, _, ref_grads = _sdpa_reference(q, k, v, grad_out)
    fwd = _cudnn(q, k, v)
    assert fwd[0].dtype == torch.float32
    assert _rel(sk.max_abs_error(fwd[0], ref_out), ref_out) > 0.5
    assert torch.equal(fwd[0], _cudnn(q, k, v)[0])  # deterministic
    grads = _cudnn_bwd(grad_out, q, k, v, fwd)
    for got, ref in zip(grads, ref_grads):
        assert _rel(sk.max_abs_error(got, ref), ref) > 0.5
    with pytest.raises(RuntimeError, match=sk.FLASH_DTYPE_MESSAGE):
        _flash(q, k, v)

    assert sk.strict_dtype(True) is False
    assert sk.strict_dtype() is True
    with pytest.raises(RuntimeError, match="strict_dtype"):
        _cudnn(q, k, v)
    with pytest.raises(RuntimeError, match="strict_dtype"):
        _cudnn_bwd(grad_out, q, k, v, fwd)
    with pytest.raises(RuntimeError, match="does not support dtype"):
        _cudnn(*(t.double() for t in (q, k, v)))


def test_grad_out_with_other_strides_than_out():
    b, h, s, d = 2, 4, 16, 64
    q, k, v = (_bshd_view(b, s, h, d, seed=i) for i in (70, 71, 72))
    fwd = _cudnn(q, k, v)  # out comes back in (B, S, H, D) memory (dense (B, H, S, D) before torch 2.8)
    grad_values = _randn(b, h, s, d, seed=73)  # contiguous (B, H, S, D): other strides than out
    if not sk.CUDNN_OUT_MATCHES_QUERY:
        grad_values = _bshd_view(b, s, h, d, seed=73)
    assert grad_values.stride() != fwd[0].stride()
    _, _, ref_grads = _sdpa_reference(q, k, v, grad_values)

    matching = torch.empty_like(fwd[0]).copy_(grad_values)
    for name, got, ref in zip(("dq", "dk", "dv"), _cudnn_bwd(matching, q, k, v, fwd), ref_grads):
        _assert_close(name, got, ref)
    wrong = _cudnn_bwd(grad_values, q, k, v, fwd)
    assert max(_rel(sk.max_abs_error(g, r), r) for g, r in zip(wrong, ref_grads)) > 0.5
    # flash makes grad_out contiguous itself, so the same call is right there
    ffwd = _flash(q, k, v)
    for name, got, ref in zip(("dq", "dk", "dv"), _flash_bwd(grad_values, q, k, v, ffwd), ref_grads):
        _assert_close(name, got, ref)

    sk.strict_grad_out_strides(True)
    with pytest.raises(RuntimeError, match="strict_grad_out_strides"):
        _cudnn_bwd(grad_values, q, k, v, fwd)
    _cudnn_bwd(matching, q, k, v, fwd)  # matching strides still fine in strict mode


def _mask_with_dead_row(b: int, s: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(80)
    keep = torch.rand(b, 1, s, s, generator=gen) > 0.4
    keep[..., :, 0] = True
    keep[:, :, 3, :] = False  # one fully masked row
    return keep


def test_bool_bias_is_read_as_additive_zero_one():
    b, h, s, d = 1, 2, 32, 64
    q, k, v = _qkv(b, h, s, s, d, seed=81)
    keep = _mask_with_dead_row(b, s)
    out = _cudnn(q, k, v, bias=keep)[0]
    as_numbers = sk.reference_attention(q, k, v, additive_mask=keep.to(torch.float32))
    masked = sk.reference_attention(q, k, v, bool_mask=keep)
    _assert_close("out vs 0/1 additive", out, as_numbers)
    assert _rel(sk.max_abs_error(out, masked), masked) > 0.1


@pytest.mark.parametrize("fill", ["-inf", "finfo.min"])
def test_additive_bias_in_q_dtype_masks_and_zeroes_dead_rows(fill):
    b, h, s, d = 1, 2, 32, 64
    q, k, v = _qkv(b, h, s, s, d, seed=82)
    keep = _mask_with_dead_row(b, s)
    value = float("-inf") if fill == "-inf" else torch.finfo(BF16).min
    bias = torch.zeros(keep.shape, dtype=BF16).masked_fill(~keep, value)
    grad_out = _randn(b, h, s, d, seed=83)
    out, lse, grads = _run("cudnn", q, k, v, grad_out, bias=bias)
    ref_out, ref_grads = _reference_grads(q, k, v, grad_out, bool_mask=keep)
    assert torch.all(out[:, :, 3] == 0)
    assert torch.all(torch.isneginf(lse[:, :, 3]))
    _assert_close("out", out, ref_out)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert torch.isfinite(got).all(), name
        _assert_close(name, got, ref)


def test_fp16_max_bias_leaves_dead_row_unmasked():
    """-65504 (F.sdpa's own bool-mask conversion for cuDNN) does not zero a fully masked row."""
    b, h, s, d = 1, 2, 32, 64
    q, k, v = _qkv(b, h, s, s, d, seed=84)
    keep = _mask_with_dead_row(b, s)
    out = _cudnn(q, k, v, bias=torch.zeros(keep.shape, dtype=BF16).masked_fill(~keep, -65504.0))[0]
    assert out[:, :, 3].abs().max() > 0.01  # the row attends to every key instead of none


def test_bias_of_another_dtype_is_misread():
    b, h, s, d = 1, 2, 16, 64
    q, k, v = _qkv(b, h, s, s, d, seed=85)
    bias = _randn(b, 1, s, s, seed=86, dtype=torch.float32)
    out = _cudnn(q, k, v, bias=bias)[0]
    right = sk.reference_attention(q, k, v, additive_mask=bias)
    assert _rel(sk.max_abs_error(out, right), right) > 0.1
    # the same values in q's dtype are read correctly
    _assert_close(
        "out", _cudnn(q, k, v, bias=bias.to(BF16))[0], sk.reference_attention(q, k, v, additive_mask=bias.to(BF16))
    )


# --------------------------------------------------------------------------------------------------
# dispatcher: autograd, meta kernels, registration
# --------------------------------------------------------------------------------------------------
def test_autograd_routes_the_forward_op_to_the_standin_backward():
    q, k, v = (t.requires_grad_() for t in _qkv(2, 4, 16, 16, 64, seed=90))
    grad_out = _randn(2, 4, 16, 64, seed=91)
    aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[0].backward(grad_out)
    _, _, ref_grads = _sdpa_reference(q, k, v, grad_out)
    for name, leaf, ref in zip(("dq", "dk", "dv"), (q, k, v), ref_grads):
        _assert_close(name, leaf.grad, ref)
    # without the log-sum-exp the autograd backward must not silently succeed
    out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, False)[0]
    with pytest.raises(RuntimeError, match="logsumexp is missing"):
        out.backward(grad_out)


def _describe(outputs) -> list:
    return [(tuple(x.shape), x.dtype, tuple(x.stride())) if isinstance(x, torch.Tensor) else x for x in outputs]


@pytest.mark.parametrize("layout", ["contiguous", "bshd_view"])
def test_meta_kernels_still_work_and_match_standin_metadata(layout):
    assert sk.is_registered()
    b, h, sq, skv, d = 2, 4, 12, 20, 64

    def make(device, s, seed):
        if layout == "contiguous":
            return _randn(b, h, s, d, seed=seed).to(device)
        return _randn(b, s, h, d, seed=seed).to(device).transpose(1, 2)

    cpu = [make("cpu", s, i) for i, s in enumerate((sq, skv, skv))]
    meta = [make("meta", s, i) for i, s in enumerate((sq, skv, skv))]

    meta_fwd = _cudnn(*meta)
    cpu_fwd = _cudnn(*cpu)
    assert meta_fwd[0].device.type == "meta"
    assert _describe(cpu_fwd) == _describe(meta_fwd)
    # The meta kernel always allocates a log-sum-exp; the real op (and the stand-in) gives None
    # when compute_log_sumexp=False.
    assert isinstance(_cudnn(*meta, lse=False)[1], torch.Tensor)
    assert _cudnn(*cpu, lse=False)[1] is None

    meta_ffwd, cpu_ffwd = _flash(*meta), _flash(*cpu)
    assert _describe(cpu_ffwd) == _describe(meta_ffwd)

    grad_cpu = torch.empty_like(cpu_fwd[0]).copy_(_randn(b, h, sq, d, seed=9))
    grad_meta = torch.empty_like(meta_fwd[0])
    assert _describe(_cudnn_bwd(grad_cpu, *cpu, cpu_fwd)) == _describe(_cudnn_bwd(grad_meta, *meta, meta_fwd))
    assert _describe(_flash_bwd(grad_cpu, *cpu, cpu_ffwd)) == _describe(_flash_bwd(grad_meta, *meta, meta_ffwd))


def test_register_is_idempotent_and_shared_between_module_copies():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sk.register()
        # a second copy of the module (another import name) shares the same registration and flags
        spec = importlib.util.spec_from_file_location("_standin_kernels_copy", sk.__file__)
        copy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(copy)
        copy.register()
    assert not [w for w in caught if "Overriding" in str(w.message)]
    assert sk.is_registered() and copy.is_registered()
    copy.strict_dtype(True)
    assert sk.strict_dtype() is True


def test_reference_helpers():
    q, k, v = _qkv(1, 2, 8, 8, 64, seed=95)
    keep = _mask_with_dead_row(1, 8)
    ref = sk.reference_attention(q, k, v, bool_mask=keep, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=keep & torch.ones(8, 8, dtype=torch.bool).tril()
        )
    assert sk.max_abs_error(ref, expected) < 1e-5
    assert torch.all(ref[:, :, 3] == 0)
    assert sk.max_abs_error(torch.tensor([float("-inf"), 1.0]), torch.tensor([float("-inf"), 1.5])) == 0.5
    assert sk.max_abs_error(torch.tensor([float("nan")]), torch.tensor([0.0])) == float("inf")


def test_one_query_and_one_key_position_run_forward_but_not_backward():
    """The real cuDNN backward refuses S_q = S_kv = 1 (H200, cuDNN 9.19); the forward runs (out = v)."""
    q, k, v = _qkv(2, 3, 1, 1, 8, seed=90)
    fwd = _cudnn(q, k, v)
    torch.testing.assert_close(fwd[0].float(), v.float(), atol=1e-2, rtol=1e-2)
    with pytest.raises(RuntimeError, match="s_q = s_kv = 1 is not supported"):
        _cudnn_bwd(torch.ones_like(q), q, k, v, fwd)
    q2, k2, v2 = _qkv(2, 3, 2, 1, 8, seed=91)  # one key, two queries: fine
    _cudnn_bwd(torch.ones_like(q2), q2, k2, v2, _cudnn(q2, k2, v2))


def test_a_masked_row_with_one_key_gets_wrong_gradients_in_bf16():
    """The backward's fault with one key position (H200, cuDNN 9.19): bf16, S_q < 8, a row whose key is
    masked; with that row's grad_out at 0 the gradients are right (the masked-row guard's remedy)."""
    b, h, sq, d = 1, 2, 5, 8
    q, k, v = _qkv(b, h, sq, 1, d, seed=92)
    bias = torch.zeros(b, 1, sq, 1, dtype=BF16)
    bias[:, :, 2] = float("-inf")
    grad_out = _randn(b, h, sq, d, seed=93)
    keep = torch.isfinite(bias)
    _, ref_grads = _reference_grads(q, k, v, grad_out, bool_mask=keep)
    fwd = _cudnn(q, k, v, bias=bias)
    faulty = _cudnn_bwd(grad_out, q, k, v, fwd, bias=bias)
    assert max((g.float() - r).abs().max().item() for g, r in zip(faulty, ref_grads)) > 0.1
    right = _cudnn_bwd(grad_out.masked_fill(~keep, 0.0), q, k, v, fwd, bias=bias)
    for got, want in zip(right, ref_grads):
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
