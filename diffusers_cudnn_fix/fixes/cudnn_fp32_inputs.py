"""fp32 q/k/v reaching the raw cuDNN attention op are accepted and give garbage.

Bug: cuDNN SDPA supports fp16 and bf16 only. ``F.scaled_dot_product_attention`` checks that before picking
cuDNN, but diffusers' context-parallel path calls ``aten::_scaled_dot_product_cudnn_attention`` directly,
which does not check: fp32 inputs come back as garbage without an error. diffusers' own dtype constraint
for the backend runs only with ``DIFFUSERS_ATTN_CHECKS`` set.

Releases: every release with the op, 0.36.0 up to at least 0.42.1.

Detection: run the installed forward with fp32 q/k/v and see whether they reach the kernel.

Replacement: a thin wrapper around the installed forward op that raises :class:`UnsafeAttentionError`
naming the dtype and the way out (cast the model / inputs to bf16 or fp16, or use another backend).

Revert: the object that was there before is put back (the registry keeps it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .. import _detect
from .._fix import Finding, Fix, Lookup
from .._warnings import UnsafeAttentionError
from ._forward_guard import guard_forward

TARGET = "_cudnn_attention_forward_op"
_SUPPORTED = (torch.float16, torch.bfloat16)


def refuse_unsupported_dtypes(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """Raises for the dtypes the cuDNN kernel silently gets wrong; passes the mask on untouched."""
    if query.dtype not in _SUPPORTED or key.dtype not in _SUPPORTED or value.dtype not in _SUPPORTED:
        raise UnsafeAttentionError(
            f"diffusers_cudnn_fix: q/k/v of dtype {query.dtype}/{key.dtype}/{value.dtype} reached diffusers' "
            "context-parallel cuDNN attention op; cuDNN supports float16 and bfloat16 only and returns "
            "garbage for anything else. Run the model in bf16/fp16 (e.g. torch.autocast or .to(torch.bfloat16)) "
            "or choose another attention backend."
        )
    return attn_mask


def check(lookup: Lookup) -> Finding:
    forward = lookup(TARGET)
    if forward is None:
        return Finding("absent", "the cuDNN forward op does not exist in this diffusers")
    if not _detect.signature_matches(forward, _detect.FORWARD_PARAMS):
        return Finding("unknown", "the forward op's signature differs from every known release")
    trace = _detect.run_pair(forward, None, return_lse=True, dtype=torch.float32)
    call = trace.first(_detect.CUDNN_FORWARD)
    if call is not None:
        return Finding("broken", f"fp32 q/k/v reach the cuDNN kernel ({call.tensor('query')})")
    if trace.error is None:
        return Finding("unknown", "with fp32 inputs the forward neither reached the kernel nor raised")
    return Finding("ok", f"fp32 q/k/v are refused before the kernel ({trace.error[:80]})")


def build(lookup: Lookup) -> Mapping[str, Any]:
    return {TARGET: guard_forward(lookup(TARGET), refuse_unsupported_dtypes)}


FIX = Fix(
    id="cudnn_fp32_inputs",
    title="fp32 q/k/v are accepted by the raw cuDNN op and give garbage",
    upstream="none filed yet: aten::_scaled_dot_product_cudnn_attention has no dtype check",
    affected=">=0.36.0",
    targets=(TARGET,),
    check=check,
    build=build,
    kind="guard",
)
