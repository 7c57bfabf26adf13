"""The native-flash CP forward hands the flash kernel q/k/v at an address off 16 bytes.

Bug: ``transpose(1, 2).contiguous()`` copies nothing where a head count or a sequence length is 1, so a view
at an odd offset reaches the flash kernel as it is: "CUDA error: misaligned address" on an H200, which ends
the process's CUDA context. Every release with the op, 0.37.0 up to at least 0.42.1.
Detection: contiguous views one element past a fresh allocation: are they on 16 bytes at the kernel?
The package: the flash forward's replacement hands it dense copies of such q/k/v (docs/fixes.md).
"""

from __future__ import annotations

import math

import torch

from .. import _detect
from .._fix import Finding, Lookup
from .._layout import ALIGNMENT
from . import FLASH_FORWARD

#: The record's id (the module is named after it: the registry finds the check so), for its policy's mark (targets/).
FIX_ID = __name__.rpartition(".")[2]


def check(lookup: Lookup) -> Finding:
    forward = lookup(FLASH_FORWARD)
    if (problem := _detect.op_problem(forward)) is not None:
        return problem
    # (B, S, H=1, D) bf16 q/k/v, each a contiguous view one element past the start of its buffer.
    shape = (_detect.BATCH, _detect.SEQ_Q, 1, _detect.HEAD_DIM)
    q, k, v = (torch.empty(math.prod(shape) + 1, dtype=torch.bfloat16)[1:].view(shape) for _ in range(3))
    trace = _detect.run_pair(forward, None, return_lse=False, qkv=(q, k, v))
    call = trace.first(_detect.FLASH_FORWARD_KERNEL)
    if call is None:
        return Finding("unknown", f"the flash forward never reached the kernel ({trace.error})")
    off = [n for n in ("query", "key", "value") if call.args[n].data_ptr() % ALIGNMENT != 0]
    if off:
        return Finding("broken", f"a view off 16 bytes reaches the flash kernel as it is ({', '.join(off)})")
    return Finding("ok", "q/k/v reach the flash kernel on 16 bytes")
