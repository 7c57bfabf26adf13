"""A context-parallel plan that gathers inside the model (Helios) trains silently wrong: its gradients corrected.

Bug: such a plan splits a module's input and gathers its output, so the model runs replicated between the pairs;
``AllGatherFunction.backward`` keeps this rank's chunk of a gradient it assumes equal on every rank, and the
replicated parameters' gradients come out off (the output is exact). Every release with context parallelism.
Detection: diffusers' gather backward, run in one process: does it keep its chunk without reducing over ranks?
The package: for such a plan alone, each gather's backward sums the gradient over the ranks first, and the gradient
entering the model's outputs is divided by the world size (:func:`correct`; docs/fixes.md says why that is exact).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

try:  # a torch built without distributed has no context parallelism to correct
    from torch.distributed import _functional_collectives as funcol
except ImportError:  # pragma: no cover - such builds are not tested here
    funcol = None  # type: ignore[assignment]

from .. import _ledger
from .._detect import StandInModel, spreads, with_globals
from .._fix import Finding, Lookup, built_of
from . import ENABLE_PARALLELISM

#: The record's id (the module is named after it: the registry finds the check so), for the policy's mark.
FIX_ID = __name__.rpartition(".")[2]

#: diffusers' module of the plan's hooks and of the gather whose backward the check runs.
CONTEXT_PARALLEL = "diffusers.hooks.context_parallel"
GATHER = "AllGatherFunction"
#: The attribute of a model whose correction is made (its output hook's handle): made once per model.
CORRECTED = "_diffusers_cudnn_fix_cp_gather_grads"

#: Sums a gradient over the ranks of a process group: ``all_reduce(tensor, group) -> tensor`` (a check stands in).
AllReduce = Callable[[torch.Tensor, Any], torch.Tensor]


def all_reduce_sum(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` summed over the ranks of ``group``, out of place (the functional collective: torch.compile traces
    it; ``wait_tensor`` so that autograd gets a plain tensor). Runs in backwards, on autograd's threads too: its
    module is imported with this one, never here."""
    return funcol.wait_tensor(funcol.all_reduce(tensor.contiguous(), "sum", group))


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


