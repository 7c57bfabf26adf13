"""diffusers' Ulysses backward reshapes the K/V gradients with the queries' local length.

Bug: where the keys are longer or shorter than the queries (cross-attention to sharded text: LTX, LTX2), the
backward raises "shape '[...]' is invalid for input of size ...". Every release with the class, 0.36.0 up to at
least 0.42.1. Detection: diffusers' forward then the backward, Ulysses degree 2, stand-in collectives and ops, at
S_q != S_kv: does each gradient come back in its input's layout (the op's own inputs handed back as gradients)?
The package: the Ulysses backward's replacement is its own (:func:`routed_back`), which routes each gradient
back with its own length (docs/fixes.md).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from .. import _detect, _ledger
from .._fix import Finding, Lookup, shipped_of
from . import ULYSSES_BACKWARD, ULYSSES_FORWARD

#: The record's id (the module is named after it: the registry finds the check so), for the policy's mark.
FIX_ID = __name__.rpartition(".")[2]

#: diffusers' all-to-all over the Ulysses group, a global of its attention module (0.36.0 to 0.42.1). The
#: replacement reads it from the globals of diffusers' own backward, which a check replaces with a stand-in copy.
ALL_TO_ALL = "_all_to_all_single"

#: The check's sizes: Ulysses degree 2, every dimension different, keys longer than queries.
DEGREE, BATCH, SEQ_Q, SEQ_KV, HEADS, HEAD_DIM = 2, 2, 3, 5, 4, 8


def _sequence_sharded(grad: torch.Tensor, degree: int, all_to_all: Callable[..., Any], group: Any) -> torch.Tensor:
    """A gradient from the op's layout, (B, S, H / degree, D): every rank's tokens of this rank's heads, to the
    model's, (B, S / degree, H, D): this rank's tokens of every head. S is the gradient's own length (the queries'
    or the keys'), never another's."""
    batch, seq, local_heads, dim = grad.shape
    # Dim 0: the rank whose tokens these are (the forward's order of the shards); after the all-to-all, the rank
    # whose heads they are, so that flattening it with the heads gives every head in the model's order.
    sent = grad.reshape(batch, degree, seq // degree, local_heads, dim).permute(1, 3, 0, 2, 4).contiguous()
    return all_to_all(sent, group).flatten(0, 1).permute(1, 2, 0, 3).contiguous()


def routed_back(ctx: Any, grad_out: torch.Tensor, all_to_all: Callable[..., Any]) -> tuple[torch.Tensor, ...]:
    """The Ulysses backward's gradients of q, k and v (the package's own): ``grad_out`` sent to the ranks that
    computed it (this rank's tokens of every head -> every rank's tokens of this rank's heads), diffusers' backward
    op on it, and each gradient sent back with its own length. ``all_to_all``: diffusers' ``_all_to_all_single``."""
    cp = ctx._parallel_config.context_parallel_config
    degree, group = cp.ulysses_degree, cp._ulysses_mesh.get_group()
    batch, seq_local, heads, dim = grad_out.shape
    # Dim 0: the rank whose heads these are; after the all-to-all, the rank whose tokens they are.
    sent = grad_out.reshape(batch, seq_local, degree, heads // degree, dim).permute(2, 1, 0, 3, 4).contiguous()
    grad_out = all_to_all(sent, group).flatten(0, 1).permute(1, 0, 2, 3).contiguous()  # (B, S, H / degree, D)
    grads = ctx.backward_op(ctx, grad_out)[:3]
    if _ledger.recording and grads[1].shape[1] != grads[0].shape[1]:  # only where diffusers' own would have raised
        _ledger.reached(FIX_ID)
    return tuple(_sequence_sharded(grad, degree, all_to_all, group) for grad in grads)


def _round_trip(lookup: Lookup, seq_kv: int) -> str | None:
    """Run diffusers' Ulysses forward then the backward ``lookup`` shows in one process, with stand-in collectives
    (every all-to-all returns its input: the forward's layout change is then undone exactly by a right backward)
    and a stand-in op pair whose backward hands back the q, k and v the forward op got: the gradients must be the
    inputs again. None where they are; else what happened."""
    gen = torch.Generator().manual_seed(0)
    inputs = tuple(torch.randn(BATCH, seq, HEADS, HEAD_DIM, generator=gen) for seq in (SEQ_Q, seq_kv, seq_kv))

    def forward_op(ctx: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        ctx.kept = (query, key, value)
        return query  # the output's layout is the query's

    def backward_op(ctx: Any, grad_out: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        return ctx.kept

    config = types.SimpleNamespace(
        context_parallel_config=types.SimpleNamespace(_ulysses_mesh=_detect.FAKE_MESH, ulysses_degree=DEGREE)
    )
    ctx = types.SimpleNamespace()
    run_forward = _detect.with_stand_ins(
        lambda name: shipped_of(lookup, name), ULYSSES_FORWARD, _detect.ULYSSES_STAND_INS
    )
    identity = _detect.ULYSSES_STAND_INS[ALL_TO_ALL]
    run_backward = _detect.with_stand_ins(lookup, ULYSSES_BACKWARD, {ALL_TO_ALL: identity}, all_to_all=identity)
    if isinstance(run_forward, str) or isinstance(run_backward, str):
        return f"cannot be run ({run_forward if isinstance(run_forward, str) else run_backward})"
    try:
        with torch.no_grad():  # as inside autograd.Function
            run_forward(ctx, *inputs, None, 0.0, False, None, False, False, forward_op, backward_op, config)
            grads = tuple(run_backward(ctx, torch.zeros_like(inputs[0])))[:3]
    except Exception as exc:  # noqa: BLE001 - the bug raises; anything else is told apart by the caller
        return f"raises {type(exc).__name__}: {exc}"
    shapes = [tuple(g.shape) if isinstance(g, torch.Tensor) else None for g in grads]
    if shapes != [tuple(x.shape) for x in inputs]:
        return f"returns gradients of shapes {shapes} for inputs of {[tuple(x.shape) for x in inputs]}"
    if not all(torch.equal(g, x) for g, x in zip(grads, inputs, strict=True)):
        return "returns gradients of the right shapes in another layout than its inputs'"
    return None


def check(lookup: Lookup) -> Finding:
    forward, backward = shipped_of(lookup, ULYSSES_FORWARD), lookup(ULYSSES_BACKWARD)
    shipped = shipped_of(lookup, ULYSSES_BACKWARD)
    if forward is None or backward is None:
        return Finding("absent", "this diffusers has no TemplatedUlyssesAttention")
    if (
        not all(isinstance(fn, types.FunctionType) for fn in (forward, shipped))
        or shipped_of(lookup, ALL_TO_ALL) is None
    ):
        return Finding("unknown", "TemplatedUlyssesAttention is not the one of any known release")
    same = _round_trip(lookup, SEQ_Q)
    if same is not None:
        return Finding("unknown", f"at equal query and key lengths the Ulysses backward {same}")
    other = _round_trip(lookup, SEQ_KV)
    if other is None:
        return Finding("ok", "the Ulysses backward routes dK/dV back with the keys' own length")
    return Finding("broken", f"with keys longer than the queries ({SEQ_KV} and {SEQ_Q} tokens a rank, Ulysses "
                   f"degree {DEGREE}) the Ulysses backward {other}")  # fmt: skip
