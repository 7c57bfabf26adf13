"""The replaced targets: one replacement per attribute of diffusers' attention module (and QwenImage's attention
processor, and ``ModelMixin.enable_parallelism``), built once from the set of fixes found broken (:func:`build`).
The cuDNN and flash ops are built first; the Ulysses and ring builders are handed them (``ulysses.build``,
``ring.build``): a replacement learns of another through its builder's arguments."""

from __future__ import annotations

import functools
from typing import Any

from .._detect import CUDNN_FORWARD_KERNEL, FLASH_FORWARD_KERNEL, refuses_gqa
from .._fix import Lookup
from ..fixes import CUDNN_FORWARD, FLASH_FORWARD
from . import cudnn, flash, models, ring, ulysses


def build(shipped: Lookup, broken: frozenset[str]) -> dict[str, Any]:
    """Every replacement the policies of the ``broken`` fixes need, by target (diffusers' objects: ``shipped``)."""
    kernels = {CUDNN_FORWARD: CUDNN_FORWARD_KERNEL, FLASH_FORWARD: FLASH_FORWARD_KERNEL}

    @functools.cache
    def gqa_refused(op: str) -> bool:
        """Whether diffusers' forward op ``op`` raises its own error for enable_gqa: asked where a replacement
        needs it, once (it runs the op), for the op's replacement and the Ulysses forward that may be handed it."""
        return refuses_gqa(shipped(op), kernels[op])

    ops = {**cudnn.build(shipped, broken, gqa_refused), **flash.build(shipped, broken, gqa_refused)}
    built = {**ops, **ulysses.build(shipped, broken, ops, gqa_refused), **ring.build(shipped, broken, ops)}
    return {**built, **models.build(shipped, broken)}
