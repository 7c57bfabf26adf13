"""Ring (and unified) context parallelism's backward gives wrong K/V gradients (every release with it).

Bug: 0.36.0-0.39.0 reuse the first ring step's tensors in every step's backward (wrong for every backend and
degree; fixed in 0.40.0, #14274); 0.40.0 on pass the K/V gradient accumulator the wrong way round the ring
(right at ring degree 2 only), and every release hands each ring step the rank's own mask. Detection, one process,
stand-in collectives and ops: at degree 2, does each step's backward get its K and the merged output; at degree 3,
does rank 0 end with its own chunk's gradients only? The package: the corrected ring (``targets/ring.py``), each
step with its chunk's mask columns (:func:`ring_masks`); the rest refused (docs/fixes.md). 0.2.x id: ring_backward."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from .. import _detect, _switches
from .._fix import Finding, Lookup
from .._key_padding import remembered
from .._target_names import CUDNN_BACKWARD, FLASH_BACKWARD, RING_BACKWARD, RING_FORWARD
from .._warnings import UnsafeAttentionError, explain

FIX_ID = "ring_grad_route"
#: The largest ring degree whose K/V gradients 0.40+'s route gets right (any backend's op runs there).
RIGHT_UP_TO = 2
#: diffusers' own backward ops (0.40 on) that the corrected ring drives at any ring degree.
OPS = (CUDNN_BACKWARD, FLASH_BACKWARD)
#: Those of them that read the attention mask from ``ctx.attn_mask`` (the flash ops take none): the corrected ring
#: hands each ring step its own mask there.
MASK_OPS = (CUDNN_BACKWARD,)
#: Where the long explanation of every ring refusal lives.
DOCS = f"fixes.md#{FIX_ID}"
WAY_OUT = (
    "Train these inputs with Ulysses (ContextParallelConfig(ulysses_degree=...)); "
    f"DIFFUSERS_CUDNN_FIX_SKIP={FIX_ID} runs diffusers' own ring backward (wrong gradients)."
)
#: The way out of a mask the ring cannot map onto its K/V chunks.
MASK_WAY_OUT = (
    "Pass a [B, 1|H, 1|S_q, S_kv] mask whose key dimension is the whole sequence or this rank's shard, or "
    "attn_mask=None where nothing is masked, or train with Ulysses (ContextParallelConfig(ulysses_degree=...))."
)
#: The way out of a mask over the whole key length whose token order cannot be read: QwenImage's joint mask up to
#: 0.38.0 where its attention processor ran compiled (or its ``qwen_joint_mask_order`` fix is skipped).
ORDER_WAY_OUT = (
    "Run QwenImage's attention eagerly (compile without fullgraph=True) with the qwen_joint_mask_order fix on, "
    "upgrade diffusers to >= 0.39.0 (which shards the mask), or pass encoder_hidden_states_mask=None."
)


@dataclass(frozen=True)
class StepOps:
    """The backward ops a corrected ring may drive, each mapped to whether it reads a ring step's tensors from
    ``ctx.saved_tensors`` (the package's corrected ops, 0.36-0.39) rather than from keywords (diffusers' own,
    0.40 on). The ring's builder is handed it (``targets/ring.py``); the check hands its stand-in op the same
    way (a ``step_ops`` seam, ``_fix.built_of``)."""

    reads_saved: Mapping[Any, bool]
    #: The ops among them that read a ring step's attention mask from ``ctx.attn_mask`` (the cuDNN ones): a
    #: masked ring's backward drives no other.
    reads_mask: frozenset[Any] = field(default_factory=frozenset)


def refusal(world: int, dropout_p: float, is_causal: bool, enable_gqa: bool) -> str | None:
    """What makes the corrected backward wrong for these inputs, or None. With one ring chunk (the whole
    sequence) dropout and causal attention mean what they say, and nothing is refused but GQA. Masks are not
    refused: each ring step gets its chunk's columns (:func:`ring_masks`)."""
    if enable_gqa:
        return "enable_gqa (the attention ops do not support it)"
    if world == 1:
        return None
    if dropout_p > 0.0:
        return "dropout (only the first ring step's random state is kept, each step's backward needs its own)"
    if is_causal:
        return "is_causal (each ring step would apply a causal mask to a block of another rank's keys)"
    return None


#: The ring's forward and backward, driven together by the check.
RING = (RING_FORWARD, RING_BACKWARD)


