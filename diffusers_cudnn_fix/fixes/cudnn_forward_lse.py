"""cuDNN forward op computes no log-sum-exp on the context-parallel training path.

Bug: ``compute_log_sumexp=return_lse``; Ulysses trains with ``return_lse=False``, so the backward reads no
log-sum-exp and returns garbage, silently. Releases 0.36.0-0.39.0 (fixed in 0.40.0, #14274).
Detection: run the forward as Ulysses does in training and read the flag reaching the ATen op.
The package: :func:`corrected_forward` asks for it whenever a backward may follow (docs/fixes.md).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _detect, _ledger
from .._fix import Finding, Lookup
from .._layout import backward_may_follow, kernel_layout
from .._warnings import explain
from . import CUDNN_FORWARD

#: The record's id (the module is named after it: the registry finds the check so), for the policy's mark.
FIX_ID = __name__.rpartition(".")[2]


def corrected_forward(
    ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
    dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool, return_lse: bool, _save_ctx: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """cuDNN attention forward for diffusers' templated attention, corrected: (B, S, H, D) in, ``out``
    (B, S, H, D) or ``(out, lse)`` out; saves what the shipped op saves, with the log-sum-exp whenever a
    backward may follow."""
    if _ledger.recording:
        _ledger.reached(FIX_ID)
    if enable_gqa:
        raise ValueError("`enable_gqa` is not yet supported for cuDNN attention.")
    q, k, v = kernel_layout(query, key, value)
    # The backward recomputes the softmax from the log-sum-exp: compute it whenever one may follow.
    compute_lse = return_lse or (_save_ctx and backward_may_follow(ctx))
    try:
        out, lse, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, _ = (
            torch.ops.aten._scaled_dot_product_cudnn_attention(
                query=q,
                key=k,
                value=v,
                attn_bias=attn_mask,
                compute_log_sumexp=compute_lse,
                dropout_p=dropout_p,
                is_causal=is_causal,
                return_debug_mask=False,
                scale=scale,
            )
        )
    except NotImplementedError as exc:  # only here, so that a call that runs pays nothing for the question
        if _has_kernel(q.device):
            raise
        raise NotImplementedError(no_kernel_message(q.device)) from exc
    if _save_ctx:
        ctx.save_for_backward(q, k, v, out, lse, cum_seq_q, cum_seq_k, philox_seed, philox_offset)
        ctx.dropout_p = dropout_p
        ctx.is_causal = is_causal
        ctx.scale = scale
        ctx.attn_mask = attn_mask
        ctx.max_q = max_q
        ctx.max_k = max_k
    out = out.transpose(1, 2).contiguous()
    return (out, lse.transpose(1, 2).contiguous()) if return_lse else out


OP = "aten::_scaled_dot_product_cudnn_attention"


def _has_kernel(device: torch.device) -> bool:
    """Whether the cuDNN attention op has a kernel for ``device`` (a CUDA build on a GPU: yes; a CPU: no, unless
    one was registered, as the tests' stand-ins are)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(OP, torch._C._dispatch_key_for_device(device.type))


def no_kernel_message(device: torch.device) -> str:
    """What a user whose tensors are not on a GPU reads: the backend's need, and the backend that runs there."""
    return explain(f"diffusers' _native_cudnn attention backend needs CUDA tensors: q/k/v are on {device}, where torch "
                   f"has no kernel for {OP}.", "The call cannot run (torch's error is below); this is not "
                   "diffusers_cudnn_fix's doing.", f'On {device.type} use diffusers\' "native" attention backend, '
                   "which supports context parallelism too.", "behaviour.md#tensors-off-the-gpu")  # fmt: skip


def check(lookup: Lookup) -> Finding:
    return _detect.check_forward_lse(lookup(CUDNN_FORWARD), forward_op=_detect.CUDNN_FORWARD_KERNEL)
