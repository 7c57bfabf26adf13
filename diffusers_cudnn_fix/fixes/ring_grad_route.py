"""Ring attention's backward hands the K/V gradient accumulator the wrong way round the ring (0.40 on).

Bug: ``TemplatedRingAttention.backward`` works on the K/V chunk of ring rank ``rank + i`` at step ``i`` and
passes the K/V gradient accumulator to rank ``rank + 1`` after each step. The rank receiving it works on the
chunk of ``rank + i + 2`` next, not on the chunk the accumulator holds: each accumulator sums the gradients
of several chunks. With two ring ranks ``rank + 2`` is ``rank`` and the route happens to be right; from ring
degree 3 the K and V gradients are wrong (the output and the query gradient are right). See
docs/kernel-facts.md, "Ring attention".

Releases: 0.40.0 on (the release that corrected the first-step bug of ``ring_backward``).

Detection: run the installed forward and backward in one process as rank 0 of a ring of three, with stand-in
collectives and attention ops. The stand-in backward op returns, for each step, a K/V gradient that marks
which rank's chunk that step worked on (read from the K it is handed); the stand-in ``permute_tensor``
records each send's source -> destination map and hands rank 0 what its sender would hold, which, the ranks
running the same code, is rank 0's own accumulator with the chunk marks shifted by the sender's rank. A
correct route leaves on rank 0 the gradients of its own chunk only, one from each rank. The package's own
corrected ring (``ring_backward`` on 0.36 to 0.39, and this fix's on 0.40 on) passes the same test; a ring
whose steps do not work on each step's K/V at all (``ring_backward``'s bug, the fix skipped) is left to that
fix.

Replacement: the package's corrected ring (``ring_backward``'s forward, whose inference output is the
shipped one's bit for bit, and :func:`routed_ring_backward`), driving diffusers' own backward ops the way
0.40 does (each ring step's q / K / V and the merged output and log-sum-exp handed over as keyword tensors)
and routing each chunk's K/V gradient to its owner at any ring degree. At ring degree 3 and more only
diffusers' ``_native_cudnn`` and ``_native_flash`` backward ops are driven (behind the package's own
wrappers, if any); any other backend is refused there with :class:`UnsafeAttentionError` naming the way out
(at ring degree 2 it runs, as diffusers' own backward would). A mask, dropout or ``is_causal`` at ring degree
> 1 (diffusers applies each rank's own mask to every ring step's K/V and keeps only the first step's random
state) is refused as on 0.36 to 0.39.

Revert: the class's original ``forward`` and ``backward`` staticmethods are put back (the registry keeps them).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch

from .. import _detect
from .._fix import Finding, Fix, Lookup
from .._warnings import UnsafeAttentionError
from .ring_backward import (
    BACKWARD,
    FORWARD,
    installed_ring,
    recorded,
    ring_attention_forward,
    ring_gradients,
    step_backend,
)

if torch.distributed.is_available():
    from torch.distributed import _functional_collectives as funcol
else:  # a torch without distributed support never reaches ring attention
    funcol = None  # type: ignore[assignment]

FIX_ID = "ring_grad_route"

#: The largest ring degree whose K/V gradients the shipped route gets right (any backend's op runs there).
RIGHT_UP_TO = 2

#: diffusers' own backward ops (0.40 on) that the corrected ring drives at any ring degree -> their backend.
OPS = {"_cudnn_attention_backward_op": "_native_cudnn", "_native_flash_attention_backward_op": "_native_flash"}

#: Those ops as installed, and every function they wrap, by identity -> backend; filled by :func:`build`. A
#: module global, not a closure: the checks and the test harnesses run the installed backward as a copy that
#: sees other module globals (the checks put their stand-in op here), and such a copy keeps no closure.
STEP_BACKWARD_OPS: dict[Any, str] = {}


def unsupported_backend_message(backward_op: Any, degree: int) -> str:
    name = f"{getattr(backward_op, '__module__', '?')}.{getattr(backward_op, '__qualname__', repr(backward_op))}"
    return (
        f"diffusers_cudnn_fix: this diffusers release's ring attention backward computes wrong key/value "
        f"gradients from ring_degree 3 on (it passes the K/V gradient accumulator the other way round the ring "
        f"from the K/V chunks); this call has ring_degree {degree}. The package corrects it for the "
        f"{' and '.join(sorted(set(OPS.values())))} attention backends; this call's backward op is {name}. Use "
        f"one of those backends, or ring_degree=2 with Ulysses for the rest of the parallelism "
        f"(ContextParallelConfig(ring_degree=2, ulysses_degree=...)), or Ulysses alone. Ring inference (no "
        f"backward) is not affected. DIFFUSERS_CUDNN_FIX_SKIP={FIX_ID} lets diffusers' own (wrong) ring "
        f"backward run."
    )


def routed_ring_backward(ctx: Any, grad_out: torch.Tensor, *args: Any) -> tuple[torch.Tensor | None, ...]:
    """Stands in for ``TemplatedRingAttention.backward`` (0.40 on): each ring step's gradients from diffusers'
    own backward op, handed that step's K/V with the merged output and log-sum-exp, and each chunk's K/V
    gradient routed to its owner (``ring_backward.ring_gradients``)."""
    record = recorded(ctx, FIX_ID)
    degree = ctx._parallel_config.context_parallel_config.ring_degree
    # The global as this function sees it (the check's stand-in op), through the package's wrappers.
    if degree > RIGHT_UP_TO and step_backend(ctx.backward_op, STEP_BACKWARD_OPS) is None:
        raise UnsafeAttentionError(unsupported_backend_message(ctx.backward_op, degree))
    # What the forward op saved at the first ring step: q and the local K/V, in model layout (B, S, H, D).
    query, key, value = ctx.saved_tensors[:3]

    def step_grads(step_key: torch.Tensor, step_value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        grads = ctx.backward_op(
            ctx, grad_out, query=query, key=step_key, value=step_value, out=record.out, lse=record.lse
        )
        return tuple(grads[:3])

    return ring_gradients(ctx, grad_out, key, value, step_grads, funcol)


# ------------------------------------------------------------------------------------------------------------
# The behavioural check
# ------------------------------------------------------------------------------------------------------------
#: Ring degree of the check: the smallest one at which a wrong route shows.
_WORLD = 3
#: The head dim is the chunk mark: a step's K/V gradient is 1 at the index of the rank whose chunk it is.
_BATCH, _SEQ, _HEADS, _DIM = 1, 2, 1, _WORLD


def _marks(buffer: torch.Tensor) -> torch.Tensor:
    """A flat K/V gradient buffer as (elements, chunk mark): the last dim of K and V is the mark."""
    return buffer.reshape(-1, _WORLD)


def _drive(forward: Any, backward: Any) -> tuple[list[int], list[list[int]], torch.Tensor | None, str | None]:
    """Run ``forward`` then ``backward`` as rank 0 of a ring of ``_WORLD`` ranks, in this process.

    Rank ``r``'s K/V are filled with ``r``. Returns the chunk each backward step worked on, the src -> dst
    map of every ``permute_tensor``, the K gradient returned (None on failure) and the error text of a failure.
    """
    chunks: list[int] = []
    routes: list[list[int]] = []

    def forward_op(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *a: Any, **kw: Any) -> Any:
        out, lse = k + 1.0, k[..., 0].clone()
        if kw.get("_save_ctx"):
            kernel = (x.transpose(1, 2).contiguous() for x in (q, k, v, out))
            ctx.save_for_backward(*kernel, lse.transpose(1, 2).contiguous(), None, None, None, None)
        return out, lse

    def backward_op(ctx: Any, grad: torch.Tensor, *a: Any, **kw: Any) -> tuple[torch.Tensor, ...]:
        key = kw["key"] if kw.get("key") is not None else ctx.saved_tensors[1]
        chunk = round(float(key.float().mean()))
        chunks.append(chunk)
        mark = torch.nn.functional.one_hot(torch.tensor(chunk % _WORLD), _WORLD).float()
        grad_kv = mark.expand(*ctx.kv_shape).clone()
        return torch.zeros(ctx.q_shape), grad_kv, grad_kv.clone()

    def permute_tensor(x: torch.Tensor, ranks: list[int], group: Any = None) -> torch.Tensor:
        routes.append(list(ranks))
        senders = [src for src, dst in enumerate(ranks) if dst == 0]
        if len(senders) != 1:
            raise ValueError(f"permute_tensor map {ranks} does not send to rank 0 exactly once")
        # The sender runs the same code on its own rank: its marks are ours shifted by its rank.
        return torch.roll(_marks(x), shifts=senders[0], dims=1).reshape(x.shape)

    collectives = types.SimpleNamespace(
        all_gather_tensor=lambda x, gather_dim=0, group=None: torch.cat([x + r for r in range(_WORLD)]),
        permute_tensor=permute_tensor,
        AsyncCollectiveTensor=type("AsyncCollectiveTensor", (), {}),
    )
    config = types.SimpleNamespace(
        _ring_mesh=_detect.FAKE_MESH,
        _ring_local_rank=0,
        ring_degree=_WORLD,
        convert_to_fp32=False,
        _world_size=_WORLD,
    )
    parallel = types.SimpleNamespace(context_parallel_config=config)
    ctx = _detect.ProbeCtx()
    q, k, v = (torch.zeros(_BATCH, _SEQ, _HEADS, _DIM) for _ in range(3))
    try:
        _detect.with_globals(forward, funcol=collectives)(
            ctx, q, k, v, None, 0.0, False, None, False, False, forward_op, backward_op, parallel
        )
        # STEP_BACKWARD_OPS: the package's corrected ring drives only the ops it knows, by identity.
        grads = _detect.with_globals(backward, funcol=collectives, STEP_BACKWARD_OPS={backward_op: "check"})(
            ctx, torch.zeros(_BATCH, _SEQ, _HEADS, _DIM)
        )
    except Exception as exc:  # noqa: BLE001 - the package's refusal, or an unknown build: the caller decides
        return chunks, routes, None, f"{type(exc).__name__}: {exc}"
    return chunks, routes, grads[1], None


def check(lookup: Lookup) -> Finding:
    found = installed_ring(lookup)
    if isinstance(found, Finding):
        return found
    forward, backward = found
    chunks, routes, grad_key, error = _drive(forward, backward)
    if error is not None and error.startswith(UnsafeAttentionError.__name__) and not chunks:
        return Finding("ok", f"the ring backward refuses ring degree {_WORLD} before computing anything")
    if error is not None or grad_key is None:
        return Finding("unknown", f"the ring backward could not be run as one rank of {_WORLD} ({error})")
    if sorted(chunks) != list(range(_WORLD)):
        return Finding(
            "absent", f"the ring backward's steps do not work on each rank's K/V (chunks {chunks}): see ring_backward"
        )
    got = _marks(grad_key.flatten()).mean(dim=0).tolist()
    want = [float(_WORLD)] + [0.0] * (_WORLD - 1)
    seen = f"rank 0's steps work on the chunks of ranks {chunks}, the K/V gradients are sent by src->dst maps {routes}"
    if got != want:
        return Finding("broken", f"{seen}: rank 0's K gradient sums the chunks {got}, not {want}")
    return Finding("ok", f"{seen}: every chunk's gradient reaches its owner")


def build(lookup: Lookup) -> Mapping[str, Any]:
    known: dict[Any, str] = {}
    for name, backend in OPS.items():
        op = lookup(name)
        for _ in range(8):  # the installed op, and what its wrappers (functools.wraps) wrap: a chain, not a cycle
            if op is None:
                break
            known[op] = backend
            op = getattr(op, "__wrapped__", None)
    STEP_BACKWARD_OPS.clear()
    STEP_BACKWARD_OPS.update(known)
    return {FORWARD: staticmethod(ring_attention_forward), BACKWARD: staticmethod(routed_ring_backward)}


FIX = Fix(
    id=FIX_ID,
    title="ring attention's backward routes the K/V gradients wrong from ring degree 3",
    upstream="https://github.com/huggingface/diffusers/pull/14274",
    affected=">=0.40.0",
    targets=(FORWARD, BACKWARD),
    check=check,
    build=build,
    only_for="ring attention at ring_degree >= 3, or with a mask or dropout",
)
