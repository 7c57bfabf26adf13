"""The replaced targets, grouped by what is patched: one replacement per attribute of diffusers' attention
module, built once from the set of fixes found broken (each group's ``build(shipped, broken)``)."""

from __future__ import annotations

from . import cudnn, flash, ring, ulysses

GROUPS = (cudnn, flash, ulysses, ring)
