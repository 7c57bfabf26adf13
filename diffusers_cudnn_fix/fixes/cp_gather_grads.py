"""A context-parallel plan that gathers inside the model (Helios) trains silently wrong: refused at backward.

Bug: such a plan splits a module's input and gathers its output, so the model runs replicated between the pairs;
``AllGatherFunction.backward`` keeps this rank's chunk of a gradient it assumes equal on every rank, and the
replicated parameters' gradients come out off (the output is exact). Every release with context parallelism.
Detection: diffusers' gather backward, run in one process: does it keep its chunk without reducing over ranks?
The package: ``enable_parallelism``'s replacement arms, for such a plan, a refusal at backward (docs/fixes.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import types
from collections.abc import Mapping
from typing import Any

import torch

from .. import _ledger
from .._detect import StandInModel, spreads, with_globals
from .._fix import Finding, Lookup, built_of
from .._warnings import UnsafeAttentionError, explain
from . import ENABLE_PARALLELISM

#: The record's id (the module is named after it: the registry finds the check so), for the policy's mark.
FIX_ID = __name__.rpartition(".")[2]

#: diffusers' module of the plan's hooks and of the gather whose backward the check runs.
CONTEXT_PARALLEL = "diffusers.hooks.context_parallel"
GATHER = "AllGatherFunction"
#: The attribute of a model whose refusal is armed (its forward hook's handle): armed once per model.
ARMED = "_diffusers_cudnn_fix_cp_gather_grads"

CAUSE = (
    "this model's context-parallel plan gathers the output of {modules} inside the model, so the model runs "
    "replicated on every rank between the split/gather pairs, and diffusers' all-gather backward keeps this "
    "rank's chunk of a gradient it assumes equal on every rank."
)
CONSEQUENCE = (
    "The output is exact but the parameter gradients are not: a tiny Helios under Ulysses 2 (diffusers 0.38.0 - "
    "0.42.1) gets 51 of 1,095 gradients off, the replicated ones (proj_out, norm_out, the time embedder, each "
    "block's scale_shift_table, patch_embedding) 1.5 - 2.0 x one process's when summed over the ranks, so this "
    "backward is refused."
)
WAY_OUT = (
    "Train this model without context parallelism, or run it under context parallelism for inference only "
    "(torch.no_grad(), which is exact). diffusers would need the replicated parameters' gradients reduced apart "
    "from the sharded ones (a rule not proven here)."
)
_SECTION = "fixes.md#cp_gather_grads"


def _gathers(entry: Any) -> bool:
    """Whether a plan entry gathers a module's output: one or more objects with a ``gather_dim``."""
    items = entry if isinstance(entry, (list, tuple)) else (entry,)
    return bool(items) and all(hasattr(item, "gather_dim") for item in items)


def _splits_input(entry: Any) -> bool:
    """Whether a plan entry splits a module's input: a mapping of inputs to objects with a ``split_dim``, one of
    them not ``split_output`` (which splits the module's output instead)."""
    return isinstance(entry, Mapping) and any(
        hasattr(item, "split_dim") and not getattr(item, "split_output", False) for item in entry.values()
    )


def _same_module(a: str, b: str) -> bool:
    """Whether two plan keys can name one module: dotted paths of one length, ``*`` matching any one part."""
    left, right = a.split("."), b.split(".")
    return len(left) == len(right) and all(x == y or "*" in (x, y) for x, y in zip(left, right, strict=True))


def gathers_inside(plan: Any) -> list[str]:
    """The modules a context-parallel ``plan`` (a model's ``_cp_plan``) both splits the input of and gathers the
    output of, read off the plan's structure alone (never a class name): the plan re-splits after each such
    gather, and the model runs replicated in between. Empty for a plan that gathers only where it stops splitting
    (Flux, QwenImage, Wan, LTX: the output projection), and for anything that is not a plan."""
    if not isinstance(plan, Mapping):
        return []
    split = [key for key, entry in plan.items() if isinstance(key, str) and _splits_input(entry)]
    gathered = [key for key, entry in plan.items() if isinstance(key, str) and key and _gathers(entry)]
    found = [key for key in gathered if any(_same_module(key, other) for other in split)]
    # Helios names its blocks one by one (blocks.0.attn1 ... blocks.39.attn1): said once, with its pattern.
    return list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", key) for key in found))


def message(modules: list[str]) -> str:
    """The refusal's message for a plan gathering the output of ``modules`` inside the model."""
    return explain(CAUSE.format(modules=", ".join(modules)), CONSEQUENCE, WAY_OUT, _SECTION)


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a model's output: a tensor, a tuple or list of them, or diffusers' output dataclass (a
    mapping)."""
    if isinstance(output, torch.Tensor):
        return [output]
    items = output.values() if isinstance(output, Mapping) else output if isinstance(output, (list, tuple)) else ()
    return [item for item in items if isinstance(item, torch.Tensor)]


def arm(model: Any, config: Any, plan: Any) -> None:
    """Where ``plan`` gathers inside the model and ``config`` spreads it over ranks: a forward hook on ``model``
    that, where the output requires grad, makes its backward raise :class:`UnsafeAttentionError`. A forward without
    grad (inference) runs as shipped."""
    modules = gathers_inside(plan)
    if not modules or not spreads(config) or getattr(model, ARMED, None) is not None:
        return
    if _ledger.recording:
        _ledger.reached(FIX_ID)
    text = message(modules)

    def refuse(_: torch.Tensor) -> None:
        raise UnsafeAttentionError(text)

    def refuse_at_backward(module: Any, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(refuse)

    setattr(model, ARMED, model.register_forward_hook(refuse_at_backward))


class _Collective(Exception):
    """The gather's backward reached for a collective (stood in): it communicates with the other ranks."""


