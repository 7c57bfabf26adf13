"""cuDNN forward op computes no log-sum-exp on the context-parallel training path.

Bug: ``_cudnn_attention_forward_op`` passes ``compute_log_sumexp=return_lse`` to
``aten::_scaled_dot_product_cudnn_attention``. Ulysses context parallelism calls it with
``return_lse=False`` in a normal training step, so the kernel returns no log-sum-exp, ``None`` is saved for
the backward, and the cuDNN backward (which recomputes the softmax from it) returns garbage without raising
(docs/kernel-facts.md).

Releases: 0.36.0 to 0.39.0. Fixed upstream in 0.40.0 (huggingface/diffusers#14274).

Detection: run the installed forward on tiny CPU tensors (``_detect``) as Ulysses does in training
(``return_lse=False``, context saved, a context-parallel config of world size 2, the Function's
``needs_input_grad`` set) and read the ``compute_log_sumexp`` flag reaching the ATen op.

Replacement: :func:`cudnn_attention_forward_op`, which asks the kernel for the log-sum-exp whenever it saves
the context for a backward, saves exactly what the shipped op saves (so the shipped or the corrected
backward can read it) and still returns only what the caller asked for.

Revert: the shipped function object is put back (the registry keeps it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .. import _detect, _devices
from .._fix import Finding, Fix, Lookup
from .._layout import backward_may_follow, to_kernel_layout, to_model_layout

TARGET = "_cudnn_attention_forward_op"


def cudnn_attention_forward_op(
    ctx: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _save_ctx: bool = True,
    _parallel_config: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """cuDNN attention forward for diffusers' templated (context-parallel) attention, corrected.

    Takes (B, S, H, D) tensors; returns ``out`` (B, S, H, D), or ``(out, lse)`` when ``return_lse``.
    Saves (B, H, S, D) q/k/v, the kernel's output and its log-sum-exp, as the shipped op does.
    """
    if enable_gqa:
        raise ValueError("`enable_gqa` is not yet supported for cuDNN attention.")
    _devices.on_cuda_call(query)  # the GPU probe, once per CUDA device
    q, k, v = to_kernel_layout(query), to_kernel_layout(key), to_kernel_layout(value)
    # The backward recomputes the softmax from the log-sum-exp: compute it whenever one may follow.
    compute_lse = return_lse or (_save_ctx and backward_may_follow(ctx))
    out, lse, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, _ = (
        torch.ops.aten._scaled_dot_product_cudnn_attention(
            query=q,
            key=k,
            value=v,
            attn_bias=attn_mask,
            compute_log_sumexp=compute_lse,
            dropout_p=dropout_p,
            is_causal=is_causal,
            return_debug_mask=False,
            scale=scale,
        )
    )
    if _save_ctx:
        ctx.save_for_backward(q, k, v, out, lse, cum_seq_q, cum_seq_k, philox_seed, philox_offset)
        ctx.dropout_p = dropout_p
        ctx.is_causal = is_causal
        ctx.scale = scale
        ctx.attn_mask = attn_mask
        ctx.max_q = max_q
        ctx.max_k = max_k
    out = to_model_layout(out)
    if return_lse:
        return out, lse.transpose(1, 2).contiguous()
    return out


def check(lookup: Lookup) -> Finding:
    return _detect.check_forward_lse(lookup(TARGET), forward_op=_detect.CUDNN_FORWARD)


def build(lookup: Lookup) -> Mapping[str, Any]:
    return {TARGET: cudnn_attention_forward_op}


FIX = Fix(
    id="cudnn_forward_lse",
    title="cuDNN forward op computes no log-sum-exp on the context-parallel training path",
    upstream="https://github.com/huggingface/diffusers/pull/14274",
    affected=">=0.36.0,<0.40.0",
    targets=(TARGET,),
    check=check,
    build=build,
)
