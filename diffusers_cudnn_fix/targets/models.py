"""Replacements of diffusers' model-level entry points: ``ModelMixin._resolve_parallel_config``, where 0.42 divides by
the accelerator count (cp_no_accelerator: a copy that counts the CPU where there is no accelerator), and
``ModelMixin.enable_parallelism``. Its policies, in order:
(ltx2_cp_plan) the plan applied (the ``cp_plan`` passed, else the model's own ``_cp_plan``) is completed where it
leaves a module of the same class as one whose output it splits unsplit (LTX2), or refused where the package cannot
complete it (:func:`~diffusers_cudnn_fix.fixes.ltx2_cp_plan.plan_for`); diffusers' own ``enable_parallelism``
applies it; (cp_gather_grads) where that plan gathers inside the model and the config spreads it over ranks,
:func:`~diffusers_cudnn_fix.fixes.cp_gather_grads.correct` sums each gathered gradient over the ranks and divides
the output's by the world size (its inference runs as shipped); (cp_split_warning_once) the logger of the split
hooks diffusers put on the model gets a ``warning_once`` where it lacks one
(:func:`~diffusers_cudnn_fix.fixes.cp_split_warning_once.lend`).
"""

from __future__ import annotations

import functools
from typing import Any

from .._fix import Lookup
from ..fixes import (
    ENABLE_PARALLELISM,
    RESOLVE_PARALLEL_CONFIG,
    cp_gather_grads,
    cp_no_accelerator,
    cp_split_warning_once,
    ltx2_cp_plan,
)
from ..fixes.cp_gather_grads import AllReduce, all_reduce_sum, correct
from ..fixes.cp_no_accelerator import resolve_parallel_config
from ..fixes.cp_split_warning_once import lend
from ..fixes.ltx2_cp_plan import plan_for

#: The fixes whose policy is a step of this replacement.
POLICIES = frozenset({ltx2_cp_plan.FIX_ID, cp_gather_grads.FIX_ID, cp_split_warning_once.FIX_ID})


def build(
    shipped: Lookup, broken: frozenset[str], all_reduce: AllReduce | None = None, torch_module: Any = None
) -> dict[str, Any]:
    """The replacements for the ``broken`` fixes (diffusers' objects: ``shipped``); ``all_reduce``: how a gathered
    gradient is summed over the ranks (a check's stand-in; default: the functional collective); ``torch_module``:
    the torch ``_resolve_parallel_config``'s replacement reads the accelerator count of (a check's stand-in)."""
    built = {}
    steps = POLICIES & broken
    if steps and shipped(ENABLE_PARALLELISM) is not None:
        built[ENABLE_PARALLELISM] = enable_parallelism(shipped(ENABLE_PARALLELISM), steps, all_reduce or all_reduce_sum)
    if cp_no_accelerator.FIX_ID in broken and shipped(RESOLVE_PARALLEL_CONFIG) is not None:
        built[RESOLVE_PARALLEL_CONFIG] = resolve_parallel_config(shipped(RESOLVE_PARALLEL_CONFIG), torch_module)
    return built


def enable_parallelism(shipped: Any, steps: frozenset[str] = POLICIES, all_reduce: AllReduce = all_reduce_sum) -> Any:
    """diffusers' ``ModelMixin.enable_parallelism`` (``shipped``) with the ``steps`` (fix ids) of the policies above
    around it: the plan completed or refused before it (:func:`plan_for`), the correction of a plan gathering inside
    the model (:func:`correct`, summing with ``all_reduce``) and the split hooks' logger given ``warning_once``
    (:func:`lend`) after it."""

    @functools.wraps(shipped)
    def enable_parallelism(self: Any, *args: Any, **kwargs: Any) -> Any:
        given = kwargs.get("cp_plan")
        plan = given if given is not None else getattr(self, "_cp_plan", None)
        if ltx2_cp_plan.FIX_ID in steps:
            completed = plan_for(self, kwargs.get("config"), plan)
            if completed is not plan:
                plan = kwargs["cp_plan"] = completed
        result = shipped(self, *args, **kwargs)
        if cp_gather_grads.FIX_ID in steps:
            correct(self, kwargs.get("config"), plan, all_reduce)
        if cp_split_warning_once.FIX_ID in steps:
            lend(self)
        return result

    return enable_parallelism
