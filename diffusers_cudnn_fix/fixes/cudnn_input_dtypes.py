"""q/k/v of an unsupported dtype, or of different dtypes, reach the raw cuDNN attention op and give garbage.

Bug: cuDNN SDPA takes fp16/bf16 q, k, v of one dtype; diffusers' CP path calls the raw ATen op, which checks
neither (F.sdpa does). Releases: every release with the op, 0.36.0 up to at least 0.42.1.
Detection: fp32 q/k/v, and bf16 q with fp16 k/v: do they reach the kernel?
The package: :func:`refuse_unsupported_dtypes` raises :class:`UnsafeAttentionError`; under autocast the
cuDNN forward first casts q/k/v as F.sdpa does (docs/fixes.md).
"""

from __future__ import annotations

import torch

from .. import _detect, _ledger
from .._fix import Finding, Lookup
from .._warnings import UnsafeAttentionError, explain
from . import CUDNN_FORWARD

#: The record's id (the module is named after it: the registry finds the check so), for the policy's mark.
FIX_ID = __name__.rpartition(".")[2]

_SUPPORTED = (torch.float16, torch.bfloat16)


def refuse_unsupported_dtypes(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """Raises for the dtypes the cuDNN kernel silently gets wrong; passes the mask on untouched."""
    if _ledger.recording:
        _ledger.reached(FIX_ID)
    if query.dtype not in _SUPPORTED or not query.dtype == key.dtype == value.dtype:
        raise UnsafeAttentionError(explain(f"q/k/v of dtypes {query.dtype}/{key.dtype}/{value.dtype} reached diffusers'"
            " context-parallel cuDNN attention op, which needs q, k and v of one dtype, float16 or bfloat16.", "It"
            " returns garbage for anything else, so the call is refused.", "Run the model in bfloat16 or float16 (or"
            " under torch.autocast to one), or use another backend.", "fixes.md#cudnn_input_dtypes"))  # fmt: skip
    return attn_mask


def check(lookup: Lookup) -> Finding:
    forward = lookup(CUDNN_FORWARD)
    if (problem := _detect.op_problem(forward)) is not None:
        return problem
    cases = {"fp32 q/k/v": (torch.float32, None), "bf16 q with fp16 k/v": (torch.bfloat16, torch.float16)}
    for label, (dtype, key_dtype) in cases.items():
        trace = _detect.run_pair(forward, None, return_lse=True, dtype=dtype, key_dtype=key_dtype)
        if trace.first(_detect.CUDNN_FORWARD_KERNEL) is not None:
            return Finding("broken", f"{label} reach the cuDNN kernel")
        if trace.error is None:
            return Finding("unknown", f"with {label} the forward neither reached the kernel nor raised")
    return Finding("ok", "fp32 and mixed-dtype q/k/v are refused before the kernel")
