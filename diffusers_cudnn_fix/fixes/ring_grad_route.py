"""Ring attention's backward hands the K/V gradient accumulator the wrong way round the ring (0.40 on).

Bug: each accumulator sums the gradients of several chunks: right at ring degree 2 only. Releases 0.40.0 on.
Detection: rank 0 of a ring of three in one process, stand-in ops marking each step's chunk: does rank 0 end
with its own chunk's gradients only? Run on ring_backward's replacement, which it must find right.
The package: the corrected ring (``targets/ring.py``) driving diffusers' own backward ops; other backends at
degree >= 3, and a mask, dropout or causal at degree > 1, are refused (docs/fixes.md)."""

from __future__ import annotations

from typing import Any

import torch

from .. import _detect
from .._fix import Finding, Lookup
from .._warnings import UnsafeAttentionError

FIX_ID = "ring_grad_route"

#: The largest ring degree whose K/V gradients the shipped route gets right (any backend's op runs there).
RIGHT_UP_TO = 2
#: diffusers' own backward ops (0.40 on) that the corrected ring drives at any ring degree -> their backend.
OPS = {"_cudnn_attention_backward_op": "_native_cudnn", "_native_flash_attention_backward_op": "_native_flash"}


def unsupported_backend_message(backward_op: Any, degree: int) -> str:
    name = f"{getattr(backward_op, '__module__', '?')}.{getattr(backward_op, '__qualname__', repr(backward_op))}"
    return (
        "diffusers_cudnn_fix: this diffusers' ring attention backward computes wrong K/V gradients from ring_degree "
        f"3 on (it passes the K/V gradient accumulator the other way round the ring from the K/V chunks); this call "
        f"has ring_degree {degree}. The package corrects it for the {' and '.join(sorted(set(OPS.values())))} "
        f"backends; this call's backward op is {name}. Use one of those, ring_degree=2 with Ulysses for the rest "
        "(ContextParallelConfig(ring_degree=2, ulysses_degree=...)), or Ulysses alone; ring inference is not "
        f"affected. DIFFUSERS_CUDNN_FIX_SKIP={FIX_ID} lets diffusers' own (wrong) ring backward run."
    )


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

    try:
        _, grads = _detect.run_ring(
            forward, backward, lambda k: (k + 1.0, k[..., 0].clone()), backward_op, world=_WORLD,
            permute=permute_tensor, shape=(_BATCH, _SEQ, _HEADS, _DIM),
            gather=lambda x, gather_dim=0, group=None: torch.cat([x + r for r in range(_WORLD)]),
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the package's refusal, or an unknown build: the caller decides
        return chunks, routes, None, f"{type(exc).__name__}: {exc}"
    return chunks, routes, grads[1], None


def check(lookup: Lookup) -> Finding:
    found = _detect.installed_ring(lookup)
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
