"""Small tensor-layout helpers shared by the corrected ops, and their trigger of the GPU probe.

Everything here runs on the training hot path and under ``torch.compile``: plain tensor code, no logging,
no warnings, no Python state that changes after the fixes are applied.

Layouts: diffusers hands its attention ops tensors in *model layout* (B, S, H, D); the ATen SDPA kernels
take *kernel layout* (B, H, S, D), needing only a unit stride in the last dimension.
"""

from __future__ import annotations

import torch


#: Whether the corrected cuDNN forward may hand the kernel strided (B, H, S, D) views of the (B, S, H, D)
#: tensors instead of dense copies. The ops need only a unit last-dim stride, and on an H200 the views gave
#: the same gradients as the copies while saving their cost (forward 0.47 -> 0.35 ms at B=1 S=4096 H=24
#: D=128); but diffusers notes that non-contiguous inputs once gave wrong results. So it stays off until
#: the GPU probe has verified views on the device in use (``_probe.py``), and the probe turns it on.
zero_copy = False


def maybe_probe(tensor: torch.Tensor) -> None:
    """The GPU probe's trigger in the corrected ops (``_probe.maybe_probe``): at once back on CPU tensors and
    while ``torch.compile`` traces; ``_probe`` is imported at the first call on a CUDA tensor, not by the
    import hook, which has a 10 ms budget and no GPU work to do."""
    if torch.compiler.is_compiling() or tensor.device.type != "cuda":
        return
    from . import _probe

    _probe.maybe_probe(tensor)


def to_kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) -> (B, H, S, D): a view where the probe verified views, else a dense copy (as shipped)."""
    x = x.transpose(1, 2)
    return x if zero_copy else x.contiguous()


def to_model_layout(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) -> dense (B, S, H, D); free when ``x`` already lies in (B, S, H, D) memory."""
    return x.transpose(1, 2).contiguous()


def with_strides_of(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``grad`` laid out with exactly ``like``'s strides.

    The cuDNN backward must get ``grad_out`` with ``out``'s strides: on torch 2.11 a backward whose dO
    strides differed from an earlier call at the same shapes silently returned wrong gradients (its graph
    cache key ignores dO strides). One copy when the strides differ, none when they already match.
    """
    if grad.stride() == like.stride():
        return grad
    return torch.empty_strided(like.shape, like.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)


def backward_may_follow(ctx: object) -> bool:
    """Whether the autograd context this op saves into will see a backward.

    diffusers calls the op inside ``autograd.Function.forward`` (grad mode off, fresh tensors), so
    ``requires_grad`` on q/k/v says nothing; the Function's ``needs_input_grad`` does. A context without
    it (a caller we do not know) is treated as training: computing an unused log-sum-exp is cheap,
    a missing one gives garbage gradients.
    """
    needs = getattr(ctx, "needs_input_grad", None)
    if needs is None:
        return True
    return any(needs[:3])


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


_PER_STEP_NAMES = ("query", "key", "value", "out", "lse")


def reject_per_step_tensors(kwargs: dict, fix_id: str) -> None:
    """Raise if a caller hands the backward per-step tensors (diffusers >= 0.40's ring attention does).

    The corrected backward ops exist for releases <= 0.39, whose callers never pass these; a build that does
    pairs new callers with old ops, which this package has not verified.
    """
    for name in _PER_STEP_NAMES:
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"diffusers_cudnn_fix: this diffusers build passes per-step tensors ({name}=...) to a backward "
                "op that the package replaced for releases <= 0.39. Upgrade diffusers to >= 0.40, or set "
                f"DIFFUSERS_CUDNN_FIX_SKIP={fix_id} and report your diffusers version."
            )
