"""cuDNN backward op transposes the saved K and V a second time.

Bug: ``_cudnn_attention_forward_op`` saves q, k, v already in kernel layout (B, H, S, D);
``_cudnn_attention_backward_op`` transposes k and v again (not q) before calling
``aten::_scaled_dot_product_cudnn_attention_backward``. With num_heads == seq_len the shapes still fit and
the gradients are unrelated to the true ones; otherwise cuDNN raises "For group-query attention, number of
heads for key and query must be a factor..." (docs/kernel-facts.md).

Releases: 0.36.0 to 0.39.0. Fixed upstream in 0.40.0 (huggingface/diffusers#14274); first reported with
the fix proposed in huggingface/diffusers#14341.

Detection: run the installed forward and backward on tiny CPU tensors with every dimension distinct
(``_detect``: the ATen calls are recorded, not computed) and compare the q/k/v shapes reaching the
backward kernel with those that reached the forward kernel.

Replacement: :func:`cudnn_attention_backward_op`, which hands the kernel the saved tensors as saved,
``grad_out`` with exactly ``out``'s strides and the log-sum-exp with the dims this torch's kernel expects,
and raises instead of computing garbage when the forward saved no log-sum-exp.

Revert: the shipped function object is put back (the registry keeps it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .. import _detect
from .._fix import Finding, Fix, Lookup
from .._layout import lse_with_ndim, reject_per_step_tensors, to_model_layout, with_strides_of

FIX_ID = "cudnn_backward_kv"
TARGET = "_cudnn_attention_backward_op"

LSE_MISSING = (
    "diffusers_cudnn_fix: the cuDNN attention forward saved no log-sum-exp, so its backward would return "
    "garbage gradients. Keep the 'cudnn_forward_lse' fix enabled (remove it from DIFFUSERS_CUDNN_FIX_SKIP)."
)

#: Dims of the log-sum-exp this torch's cuDNN backward kernel takes (4 from torch 2.9 on, else 3).
LSE_NDIM = _detect.cudnn_lse_ndim()


def cudnn_attention_backward_op(
    ctx: Any, grad_out: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cuDNN attention backward for diffusers' templated attention, corrected.

    Takes ``grad_out`` in (B, S, H, D); returns (dq, dk, dv) in (B, S, H, D).
    """
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
        logsumexp=lse_with_ndim(lse, LSE_NDIM),
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
    return to_model_layout(grad_q), to_model_layout(grad_k), to_model_layout(grad_v)


def check(lookup: Lookup) -> Finding:
    return _detect.check_backward_layout(
        lookup("_cudnn_attention_forward_op"),
        lookup(TARGET),
        forward_op=_detect.CUDNN_FORWARD,
        backward_op=_detect.CUDNN_BACKWARD,
    )


def build(lookup: Lookup) -> Mapping[str, Any]:
    return {TARGET: cudnn_attention_backward_op}


FIX = Fix(
    id=FIX_ID,
    title="cuDNN backward op transposes the saved K/V a second time",
    upstream="https://github.com/huggingface/diffusers/pull/14274",
    affected=">=0.36.0,<0.40.0",
    targets=(TARGET,),
    check=check,
    build=build,
)
