"""0.36.0's Ulysses backward returns 11 gradients for 12 inputs.

Bug: ``TemplatedUlyssesAttention.forward`` takes 12 inputs (q, k, v, mask, dropout, causal, scale, gqa,
return_lse, forward_op, backward_op, parallel config); its backward returns the three gradients and 8
``None``s, one short, so autograd raises "returned an incorrect number of gradients (expected 12, got 11)"
for every attention backend, with or without this package's other fixes.

Releases: 0.36.0. Fixed upstream in 0.37.0.

Detection: run the installed backward in one process with stand-in collectives (Ulysses degree 1) and a
backward op returning empty gradients, and count what it returns against the forward's inputs.

Replacement: the shipped backward, its result padded with ``None`` (no gradient) for the missing trailing
inputs (the parallel config, which takes none).

Revert: the class's original ``backward`` staticmethod is put back (the registry keeps it).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch

from .. import _detect
from .._fix import Finding, Fix, Lookup

CLASS = "TemplatedUlyssesAttention"
TARGET = f"{CLASS}.backward"


def _padded(shipped: Any, inputs: int) -> Any:
    def backward(ctx: Any, grad_out: torch.Tensor, *args: Any) -> tuple[Any, ...]:
        """diffusers' Ulysses backward with one gradient (None) per forward input."""
        grads = tuple(shipped(ctx, grad_out, *args))
        return grads + (None,) * (inputs - len(grads))

    backward.__wrapped__ = shipped  # type: ignore[attr-defined]
    backward._padded_to = inputs  # type: ignore[attr-defined]
    return backward


def _with_stand_in_collectives(backward: Any) -> Any:
    """``backward`` (or, for our padded wrapper, the shipped one inside it) calling stand-in all-to-alls."""
    inputs = getattr(backward, "_padded_to", None)
    if inputs is not None:
        return _padded(_with_stand_in_collectives(backward.__wrapped__), inputs)
    return _detect.with_globals(backward, _all_to_all_single=lambda x, group=None: x)


def run_backward(backward: Any) -> tuple[tuple[Any, ...] | None, str | None]:
    """Run ``backward`` (Ulysses degree 1, stand-in collectives, a backward op returning empty gradients) in
    this process; returns what it returned, or None and the error."""
    batch, seq, heads, dim = 1, 4, 2, 8

    def backward_op(ctx: Any, grad: torch.Tensor, *a: Any, **kw: Any) -> tuple[torch.Tensor, ...]:
        return torch.empty_like(grad), torch.empty_like(grad), torch.empty_like(grad)  # only counted

    config = types.SimpleNamespace(_ulysses_mesh=_detect.FAKE_MESH, ulysses_degree=1, _world_size=2)
    ctx = types.SimpleNamespace(
        _parallel_config=types.SimpleNamespace(context_parallel_config=config), backward_op=backward_op
    )
    run = _with_stand_in_collectives(backward)
    try:
        return tuple(run(ctx, torch.empty(batch, seq, heads, dim))), None
    except Exception as exc:  # noqa: BLE001 - an unknown build: say so
        return None, f"{type(exc).__name__}: {exc}"


def check(lookup: Lookup) -> Finding:
    forward, backward = lookup(f"{CLASS}.forward"), lookup(TARGET)
    if forward is None or backward is None:
        return Finding("absent", "this diffusers has no TemplatedUlyssesAttention")
    inputs = _detect.input_count(forward)
    if inputs is None or getattr(backward, "__code__", None) is None:
        return Finding("unknown", "TemplatedUlyssesAttention's forward/backward are not plain functions")
    grads, error = run_backward(backward)
    if grads is None:
        return Finding("unknown", f"the Ulysses backward could not be run in one process ({error})")
    returned = len(grads)
    if returned < inputs:
        return Finding("broken", f"the Ulysses backward returns {returned} gradients for {inputs} inputs")
    if returned > inputs:
        return Finding("unknown", f"the Ulysses backward returns {returned} gradients for {inputs} inputs")
    return Finding("ok", f"the Ulysses backward returns one gradient per input ({inputs})")


def build(lookup: Lookup) -> Mapping[str, Any]:
    inputs = _detect.input_count(lookup(f"{CLASS}.forward"))
    assert inputs is not None  # the check read it before the build
    return {TARGET: staticmethod(_padded(lookup(TARGET), inputs))}


FIX = Fix(
    id="ulysses_grad_count",
    title="Ulysses backward returns one gradient fewer than the forward has inputs",
    upstream="https://github.com/huggingface/diffusers/pull/14274",
    affected=">=0.36.0,<0.37.0",
    targets=(TARGET,),
    check=check,
    build=build,
)
