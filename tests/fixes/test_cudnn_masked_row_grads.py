"""``cudnn_masked_row_grads`` (fixes/cudnn_masked_row_grads.py): cuDNN's backward gets a fully masked query row
wrong when there is one key/value position (cuDNN 9.19, measured on an H200; the CPU stand-in is faithful to it).

* The check: broken on every release with the op (0.39.0 and 0.42.1 here); the replacement passes it.
* The policy: such a row gets no gradient before the kernel, which is exact: the gradients come out right; rows
  that see their key, and fp16 masks (-65504 is an ordinary bias there), are left alone.
* The control: the backward the guard wraps, on the same inputs, is wrong.

In process on diffusers 0.39.0 (conftest). On a GPU: tests/test_gpu.py.
"""

from __future__ import annotations

import pytest
from harness import op_pair, pair_config
from releases import WITH_OPS, fix_states

import diffusers_cudnn_fix

FIX = "cudnn_masked_row_grads"
#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them).
CARRIES = WITH_OPS
CORRECTION = False  # a guard: the package refuses or converts the input (True: a correction)


@pytest.mark.slow
def test_the_check_finds_the_bug_and_passes_the_replacement() -> None:
    """Every release with the op carries it: broken as shipped, and the package's replacement passes the same
    check (``guarded``)."""
    for version in ("0.39.0", "0.42.1"):
        assert fix_states(version)[FIX] == ["broken", True, "guarded"], version


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
