"""Tensor-layout helpers shared by the corrected ops.

Everything here runs on the training hot path, on autograd's threads and under ``torch.compile``: plain
tensor code, no logging, no warnings, no imports.

Layouts: diffusers hands its attention ops tensors in *model layout* (B, S, H, D); the ATen SDPA kernels
take *kernel layout* (B, H, S, D), needing only a unit stride in the last dimension (docs/kernel-facts.md).
"""

from __future__ import annotations

from typing import Any

import torch

from . import _devices
from ._warnings import UnsafeAttentionError, explain

#: cuDNN reads its operands in 16-byte vectors: a tensor whose data or whose strides are not on 16 bytes is
#: read wrong, silently (docs/kernel-facts.md). A fresh allocation always is.
ALIGNMENT = 16


def aligned(x: torch.Tensor) -> bool:
    """Whether ``x``'s data pointer and every stride but the last (which must be 1) lie on 16 bytes."""
    size = x.element_size()
    return (
        x.stride(-1) == 1
        and x.data_ptr() % ALIGNMENT == 0
        and all((stride * size) % ALIGNMENT == 0 for stride in x.stride()[:-1])
    )


def entering(query: torch.Tensor) -> None:
    """What every replaced forward op does first: hand a CUDA device to the GPU probe (once per device), and
    inside a ``torch.compile`` graph refuse q with one head or one query position (model layout).

    On the H200 (inductor, torch 2.11) such calls of diffusers' cuDNN and flash context-parallel ops gave wrong
    gradients in every random case drawn, while the same calls run eagerly were right (docs/behaviour.md). Raising
    while tracing makes dynamo run the call eagerly; with ``fullgraph=True`` it is an error carrying this text.
    """
    if not torch.compiler.is_compiling():
        if query.is_cuda:
            _devices.on_cuda_call(query)
    elif query.shape[1] == 1 or query.shape[2] == 1:
        raise UnsafeAttentionError(explain(f"inside a torch.compile graph, context-parallel cuDNN / flash attention got"
            f" q of shape {tuple(query.shape)} (B, S, H, D: one head or one query position per rank).", "Compiled, such"
            " calls gave wrong gradients on an H200 (eager: right), so this one must run eagerly (dynamo does so"
            " without fullgraph=True).", "With fullgraph=True, wrap the attention in torch.compiler.disable, or pick"
            " context-parallel degrees leaving 2+ heads a rank.", "behaviour.md#under-torchcompile"))  # fmt: skip


