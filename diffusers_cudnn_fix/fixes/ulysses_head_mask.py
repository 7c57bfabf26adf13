"""diffusers' Ulysses attention hands the op a per-head mask with every head, where q holds this rank's alone.

Bug: LTX and LTX2 repeat their text mask per head ([B, heads, S_q, S_kv]); after the all-to-all each rank holds
heads / degree of them, and the op raises "doesn't match the broadcast shape" (training and inference). Every
release with the class, 0.36.0 up to at least 0.42.1 (models meet it from 0.39.0: docs/fixes.md).
Detection: the Ulysses forward at degree 2 as rank 1 (stand-in collectives) with a mask whose heads differ: which
heads reach the op? The package: the Ulysses forward's replacement hands the op (:func:`cut_to_rank`) the mask's
heads this rank holds, in their order, after diffusers gathered it along the keys; other masks go on as they came.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _detect, _ledger
from .._fix import Finding, Lookup
from . import ULYSSES_FORWARD

#: The record's id (the module is named after it: the registry finds the check so), for the policy's mark.
FIX_ID = __name__.rpartition(".")[2]

#: The check's call: Ulysses degree 2, seen from rank 1 (its heads are not the first ones), tokens a rank.
DEGREE, RANK, HEADS, SEQ = 2, 1, 4, 2


def per_head(attn_mask: torch.Tensor, query: torch.Tensor, parallel_config: Any) -> bool:
    """Whether ``attn_mask`` has a heads dimension of every one of ``query``'s heads (the model's layout, (B, S, H,
    D)), which Ulysses (``parallel_config``'s degree) spreads over its ranks."""
    if attn_mask.ndim != 4 or not attn_mask.shape[1] == query.shape[2] > 1:
        return False
    return bool(parallel_config.context_parallel_config.ulysses_degree > 1)


def _rank(cp: Any) -> int:
    """This rank's place in the Ulysses group: the one whose heads the all-to-all leaves here."""
    rank = getattr(cp, "_ulysses_local_rank", None)
    if rank is None:  # a config diffusers did not set up (its own always sets it)
        rank = torch.distributed.get_rank(cp._ulysses_mesh.get_group())
    return int(rank)


def rank_heads(attn_mask: torch.Tensor, local: int, cp: Any) -> torch.Tensor:
    """Of a mask with every head (Ulysses degree x ``local``, the heads of q after the all-to-all), the ``local``
    heads this rank holds: the all-to-all leaves rank r the r-th run of H / degree heads. Any other mask as it is."""
    degree = cp.ulysses_degree
    if attn_mask.ndim == 4 and degree > 1 and attn_mask.shape[1] == local * degree:
        if _ledger.recording:
            _ledger.reached(FIX_ID)
        start = _rank(cp) * local
        return attn_mask[:, start : start + local].contiguous()
    return attn_mask


def cut_to_rank(forward_op: Callable[..., Any], parallel_config: Any) -> Callable[..., Any]:
    """``forward_op`` (the attention op diffusers' Ulysses forward calls after its all-to-all) handed, of a mask with
    every head, the heads this rank holds (:func:`rank_heads`). The cut is made where the mask meets the op, so
    after diffusers gathered it along the keys (0.39+), whose gather needs every rank's whole mask."""
    cp = parallel_config.context_parallel_config

    def with_rank_heads(ctx: Any, query: Any, key: Any, value: Any, attn_mask: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(attn_mask, torch.Tensor):
            attn_mask = rank_heads(attn_mask, query.shape[2], cp)
        return forward_op(ctx, query, key, value, attn_mask, *args, **kwargs)

    return with_rank_heads


def check(lookup: Lookup) -> Finding:
    forward = lookup(ULYSSES_FORWARD)
    if forward is None:
        return Finding("absent", "this diffusers has no TemplatedUlyssesAttention")
    # Head h's mask is all h: the heads that reach the op can be read off it.
    mask = torch.arange(HEADS, dtype=torch.float32).view(1, HEADS, 1, 1).repeat(1, 1, 1, SEQ)
    reached = _detect.op_reached(
        lookup, ULYSSES_FORWARD, mask, degree=DEGREE, shape=(1, SEQ, HEADS, 8),
        _ulysses_local_rank=RANK,
    )  # fmt: skip
    if isinstance(reached, str) or not isinstance(reached.mask, torch.Tensor) or reached.mask.ndim != 4:
        found = reached if isinstance(reached, str) else f"the op got {reached.mask!r}"
        return Finding("unknown", f"the Ulysses forward could not be run in one process ({found})")
    local = HEADS // DEGREE
    heads = [int(h) for h in reached.mask[0, :, 0, 0].tolist()]
    if heads == list(range(RANK * local, (RANK + 1) * local)):
        return Finding("ok", "a per-head mask reaches the attention op cut to the heads of the rank")
    return Finding("broken", f"a mask of {HEADS} heads reaches rank {RANK}'s attention op (Ulysses degree {DEGREE}, "
                   f"{local} heads a rank) as heads {heads}")  # fmt: skip
