"""Native-flash backward op transposes the saved K and V a second time.

Bug: the cuDNN backward's double transpose, in ``_native_flash_attention_backward_op``. Releases
0.37.0-0.39.0 (0.36.0 has no such op; fixed in 0.40.0, #14274).
Detection: as for the cuDNN backward, on the flash op pair.
The package: :func:`corrected_backward` hands the kernel the saved tensors as saved (docs/fixes.md).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _detect, _devices, _ledger
from .._fix import Finding, Lookup
from .._layout import backward_as_saved
from . import FLASH_BACKWARD, FLASH_FORWARD

#: The record's id (the module is named after it: the registry finds the check so), for the policy's mark.
FIX_ID = __name__.rpartition(".")[2]


def corrected_backward(ctx: Any, grad_out: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """Native flash attention backward for diffusers' templated attention, corrected: ``grad_out``
    (B, S, H, D) in, (dq, dk, dv) in (B, S, H, D) out."""
    if _ledger.recording:
        _ledger.reached(FIX_ID)
    # The flash forward may be diffusers' own: this is the first corrected op a flash run reaches. It runs on
    # autograd's thread, so the probe (if it runs now) runs there; on_cuda_call imports nothing.
    if grad_out.is_cuda:
        _devices.on_cuda_call(grad_out)
    op = torch.ops.aten._scaled_dot_product_flash_attention_backward
    return backward_as_saved(ctx, grad_out, kwargs, FIX_ID, op=op)


def check(lookup: Lookup) -> Finding:
    forward = lookup(FLASH_FORWARD)
    return _detect.check_backward_layout(
        forward, lookup(FLASH_BACKWARD), _detect.FLASH_FORWARD_KERNEL, _detect.FLASH_BACKWARD_KERNEL
    )
