"""cuDNN's attention backward gets a fully masked query row wrong when there is one key/value position.

Bug: with S_kv = 1 and an additive mask masking that key (``-inf``) for some rows, the kernel returns wrong
dQ/dK/dV, silently (bf16, fewer than 8 query positions, on an H200; docs/kernel-facts.md). Every release
with the op, 0.36.0 up to at least 0.42.1; the fault is the kernel's.
Detection: S_kv = 1, one masked row, ``grad_out`` of ones: does that row's gradient reach the kernel?
The package: :func:`without_masked_rows` zeroes those rows' ``grad_out`` (exact: they have no attention
weights); any other mask, and no mask, pass untouched (docs/fixes.md).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _detect, _ledger
from .._fix import Finding, Lookup
from . import CUDNN_BACKWARD, CUDNN_FORWARD

#: The record's id (the module is named after it: the registry finds the check so), for the policy's mark.
FIX_ID = __name__.rpartition(".")[2]

#: The kernels compute the softmax as exp2(score * log2(e) - max).
_LOG2E = 1.4426950408889634


def without_masked_rows(grad_out: torch.Tensor, mask: Any) -> torch.Tensor:
    """``grad_out`` (B, S_q, H, D) with 0 in the query rows that a one-key-position additive mask masks.

    ``mask`` is the additive mask the forward handed the kernel (2-D to 4-D, broadcasting to
    (B, H, S_q, S_kv)). Anything other than a floating mask whose last dimension is 1 returns ``grad_out``
    unchanged.
    """
    if _ledger.recording:
        _ledger.reached(FIX_ID)
    floating = isinstance(mask, torch.Tensor) and mask.is_floating_point()
    if not floating or not 2 <= mask.dim() <= 4 or mask.shape[-1] != 1:
        return grad_out
    # One key position, so a masked entry is a fully masked row. Masked as the kernel sees it: -inf, or a
    # value whose exp2-domain score overflows float32 (finfo(bf16).min does, fp16's -65504 does not).
    masked = torch.isneginf(mask.float() * _LOG2E)
    masked = masked.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).transpose(1, 2)  # (B|1, S_q, H|1, 1)
    try:
        torch.broadcast_shapes(masked.shape, grad_out.shape)
    except RuntimeError:
        return grad_out  # a mask that does not fit: the kernel reports it in its own words
    return grad_out.masked_fill(masked, 0.0)


def check(lookup: Lookup) -> Finding:
    forward, backward = lookup(CUDNN_FORWARD), lookup(CUDNN_BACKWARD)
    if (problem := _detect.op_problem(forward, backward)) is not None:
        return problem
    b, s_q, h, d = _detect.BATCH, _detect.SEQ_Q, _detect.HEADS, _detect.HEAD_DIM
    q = torch.zeros(b, s_q, h, d, dtype=torch.bfloat16)
    k, v = (torch.zeros(b, 1, h, d, dtype=torch.bfloat16) for _ in range(2))  # one key/value position
    mask = torch.zeros(b, 1, s_q, 1, dtype=torch.bfloat16)
    mask[:, :, -1] = float("-inf")  # the last query row sees no key
    trace = _detect.run_pair(forward, backward, return_lse=True, mask=mask, qkv=(q, k, v))  # grad_out: ones
    call = trace.first(_detect.CUDNN_BACKWARD_KERNEL)
    if call is None:
        return Finding("unknown", f"the backward never reached the cuDNN kernel ({trace.error or 'no call'})")
    grad_out = call.args.get("grad_out")
    if not isinstance(grad_out, torch.Tensor) or tuple(grad_out.shape) != (b, h, s_q, d):
        return Finding("unknown", f"grad_out reaches the kernel as {_detect.TensorInfo.of(grad_out)}")
    if bool(grad_out[:, :, -1].ne(0).any()):
        return Finding(
            "broken",
            "with one key position, a fully masked row's gradient reaches cuDNN's backward, which then "
            "returns wrong dQ/dK/dV",
        )
    if not bool(grad_out[:, :, :-1].eq(1).all()):
        return Finding("unknown", "the rows that see a key reach the backward kernel with another gradient")
    return Finding("ok", "with one key position, fully masked rows reach cuDNN's backward with no gradient")