class _SumOverRanks(torch.autograd.Function):
    """The identity forward; backward, the gradient summed over the ranks. Put after diffusers' all-gather, whose
    backward then keeps this rank's chunk of the sum: a reduce-scatter, the all-gather's true backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any, all_reduce: AllReduce) -> torch.Tensor:
        ctx.group, ctx.all_reduce = group, all_reduce
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.all_reduce(grad, ctx.group), None, None


class _Scaled(torch.autograd.Function):
    """The identity forward; backward, the gradient times ``factor``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def _each_tensor(value: Any, change: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` (a module's output: a tensor, a tuple or list of them, or diffusers' output dataclass, a mapping)
    with ``change`` applied to each tensor that requires grad; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return change(value) if value.requires_grad else value
    if isinstance(value, (tuple, list)):
        return type(value)(_each_tensor(item, change) for item in value)
    if isinstance(value, Mapping):
        return type(value)(**{key: _each_tensor(item, change) for key, item in value.items()})
    return value


def _world(config: Any) -> int:
    """The ranks ``config`` (diffusers' ``ParallelConfig`` or a ``ContextParallelConfig``) spreads attention over."""
    cp = getattr(config, "context_parallel_config", config)
    return int(getattr(cp, "ulysses_degree", 1) or 1) * int(getattr(cp, "ring_degree", 1) or 1)


def _gather_hooks(model: Any) -> list[Any]:
    """The gather hooks diffusers put on ``model``'s modules (each with the plan's gather entries as ``metadata`` and
    the post-forward its registry calls, ``fn_ref.post_forward``)."""
    found = []
    for module in model.modules():
        hooks = getattr(getattr(module, "_diffusers_hook", None), "hooks", None)
        for hook in hooks.values() if isinstance(hooks, dict) else ():
            if _gathers(getattr(hook, "metadata", None)) and hasattr(getattr(hook, "fn_ref", None), "post_forward"):
                found.append(hook)
    return found


def _group(hook: Any) -> Any:
    """The process group a gather hook gathers over (its config's flattened mesh's, as diffusers' gather takes it)."""
    mesh = getattr(getattr(hook, "parallel_config", None), "_flattened_mesh", None)
    return mesh.get_group() if mesh is not None and hasattr(mesh, "get_group") else None


def correct(model: Any, config: Any, plan: Any, all_reduce: AllReduce = all_reduce_sum) -> None:
    """Where ``plan`` gathers inside the model and ``config`` spreads it over ranks: each gather hook diffusers put on
    ``model`` hands on its output with :class:`_SumOverRanks` (the gradient summed over the ranks before diffusers'
    backward keeps this rank's chunk), and a forward hook on ``model`` divides the gradient entering its outputs by
    the world size. Every rank's gradients are then partial sums that add up over the ranks to one process's, as
    for a plan that gathers only at its end (docs/fixes.md). A forward without grad (inference) is unchanged."""
    if not gathers_inside(plan) or not spreads(config) or getattr(model, CORRECTED, None) is not None:
        return
    if _ledger.recording:
        _ledger.reached(FIX_ID)
    for hook in _gather_hooks(model):
        hook.fn_ref.post_forward = _summing(hook.fn_ref.post_forward, _group(hook), all_reduce)
    share = 1.0 / _world(config)

    def divide_outputs(module: Any, args: Any, output: Any) -> Any:
        return _each_tensor(output, lambda tensor: _Scaled.apply(tensor, share))

    setattr(model, CORRECTED, model.register_forward_hook(divide_outputs))


def _summing(post_forward: Any, group: Any, all_reduce: AllReduce) -> Any:
    """A gather hook's ``post_forward`` (diffusers' all-gather) followed by :class:`_SumOverRanks` on each output."""

    def gathered_then_summed(module: Any, output: Any) -> Any:
        return _each_tensor(post_forward(module, output), lambda tensor: _SumOverRanks.apply(tensor, group, all_reduce))

    return gathered_then_summed


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


class _StandInGatheringModel(torch.nn.Module):
    """A model of two stand-in layers whose first one's output goes through the post-forward of the gather hook the
    stand-in of diffusers' ``enable_parallelism`` puts on it (as diffusers' hook registry calls it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = StandInModel(), StandInModel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hook: Any = getattr(self.inner, "_diffusers_hook").hooks["gather"]  # noqa: B009 - put there at run time
        return self.outer(hook.fn_ref.post_forward(self.inner, self.inner(x)))


def _corrects(lookup: Lookup) -> bool | str:
    """Whether the ``enable_parallelism`` a model gets (as ``lookup`` shows it), run in one process on a stand-in
    model whose plan gathers inside it over 2 ranks (diffusers' own stood in by one that puts an identity gather
    hook on it; the sum over the ranks stood in by one that records its group and doubles the gradient, as two
    equal ranks would sum), sums the gathered gradient over the hook's group and halves the gradient entering the
    output, so that each parameter gets its share of one process's gradient. diffusers' own: False (a text where
    it cannot be run)."""
    group = object()
    summed: list[Any] = []

    def stand_in_all_reduce(tensor: torch.Tensor, over: Any) -> torch.Tensor:
        summed.append(over)
        return tensor * 2

    def register(self: Any, *args: Any, **kwargs: Any) -> None:
        mesh = types.SimpleNamespace(get_group=lambda: group)
        fn_ref = types.SimpleNamespace(post_forward=lambda module, output: output)
        hook = types.SimpleNamespace(metadata=[_StandInPlan(gather_dim=1)], fn_ref=fn_ref,
                                     parallel_config=types.SimpleNamespace(_flattened_mesh=mesh))  # fmt: skip
        self.inner._diffusers_hook = types.SimpleNamespace(hooks={"gather": hook})

    run = built_of(lookup, ENABLE_PARALLELISM, register, all_reduce=stand_in_all_reduce)
    if run is None:
        return "the replacement could not be built around a stand-in"
    split = {"x": _StandInPlan(split_dim=1, split_output=False)}
    plan = {"blocks.*.attn": split, "blocks.0.attn": _StandInPlan(gather_dim=1)}
    model, reference = _StandInGatheringModel(), _StandInGatheringModel()
    config = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(ulysses_degree=2, ring_degree=1))
    try:
        run(model, config=config, cp_plan=plan)
        x = torch.tensor([[1.0, 2.0]])
        model(x).square().sum().backward()
        register(reference)
        reference(x).square().sum().backward()
        # As one of two equal ranks: the layer before the gather gets one process's gradient (the sum over the two
        # ranks, halved at the output), the one after it half of it (its share of the two ranks' sum).
        mine: Any = [model.inner.weight.grad, model.outer.weight.grad]
        theirs: Any = [reference.inner.weight.grad, reference.outer.weight.grad]
        before, after = torch.equal(mine[0], theirs[0]), torch.equal(mine[1] * 2, theirs[1])
    except Exception as exc:  # noqa: BLE001 - a replacement this check cannot run: said as unknown
        return f"{type(exc).__name__}: {exc}"
    return summed == [group] and before and after


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
    corrects = _corrects(lookup)
    if isinstance(corrects, str):
        return Finding("unknown", f"ModelMixin.enable_parallelism could not be run in one process ({corrects})")
    if corrects:
        return Finding("ok", "a model whose plan gathers inside it gets its gathered gradients summed over the ranks "
                       "and its output's gradient divided by the world size: one process's gradients")  # fmt: skip
    return Finding(
        "broken",
        f"{GATHER}.backward keeps this rank's chunk of a gradient it assumes equal on every rank, and "
        "enable_parallelism applies plans that gather inside the model (Helios): replicated parameters train wrong",
    )
