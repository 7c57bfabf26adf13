"""The native-flash CP forward hands the flash kernel q/k/v at an address off 16 bytes.

Bug: ``_native_flash_attention_forward_op`` turns (B, S, H, D) inputs into kernel layout with
``transpose(1, 2).contiguous()``. Where a head count or a sequence length is 1 the transposed view already
counts as contiguous, so a view at an odd offset (a slice of a larger buffer) reaches
``aten::_scaled_dot_product_flash_attention`` as it is. The flash kernel reads in 16-byte vectors: on an
H200 such a call ends in "CUDA error: misaligned address", which ends the process's CUDA context
(docs/kernel-facts.md). The backward reads the tensors the forward saved, so it is fixed with the forward.

Releases: every release with the op, 0.37.0 up to at least 0.42.1.

Detection: run the installed forward with q/k/v that are contiguous views one element past a fresh
allocation (one head), and read the data pointers reaching the flash kernel.

Replacement: the installed forward, handed a dense copy of any q/k/v whose data is not on 16 bytes (the
rest untouched, so the usual case costs a pointer check). It is also where the GPU probe first runs for
users of the flash backend only.

Revert: the object that was there before is put back (the registry keeps it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import _detect, _devices
from .._fix import Finding, Fix, Lookup
from .._layout import ALIGNMENT, realigned, refuse_one_head_or_query_while_compiling

TARGET = "_native_flash_attention_forward_op"


def aligned_inputs(inner: Callable[..., Any]) -> Callable[..., Any]:
    """``inner`` (the installed flash forward op) handed q/k/v on 16 bytes."""

    @functools.wraps(inner)  # keeps diffusers' forward-op signature, which the checks read
    def native_flash_attention_forward_op(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        _devices.on_cuda_call(query)  # the GPU probe, once per CUDA device
        refuse_one_head_or_query_while_compiling(query)
        return inner(ctx, realigned(query), realigned(key), realigned(value), *args, **kwargs)

    native_flash_attention_forward_op.__doc__ = "diffusers' native-flash forward op, handed q/k/v on 16 bytes."
    return native_flash_attention_forward_op


def _offset_views() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, S, H=1, D) bf16 q/k/v, each a contiguous view one element past the start of its buffer."""
    shape = (_detect.BATCH, _detect.SEQ_Q, 1, _detect.HEAD_DIM)
    count = shape[0] * shape[1] * shape[2] * shape[3]
    q, k, v = (torch.empty(count + 1, dtype=torch.bfloat16)[1:].view(shape) for _ in range(3))
    return q, k, v


def check(lookup: Lookup) -> Finding:
    forward = lookup(TARGET)
    if forward is None:
        return Finding("absent", "the native-flash forward op does not exist in this diffusers")
    if not _detect.signature_matches(forward, _detect.FORWARD_PARAMS):
        return Finding("unknown", "the flash forward op's signature differs from every known release")
    trace = _detect.run_pair(forward, None, return_lse=False, qkv=_offset_views())
    call = trace.first(_detect.FLASH_FORWARD)
    if call is None:
        return Finding("unknown", f"the flash forward never reached the kernel ({trace.error})")
    off = [n for n in ("query", "key", "value") if call.args[n].data_ptr() % ALIGNMENT != 0]
    if off:
        return Finding("broken", f"a view off 16 bytes reaches the flash kernel as it is ({', '.join(off)})")
    return Finding("ok", "q/k/v reach the flash kernel on 16 bytes")


def build(lookup: Lookup) -> Mapping[str, Any]:
    return {TARGET: aligned_inputs(lookup(TARGET))}


FIX = Fix(
    id="flash_input_alignment",
    title="the native-flash CP forward hands the flash kernel q/k/v off 16 bytes (misaligned address on a GPU)",
    upstream="not reported upstream as of diffusers 0.42.1",
    affected=">=0.37.0",
    targets=(TARGET,),
    check=check,
    build=build,
    kind="guard",
)
