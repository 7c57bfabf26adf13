"""Replacements of diffusers' model-level entry points: ``ModelMixin.enable_parallelism``.

Policy (cp_gather_grads): diffusers' own ``enable_parallelism`` applies the plan; then, where that plan gathers
inside the model and the config spreads it over ranks, :func:`~diffusers_cudnn_fix.fixes.cp_gather_grads.arm`
refuses the model's backward (its inference runs as shipped).
"""

from __future__ import annotations

import functools
from typing import Any

from .._fix import Lookup
from ..fixes import ENABLE_PARALLELISM
from ..fixes.cp_gather_grads import arm


def build(shipped: Lookup, broken: frozenset[str]) -> dict[str, Any]:
    """The replacements for the ``broken`` fixes (diffusers' objects: ``shipped``)."""
    if "cp_gather_grads" in broken and shipped(ENABLE_PARALLELISM) is not None:
        return {ENABLE_PARALLELISM: enable_parallelism(shipped(ENABLE_PARALLELISM))}
    return {}


def enable_parallelism(shipped: Any) -> Any:
    """diffusers' ``ModelMixin.enable_parallelism`` (``shipped``), then the refusal of a plan gathering inside the
    model (:func:`arm`: the ``cp_plan`` passed, else the model's own ``_cp_plan``, as diffusers reads them)."""

    @functools.wraps(shipped)
    def enable_parallelism(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = shipped(self, *args, **kwargs)
        plan = kwargs.get("cp_plan")
        arm(self, kwargs.get("config"), plan if plan is not None else getattr(self, "_cp_plan", None))
        return result

    return enable_parallelism
