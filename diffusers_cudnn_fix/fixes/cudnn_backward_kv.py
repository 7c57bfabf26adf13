"""cuDNN backward op transposes the saved K and V a second time.

Bug: the forward saves q/k/v in kernel layout, the backward transposes k and v again: wrong gradients
(num_heads == seq_len) or a cuDNN error. Releases 0.36.0-0.39.0 (fixed in 0.40.0, #14274; reported #14341).
Detection: the q/k/v shapes reaching the backward kernel against those that reached the forward kernel.
The package: :func:`corrected_backward` hands the kernel the saved tensors as saved (docs/fixes.md).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _detect, _ledger
from .._fix import Finding, Lookup
from .._layout import lse_with_ndim, reject_per_step_tensors, with_strides_of
from . import CUDNN_BACKWARD, CUDNN_FORWARD

FIX_ID = "cudnn_backward_kv"

LSE_MISSING = (
    "diffusers_cudnn_fix: the cuDNN attention forward saved no log-sum-exp, so its backward would return "
    "garbage gradients. Keep the 'cudnn_forward_lse' fix enabled (remove it from DIFFUSERS_CUDNN_FIX_SKIP)."
)

#: Dims of the log-sum-exp this torch's cuDNN backward kernel takes (4 from torch 2.9 on, else 3).
LSE_NDIM = _detect.cudnn_lse_ndim()


def corrected_backward(ctx: Any, grad_out: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """cuDNN attention backward for diffusers' templated attention, corrected: ``grad_out`` (B, S, H, D) in,
    (dq, dk, dv) in (B, S, H, D) out; raises where the forward saved no log-sum-exp."""
    if _ledger.recording:
        _ledger.reached(FIX_ID)
    if kwargs:
        reject_per_step_tensors(kwargs, FIX_ID)
    q, k, v, out, lse, cum_seq_q, cum_seq_k, philox_seed, philox_offset = ctx.saved_tensors
    if lse is None:
        # The real kernel accepts a missing log-sum-exp and returns garbage: stop here instead.
        raise RuntimeError(LSE_MISSING)
    grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out=with_strides_of(grad_out.transpose(1, 2), out),
        query=q,
        key=k,
        value=v,
        out=out,
        logsumexp=lse if lse.dim() == LSE_NDIM else lse_with_ndim(lse, LSE_NDIM),
        philox_seed=philox_seed,
        philox_offset=philox_offset,
        attn_bias=ctx.attn_mask,
        cum_seq_q=cum_seq_q,
        cum_seq_k=cum_seq_k,
        max_q=ctx.max_q,
        max_k=ctx.max_k,
        dropout_p=ctx.dropout_p,
        is_causal=ctx.is_causal,
        scale=ctx.scale,
    )
    return grad_q.transpose(1, 2).contiguous(), grad_k.transpose(1, 2).contiguous(), grad_v.transpose(1, 2).contiguous()


def check(lookup: Lookup) -> Finding:
    forward = lookup(CUDNN_FORWARD)
    return _detect.check_backward_layout(
        forward, lookup(CUDNN_BACKWARD), _detect.CUDNN_FORWARD_KERNEL, _detect.CUDNN_BACKWARD_KERNEL
    )
