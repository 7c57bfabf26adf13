"""Key-padding masks at no cost: the cuDNN context-parallel op run on the valid keys alone.

A mask that only pads keys (every query row and every head sees the same keys: QwenImage's ``[B, 1, 1, S_kv]``
bool mask, or a ``[B, 1|H, S_q, S_kv]`` mask whose rows are all equal, bool or additive ``0`` / ``-inf``) makes
the kernel read a bias it does not need. Here the mask guard hands the op the keys that are attended to:

* one batch element's worth of keys (B = 1, or a mask shared by the batch): the valid keys gathered (a view
  where they are one run), no bias;
* B > 1: each element's valid keys moved to the front, trimmed to the longest valid count, with an additive
  bias (``-inf``) only for the tail of the shorter ones.

The K/V gradients are scattered back to full length by the backward op's wrapper (zeros for the dropped keys).
The plan for a mask costs one host sync, once per mask object and version (the mask is reused by every layer);
while compiling or capturing a CUDA graph, for inference tensors, with dropout, ``is_causal`` or ring attention,
outside the ``convert`` mask mode, or where the backward op that will run cannot scatter, the op gets the bias
as before. Plain tensor code, no imports at call time: this runs on autograd's threads.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

#: The autograd-context attribute that tells the backward what the forward trimmed.
CTX_ATTR = "dcf_key_padding"
_MAX_MASKS = 8
# id(tensor) -> (the tensor, weakly; its version counter; {(compute, question): what it computed})
_kept: dict[int, tuple[weakref.ref[torch.Tensor], int, dict[Any, Any]]] = {}


def remembered(compute: Any, tensor: torch.Tensor, question: Any, kept_for: torch.Tensor | None = None) -> Any:
    """``compute(tensor, question)``, kept while ``tensor`` (or ``kept_for``, the tensor it was made from) lives
    unchanged (its version counter): a mask built once and handed to every layer is converted, planned or reordered
    once. The one cache of the mask policies, a few masks deep (a model alternating masks keeps both). Computed
    every time while compiling, and for an inference tensor (it has no version counter)."""
    owner = tensor if kept_for is None else kept_for
    if torch.compiler.is_compiling() or owner.is_inference():
        return compute(tensor, question)
    key = id(owner)
    entry = _kept.get(key)
    if entry is None or entry[0]() is not owner or entry[1] != owner._version:
        if len(_kept) >= _MAX_MASKS:
            _kept.clear()
        # The tensor gone, so is what was computed from it (and its id may be reused). The callback holds the
        # dict's own pop, never the module global: at interpreter exit the module's globals are cleared (None)
        # first, and dropping this dict then frees an answer that may hold the last reference to the tensor.
        forget = _kept.pop
        entry = _kept[key] = (weakref.ref(owner, lambda _: forget(key, None)), owner._version, {})
    answers = entry[2]
    if (compute, question) not in answers:
        answers[compute, question] = compute(tensor, question)
    return answers[compute, question]


class Plan(NamedTuple):
    """What to do with a mask. ``kind``: ``"bias"`` (not key padding, or no key valid: unchanged), ``"all"``
    (every key valid: no bias), ``"window"`` (the valid keys lie in ``[start, start + n)``: a view), ``"gather"``
    (``positions``: (B|1, n) positions of each element's valid keys first). ``bias``: (B|1, 1, 1, n) or None."""

    kind: str
    start: int = 0
    n: int = 0
    positions: torch.Tensor | None = None
    bias: torch.Tensor | None = None


_BIAS = Plan("bias")
_ALL = Plan("all")


def plan(mask: torch.Tensor, dtype: torch.dtype) -> Plan:
    """The plan for a 4-D ``mask`` (bool, True = attend, or additive) whose last dim is the keys; one host sync."""
    keep = mask if mask.dtype == torch.bool else mask == 0
    row = keep[:, :1, :1, :]
    ok = (keep == row).all()
    if mask.dtype != torch.bool:
        ok &= (keep | torch.isneginf(mask)).all()  # another value is a real bias, not padding
    row = row.reshape(mask.shape[0], mask.shape[-1])
    seq = row.shape[1]
    counts = row.sum(dim=1)
    pos = torch.arange(seq, device=mask.device)
    first = torch.where(row, pos, seq).amin()
    last = torch.where(row, pos, -1).amax()
    found = torch.stack([ok.to(torch.int64), counts.max(), counts.min(), first, last]).tolist()  # the one sync
    is_padding, most, least, start, end = found[0], found[1], found[2], found[3], found[4] + 1
    if not is_padding or most == 0:  # no valid key at all: the bias path's result (zero rows) stays
        return _BIAS
    if least == seq:
        return _ALL
    if end - start == most:  # every valid key in one run of the longest count's length: a view
        bias = None if least == most else _additive(row[:, start:end], dtype)
        return Plan("window", start, most, None, bias)
    index = torch.argsort((~row).to(torch.int8), dim=1, stable=True)[:, :most]
    bias = None if least == most else _additive(torch.arange(most, device=mask.device) < counts[:, None], dtype)
    return Plan("gather", 0, most, index, bias)


def plan_of(given: torch.Tensor, dtype: torch.dtype, gathered_from: torch.Tensor, config: Any) -> Plan:
    """The plan for ``given``, kept for the mask it was made from. Under Ulysses, diffusers all-gathers a
    sequence-local mask into a new tensor in every layer; the layers share the mask the model handed them,
    ``gathered_from``, so the plan is kept for that one: one host sync per mask per step, not per layer.

    Whether another layer's gather holds the same values depends on every rank's mask, which this rank cannot see
    without a sync. So each later layer checks, on the device and without waiting, that it equals the first one
    (``torch._assert_async``): a rank whose mask changed while this one's did not stops the run (on a GPU a
    device-side assert) instead of training on a stale plan."""
    # The plan is kept for gathered_from (its id and version), per dtype, gathered shape and parallel config.
    first, found = remembered(_planned, given, (dtype, tuple(given.shape), id(config)), gathered_from)
    if first is not given:  # trim() runs no plan while compiling
        same = first == given
        if given.is_floating_point():  # a NaN is the same NaN
            same |= first.isnan() & given.isnan()
        torch._assert_async(same.all(), "diffusers_cudnn_fix: the attention mask diffusers' Ulysses forward gathered"
                            " changed between layers while this rank's own did not; hand every layer of a step the"
                            " same mask on every rank, or change it on every rank")  # fmt: skip
    return found


def _planned(given: torch.Tensor, question: tuple[Any, ...]) -> tuple[torch.Tensor, Plan]:
    """The mask planned for (kept, to check later layers' against it) and its plan."""
    return given, plan(given, question[0])


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, n) keep flags as a (B, 1, 1, n) additive bias (``-inf`` where False)."""
    bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))
    return bias[:, None, None, :]


def trim(
    ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, given: torch.Tensor, mask: torch.Tensor, *,
    dropout_p: float, is_causal: bool, save_ctx: bool, parallel_config: Any, restoring: Any, mode: str,
    gathered_from: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(key, value, mask) for diffusers' cuDNN forward op: trimmed to the valid keys where ``given`` (the mask
    as it reached the op) only pads keys, else as they came. ``mask`` is ``given`` after the mask policy; the
    keywords are the op's own arguments, ``mode`` the mask mode the op read for this call, ``restoring`` the
    backward op that scatters the K/V gradients back (:func:`restored`), or None, and ``gathered_from`` the mask
    diffusers' Ulysses forward was handed, where it may have gathered ``given`` from it (:func:`plan_of`).
    Records on ``ctx`` what ``restored`` needs."""
    if torch.compiler.is_compiling() or (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()):
        return key, value, mask
    if ctx is not None:
        setattr(ctx, CTX_ATTR, None)
    seq = key.shape[1]
    if (
        given.dim() != 4
        or given.shape[-1] != seq
        or given.shape[0] not in (1, key.shape[0])
        or given.shape[1] not in (1, query.shape[2])
        or given.shape[2] not in (1, query.shape[1])
        or given.is_inference()  # no version counter: a plan could not be cached
        or dropout_p
        or is_causal
        # Ring attention hands the op each step's K/V chunk with its mask columns: no trim inside the steps.
        or getattr(getattr(parallel_config, "context_parallel_config", None), "ring_degree", 1) > 1
        # The backward that will run could not scatter the K/V gradients back.
        or (save_ctx and (restoring is None or getattr(ctx, "backward_op", None) is not restoring))
        # Only in convert mode (warn: as upstream; error: bool masks never get here).
        or mode != "convert"
    ):
        return key, value, mask
    if gathered_from is None or gathered_from is given:
        found = remembered(plan, given, mask.dtype)
    else:  # under Ulysses, where diffusers may have gathered it
        found = plan_of(given, mask.dtype, gathered_from, parallel_config)
    kind = found.kind
    if kind == "bias" or (found.n == 1 and query.shape[1] == 1):  # cuDNN refuses S_q = S_kv = 1
        return key, value, mask
    if kind == "all":
        return key, value, None
    if kind == "window":
        stop = found.start + found.n
        key, value = key[:, found.start : stop], value[:, found.start : stop]
    elif found.positions is not None and found.positions.shape[0] == 1:
        key, value = key.index_select(1, found.positions[0]), value.index_select(1, found.positions[0])
    elif found.positions is not None:
        index = found.positions[:, :, None, None]
        key = key.gather(1, index.expand(-1, -1, key.shape[2], key.shape[3]))
        value = value.gather(1, index.expand(-1, -1, value.shape[2], value.shape[3]))
    if ctx is not None and save_ctx:
        setattr(ctx, CTX_ATTR, (seq, found))
    return key, value, found.bias


def restored(ctx: Any, grads: Any) -> Any:
    """The backward op's gradients with dK / dV (B, n, H, D) scattered back to the full key length."""
    trimmed = getattr(ctx, CTX_ATTR, None)
    if trimmed is None:
        return grads
    seq, found = trimmed
    grad_key, grad_value = grads[1], grads[2]
    if found.positions is None:
        pad = (0, 0, 0, 0, found.start, seq - found.start - found.n)
        return (grads[0], F.pad(grad_key, pad), F.pad(grad_value, pad), *grads[3:])
    index = found.positions[:, :, None, None]
    full_key = grad_key.new_zeros(grad_key.shape[0], seq, *grad_key.shape[2:])
    full_value = grad_value.new_zeros(grad_value.shape[0], seq, *grad_value.shape[2:])
    full_key.scatter_(1, index.expand(grad_key.shape), grad_key)
    full_value.scatter_(1, index.expand(grad_value.shape), grad_value)
    return (grads[0], full_key, full_value, *grads[3:])
