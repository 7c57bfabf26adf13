"""The one replacement of diffusers' cuDNN forward op and the one of its backward op.

Each is built once from the set of fixes found broken; each fix found broken adds its policy, a plain
function named in the comments below, at its place in the one call:

forward: a call diffusers' op refuses itself (``enable_gqa``) goes to it untouched, so that its own error
surfaces -> probe trigger and compile refusal (:func:`entering`) -> autocast cast -> ``cudnn_input_dtypes``
(:func:`refuse_unsupported_dtypes`) -> ``cudnn_bool_mask`` (:func:`mask_policy`, then the key-padding trim,
``_key_padding.trim``) -> [a new step on the mask the kernel gets goes here] -> ``cudnn_forward_lse``
(:func:`corrected_forward`, else diffusers' op).
backward: ``cudnn_masked_row_grads`` (:func:`without_masked_rows`) -> [a new step on ``grad_out`` goes here]
-> ``cudnn_backward_kv`` (:func:`corrected_backward`, else diffusers' op) -> K/V gradients back to full
length where the forward trimmed keys (``_key_padding.restored``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _ledger
from .._fix import Lookup
from .._key_padding import restored, trim
from .._layout import entering, realigned_all
from .._switches import mask_mode
from ..fixes import (
    CUDNN_BACKWARD,
    CUDNN_FORWARD,
    cudnn_backward_kv,
    cudnn_bool_mask,
    cudnn_forward_lse,
    cudnn_input_dtypes,
    cudnn_masked_row_grads,
)
from ..fixes.cudnn_backward_kv import corrected_backward
from ..fixes.cudnn_bool_mask import mask_policy
from ..fixes.cudnn_forward_lse import corrected_forward
from ..fixes.cudnn_input_dtypes import refuse_unsupported_dtypes
from ..fixes.cudnn_masked_row_grads import without_masked_rows

FORWARD_POLICIES = frozenset({cudnn_forward_lse.FIX_ID, cudnn_input_dtypes.FIX_ID, cudnn_bool_mask.FIX_ID})
BACKWARD_POLICIES = frozenset({cudnn_backward_kv.FIX_ID, cudnn_masked_row_grads.FIX_ID})


def build(
    shipped: Lookup, broken: frozenset[str], gqa_refused: Callable[[str], bool], mask_mode: str | None = None
) -> dict[str, Any]:
    """The cuDNN op replacements; ``gqa_refused(op)``: whether diffusers' op ``op`` raises its own error for
    ``enable_gqa``; ``mask_mode``: the forward's mask mode (:func:`forward_op`)."""
    backward = backward_op(shipped(CUDNN_BACKWARD), broken) if broken & BACKWARD_POLICIES else None
    if not broken & FORWARD_POLICIES:
        return {} if backward is None else {CUDNN_BACKWARD: backward}
    forward = forward_op(shipped(CUDNN_FORWARD), broken, gqa_refused(CUDNN_FORWARD), backward, mask_mode)
    return {CUDNN_FORWARD: forward} if backward is None else {CUDNN_FORWARD: forward, CUDNN_BACKWARD: backward}