def realigned_all(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of ``xs``, or a dense copy of it where its data pointer is not on 16 bytes (a view at an odd offset,
    say: even a contiguous one, which ``.contiguous()`` would hand on as it is), in one call: a loop, not a
    generator (no Python frame per tensor). On every device, so that the behavioural checks see on the CPU what
    the GPU kernels get. While compiling the pointer cannot be read, so it is always a copy there; inductor may
    still drop a copy it finds redundant, which is why the shapes where a view reaches the kernel as it is (one
    head or one query position) are refused while compiling."""
    compiling = torch.compiler.is_compiling()
    out = []
    for x in xs:
        out.append(x.clone(memory_format=torch.contiguous_format) if compiling or x.data_ptr() % ALIGNMENT else x)
    return tuple(out)


def kernel_layout(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of ``xs`` (B, S, H, D) as (B, H, S, D), in one call (the cuDNN forward's hot path): a strided view where
    the GPU probe verified views on its device and the view is aligned (unit last stride, 16-byte data and
    strides); else a dense copy, as the shipped ops make."""
    compiling = torch.compiler.is_compiling()
    views = xs[0].is_cuda and not compiling and _devices.zero_copy_allowed(xs[0].device)
    out = []
    for x in xs:
        x = x.transpose(1, 2)
        if views and aligned(x):
            out.append(x)
            continue
        x = x.contiguous()
        out.append(x.clone(memory_format=torch.contiguous_format) if compiling or x.data_ptr() % ALIGNMENT else x)
    return tuple(out)


def with_strides_of(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``grad`` laid out with exactly ``like``'s strides.

    The cuDNN backward must get ``grad_out`` with ``out``'s strides: its graph cache key ignores them, so a
    call whose strides differ from an earlier one at the same shapes returns wrong gradients. One copy when
    the strides differ (or the data is not on 16 bytes, which cannot be read while compiling), none when they
    already match.
    """
    if grad.stride() == like.stride() and (
        grad.device.type != "cuda" or (not torch.compiler.is_compiling() and grad.data_ptr() % ALIGNMENT == 0)
    ):
        return grad
    return torch.empty_strided(like.shape, like.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)


def backward_as_saved(
    ctx: Any, grad_out: torch.Tensor, per_step: dict[str, Any], fix_id: str, *, op: Any, lse_ndim: int | None = None,
    lse_missing: str = "", **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The corrected backward of the op pairs whose forward saves q/k/v in kernel layout (cuDNN, native flash): the
    ATen backward ``op`` on the saved tensors as saved, ``grad_out`` (B, S, H, D) laid out as the saved ``out``;
    (dq, dk, dv) in (B, S, H, D) out. ``extra``: ``op``'s arguments beyond those the two ops share; ``lse_ndim``:
    the dims ``op`` takes the saved log-sum-exp with (default: as saved); ``lse_missing``: the error raised where
    the forward saved none (default: ``op`` gets None). ``per_step``: the caller's keyword arguments, refused for
    ``fix_id`` where they hand per-step tensors. Plain code, no helper calls it does not need: it runs per layer."""
    if per_step:
        reject_per_step_tensors(per_step, fix_id)
    q, k, v, out, lse, cum_seq_q, cum_seq_k, philox_seed, philox_offset = ctx.saved_tensors
    if lse is None and lse_missing:
        raise RuntimeError(lse_missing)
    if lse_ndim is not None and lse.dim() != lse_ndim:
        lse = lse_with_ndim(lse, lse_ndim)
    grad_q, grad_k, grad_v = op(
        grad_out=with_strides_of(grad_out.transpose(1, 2), out), query=q, key=k, value=v, out=out,
        logsumexp=lse, cum_seq_q=cum_seq_q, cum_seq_k=cum_seq_k,
        max_q=ctx.max_q, max_k=ctx.max_k, dropout_p=ctx.dropout_p, is_causal=ctx.is_causal,
        philox_seed=philox_seed, philox_offset=philox_offset, scale=ctx.scale, **extra,
    )  # fmt: skip
    return grad_q.transpose(1, 2).contiguous(), grad_k.transpose(1, 2).contiguous(), grad_v.transpose(1, 2).contiguous()


def backward_may_follow(ctx: object) -> bool:
    """Whether the autograd context this op saves into will see a backward for q, k or v.

    diffusers calls the op inside ``autograd.Function.forward`` (grad mode off, fresh tensors), so
    ``requires_grad`` on q/k/v says nothing; the Function's ``needs_input_grad`` does. A context without
    it (a caller we do not know) is treated as training: computing an unused log-sum-exp is cheap,
    a missing one gives garbage gradients.
    """
    needs = getattr(ctx, "needs_input_grad", None)
    return needs is None or any(needs[:3])


def lse_with_ndim(lse: torch.Tensor, ndim: int) -> torch.Tensor:
    """The log-sum-exp as (B, H, S, 1) (``ndim`` 4, torch >= 2.9) or (B, H, S) (``ndim`` 3, older)."""
    if lse.dim() == ndim:
        return lse
    if lse.dim() == ndim - 1:
        return lse.unsqueeze(-1)
    if lse.dim() == ndim + 1 and lse.shape[-1] == 1:
        return lse.squeeze(-1)
    raise RuntimeError(
        f"diffusers_cudnn_fix: log-sum-exp of shape {tuple(lse.shape)} cannot be given the {ndim} dims "
        "the cuDNN backward kernel of this torch expects"
    )


def reject_per_step_tensors(kwargs: dict[str, Any], fix_id: str) -> None:
    """Raise if a caller hands the backward per-step tensors (diffusers >= 0.40's ring attention does).

    The corrected backward ops exist for releases <= 0.39, whose callers never pass these; a build that does
    pairs new callers with old ops, which this package has not verified.
    """
    for name in ("query", "key", "value", "out", "lse"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(explain(f"this diffusers build passes per-step tensors ({name}=...) to a backward"
                " op the package replaced for releases <= 0.39.", "This pairing is unverified, so the call is refused.",
                f"Upgrade diffusers to >= 0.40, or set DIFFUSERS_CUDNN_FIX_SKIP={fix_id} and report your version.",
                f"fixes.md#{fix_id}"))  # fmt: skip
