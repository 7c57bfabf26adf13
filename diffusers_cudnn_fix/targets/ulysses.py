"""The one replacement of ``TemplatedUlyssesAttention.forward``, the one of its ``backward``, and the one of
``TemplatedUlyssesAnythingAttention.forward`` (0.37+, ``ulysses_anything``; its backward raises, as shipped).

forward (both classes), for a mask tensor unless diffusers' op refuses the call itself (``enable_gqa``):
``qwen_joint_mask_order`` (:func:`in_kv_order`; through ``ulysses_anything`` a refusal) ->
``ulysses_mask_grad`` (:func:`refuse_mask_grad`, a mask that requires grad; plain Ulysses only: the
``anything`` backward raises rather than give a mask no gradient) -> ``cudnn_bool_mask`` (the cuDNN
op's :func:`mask_policy`, before diffusers gathers the mask; the op is handed the mode read and that mask, for
which its key-padding plan is kept: ``_key_padding.plan_of``) -> ``ulysses_head_mask`` (plain Ulysses: the op
diffusers' forward calls is handed, of a per-head mask, this rank's heads, :func:`cut_to_rank`, after diffusers
gathered it) -> [a new step on the mask goes here] -> diffusers' forward. backward: diffusers' backward, or with
``ulysses_kv_length`` the package's own (:func:`routed_back`, as many gradients as diffusers' returns) ->
``ulysses_grad_count`` (one gradient per input).

Built after the package's forward ops, which the builder is handed (``ops``): each call's ``forward_op`` is
recognised among them by identity, and what it needs is read off its :class:`ForwardOp` record.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import _ledger
from .._fix import Lookup
from .._switches import mask_mode as read_mask_mode
from ..fixes import (
    CUDNN_FORWARD,
    FLASH_FORWARD,
    ULYSSES_ANYTHING_FORWARD,
    ULYSSES_BACKWARD,
    ULYSSES_FORWARD,
    cudnn_bool_mask,
    qwen_joint_mask_order,
    ulysses_grad_count,
    ulysses_head_mask,
    ulysses_kv_length,
    ulysses_mask_grad,
)
from ..fixes.cudnn_bool_mask import mask_policy
from ..fixes.qwen_joint_mask_order import QWEN_PROCESSOR, in_kv_order, processor
from ..fixes.ulysses_head_mask import cut_to_rank, per_head
from ..fixes.ulysses_kv_length import ALL_TO_ALL, routed_back
from ..fixes.ulysses_mask_grad import refuse_mask_grad

FORWARD_POLICIES = frozenset(
    {qwen_joint_mask_order.FIX_ID, ulysses_mask_grad.FIX_ID, cudnn_bool_mask.FIX_ID, ulysses_head_mask.FIX_ID}
)
BACKWARD_POLICIES = frozenset({ulysses_grad_count.FIX_ID, ulysses_kv_length.FIX_ID})
ANYTHING_POLICIES = frozenset({qwen_joint_mask_order.FIX_ID, cudnn_bool_mask.FIX_ID})
#: Positions among the forward's arguments after the mask: ``enable_gqa``, ``forward_op``, ``_parallel_config``.
_GQA_AFTER_MASK = 3
_FORWARD_OP_AFTER_MASK = 5
_CONFIG_AFTER_MASK = 7


@dataclass(frozen=True)
class ForwardOp:
    """What the Ulysses forward must know of one of the package's forward ops when it is handed it."""

    refuses_gqa: bool  # diffusers' op behind it raises its own error for enable_gqa: such a call goes on untouched
    converts_masks: bool  # the cuDNN op's mask policy runs on the mask before diffusers gathers it


def build(
    shipped: Lookup, broken: frozenset[str], ops: dict[str, Any], facts: Any, *, diffusers: Any = None,
    all_to_all: Callable[..., Any] | None = None, mask_mode: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The replacements for the ``broken`` fixes; ``ops``: the package's replacements of diffusers' ops, by target;
    ``facts``: what was read off diffusers' code (``targets.Facts``: ``gqa_refused(op)``, whether diffusers' op
    ``op`` raises its own error for ``enable_gqa``; the Ulysses forward's inputs; the gradients diffusers' backward
    returns); ``all_to_all``: the collective the Ulysses backward routes gradients with (default: diffusers'
    ``_all_to_all_single`` as its attention module, ``diffusers``, holds it at each call, as diffusers' own backward
    reads it); ``mask_mode``: the forwards' mask mode (:func:`forward`)."""
    converts = CUDNN_FORWARD if cudnn_bool_mask.FIX_ID in broken else None
    meets = {
        ops[name]: ForwardOp(facts.gqa_refused(name), name == converts)
        for name in (CUDNN_FORWARD, FLASH_FORWARD)
        if name in ops
    }
    built: dict[str, Any] = {}
    if broken & FORWARD_POLICIES and shipped(ULYSSES_FORWARD) is not None:
        built[ULYSSES_FORWARD] = staticmethod(forward(shipped(ULYSSES_FORWARD), broken, meets, mask_mode=mask_mode))
    if broken & ANYTHING_POLICIES and shipped(ULYSSES_ANYTHING_FORWARD) is not None:
        anything = forward(
            shipped(ULYSSES_ANYTHING_FORWARD), broken & ANYTHING_POLICIES, meets, anything=True, mask_mode=mask_mode
        )
        built[ULYSSES_ANYTHING_FORWARD] = staticmethod(anything)
    if (
        qwen_joint_mask_order.FIX_ID in broken and shipped(QWEN_PROCESSOR) is not None
    ):  # hands in_kv_order the text length
        built[QWEN_PROCESSOR] = processor(shipped(QWEN_PROCESSOR))
    if broken & BACKWARD_POLICIES:
        returned = facts.ulysses_returned if ulysses_kv_length.FIX_ID in broken else 0
        if all_to_all is None:
            all_to_all = _at_each_call(diffusers, ALL_TO_ALL)
        built[ULYSSES_BACKWARD] = staticmethod(
            backward(shipped(ULYSSES_BACKWARD), broken, facts.ulysses_inputs, returned, all_to_all)
        )
    return built


