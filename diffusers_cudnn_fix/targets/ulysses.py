"""The one replacement of ``TemplatedUlyssesAttention.forward``, the one of its ``backward``, and the one of
``TemplatedUlyssesAnythingAttention.forward`` (0.37+, ``ulysses_anything``; its backward raises, as shipped).

forward (both classes), for a mask tensor unless diffusers' op refuses the call itself (``enable_gqa``):
``qwen_joint_mask_order`` (:func:`in_kv_order`; through ``ulysses_anything`` a refusal) ->
``ulysses_mask_grad`` (:func:`refuse_mask_grad`, a mask that requires grad; plain Ulysses only: the
``anything`` backward raises rather than give a mask no gradient) -> ``cudnn_bool_mask`` (the cuDNN
op's :func:`mask_policy`, before diffusers gathers the mask) -> [a new step on the mask goes here] ->
diffusers' forward. backward: diffusers' backward -> ``ulysses_grad_count`` (one gradient per input).
Both call diffusers' function as their keyword ``_shipped``, so that a check can run them with stand-in
collectives (``_detect.with_stand_ins``).
"""

from __future__ import annotations

from typing import Any

import torch

from .._detect import REFUSES_GQA, input_count
from .._fix import Lookup
from ..fixes import ULYSSES_ANYTHING_FORWARD, ULYSSES_BACKWARD, ULYSSES_FORWARD
from ..fixes.qwen_joint_mask_order import in_kv_order
from ..fixes.ulysses_mask_grad import refuse_mask_grad

FORWARD_POLICIES = frozenset({"qwen_joint_mask_order", "ulysses_mask_grad", "cudnn_bool_mask"})
ANYTHING_POLICIES = frozenset({"qwen_joint_mask_order", "cudnn_bool_mask"})
POLICIES = FORWARD_POLICIES | {"ulysses_grad_count"}
#: Positions among the forward's arguments after the mask: ``enable_gqa``, ``forward_op``, ``_parallel_config``.
_GQA_AFTER_MASK = 3
_FORWARD_OP_AFTER_MASK = 5
_CONFIG_AFTER_MASK = 7


def build(shipped: Lookup, broken: frozenset[str]) -> dict[str, Any]:
    built: dict[str, Any] = {}
    if broken & FORWARD_POLICIES and shipped(ULYSSES_FORWARD) is not None:
        built[ULYSSES_FORWARD] = staticmethod(forward(shipped(ULYSSES_FORWARD), broken))
    if broken & ANYTHING_POLICIES and shipped(ULYSSES_ANYTHING_FORWARD) is not None:
        anything = forward(shipped(ULYSSES_ANYTHING_FORWARD), broken & ANYTHING_POLICIES, anything=True)
        built[ULYSSES_ANYTHING_FORWARD] = staticmethod(anything)
    if "ulysses_grad_count" in broken:
        inputs = input_count(shipped(ULYSSES_FORWARD))
        assert inputs is not None  # the check read it before the build
        built[ULYSSES_BACKWARD] = staticmethod(backward(shipped(ULYSSES_BACKWARD), inputs))
    return built


def forward(shipped: Any, broken: frozenset[str], *, anything: bool = False) -> Any:
    """diffusers' Ulysses forward ``shipped`` (``anything``: ``TemplatedUlyssesAnythingAttention``'s) with the
    policies of the ``broken`` fixes on the mask."""
    qwen = "qwen_joint_mask_order" in broken
    grad = "ulysses_mask_grad" in broken
    convert = "cudnn_bool_mask" in broken

    def ulysses_attention_forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Any,
        *args: Any,
        _shipped: Any = shipped,
        **kwargs: Any,
    ) -> Any:
        op = args[_FORWARD_OP_AFTER_MASK] if len(args) > _FORWARD_OP_AFTER_MASK else kwargs.get("forward_op")
        gqa = args[_GQA_AFTER_MASK] if len(args) > _GQA_AFTER_MASK else kwargs.get("enable_gqa", False)
        # An input diffusers' op refuses itself (enable_gqa) gets diffusers' own error, not one of the guards'.
        if isinstance(attn_mask, torch.Tensor) and not (gqa and getattr(op, REFUSES_GQA, False)):
            if qwen:
                config = args[_CONFIG_AFTER_MASK] if len(args) > _CONFIG_AFTER_MASK else None
                attn_mask = in_kv_order(
                    attn_mask, query, key, kwargs.get("_parallel_config", config), anything=anything
                )
            if grad:
                refuse_mask_grad(attn_mask)
            # A mask that requires grad goes on as it came: with the mask-grad guard off, the op's policy refuses it.
            if convert and not attn_mask.requires_grad:
                policy = getattr(op, "mask_policy", None)
                if policy is not None:
                    attn_mask = policy(query, key, value, attn_mask)
        return _shipped(ctx, query, key, value, attn_mask, *args, **kwargs)

    name = "Ulysses anything" if anything else "Ulysses"
    ulysses_attention_forward.__doc__ = (
        f"diffusers' {name} forward with the policies of {sorted(broken & FORWARD_POLICIES)}."
    )
    return ulysses_attention_forward


def backward(shipped: Any, inputs: int) -> Any:
    """diffusers' Ulysses backward ``shipped``, its result padded with ``None`` to one gradient per input."""

    def ulysses_attention_backward(ctx: Any, grad_out: torch.Tensor, *args: Any, _shipped: Any = shipped) -> Any:
        grads = tuple(_shipped(ctx, grad_out, *args))
        return grads + (None,) * (inputs - len(grads))

    return ulysses_attention_backward
