"""One module per upstream bug. Order matters: a later fix's check sees the earlier fixes' replacements.

Adding a fix: write a module with a ``FIX`` record (see ``diffusers_cudnn_fix._fix.Fix``) and list it here.
"""

from __future__ import annotations

from .._fix import Fix
from . import (
    cudnn_backward_kv,
    cudnn_bool_mask,
    cudnn_forward_lse,
    cudnn_input_dtypes,
    cudnn_masked_row_grads,
    flash_backward_kv,
    flash_input_alignment,
    qwen_joint_mask_order,
    ring_backward,
    ring_grad_route,
    ulysses_grad_count,
    ulysses_mask_grad,
)

ALL_FIXES: tuple[Fix, ...] = (
    # Gradient corrections (the package's reason to exist).
    cudnn_forward_lse.FIX,
    cudnn_backward_kv.FIX,
    flash_backward_kv.FIX,
    ulysses_grad_count.FIX,
    # Guards: wrappers around the (corrected) forward (the input-dtype guard outermost), and refusals where
    # no correction is offered. The Ulysses mask-grad refusal comes before the mask guard, which wraps the Ulysses
    # forward too: its check runs diffusers' own forward with stand-in collectives, so it must be innermost.
    ulysses_mask_grad.FIX,
    cudnn_bool_mask.FIX,
    cudnn_input_dtypes.FIX,
    # Around the (corrected) cuDNN backward: no gradient for fully masked rows where S_kv is 1.
    cudnn_masked_row_grads.FIX,
    flash_input_alignment.FIX,
    qwen_joint_mask_order.FIX,
    # Ring attention's correction: drives the corrected cuDNN / flash backward ops one ring step at a time
    # (refuses for any other backward op).
    ring_backward.FIX,
    # diffusers' ring backward from 0.40 on routes the K/V gradients wrong from ring degree 3: the same corrected
    # ring, driving diffusers' own (fixed) ops (after ring_backward, whose corrected ring on 0.36-0.39 its check
    # then sees and finds right).
    ring_grad_route.FIX,
)
