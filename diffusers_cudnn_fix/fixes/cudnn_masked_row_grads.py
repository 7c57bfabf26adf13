"""cuDNN's attention backward gets a fully masked query row wrong when there is one key/value position.

Bug: with a single key/value position (S_kv = 1) and an additive mask that masks it (``-inf``) for some query
rows, ``aten::_scaled_dot_product_cudnn_attention_backward`` returns wrong dQ, dK and dV, silently. The
forward is right (those rows' output is 0). Measured on an H200 (torch 2.11, cuDNN 9.19) on the bare kernels:
bf16 with fewer than 8 query positions goes wrong, every other S_kv, fp16 and longer queries come out right
(docs/kernel-facts.md). diffusers' context-parallel cuDNN ops hand the kernel the mask they were given (the
mask guard's conversion of a bool mask writes ``-inf``), so the backward inherits the fault on every release.

Releases: every release with the op, 0.36.0 up to at least 0.42.1. The fault is the kernel's; no upstream
report is known.

Detection: run the installed op pair with S_kv = 1, an additive mask that masks the key for one query row,
and a ``grad_out`` of ones, and read the ``grad_out`` that reaches the backward kernel: broken when that row
still carries a gradient.

Replacement: a thin wrapper around the installed backward op. Where the saved mask has one key position
(``mask.shape[-1] == 1``: always so when S_kv = 1), it sets ``grad_out`` to 0 in the query rows whose mask is
``-inf``. Those rows have no attention weights, so their true contribution to every gradient is 0: the
change is exact, and with it the kernel's gradients are right (measured on the same grid). Any other mask,
and no mask, pass through untouched.

Revert: the object that was there before is put back (the registry keeps it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import _detect
from .._fix import Finding, Fix, Lookup
from .._key_padding import RESTORES, restored

TARGET = "_cudnn_attention_backward_op"
#: The kernels compute the softmax as exp2(score * log2(e) - max).
_LOG2E = 1.4426950408889634


def without_masked_rows(grad_out: torch.Tensor, mask: Any) -> torch.Tensor:
    """``grad_out`` (B, S_q, H, D) with 0 in the query rows that a one-key-position additive mask masks.

    ``mask`` is the additive mask the forward handed the kernel (2-D to 4-D, broadcasting to
    (B, H, S_q, S_kv)). Anything other than a floating mask whose last dimension is 1 returns ``grad_out``
    unchanged.
    """
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point() or not 2 <= mask.dim() <= 4:
        return grad_out
    if mask.shape[-1] != 1:
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


def zero_masked_rows(inner: Callable[..., Any]) -> Callable[..., Any]:
    """``inner`` (the installed backward op) handed a ``grad_out`` without fully masked rows (see above)."""

    @functools.wraps(inner)  # keeps diffusers' backward-op signature, which the checks read
    def cudnn_attention_backward_op(ctx: Any, grad_out: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        grads = inner(ctx, without_masked_rows(grad_out, getattr(ctx, "attn_mask", None)), *args, **kwargs)
        return restored(ctx, grads)  # dK/dV back to full length where the forward trimmed padded keys

    cudnn_attention_backward_op.__doc__ = (
        "diffusers' cuDNN backward op, handed no gradient for fully masked rows where S_kv is 1."
    )
    setattr(cudnn_attention_backward_op, RESTORES, True)  # the forward may trim padded keys (_key_padding)
    return cudnn_attention_backward_op


def check(lookup: Lookup) -> Finding:
    forward, backward = lookup("_cudnn_attention_forward_op"), lookup(TARGET)
    if forward is None or backward is None:
        return Finding("absent", "the cuDNN op pair does not exist in this diffusers")
    if not _detect.signature_matches(forward, _detect.FORWARD_PARAMS) or not _detect.backward_signature_ok(backward):
        return Finding("unknown", "the forward/backward op signatures differ from every known release")
    b, s_q, h, d = _detect.BATCH, _detect.SEQ_Q, _detect.HEADS, _detect.HEAD_DIM
    qkv = (
        torch.zeros(b, s_q, h, d, dtype=torch.bfloat16),
        torch.zeros(b, 1, h, d, dtype=torch.bfloat16),
        torch.zeros(b, 1, h, d, dtype=torch.bfloat16),
    )
    mask = torch.zeros(b, 1, s_q, 1, dtype=torch.bfloat16)
    mask[:, :, -1] = float("-inf")  # the last query row sees no key
    trace = _detect.run_pair(forward, backward, return_lse=True, mask=mask, qkv=qkv, grad_value=1.0)
    call = trace.first(_detect.CUDNN_BACKWARD)
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


def build(lookup: Lookup) -> Mapping[str, Any]:
    return {TARGET: zero_masked_rows(lookup(TARGET))}


FIX = Fix(
    id="cudnn_masked_row_grads",
    title="cuDNN's backward gets fully masked query rows wrong when there is one key/value position",
    upstream="none known: a fault of aten::_scaled_dot_product_cudnn_attention_backward (cuDNN 9.19)",
    affected=">=0.36.0",
    targets=(TARGET,),
    check=check,
    build=build,
    kind="guard",
)
