"""The replaced targets: one replacement per attribute of diffusers' attention module (and QwenImage's attention
processor, and ``ModelMixin.enable_parallelism``), built once from the set of fixes found broken (:func:`build`).
The cuDNN and flash ops are built first; the Ulysses and ring builders are handed them (``ulysses.build``,
``ring.build``): a replacement learns of another through its builder's arguments."""

from __future__ import annotations

from typing import Any

from .._fix import Lookup
from . import cudnn, flash, models, ring, ulysses


def build(shipped: Lookup, broken: frozenset[str]) -> dict[str, Any]:
    """Every replacement the policies of the ``broken`` fixes need, by target (diffusers' objects: ``shipped``)."""
    ops = {**cudnn.build(shipped, broken), **flash.build(shipped, broken)}
    built = {**ops, **ulysses.build(shipped, broken, ops), **ring.build(shipped, broken, ops)}
    return {**built, **models.build(shipped, broken)}
