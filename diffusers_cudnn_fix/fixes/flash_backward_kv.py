"""Native-flash backward op transposes the saved K and V a second time.

Bug: the same double transpose as the cuDNN backward, in ``_native_flash_attention_backward_op``: the
forward saves (B, H, S, D) tensors, the backward transposes k and v again before calling
``aten::_scaled_dot_product_flash_attention_backward``. Gradients of context-parallel training with the
``_native_flash`` backend are wrong (or the kernel rejects the shapes).

Releases: 0.37.0 to 0.39.0 (0.36.0 has no such op). Fixed upstream in 0.40.0
(huggingface/diffusers#14274).

Detection: as for the cuDNN backward, on the flash op pair (the flash forward always computes the
log-sum-exp, so only the layout can be wrong).

Replacement: :func:`native_flash_attention_backward_op`, which hands the kernel the saved tensors as saved
and ``grad_out`` with exactly ``out``'s strides.

Revert: the shipped function object is put back (the registry keeps it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .. import _detect, _devices
from .._fix import Finding, Fix, Lookup
from .._layout import reject_per_step_tensors, to_model_layout, with_strides_of

FIX_ID = "flash_backward_kv"
TARGET = "_native_flash_attention_backward_op"


def native_flash_attention_backward_op(
    ctx: Any, grad_out: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Native flash attention backward for diffusers' templated attention, corrected.

    Takes ``grad_out`` in (B, S, H, D); returns (dq, dk, dv) in (B, S, H, D).
    """
    reject_per_step_tensors(kwargs, FIX_ID)
    # The flash forward is diffusers' own: this is the first corrected op a flash run reaches. It runs on
    # autograd's thread, so the probe (if it runs now) runs there; on_cuda_call imports nothing.
    _devices.on_cuda_call(grad_out)
    q, k, v, out, lse, cum_seq_q, cum_seq_k, philox_seed, philox_offset = ctx.saved_tensors
    grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out=with_strides_of(grad_out.transpose(1, 2), out),
        query=q,
        key=k,
        value=v,
        out=out,
        logsumexp=lse,
        cum_seq_q=cum_seq_q,
        cum_seq_k=cum_seq_k,
        max_q=ctx.max_q,
        max_k=ctx.max_k,
        dropout_p=ctx.dropout_p,
        is_causal=ctx.is_causal,
        philox_seed=philox_seed,
        philox_offset=philox_offset,
        scale=ctx.scale,
    )
    return to_model_layout(grad_q), to_model_layout(grad_k), to_model_layout(grad_v)


def check(lookup: Lookup) -> Finding:
    return _detect.check_backward_layout(
        lookup("_native_flash_attention_forward_op"),
        lookup(TARGET),
        forward_op=_detect.FLASH_FORWARD,
        backward_op=_detect.FLASH_BACKWARD,
    )


def build(lookup: Lookup) -> Mapping[str, Any]:
    return {TARGET: native_flash_attention_backward_op}


FIX = Fix(
    id=FIX_ID,
    title="native-flash backward op transposes the saved K/V a second time",
    upstream="https://github.com/huggingface/diffusers/pull/14274",
    affected=">=0.37.0,<0.40.0",
    targets=(TARGET,),
    check=check,
    build=build,
)
