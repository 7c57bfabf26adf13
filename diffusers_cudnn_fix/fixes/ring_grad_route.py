"""Ring (and unified) context parallelism's backward gives wrong K/V gradients (every release with it).

Bug: 0.36.0-0.39.0 reuse the first ring step's tensors in every step's backward (wrong for every backend and
degree; fixed in 0.40.0, #14274); 0.40.0 on pass the K/V gradient accumulator the wrong way round the ring
(right at ring degree 2 only). Detection, in one process with stand-in collectives and ops: at ring degree 2,
does each step's backward get that step's K and the merged output; at degree 3, does rank 0 end with its own
chunk's gradients only? The package: the corrected ring (``targets/ring.py``); what it cannot drive is
refused (docs/fixes.md). Id of 0.2.x: ``ring_backward`` (still accepted by the skip switch)."""

from __future__ import annotations

from typing import Any

import torch

from .. import _detect
from .._fix import Finding, Lookup
from .._warnings import UnsafeAttentionError

FIX_ID = "ring_grad_route"
#: The largest ring degree whose K/V gradients 0.40+'s route gets right (any backend's op runs there).
RIGHT_UP_TO = 2
#: diffusers' own backward ops (0.40 on) that the corrected ring drives at any ring degree -> their backend.
OPS = {"_cudnn_attention_backward_op": "_native_cudnn", "_native_flash_attention_backward_op": "_native_flash"}
WAY_OUT = (
    "Train with Ulysses context parallelism (ContextParallelConfig(ulysses_degree=...)) for these inputs. "
    f"DIFFUSERS_CUDNN_FIX_SKIP={FIX_ID} lets diffusers' own ring backward run (wrong gradients)."
)


def refusal(world: int, attn_mask: Any, dropout_p: float, is_causal: bool, enable_gqa: bool) -> str | None:
    """What makes the corrected backward wrong for these inputs, or None. With one ring chunk (the whole
    sequence) a mask, dropout and causal attention mean what they say, and nothing is refused but GQA."""
    if enable_gqa:
        return "enable_gqa (the attention ops do not support it)"
    if world == 1:
        return None
    if attn_mask is not None:
        return "an attention mask (diffusers' ring attention applies the rank's own mask to every ring step's K/V)"
    if dropout_p > 0.0:
        return "dropout (only the first ring step's random state is kept, each step's backward needs its own)"
    if is_causal:
        return "is_causal (each ring step would apply a causal mask to a block of another rank's keys)"
    return None


def unsupported_backend_message(backward_op: Any, degree: int, *, first_step: bool) -> str:
    """Why the ring backward refuses ``backward_op`` at ring ``degree`` (``first_step``: 0.36-0.39's bug)."""
    name = f"{getattr(backward_op, '__module__', '?')}.{getattr(backward_op, '__qualname__', repr(backward_op))}"
    if first_step:
        bug = (
            "every ring step's backward reuses the first step's tensors (fixed in diffusers 0.40.0, "
            "huggingface/diffusers#14274). The package corrects it for the _native_cudnn and _native_flash backends "
            "with their corrected backward ops (fixes cudnn_backward_kv, flash_backward_kv)"
        )
        other = (
            "or diffusers >= 0.40 (right with every backend at ring_degree 2, at any with these two and this package)"
        )
    else:
        bug = (
            f"from ring_degree 3 on it passes the K/V gradient accumulator the other way round the ring from the K/V "
            f"chunks; this call has ring_degree {degree}. The package corrects it for the "
            f"{' and '.join(sorted(set(OPS.values())))} backends"
        )
        other = "or ring_degree=2 with Ulysses for the rest (ContextParallelConfig(ring_degree=2, ulysses_degree=...))"
    return (
        f"diffusers_cudnn_fix: ring context parallelism (ring_degree > 1, also unified attention) in this diffusers "
        f"computes wrong K/V gradients: {bug}; this call's backward op is {name}. Use one of those backends, Ulysses "
        f"(ContextParallelConfig(ulysses_degree=...)), {other}; ring inference is not affected. "
        f"DIFFUSERS_CUDNN_FIX_SKIP={FIX_ID} lets diffusers' own (wrong) ring backward run."
    )


# ------------------------------------------------------------------------------------------------------------
# The behavioural check
# ------------------------------------------------------------------------------------------------------------
_BATCH, _SEQ, _HEADS, _DIM = 1, 4, 2, 8
#: Ring degree of the route's check: the smallest one at which a wrong route shows; its head dim is the chunk
#: mark (a step's K/V gradient is 1 at the index of the rank whose chunk it is).
_WORLD = 3


def _mean(x: torch.Tensor) -> float:
    return float(x.float().mean())


