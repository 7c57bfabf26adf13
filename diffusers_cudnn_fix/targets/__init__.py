"""The replaced targets, grouped by what is patched: one replacement per attribute of diffusers' attention
module, built once from the set of fixes found broken (each group's ``build(shipped, broken)``). The cuDNN and
flash ops are built first, in one group with the Ulysses classes, which are handed them (``ulysses.build``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from .._fix import Lookup
from . import cudnn, flash, ring, ulysses


def _build_attention(shipped: Lookup, broken: frozenset[str]) -> dict[str, Any]:
    ops = {**cudnn.build(shipped, broken), **flash.build(shipped, broken)}
    return {**ops, **ulysses.build(shipped, broken, ops)}


GROUPS = (SimpleNamespace(POLICIES=cudnn.POLICIES | flash.POLICIES | ulysses.POLICIES, build=_build_attention), ring)
