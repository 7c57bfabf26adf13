"""Ring (and unified) context parallelism's backward reuses the first ring step's tensors.

Bug: ``TemplatedRingAttention.backward`` rotates K/V around the ring, but calls the backward op as
``ctx.backward_op(ctx, grad_out)`` on every step, so every step recomputes the first step's attention
(the saved local K/V, and the saved step-0 output and log-sum-exp instead of the merged ones). Parameter
gradients are wrong for every attention backend, with or without this package's other fixes (one step of a
tiny Flux transformer, ring degree 2, 0.39.0 with the K/V and log-sum-exp fixes: off by up to 4x their
size; 0.40.0: within 1.2%). Unified attention (ring and Ulysses degree > 1) runs the same class.

Releases: 0.36.0 to 0.39.0. Fixed upstream in 0.40.0 (huggingface/diffusers#14274: per-step
query/key/value/out/lse handed to the backward op).

Detection: run the installed ``TemplatedRingAttention.backward`` in one process with stand-in collectives
(ring degree 2, the remote shard different from the local one) and a recording backward op: does the op
see a different K on the second step?

Replacement: a backward that raises :class:`UnsafeAttentionError` naming the cause and the way out
(Ulysses, or diffusers >= 0.40). The forward is untouched, so ring inference keeps working. Porting
upstream's backward would need its forward changes too (the merged output and log-sum-exp it saves); this
package refuses instead.

Revert: the class's original ``backward`` staticmethod is put back (the registry keeps it).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch

from .. import _detect
from .._fix import Finding, Fix, Lookup
from .._warnings import UnsafeAttentionError

CLASS = "TemplatedRingAttention"
TARGET = f"{CLASS}.backward"
FIX_ID = "ring_backward"

MESSAGE = (
    "diffusers_cudnn_fix: ring context parallelism (ring_degree > 1, also unified attention) in this diffusers "
    "release reuses the first ring step's tensors in its backward and computes wrong gradients for every "
    "attention backend (fixed upstream in diffusers 0.40.0, huggingface/diffusers#14274). Train with Ulysses "
    "context parallelism (ContextParallelConfig(ulysses_degree=...)) or upgrade diffusers to >= 0.40. "
    f"The ring forward (inference) is left as shipped. DIFFUSERS_CUDNN_FIX_SKIP={FIX_ID} lets the wrong backward run."
)


def ring_backward_guard(ctx: Any, grad_out: torch.Tensor, *args: Any) -> Any:
    """Stands in for ``TemplatedRingAttention.backward`` on releases whose ring backward is wrong."""
    raise UnsafeAttentionError(MESSAGE)


def _run(backward: Any) -> tuple[list[torch.Tensor] | None, str | None]:
    """Run ``backward`` for ring degree 2 in this process; returns the K each backward-op call saw."""
    batch, seq, heads, dim = 1, 4, 2, 8
    # Values do not matter except that the remote shard differs from the local one (zeros vs ones below);
    # zeros, not randn: one tensor factory fewer to warm up in the hook.
    q, k, v, out = (torch.zeros(batch, seq, heads, dim) for _ in range(4))
    lse = torch.zeros(batch, seq, heads)
    seen: list[torch.Tensor] = []

    def backward_op(ctx: Any, grad: torch.Tensor, *a: Any, **kw: Any) -> tuple[torch.Tensor, ...]:
        key = kw.get("key")
        seen.append((key if key is not None else ctx.saved_tensors[1]).clone())
        return torch.zeros(ctx.q_shape), torch.zeros(ctx.kv_shape), torch.zeros(ctx.kv_shape)

    collectives = types.SimpleNamespace(
        # Rank 1's K/V differ from ours, so a step that uses them shows it.
        all_gather_tensor=lambda x, gather_dim=0, group=None: torch.cat([x, x + 1.0]),
        permute_tensor=lambda x, ranks, group=None: x,
        AsyncCollectiveTensor=type("AsyncCollectiveTensor", (), {}),
    )
    config = types.SimpleNamespace(
        _ring_mesh=_detect.FAKE_MESH, _ring_local_rank=0, ring_degree=2, convert_to_fp32=False, _world_size=2
    )
    ctx = types.SimpleNamespace(
        _parallel_config=types.SimpleNamespace(context_parallel_config=config),
        q_shape=q.shape,
        kv_shape=k.shape,
        saved_tensors=(q, k, v, out, lse, None, None, None, None),
        ring_out=out,
        ring_lse=lse,
        backward_op=backward_op,
        forward_op=None,
    )
    try:
        _detect.with_globals(backward, funcol=collectives)(ctx, torch.zeros(batch, seq, heads, dim))
    except UnsafeAttentionError:
        return None, None
    except Exception as exc:  # noqa: BLE001 - an unknown build: say so
        return seen, f"{type(exc).__name__}: {exc}"
    return seen, None


def check(lookup: Lookup) -> Finding:
    cls = lookup(CLASS)
    backward = lookup(TARGET)
    if cls is None or backward is None:
        return Finding("absent", "this diffusers has no TemplatedRingAttention")
    if getattr(backward, "__code__", None) is None:
        return Finding("unknown", "TemplatedRingAttention.backward is not a plain function")
    seen, error = _run(backward)
    if seen is None:
        return Finding("ok", "the ring backward raises this package's clear error instead of running")
    if error is not None or len(seen) != 2:
        return Finding("unknown", f"the ring backward could not be run in one process ({error or len(seen)} calls)")
    if torch.equal(seen[0], seen[1]):
        return Finding("broken", "every ring step's backward recomputes the first step (the local K/V)")
    return Finding("ok", "each ring step's backward sees that step's K/V")


def build(lookup: Lookup) -> Mapping[str, Any]:
    return {TARGET: staticmethod(ring_backward_guard)}


FIX = Fix(
    id=FIX_ID,
    title="ring/unified context parallelism's backward reuses the first ring step's tensors",
    upstream="https://github.com/huggingface/diffusers/pull/14274",
    affected=">=0.36.0,<0.40.0",
    targets=(TARGET,),
    check=check,
    build=build,
    kind="guard",
)