# ------------------------------------------------------------------------------------------------------------
# Masks: each ring step gets the columns of the K/V chunk it attends to
# ------------------------------------------------------------------------------------------------------------
def ring_masks(
    attn_mask: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    config: Any,
    *,
    gather: Callable[[torch.Tensor], torch.Tensor],
    in_rank_order: Callable[[torch.Tensor], torch.Tensor | None],
) -> tuple[torch.Tensor, ...] | None:
    """The mask of each ring step, by the ring rank owning the step's K/V chunk, for this rank's queries; None
    where no step needs one (a mask that masks nothing, in convert mode).

    Ring rank ``r``'s chunk is the positions ``[r * S, (r + 1) * S)`` of the sequence in rank order, S being
    ``key``'s length (in unified attention, after Ulysses' all-to-all: the Ulysses group's shards, in its ranks'
    order). The mask's last dimension says which columns a rank holds:

    * the whole key length (S x ring degree; QwenImage's joint mask up to 0.38.0, or a user's mask): put into
      rank order by ``in_rank_order`` (None where its order cannot be known), rows too where it has a row per
      query of the whole sequence (this rank's rows are then taken);
    * this rank's shard (S / Ulysses degree; QwenImage's mask from 0.39.0, which its plan shards with the
      sequence): the shards of every rank are gathered (``gather``: Ulysses group first, then the ring);
    * 1: the same for every key, so for every step.

    Anything else (and a shard with a row per query: the other ranks' rows are not there) raises
    :class:`UnsafeAttentionError`; a mask that requires grad reaches every step as it came, for the op to refuse.
    Each step gets its columns as a mask of its own; what the step's op does with it (the bool-mask conversion) it
    does per call. A mask that masks nothing (all true, or an additive one all zero) is dropped in convert mode,
    outside torch.compile (the question is a host sync): asked once per mask object where every rank holds the
    whole key length, and of the gathered mask at every call where each holds a shard (every rank then answers
    alike; the question comes after the gather, which every rank makes).
    """
    ring, rank = config.ring_degree, config._ring_local_rank
    if attn_mask.requires_grad:  # as it came, so that the op refuses it (a copy made here would not require grad)
        return (attn_mask,) * ring
    ulysses = getattr(config, "ulysses_degree", 1) or 1
    seq, rows_local = key.shape[1], query.shape[1]
    keys = attn_mask.shape[-1] if attn_mask.dim() else 1
    rows = attn_mask.shape[-2] if attn_mask.dim() >= 2 else 1
    if keys == seq * ring:
        if _droppable(attn_mask, remember=True):
            return None
        full = in_rank_order(attn_mask)
        if full is None:  # maybe QwenImage's joint mask, in an order that cannot be read here
            if not _masks_nothing(attn_mask, remember=True):
                what = "the whole key length in a token order it cannot read"
                _refuse_mask(attn_mask, query, key, what, ORDER_WAY_OUT)
            full = attn_mask  # masking nothing, its order does not matter
        rows = full.shape[-2] if full.dim() >= 2 else 1  # QwenImage's 2-D (B, S) mask comes back [B, 1, 1, S]
        if rows not in (1, rows_local, rows_local * ring):
            _refuse_mask(attn_mask, query, key, f"{rows} query rows, neither 1, the local {rows_local} nor the whole")
        if rows == rows_local * ring and ring > 1:
            full = full.narrow(-2, rank * rows_local, rows_local)
    elif keys * ulysses == seq:
        if rows != 1:
            _refuse_mask(attn_mask, query, key, "a row per query on this rank's shard of the keys only")
        full = gather(attn_mask)
        if _droppable(full, remember=False):
            return None
    elif keys == 1:
        return None if _droppable(attn_mask, remember=True) else (attn_mask,) * ring
    else:
        _refuse_mask(attn_mask, query, key, f"a key dimension of {keys}")
    return tuple(full.narrow(-1, owner * seq, seq).contiguous() for owner in range(ring))


def _masks_nothing(mask: torch.Tensor, *, remember: bool) -> bool:
    """Whether ``mask`` (bool or additive) masks nothing: one host sync, kept per mask object where ``remember``."""
    return bool(remembered(_no_masked_entry, mask, None) if remember else _no_masked_entry(mask, None))


def _no_masked_entry(mask: torch.Tensor, _: None) -> bool:
    if mask.dtype == torch.bool:
        return bool(mask.all())
    return mask.is_floating_point() and not bool(mask.ne(0).any())


def _droppable(mask: torch.Tensor, *, remember: bool) -> bool:
    """Whether the ring drops ``mask``: it masks nothing, in convert mode (warn passes a bool mask on as diffusers
    does, error refuses it in the op), and not while compiling (the answer would be a host sync in the graph)."""
    if torch.compiler.is_compiling() or _switches._choice(_switches.MASK_VAR) != "convert":
        return False
    if not (mask.dtype == torch.bool or mask.is_floating_point()):
        return False  # the op's policy refuses an integer mask in its own words
    return _masks_nothing(mask, remember=remember)


def _refuse_mask(
    mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor, what: str, way_out: str = MASK_WAY_OUT
) -> NoReturn:
    raise UnsafeAttentionError(
        explain(
            f"an attention mask {tuple(mask.shape)} reached ring attention (this rank: {query.shape[1]} queries, "
            f"K/V chunks of {key.shape[1]} keys) with {what}.",
            "The package cannot tell which of its columns each ring step's K/V chunk needs, so the call is refused.",
            way_out,
            DOCS,
        )
    )


