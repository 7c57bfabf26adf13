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
    flash_backward_kv,
    ring_backward,
    ulysses_grad_count,
)

ALL_FIXES: tuple[Fix, ...] = (
    # Gradient corrections (the package's reason to exist).
    cudnn_forward_lse.FIX,
    cudnn_backward_kv.FIX,
    flash_backward_kv.FIX,
    ulysses_grad_count.FIX,
    # Guards: wrappers around the (corrected) forward (the input-dtype guard outermost), and a refusal where
    # no correction is offered.
    cudnn_bool_mask.FIX,
    cudnn_input_dtypes.FIX,
    ring_backward.FIX,
)
