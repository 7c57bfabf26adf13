"""One module per upstream bug. Order matters: a later fix's check sees the earlier fixes' replacements.

Adding a fix: write a module with a ``FIX`` record (see ``diffusers_cudnn_fix._fix.Fix``) and list it here.
"""

from __future__ import annotations

from .._fix import Fix
from . import cudnn_backward_kv, cudnn_forward_lse, flash_backward_kv

ALL_FIXES: tuple[Fix, ...] = (
    cudnn_forward_lse.FIX,
    cudnn_backward_kv.FIX,
    flash_backward_kv.FIX,
)