class _NoCollectives:
    """Stands in for ``torch.distributed`` and its functional collectives: any use is reported."""

    def __getattr__(self, name: str) -> Any:
        raise _Collective(name)


def _keeps_own_chunk(backward: Any) -> bool | str:
    """Whether diffusers' all-gather backward (``backward``), run in one process as rank 1 of 2, returns its own
    chunk of the incoming gradient and nothing summed over ranks; False where it reaches for a collective; a text
    where it cannot be run."""
    if not isinstance(backward, types.FunctionType):
        return f"the backward is a {type(backward).__name__}, not a function"
    run = with_globals(backward, funcol=_NoCollectives(), dist=_NoCollectives())
    grad = torch.arange(4.0)
    ctx = types.SimpleNamespace(dim=0, world_size=2, rank=1, group=None)
    try:
        grads = run(ctx, grad)
    except _Collective:
        return False
    except Exception as exc:  # noqa: BLE001 - a build this check cannot run: said as unknown
        return f"{type(exc).__name__}: {exc}"
    first = grads[0] if isinstance(grads, (tuple, list)) and grads else grads
    if isinstance(first, torch.Tensor) and torch.equal(first, grad[2:]):
        return True
    return f"it returned {first!r} for rank 1's chunk {grad[2:].tolist()} of {grad.tolist()}"


class _StandInPlan:
    """A split or a gather of a stand-in plan (only the attributes the classifier reads)."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def _refuses(lookup: Lookup) -> bool | str:
    """Whether the ``enable_parallelism`` a model gets (as ``lookup`` shows it) refuses the backward of a stand-in
    model whose plan gathers inside it (run in one process, diffusers' own stood in) while its inference runs; a
    text where it cannot be run. diffusers' own applies the plan as it is: False."""
    called: list[Any] = []
    run = built_of(lookup, ENABLE_PARALLELISM, lambda self, *args, **kwargs: called.append(kwargs))
    if run is None:
        return "the replacement could not be built around a stand-in"
    split = {"x": _StandInPlan(split_dim=1, split_output=False)}
    plan = {"blocks.*.attn": split, "blocks.0.attn": _StandInPlan(gather_dim=1)}
    model = StandInModel()
    config = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(ulysses_degree=2, ring_degree=1))
    try:
        run(model, config=config, cp_plan=plan)
        with torch.no_grad():
            model(torch.ones(1, 2))
        model(torch.ones(1, 2)).sum().backward()
    except UnsafeAttentionError:
        return bool(called)
    except Exception as exc:  # noqa: BLE001 - a replacement this check cannot run: said as unknown
        return f"{type(exc).__name__}: {exc}"
    return False


def check(lookup: Lookup) -> Finding:
    try:  # finding it imports diffusers.hooks, which a build may lack
        spec = importlib.util.find_spec(CONTEXT_PARALLEL) if "diffusers" in sys.modules else None
    except ImportError:
        spec = None
    if spec is None:
        return Finding("absent", "this diffusers has no context parallelism (no diffusers.hooks.context_parallel)")
    # Not a target's module (no hook of ours fires on it): enable_parallelism imports it the same way.
    gather = getattr(importlib.import_module(CONTEXT_PARALLEL), GATHER, None)
    keeps = _keeps_own_chunk(getattr(gather, "backward", None))
    if isinstance(keeps, str):
        return Finding("unknown", f"diffusers' {GATHER}.backward could not be run in one process ({keeps})")
    if not keeps:
        return Finding("ok", f"diffusers' {GATHER}.backward reduces the incoming gradient over the ranks")
    enable = lookup(ENABLE_PARALLELISM)
    if enable is None:  # diffusers' ModelMixin not imported yet: checked again once it is (the hook watches it)
        return Finding("broken", f"{GATHER}.backward keeps this rank's chunk of a gradient it assumes equal on every "
                       "rank; ModelMixin.enable_parallelism is not imported yet")  # fmt: skip
    refuses = _refuses(lookup)
    if isinstance(refuses, str):
        return Finding("unknown", f"ModelMixin.enable_parallelism could not be run in one process ({refuses})")
    if refuses:
        return Finding("ok", "training a model whose plan gathers inside it is refused at backward")
    return Finding(
        "broken",
        f"{GATHER}.backward keeps this rank's chunk of a gradient it assumes equal on every rank, and "
        "enable_parallelism applies plans that gather inside the model (Helios): replicated parameters train wrong",
    )