def forward(
    shipped: Any, broken: frozenset[str], meets: dict[Any, ForwardOp], *, anything: bool = False,
    mask_mode: str | None = None,
) -> Any:  # fmt: skip
    """diffusers' Ulysses forward ``shipped`` (``anything``: ``TemplatedUlyssesAnythingAttention``'s) with the
    policies of the ``broken`` fixes on the mask; ``meets``: the package's forward ops it may be handed;
    ``mask_mode``: the mask mode it always runs in, without the mode's notices (a check's); default the user's
    switch, read at each call."""
    qwen = qwen_joint_mask_order.FIX_ID in broken
    grad = ulysses_mask_grad.FIX_ID in broken
    heads = ulysses_head_mask.FIX_ID in broken  # not in ANYTHING_POLICIES: ulysses_anything is left as shipped

    def ulysses_attention_forward(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any, *args: Any, **kwargs: Any
    ) -> Any:
        op: Any = args[_FORWARD_OP_AFTER_MASK] if len(args) > _FORWARD_OP_AFTER_MASK else kwargs.get("forward_op")
        gqa = args[_GQA_AFTER_MASK] if len(args) > _GQA_AFTER_MASK else kwargs.get("enable_gqa", False)
        config = args[_CONFIG_AFTER_MASK] if len(args) > _CONFIG_AFTER_MASK else kwargs.get("_parallel_config")
        needs, handed = meets.get(op), op
        # An input diffusers' op refuses itself (enable_gqa) gets diffusers' own error, not one of the guards'.
        if isinstance(attn_mask, torch.Tensor) and not (gqa and needs is not None and needs.refuses_gqa):
            if qwen:
                attn_mask = in_kv_order(attn_mask, query, key, config, anything=anything)
            if grad and (attn_mask.requires_grad or _ledger.recording):  # where it refuses, or verify counts it
                refuse_mask_grad(attn_mask)
            # A mask that requires grad goes on as it came: with the mask-grad guard off, the op's policy refuses it.
            if needs is not None and needs.converts_masks and not attn_mask.requires_grad:
                mode = mask_mode or read_mask_mode()
                attn_mask = mask_policy(query, key, value, attn_mask, mode, notify=mask_mode is None)
                # The op is handed the mode read here and the mask diffusers may gather: its plan is kept for the
                # mask the model hands every layer, not for each layer's gathered copy (_key_padding.plan_of).
                op = functools.partial(op, mask_mode_read=mode, mask_gathered_from=attn_mask)
            if heads and op is not None and per_head(attn_mask, query, config):
                # diffusers' forward gathers the mask (every rank's whole one) before the op: the op cuts it.
                op = cut_to_rank(op, config)
            if op is not handed:
                if len(args) > _FORWARD_OP_AFTER_MASK:
                    args = (*args[:_FORWARD_OP_AFTER_MASK], op, *args[_FORWARD_OP_AFTER_MASK + 1 :])
                else:
                    kwargs = {**kwargs, "forward_op": op}
        return shipped(ctx, query, key, value, attn_mask, *args, **kwargs)

    name = "Ulysses anything" if anything else "Ulysses"
    ulysses_attention_forward.__doc__ = (
        f"diffusers' {name} forward with the policies of {sorted(broken & FORWARD_POLICIES)}."
    )
    return ulysses_attention_forward


def _at_each_call(module: Any, name: str) -> Callable[..., Any]:
    """``module``'s function ``name`` as the module holds it when called (a tool or a test may put another there)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(module, name)(*args, **kwargs)

    return call


def backward(shipped: Any, broken: frozenset[str], inputs: int, returned: int, all_to_all: Callable[..., Any]) -> Any:
    """diffusers' Ulysses backward ``shipped`` (``ulysses_kv_length``: the package's own in its place, routing the
    gradients with ``all_to_all`` and returning as many as diffusers' own does, ``returned``), its result padded with
    ``None`` to one gradient per input of the forward (``inputs``) where ``ulysses_grad_count`` is broken."""
    own = ulysses_kv_length.FIX_ID in broken
    pad = ulysses_grad_count.FIX_ID in broken

    def ulysses_attention_backward(ctx: Any, grad_out: torch.Tensor, *args: Any) -> Any:
        grads: tuple[Any, ...]
        if own:
            grads = routed_back(ctx, grad_out, all_to_all)
            grads += (None,) * (returned - len(grads))
        else:
            grads = tuple(shipped(ctx, grad_out, *args))
        if pad:
            if _ledger.recording:
                _ledger.reached(ulysses_grad_count.FIX_ID)
            grads += (None,) * (inputs - len(grads))
        return grads

    return ulysses_attention_backward
