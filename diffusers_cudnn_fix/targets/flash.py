"""The one replacement of diffusers' native-flash forward op and the one of its backward op.

forward: a call diffusers' op refuses itself (``enable_gqa``) goes to it untouched -> ``flash_input_alignment``
(probe trigger, compile refusal, q/k/v on 16 bytes) -> diffusers' op.
backward: ``flash_backward_kv`` (:func:`corrected_backward`).
the ``_native_flash`` backend's registry entry (0.36.0): a call diffusers refuses itself (``return_lse``) goes to
it untouched -> ``flash_cp_ignored`` (:func:`refuse_context_parallel`) -> diffusers' backend.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from .. import _ledger
from .._fix import Lookup
from .._layout import entering, realigned_all
from ..fixes import (
    FLASH_BACKEND,
    FLASH_BACKWARD,
    FLASH_FORWARD,
    flash_backward_kv,
    flash_cp_ignored,
    flash_input_alignment,
)
from ..fixes.flash_backward_kv import corrected_backward
from ..fixes.flash_cp_ignored import refuse_context_parallel

#: ``enable_gqa``'s position among the forward op's arguments after q, k, v (mask, dropout, causal, scale, gqa).
_GQA_AFTER_V = 4


def build(shipped: Lookup, broken: frozenset[str], gqa_refused: Callable[[str], bool], facts: Any) -> dict[str, Any]:
    """The flash replacements; ``gqa_refused(op)``: whether diffusers' op ``op`` raises its own error for
    ``enable_gqa``; ``facts.flash_lse_refused``: whether its backend does for ``return_lse``."""
    built: dict[str, Any] = {}
    if flash_input_alignment.FIX_ID in broken:
        built[FLASH_FORWARD] = aligned_forward(shipped(FLASH_FORWARD), gqa_refused(FLASH_FORWARD))
    if flash_backward_kv.FIX_ID in broken:
        built[FLASH_BACKWARD] = corrected_backward
    if flash_cp_ignored.FIX_ID in broken:
        built[FLASH_BACKEND] = guarded_backend(shipped(FLASH_BACKEND), facts.flash_lse_refused)
    return built


def aligned_forward(shipped: Any, gqa_refused: bool) -> Any:
    """``shipped`` (the flash forward op) handed q/k/v on 16 bytes; its signature is the shipped op's.
    ``gqa_refused``: whether ``shipped`` raises its own error for ``enable_gqa``."""

    def native_flash_attention_forward_op(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        if gqa_refused and kwargs.get("enable_gqa", len(args) > _GQA_AFTER_V and args[_GQA_AFTER_V]):
            return shipped(ctx, query, key, value, *args, **kwargs)  # diffusers' own error for an input it rejects
        entering(query)  # where the GPU probe first runs for users of the flash backend only
        if _ledger.recording:
            _ledger.reached(flash_input_alignment.FIX_ID)
        return shipped(ctx, *realigned_all(query, key, value), *args, **kwargs)

    native_flash_attention_forward_op.__doc__ = "diffusers' native-flash forward op, handed q/k/v on 16 bytes."
    native_flash_attention_forward_op.__signature__ = inspect.signature(shipped)  # type: ignore[attr-defined]
    return native_flash_attention_forward_op


def guarded_backend(shipped: Any, lse_refused: bool) -> Any:
    """``shipped`` (diffusers' ``_native_flash`` backend function, which ignores its context-parallel config)
    refusing a context-parallel call; its signature is the shipped function's. ``lse_refused``: whether ``shipped``
    raises its own error for ``return_lse`` (such a call gets that error, not the guard's)."""
    params = list(inspect.signature(shipped).parameters)
    config_at, lse_at = params.index("_parallel_config"), params.index("return_lse")

    def native_flash_attention(*args: Any, **kwargs: Any) -> Any:
        config = kwargs["_parallel_config"] if "_parallel_config" in kwargs else None
        if config is None and len(args) > config_at:
            config = args[config_at]
        if config is not None:
            lse = kwargs["return_lse"] if "return_lse" in kwargs else len(args) > lse_at and args[lse_at]
            if not (lse and lse_refused):  # diffusers' own error for return_lse, not the guard's
                refuse_context_parallel(config)
        return shipped(*args, **kwargs)

    native_flash_attention.__doc__ = "diffusers' _native_flash backend, refusing context parallelism it ignores."
    native_flash_attention.__signature__ = inspect.signature(shipped)  # type: ignore[attr-defined]
    return native_flash_attention
