"""The wrapper both forward guards (masks, input dtypes) put around diffusers' cuDNN forward op."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import _devices
from .._key_padding import trim
from .._layout import realigned, refuse_one_head_or_query_while_compiling

#: Looks at the inputs and returns the mask to pass on (the same one, a converted one), or raises.
Check = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], "torch.Tensor | None"]


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype the op computes in: autocast's where it is on for ``query``'s device (the cast the wrapper
    makes), else ``query``'s own."""
    device_type = query.device.type
    if query.is_floating_point() and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return query.dtype


def guard_forward(inner: Callable[..., Any], check: Check, *, key_padding: bool = False) -> Callable[..., Any]:
    """``inner`` (the installed forward op) behind ``check``; with ``key_padding``, handed only the valid keys
    where the mask only pads keys (``_key_padding``).

    ``functools.wraps`` gives the wrapper ``inner``'s signature (``inspect.signature`` follows
    ``__wrapped__``), which is diffusers' forward-op signature; it is written out once, in
    ``cudnn_forward_lse``.
    """

    @functools.wraps(inner)
    def cudnn_attention_forward_op(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        _devices.on_cuda_call(query)  # the GPU probe, once per CUDA device (also where nothing is corrected)
        refuse_one_head_or_query_while_compiling(query)
        # Under autocast, q/k/v in the autocast dtype, as F.scaled_dot_product_attention's autocast rule casts
        # them: the raw op has no such rule, and a model under autocast hands it fp32 q/k from its norms.
        if torch.is_autocast_enabled(query.device.type):
            dtype = compute_dtype(query)
            query, key, value = (x.to(dtype) if x.is_floating_point() else x for x in (query, key, value))
        given, attn_mask = attn_mask, check(query, key, value, attn_mask)
        if key_padding and attn_mask is not None:
            key, value, attn_mask = trim(ctx, query, key, value, given, attn_mask, args, kwargs)
        # Views at an odd offset reach the kernel as they are on every release (a contiguous view is not
        # copied by the ops' .contiguous()), and cuDNN misreads them: hand it aligned memory.
        query, key, value = realigned(query), realigned(key), realigned(value)
        if attn_mask is not None:
            attn_mask = realigned(attn_mask)
        return inner(ctx, query, key, value, attn_mask, *args, **kwargs)

    cudnn_attention_forward_op.__doc__ = f"diffusers' cuDNN forward op behind {check.__module__}.{check.__name__}."
    return cudnn_attention_forward_op
