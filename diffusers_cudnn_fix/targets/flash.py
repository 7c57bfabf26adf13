"""The one replacement of diffusers' native-flash forward op and the one of its backward op.

forward: a call diffusers' op refuses itself (``enable_gqa``) goes to it untouched -> ``flash_input_alignment``
(probe trigger, compile refusal, q/k/v on 16 bytes) -> diffusers' op.
backward: ``flash_backward_kv`` (:func:`corrected_backward`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .._detect import FLASH_FORWARD as FLASH_KERNEL
from .._detect import REFUSES_GQA, refuses_gqa
from .._fix import Lookup
from .._layout import entering, realigned_all
from ..fixes import FLASH_BACKWARD, FLASH_FORWARD
from ..fixes.flash_backward_kv import corrected_backward
from .ring import STEPS_ATTR

POLICIES = frozenset({"flash_input_alignment", "flash_backward_kv"})
#: ``enable_gqa``'s position among the forward op's arguments after q, k, v (mask, dropout, causal, scale, gqa).
_GQA_AFTER_V = 4


def build(shipped: Lookup, broken: frozenset[str]) -> dict[str, Any]:
    built: dict[str, Any] = {}
    if "flash_input_alignment" in broken:
        built[FLASH_FORWARD] = aligned_forward(shipped(FLASH_FORWARD))
    if "flash_backward_kv" in broken:
        built[FLASH_BACKWARD] = corrected_backward
        setattr(corrected_backward, STEPS_ATTR, ("_native_flash", "saved"))
    return built


def aligned_forward(shipped: Any) -> Any:
    """``shipped`` (the flash forward op) handed q/k/v on 16 bytes; its signature is the shipped op's."""
    gqa_refused = refuses_gqa(shipped, FLASH_KERNEL)

    def native_flash_attention_forward_op(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        if gqa_refused and kwargs.get("enable_gqa", len(args) > _GQA_AFTER_V and args[_GQA_AFTER_V]):
            return shipped(ctx, query, key, value, *args, **kwargs)  # diffusers' own error for an input it rejects
        entering(query)  # where the GPU probe first runs for users of the flash backend only
        return shipped(ctx, *realigned_all(query, key, value), *args, **kwargs)

    native_flash_attention_forward_op.__doc__ = "diffusers' native-flash forward op, handed q/k/v on 16 bytes."
    setattr(native_flash_attention_forward_op, REFUSES_GQA, gqa_refused)
    native_flash_attention_forward_op.__signature__ = inspect.signature(shipped)  # type: ignore[attr-defined]
    return native_flash_attention_forward_op