def forward_op(
    shipped: Any, broken: frozenset[str], gqa_refused: bool, restoring: Any = None, built_mode: str | None = None
) -> Any:
    """diffusers' cuDNN forward op ``shipped`` with the policies of the ``broken`` fixes. ``gqa_refused``: whether
    ``shipped`` raises its own error for ``enable_gqa``. ``restoring``: the package's backward op built with it,
    which scatters the K/V gradients of trimmed keys back: only a call whose context will run it has its padded
    keys trimmed (``_key_padding``). ``built_mode``: the mask mode it always runs in, without the mode's notices
    (a check's); default the user's switch, read at each call unless the caller hands the op the mode it read
    (``mask_mode_read``: the Ulysses forward, which said the notice)."""
    correct = cudnn_forward_lse.FIX_ID in broken
    dtypes = cudnn_input_dtypes.FIX_ID in broken
    masks = cudnn_bool_mask.FIX_ID in broken
    guarded = dtypes or masks

    def cudnn_attention_forward_op(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
        return_lse: bool = False, _save_ctx: bool = True, _parallel_config: Any = None, *,
        mask_mode_read: str | None = None, mask_gathered_from: torch.Tensor | None = None,
    ) -> Any:  # fmt: skip
        # A call diffusers' op refuses itself (enable_gqa) goes to it untouched: its own error, not one of the guards'.
        if not (enable_gqa and gqa_refused):
            entering(query)
            if guarded:
                # Under autocast, q/k/v in the autocast dtype, as F.scaled_dot_product_attention's autocast rule casts
                # them: the raw op has no such rule, and a model under autocast hands it fp32 q/k from its norms.
                if torch.is_autocast_enabled(query.device.type) and query.is_floating_point():
                    dtype = torch.get_autocast_dtype(query.device.type)
                    query, key, value = (x.to(dtype) if x.is_floating_point() else x for x in (query, key, value))
                if dtypes:
                    refuse_unsupported_dtypes(query, key, value, None)
                if masks and attn_mask is not None:
                    # The mode read once per call, for the policy and the trim (the Ulysses forward hands the op
                    # the mode it read, and the mask diffusers gathered this one from).
                    mode, given = built_mode or mask_mode_read or mask_mode(), attn_mask
                    # A mask already in the dtype the op computes in (q's, cast above) is what the policy would
                    # return as it is: decided where it entered Ulysses, or passed so. The policy runs for any other,
                    # and for verify's count.
                    if attn_mask.dtype != query.dtype or attn_mask.requires_grad or _ledger.recording:
                        notify = not (built_mode or mask_mode_read)
                        attn_mask = mask_policy(query, key, value, attn_mask, mode, notify=notify)
                    if attn_mask is not None:  # a mask that only pads keys: the valid keys alone (convert mode)
                        key, value, attn_mask = trim(
                            ctx, query, key, value, given, attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            save_ctx=_save_ctx, parallel_config=_parallel_config, restoring=restoring, mode=mode,
                            gathered_from=mask_gathered_from,
                        )  # fmt: skip
                # A new per-call step on the mask the kernel gets goes here.
                # Views at an odd offset reach the kernel as they are on every release: hand it aligned memory.
                if attn_mask is not None:
                    (attn_mask,) = realigned_all(attn_mask)
            if correct:
                return corrected_forward(
                    ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, _save_ctx
                )
            if guarded:
                query, key, value = realigned_all(query, key, value)
        return shipped(
            ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
            _save_ctx=_save_ctx, _parallel_config=_parallel_config,
        )  # fmt: skip

    cudnn_attention_forward_op.__doc__ = (
        f"diffusers' cuDNN forward op with the policies of {sorted(broken & FORWARD_POLICIES)}."
    )
    return cudnn_attention_forward_op


def backward_op(shipped: Any, broken: frozenset[str]) -> Any:
    """diffusers' cuDNN backward op ``shipped`` with the policies of the ``broken`` fixes."""
    correct = cudnn_backward_kv.FIX_ID in broken
    rows = cudnn_masked_row_grads.FIX_ID in broken

    def cudnn_attention_backward_op(ctx: Any, grad_out: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        mask = getattr(ctx, "attn_mask", None)
        if rows and mask is not None:
            grad_out = without_masked_rows(grad_out, mask)
        # A new per-call step on a masked backward goes here.
        grads = corrected_backward(ctx, grad_out, **kwargs) if correct else shipped(ctx, grad_out, *args, **kwargs)
        return restored(ctx, grads)  # dK / dV back to full length where the forward trimmed padded keys

    cudnn_attention_backward_op.__doc__ = (
        f"diffusers' cuDNN backward op with the policies of {sorted(broken & BACKWARD_POLICIES)}."
    )
    return cudnn_attention_backward_op
