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
from .._layout import backward_as_saved
from . import CUDNN_BACKWARD, CUDNN_FORWARD

#: The record's id (the module is named after it: the registry finds the check so), for the policy's mark.
FIX_ID = __name__.rpartition(".")[2]

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
    op = torch.ops.aten._scaled_dot_product_cudnn_attention_backward
    # The real kernel accepts a missing log-sum-exp and returns garbage: LSE_MISSING stops it instead.
    return backward_as_saved(
        ctx, grad_out, kwargs, FIX_ID, op=op, lse_ndim=LSE_NDIM, lse_missing=LSE_MISSING, attn_bias=ctx.attn_mask
    )


def check(lookup: Lookup) -> Finding:
    forward = lookup(CUDNN_FORWARD)
    return _detect.check_backward_layout(
        forward, lookup(CUDNN_BACKWARD), _detect.CUDNN_FORWARD_KERNEL, _detect.CUDNN_BACKWARD_KERNEL
    )
