"""The replaced targets, grouped by what is patched: one replacement per attribute of diffusers' attention
module, built once from the set of fixes found broken (each group's ``build(shipped, broken)``). The cuDNN and
flash ops are built first, in one group with the Ulysses and ring classes, which are handed them (``ulysses.build``,
``ring.build``): a replacement learns of another through its builder's arguments."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from .._fix import Lookup
from . import cudnn, flash, ring, ulysses


def _build_attention(shipped: Lookup, broken: frozenset[str]) -> dict[str, Any]:
    ops = {**cudnn.build(shipped, broken), **flash.build(shipped, broken)}
    return {**ops, **ulysses.build(shipped, broken, ops), **ring.build(shipped, broken, ops)}


POLICIES = cudnn.POLICIES | flash.POLICIES | ulysses.POLICIES | ring.POLICIES
GROUPS = (SimpleNamespace(POLICIES=POLICIES, build=_build_attention),)