def mask_op_message(backward_op: Any) -> str:
    """Why a masked ring's backward refuses ``backward_op``: it does not read a step's mask from the context."""
    name = f"{getattr(backward_op, '__module__', '?')}.{getattr(backward_op, '__qualname__', repr(backward_op))}"
    return explain(
        f"ring attention with a mask runs each ring step's backward with that step's mask columns, which only the "
        f"_native_cudnn backward ops take; this call's backward op is {name}.",
        "Its gradients would apply another step's mask, so the backward is refused.",
        "Use the _native_cudnn backend, or Ulysses (ContextParallelConfig(ulysses_degree=...)).",
        DOCS,
    )


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


def _drive(lookup: Lookup, lse_ndim: int) -> tuple[dict[str, Any], str | None]:
    """Run the ring forward then backward ``lookup`` shows as rank 0 of a ring of ``_WORLD`` ranks, in this process
    (diffusers' own as copies seeing stand-in collectives; the package's built again with them, driving the
    stand-in backward op).

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

    collectives = _detect.ring_collectives(
        gather=lambda x, gather_dim=0, group=None: torch.cat([x + r for r in range(_WORLD)]), permute=permute_tensor
    )
    seams = {"collectives": collectives, "step_ops": StepOps({backward_op: True})}
    forward, backward = (_detect.with_stand_ins(lookup, n, {"funcol": collectives}, **seams) for n in RING)
    if isinstance(forward, str) or isinstance(backward, str):
        return seen, forward if isinstance(forward, str) else str(backward)
    try:
        result, grads = _detect.run_ring(forward, backward, step, backward_op, world=_WORLD, shape=(1, 2, 1, _WORLD))
        seen["merged"] = _mean(result[0] if isinstance(result, tuple) else result)
        seen["grad_key"] = grads[1]
    except Exception as exc:  # noqa: BLE001 - an unknown build, or the package's refusal: the caller decides
        return seen, f"{type(exc).__name__}: {exc}"
    return seen, None


def _run(lookup: Lookup) -> tuple[dict[str, Any], str | None, str]:
    """:func:`_drive` with a 4-D log-sum-exp (the cuDNN op's from torch 2.9 on), else a 3-D one (the flash
    op's), and a note where only the 3-D one runs (0.36.0 and 0.37.x fail on one of the two)."""
    seen, error = _drive(lookup, lse_ndim=4)
    if error is None or seen["chunks"]:
        return seen, error, ""
    return (*_drive(lookup, lse_ndim=3), f" (the forward also fails on a 4-D log-sum-exp: {error})")


def _first_step_problem(seen: dict[str, Any], note: str) -> str | None:
    """Where the steps' backward does not work on each step's K/V with the merged output (0.36-0.39), how."""
    if sorted(seen["chunks"]) != sorted(seen["keys"]):
        return f"the ring steps' backward does not see each step's K/V{note}"
    if any(out != seen["merged"] for out in seen["outs"]):
        return f"the ring steps' backward is handed a single step's output, not the merged one{note}"
    return f"each ring step's backward sees that step's K/V, but{note}" if note else None


#: The key of what :func:`check` read in its finding: whether the ring reuses the first step's tensors.
REUSES_FIRST_STEP = "reuses_first_step"


def reuses_first_step(lookup: Lookup) -> bool:
    """Whether the ring ``lookup`` shows reuses the first step's tensors (0.36-0.39): the corrected ring then
    drives the package's corrected ops, else diffusers' own ops through their keywords (0.40 on)."""
    found = _detect.installed_ring(lookup)
    if isinstance(found, Finding):
        return False
    seen, error, note = _run(lookup)
    return error is None and _first_step_problem(seen, note) is not None


def check(lookup: Lookup) -> Finding:
    found = _detect.installed_ring(lookup)
    if isinstance(found, Finding):
        return found
    seen, error, note = _run(lookup)
    problem = None if error is not None else _first_step_problem(seen, note)
    read = {REUSES_FIRST_STEP: problem is not None}  # as reuses_first_step() would find it, for the builders
    if error is not None or len(seen["chunks"]) != _WORLD:
        detail = f"the ring attention could not be run as one rank of {_WORLD} ({error or seen})"
        return Finding("unknown", detail, read)
    if problem is not None:
        return Finding("broken", problem, read)
    got = seen["grad_key"].flatten().reshape(-1, _WORLD).mean(dim=0).tolist()
    want = [float(_WORLD)] + [0.0] * (_WORLD - 1)
    steps = f"each ring step's backward sees its K/V and the merged output; K/V gradients sent by maps {seen['routes']}"
    if got != want:
        return Finding("broken", f"{steps}: rank 0's K gradient sums the chunks {got}, not {want}", read)
    return Finding("ok", f"{steps}: every chunk's gradient reaches its owner", read)
