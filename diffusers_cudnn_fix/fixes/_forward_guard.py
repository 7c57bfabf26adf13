"""The wrapper both forward guards (masks, fp32 inputs) put around diffusers' cuDNN forward op."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: Looks at the inputs and returns the mask to pass on (the same one, a converted one), or raises.
Check = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], "torch.Tensor | None"]


def guard_forward(inner: Any, check: Check) -> Any:
    """``inner`` (the installed forward op) behind ``check``, with diffusers' forward-op signature."""

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
    ):
        attn_mask = check(query, key, value, attn_mask)
        return inner(
            ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
            _save_ctx=_save_ctx, _parallel_config=_parallel_config,
        )

    cudnn_attention_forward_op.__doc__ = f"diffusers' cuDNN forward op behind {check.__module__}.{check.__name__}."
    cudnn_attention_forward_op.__wrapped__ = inner  # type: ignore[attr-defined]
    return cudnn_attention_forward_op
