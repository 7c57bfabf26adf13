"""Key-padding masks run on the valid keys alone (``diffusers_cudnn_fix/_key_padding.py``).

In-process on diffusers 0.39.0 (the package's corrected op pair behind the guards), once on 0.42.1 (diffusers'
own ops behind the guards) in a fresh interpreter. The op pair is driven as diffusers' templated attention
drives it (``ctx.backward_op`` set before the forward op runs); the biased path is the same call with a context
whose backward op cannot scatter, which the forward must then leave alone. What reaches the kernel is read with
a dispatch mode, which also counts host syncs outside the kernels. The contract: docs/behaviour.md, "Key-padding
masks".
"""

from __future__ import annotations

import types
import warnings

import pytest
from harness import stand_in_collectives, ulysses_attention, ulysses_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from releases import release_dir, run
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

pytestmark = pytest.mark.filterwarnings("ignore::diffusers_cudnn_fix.MaskConvertedWarning")


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
