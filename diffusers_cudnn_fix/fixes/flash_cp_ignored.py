"""diffusers 0.36.0's ``_native_flash`` backend takes the context-parallel config and ignores it.

Bug: set after ``enable_parallelism`` (which checks only the backend active then), each rank attends to its own
shard alone, silently (diffusers' own CP parity test, 2 ranks: 0.945 relative error). 0.36.0 only: 0.37.0 routes
it through context-parallel attention. Detection: the backend as the registry holds it, called with a parallel
config of two ranks and attention stood in: does it reach the templated context-parallel path?
The package: the registry's entry refuses such a call with :class:`UnsafeAttentionError` (docs/fixes.md).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .. import _detect, _ledger
from .._fix import Finding, Lookup
from .._target_names import TEMPLATED_ATTENTION
from .._warnings import UnsafeAttentionError, explain
from . import FLASH_BACKEND

#: The record's id (the module is named after it: the registry finds the check so), for the policy's mark.
FIX_ID = __name__.rpartition(".")[2]

#: The global of diffusers' attention module that is the templated context-parallel path.

MESSAGE = explain("this diffusers' _native_flash attention ignores context parallelism.", "Each rank would attend to "
                  "its own shard only, silently, so the call is refused.", "Set the _native_cudnn backend (corrected "
                  "by this package), or upgrade diffusers to >= 0.37.0.", "fixes.md#flash_cp_ignored")  # fmt: skip


def refuse_context_parallel(parallel_config: Any) -> None:
    """Raises where the backend would run under context parallelism (it ignores it)."""
    if _ledger.recording:
        _ledger.reached(FIX_ID)
    if parallel_config is not None and _detect.spreads(parallel_config):
        raise UnsafeAttentionError(MESSAGE)


class _ReachedTemplated(Exception):
    """The call went on to diffusers' templated context-parallel path (stood in)."""


class _ReachedAttention(Exception):
    """The call computed attention directly (``F.scaled_dot_product_attention``, stopped)."""


def _reach_templated(*args: Any, **kwargs: Any) -> Any:
    raise _ReachedTemplated


class _StopAttention(TorchFunctionMode):
    """Stops at ``F.scaled_dot_product_attention`` before any kernel is chosen; runs everything else."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            raise _ReachedAttention
        return func(*args, **(kwargs or {}))


def backend_call(fn: Any, **changes: Any) -> dict[str, Any] | None:
    """The keyword arguments diffusers' dispatch hands the backend ``fn`` on the check's CPU tensors in a
    context-parallel run of two ranks, ``changes`` applied, filtered to what ``fn`` takes as dispatch filters
    them; None where ``fn`` takes no ``_parallel_config`` (a release without context parallelism)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if "_parallel_config" not in params:
        return None
    shape = (_detect.BATCH, _detect.SEQ_Q, _detect.HEADS, _detect.HEAD_DIM)
    q, k, v = (torch.zeros(shape, dtype=torch.bfloat16) for _ in range(3))
    call = dict(query=q, key=k, value=v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False, return_lse=False, _parallel_config=_detect.training_parallel_config())  # fmt: skip
    call.update(changes)
    return {name: value for name, value in call.items() if name in params}


def outcome(lookup: Lookup, call: dict[str, Any]) -> str:
    """Where a call of the backend ``lookup`` shows (diffusers' own, or the package's replacement built around it)
    goes: ``"parallel"`` (diffusers' templated context-parallel path), ``"local"`` (attention computed directly),
    ``"refused"`` (the package's refusal), else the error it raised."""
    run = _detect.with_stand_ins(lookup, FLASH_BACKEND, {TEMPLATED_ATTENTION: _reach_templated})
    if isinstance(run, str):
        return run
    try:
        with torch.no_grad(), _StopAttention():
            run(**call)
    except _ReachedTemplated:
        return "parallel"
    except _ReachedAttention:
        return "local"
    except UnsafeAttentionError:
        return "refused"
    except Exception as exc:  # noqa: BLE001 - an unknown build, or diffusers' own refusal: the caller decides
        return f"{type(exc).__name__}: {exc}"
    return "local"  # it returned without the templated path: attention of some other kind, on the shard alone


def refuses_return_lse(shipped: Any) -> bool:
    """Whether diffusers' backend raises its own error for ``return_lse=True`` (0.36.0: "does not support
    setting `return_lse=True`"), before any attention: the guard then leaves such calls to that error."""
    call = backend_call(shipped, return_lse=True, _parallel_config=None)
    return call is not None and outcome(lambda name: shipped, call) not in ("parallel", "local", "refused")


def check(lookup: Lookup) -> Finding:
    backend = lookup(FLASH_BACKEND)
    if backend is None:
        return Finding("absent", "this diffusers registers no _native_flash backend")
    call = backend_call(backend)
    if call is None:
        return Finding("absent", "the _native_flash backend takes no parallel config (no context parallelism)")
    went = outcome(lookup, call)
    if went == "parallel":
        return Finding("ok", "under context parallelism the _native_flash backend runs the templated path")
    if went == "refused":
        return Finding("ok", "the _native_flash backend refuses a context-parallel call, which it would ignore")
    if went == "local":
        return Finding(
            "broken",
            "the _native_flash backend ignores its context-parallel config: each rank attends to its own shard",
        )
    return Finding("unknown", f"the _native_flash backend could not be run on the CPU ({went})")
