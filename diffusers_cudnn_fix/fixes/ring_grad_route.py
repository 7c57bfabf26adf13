"""Ring (and unified) context parallelism's backward gives wrong K/V gradients (every release with it).

Bug: 0.36.0-0.39.0 reuse the first ring step's tensors in every step's backward (wrong for every backend and
degree; fixed in 0.40.0, #14274); 0.40.0 on pass the K/V gradient accumulator the wrong way round the ring
(right at ring degree 2 only). Detection, in one process with stand-in collectives and ops: at ring degree 2,
does each step's backward get that step's K and the merged output; at degree 3, does rank 0 end with its own
chunk's gradients only? The package: the corrected ring (``targets/ring.py``); what it cannot drive is
refused (docs/fixes.md). Id of 0.2.x: ``ring_backward`` (still accepted by the skip switch)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import _detect
from .._fix import Finding, Lookup
from .._warnings import explain

FIX_ID = "ring_grad_route"
#: The largest ring degree whose K/V gradients 0.40+'s route gets right (any backend's op runs there).
RIGHT_UP_TO = 2
#: diffusers' own backward ops (0.40 on) that the corrected ring drives at any ring degree.
OPS = ("_cudnn_attention_backward_op", "_native_flash_attention_backward_op")
#: Where the long explanation of every ring refusal lives.
DOCS = f"fixes.md#{FIX_ID}"
WAY_OUT = (
    "Train these inputs with Ulysses (ContextParallelConfig(ulysses_degree=...)); "
    f"DIFFUSERS_CUDNN_FIX_SKIP={FIX_ID} runs diffusers' own ring backward (wrong gradients)."
)


@dataclass(frozen=True)
class StepOps:
    """The backward ops a corrected ring may drive, each mapped to whether it reads a ring step's tensors from
    ``ctx.saved_tensors`` (the package's corrected ops, 0.36-0.39) rather than from keywords (diffusers' own,
    0.40 on). The ring's builder is handed it (``targets/ring.py``); the check hands its stand-in op the same
    way (:func:`_detect.rebuilt_with`)."""

    reads_saved: Mapping[Any, bool]


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
        cause = (
            f"this diffusers' ring backward reuses the first ring step's tensors (fixed in 0.40.0), and the "
            f"package corrects it only with the corrected _native_cudnn / _native_flash backward ops "
            f"(cudnn_backward_kv, flash_backward_kv); this call's is {name}."
        )
        other = "one of those backends, or diffusers >= 0.40"
    else:
        cause = (
            f"from ring_degree 3 on (this call: {degree}) this diffusers routes the K/V gradients wrong, and the "
            f"package corrects that for the _native_cudnn and _native_flash backends only; this call's backward "
            f"op is {name}."
        )
        other = "one of those backends, or ring_degree=2 with Ulysses for the rest"
    return explain(
        cause,
        "Its K/V gradients would be wrong (ring inference is not affected), so the backward is refused.",
        f"Use {other}, or Ulysses (ContextParallelConfig(ulysses_degree=...)); DIFFUSERS_CUDNN_FIX_SKIP={FIX_ID} "
        "runs diffusers' own ring backward (wrong gradients).",
        DOCS,
    )


# ------------------------------------------------------------------------------------------------------------
# The behavioural check
# ------------------------------------------------------------------------------------------------------------
#: Ring degree of the check: the smallest one at which a wrong route shows. The head dim is the chunk mark: a
#: step's K/V gradient is 1 at the index of the rank whose chunk it is.
_WORLD = 3


def _mean(x: torch.Tensor) -> float:
    return float(x.float().mean())


def _drive(forward: Any, backward: Any, lse_ndim: int) -> tuple[dict[str, Any], str | None]:
    """Run ``forward`` then ``backward`` as rank 0 of a ring of ``_WORLD`` ranks, in this process.

    Rank ``r``'s K/V are filled with ``r`` (each tensor is constant: its mean names it whatever its layout). The
    stand-in forward op saves kernel-layout tensors as the 0.36-0.39 ops do and returns a log-sum-exp of
    ``lse_ndim`` dims; each step's output differs, so the merged output differs from every step's. Returns what
    was seen (per forward step the K; per backward step the chunk of its K and its output; the src -> dst map
    of every ``permute_tensor``; the merged output and the K gradient) and the error text of a failure.
    """
    seen: dict[str, Any] = {"keys": [], "chunks": [], "outs": [], "routes": []}

    def step(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen["keys"].append(round(_mean(k)))
        return k + 2.0, (k[..., 0].clone() if lse_ndim == 3 else k[..., :1].clone())

    def backward_op(ctx: Any, grad: torch.Tensor, *a: Any, **kw: Any) -> tuple[torch.Tensor, ...]:
        saved = ctx.saved_tensors if kw.get("key") is None else (None, kw["key"], None, kw["out"])
        chunk = round(_mean(saved[1]))
        seen["chunks"].append(chunk)
        seen["outs"].append(_mean(saved[3]))
        grad_kv = torch.nn.functional.one_hot(torch.tensor(chunk % _WORLD), _WORLD).float().expand(*ctx.kv_shape)
        return torch.zeros(ctx.q_shape), grad_kv.clone(), grad_kv.clone()

    def permute_tensor(x: torch.Tensor, ranks: list[int], group: Any = None) -> torch.Tensor:
        seen["routes"].append(list(ranks))
        senders = [src for src, dst in enumerate(ranks) if dst == 0]
        if len(senders) != 1:
            raise ValueError(f"permute_tensor map {ranks} does not send to rank 0 exactly once")
        # The sender runs the same code on its own rank: its marks are ours shifted by its rank.
        return torch.roll(x.reshape(-1, _WORLD), shifts=senders[0], dims=1).reshape(x.shape)

    try:
        driving = _detect.rebuilt_with(backward, StepOps({backward_op: True}))
        result, grads = _detect.run_ring(
            forward, driving, step, backward_op, world=_WORLD, permute=permute_tensor, shape=(1, 2, 1, _WORLD),
            gather=lambda x, gather_dim=0, group=None: torch.cat([x + r for r in range(_WORLD)]),
        )  # fmt: skip
        seen["merged"] = _mean(result[0] if isinstance(result, tuple) else result)
        seen["grad_key"] = grads[1]
    except Exception as exc:  # noqa: BLE001 - an unknown build, or the package's refusal: the caller decides
        return seen, f"{type(exc).__name__}: {exc}"
    return seen, None


def _run(forward: Any, backward: Any) -> tuple[dict[str, Any], str | None, str]:
    """:func:`_drive` with a 4-D log-sum-exp (the cuDNN op's from torch 2.9 on), else a 3-D one (the flash
    op's), and a note where only the 3-D one runs (0.36.0 and 0.37.x fail on one of the two)."""
    seen, error = _drive(forward, backward, lse_ndim=4)
    if error is None or seen["chunks"]:
        return seen, error, ""
    return (*_drive(forward, backward, lse_ndim=3), f" (the forward also fails on a 4-D log-sum-exp: {error})")


def _first_step_problem(seen: dict[str, Any], note: str) -> str | None:
    """Where the steps' backward does not work on each step's K/V with the merged output (0.36-0.39), how."""
    if sorted(seen["chunks"]) != sorted(seen["keys"]):
        return f"the ring steps' backward does not see each step's K/V{note}"
    if any(out != seen["merged"] for out in seen["outs"]):
        return f"the ring steps' backward is handed a single step's output, not the merged one{note}"
    return f"each ring step's backward sees that step's K/V, but{note}" if note else None


def reuses_first_step(lookup: Lookup) -> bool:
    """Whether the ring ``lookup`` shows reuses the first step's tensors (0.36-0.39): the corrected ring then
    drives the package's corrected ops, else diffusers' own ops through their keywords (0.40 on)."""
    found = _detect.installed_ring(lookup)
    if isinstance(found, Finding):
        return False
    seen, error, note = _run(*found)
    return error is None and _first_step_problem(seen, note) is not None


def check(lookup: Lookup) -> Finding:
    found = _detect.installed_ring(lookup)
    if isinstance(found, Finding):
        return found
    seen, error, note = _run(*found)
    if error is not None or len(seen["chunks"]) != _WORLD:
        return Finding("unknown", f"the ring attention could not be run as one rank of {_WORLD} ({error or seen})")
    problem = _first_step_problem(seen, note)
    if problem is not None:
        return Finding("broken", problem)
    got = seen["grad_key"].flatten().reshape(-1, _WORLD).mean(dim=0).tolist()
    want = [float(_WORLD)] + [0.0] * (_WORLD - 1)
    steps = f"each ring step's backward sees its K/V and the merged output; K/V gradients sent by maps {seen['routes']}"
    if got != want:
        return Finding("broken", f"{steps}: rank 0's K gradient sums the chunks {got}, not {want}")
    return Finding("ok", f"{steps}: every chunk's gradient reaches its owner")