def _drive_steps(forward: Any, backward: Any, lse_ndim: int) -> tuple[dict[str, list[float]], float | None, str | None]:
    """Run ``forward`` then ``backward`` for ring degree 2 as rank 0, in this process.

    Our K/V are zeros and rank 1's ones (the stand-in all-gather adds 1), so a step that uses them shows it.
    The stand-in forward op saves kernel-layout tensors as the 0.36-0.39 ops do and returns a log-sum-exp of
    ``lse_ndim`` dims; each step's output differs, so the merged output differs from every step's. Returns
    what the ops saw (each tensor by its mean: the tensors are constant, so the mean names one whatever its
    layout; per forward step the K, per backward call the K and the output), the mean of the forward's output
    and the error text of a failure (None if none).
    """
    seen: dict[str, list[float]] = {"forward_keys": [], "backward_keys": [], "backward_outs": []}

    def step(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen["forward_keys"].append(_mean(k))
        return k + 2.0, (k[..., 0].clone() if lse_ndim == 3 else k[..., :1].clone())

    def backward_op(ctx: Any, grad: torch.Tensor, *a: Any, **kw: Any) -> tuple[torch.Tensor, ...]:
        saved = ctx.saved_tensors
        seen["backward_keys"].append(_mean(kw["key"] if kw.get("key") is not None else saved[1]))
        seen["backward_outs"].append(_mean(kw["out"] if kw.get("out") is not None else saved[3]))
        return torch.zeros(ctx.q_shape), torch.zeros(ctx.kv_shape), torch.zeros(ctx.kv_shape)

    try:
        result, _ = _detect.run_ring(
            forward, backward, step, backward_op, world=2, permute=lambda x, ranks, group=None: x,
            gather=lambda x, gather_dim=0, group=None: torch.cat([x, x + 1.0]), shape=(_BATCH, _SEQ, _HEADS, _DIM),
        )  # fmt: skip
        merged = _mean(result[0] if isinstance(result, tuple) else result)
    except Exception as exc:  # noqa: BLE001 - an unknown build, or the package's refusal: the caller decides
        return seen, None, f"{type(exc).__name__}: {exc}"
    return seen, merged, None


def _check_steps(forward: Any, backward: Any) -> Finding:
    """Whether each ring step's backward sees that step's K/V and the merged output (0.36-0.39: not)."""
    # The cuDNN op's log-sum-exp is 4-D from torch 2.9 on, the flash op's 3-D: try the 4-D one first.
    note = ""
    seen, merged, error = _drive_steps(forward, backward, lse_ndim=4)
    if error is not None and not seen["backward_keys"]:
        note = f" (the forward also fails on a 4-D log-sum-exp: {error})"
        seen, merged, error = _drive_steps(forward, backward, lse_ndim=3)
    if error is not None or len(seen["backward_keys"]) != 2 or len(seen["forward_keys"]) != 2:
        return Finding(
            "unknown", f"the ring attention could not be run in one process ({error or len(seen['backward_keys'])})"
        )
    if sorted(seen["backward_keys"]) != sorted(seen["forward_keys"]):
        return Finding("broken", f"the ring steps' backward does not see each step's K/V{note}")
    if any(out != merged for out in seen["backward_outs"]):
        return Finding("broken", f"the ring steps' backward is handed a single step's output, not the merged one{note}")
    if note:
        return Finding("broken", f"each ring step's backward sees that step's K/V, but{note}")
    return Finding("ok", "each ring step's backward sees that step's K/V and the merged output")


def reuses_first_step(lookup: Lookup) -> bool:
    """Whether the ring ``lookup`` shows reuses the first step's tensors (0.36-0.39): the corrected ring then
    drives the package's corrected ops, else diffusers' own ops through their keywords (0.40 on)."""
    found = _detect.installed_ring(lookup)
    return not isinstance(found, Finding) and _check_steps(*found).state == "broken"


def _marks(buffer: torch.Tensor) -> torch.Tensor:
    """A flat K/V gradient buffer as (elements, chunk mark): the last dim of K and V is the mark."""
    return buffer.reshape(-1, _WORLD)


def _drive_route(forward: Any, backward: Any) -> tuple[list[int], list[list[int]], torch.Tensor | None, str | None]:
    """Run ``forward`` then ``backward`` as rank 0 of a ring of ``_WORLD`` ranks, in this process.

    Rank ``r``'s K/V are filled with ``r``. Returns the chunk each backward step worked on, the src -> dst
    map of every ``permute_tensor``, the K gradient returned (None on failure) and the error text of a failure.
    """
    chunks: list[int] = []
    routes: list[list[int]] = []

    def backward_op(ctx: Any, grad: torch.Tensor, *a: Any, **kw: Any) -> tuple[torch.Tensor, ...]:
        key = kw["key"] if kw.get("key") is not None else ctx.saved_tensors[1]
        chunk = round(_mean(key))
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
            permute=permute_tensor, shape=(_BATCH, 2, 1, _WORLD),
            gather=lambda x, gather_dim=0, group=None: torch.cat([x + r for r in range(_WORLD)]),
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the package's refusal, or an unknown build: the caller decides
        return chunks, routes, None, f"{type(exc).__name__}: {exc}"
    return chunks, routes, grads[1], None


def _check_route(forward: Any, backward: Any) -> Finding:
    """Whether each chunk's K/V gradient reaches its owner at ring degree 3 (0.40 on: not)."""
    chunks, routes, grad_key, error = _drive_route(forward, backward)
    if error is not None and error.startswith(UnsafeAttentionError.__name__) and not chunks:
        return Finding("ok", f"the ring backward refuses ring degree {_WORLD} before computing anything")
    if error is not None or grad_key is None or sorted(chunks) != list(range(_WORLD)):
        return Finding("unknown", f"the ring backward could not be run as one rank of {_WORLD} ({error or chunks})")
    got = _marks(grad_key.flatten()).mean(dim=0).tolist()
    want = [float(_WORLD)] + [0.0] * (_WORLD - 1)
    seen = f"rank 0's steps work on the chunks of ranks {chunks}, the K/V gradients are sent by src->dst maps {routes}"
    if got != want:
        return Finding("broken", f"{seen}: rank 0's K gradient sums the chunks {got}, not {want}")
    return Finding("ok", f"{seen}: every chunk's gradient reaches its owner")


def check(lookup: Lookup) -> Finding:
    found = _detect.installed_ring(lookup)
    if isinstance(found, Finding):
        return found
    steps = _check_steps(*found)
    if steps.state != "ok":
        return steps
    route = _check_route(*found)
    return Finding(route.state, f"{steps.detail}; {route.detail}")
