"""The one replacement of ``TemplatedRingAttention.forward`` and of its ``backward``: the corrected ring.

The forward computes what the shipped one computes (the same arithmetic in the same order) and keeps the
merged output and log-sum-exp for the backward. With a mask, each ring step gets the mask columns of the K/V
chunk it attends to (``ring_grad_route.ring_masks``; the shipped ring hands every step the rank's own mask), and
the merge guards the steps whose keys are all masked (log-sum-exp ``-inf``), which contribute nothing. The
backward runs each ring step's backward op on that step's K/V (and mask) with the merged output and
log-sum-exp, sums dQ locally and passes the K/V gradient accumulator round the ring so that each chunk's
gradient ends on its owner, at any ring degree (``ring_grad_route``'s policy). What a step's backward op is
handed: where the shipped ring reuses the first step's tensors (0.36-0.39), the saved tensors of the package's
corrected ops (:func:`saved_step_backward`); on 0.40 on, diffusers' own ops' per-step keywords
(:func:`keyword_step_backward`); the step's mask as ``ctx.attn_mask`` (:class:`StepContext`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .. import _ledger
from .._detect import RING_FORWARD_PARAMS, Lookup
from .._key_padding import remembered
from .._layout import kernel_layout, realigned_all, with_strides_of
from .._warnings import UnsafeAttentionError, explain
from ..fixes import (
    CUDNN_BACKWARD,
    FLASH_BACKWARD,
    RING_BACKWARD,
    RING_FORWARD,
    cudnn_backward_kv,
    qwen_joint_mask_order,
    ring_grad_route,
)
from ..fixes.ring_grad_route import StepOps
from ..fixes.ulysses_head_mask import rank_heads

if torch.distributed.is_available():
    from torch.distributed import _functional_collectives as funcol
else:  # a torch without distributed support never reaches ring attention
    funcol = None  # type: ignore[assignment]
#: The collectives the corrected ring calls (``all_gather_tensor``, ``permute_tensor``, ``AsyncCollectiveTensor``):
#: torch's functional collectives, unless its builder is handed others (a check's stand-ins, a test's threads).
COLLECTIVES: Any = funcol

#: The inputs ``apply`` takes (every parameter but ``ctx``): the backward returns one gradient for each.
INPUTS = len(RING_FORWARD_PARAMS) - 1
#: Where the corrected forward leaves what the corrected backward needs, on the autograd context.
RECORD = "_diffusers_cudnn_fix_ring"


@dataclass(frozen=True)
class RingRecord:
    """What the corrected forward keeps for the backward: the merged output (B, S, H, D) and log-sum-exp
    (B, S, H), detached, and what makes the backward refuse (None when it may run). ``masks``: with a mask, the
    mask each ring step's op kept for its backward (as it handed it to the kernel), by the ring rank owning the
    step's K/V chunk; None without one."""

    out: torch.Tensor
    lse: torch.Tensor
    refusal: str | None
    masks: tuple[Any, ...] | None = None


class StepContext:
    """The autograd context as one ring step's backward op sees it: that step's saved tensors and (given) its
    mask, every other attribute (scale, max_q, max_k, ...) read from the real context."""

    __slots__ = ("_ctx", "attn_mask", "saved_tensors")

    def __init__(self, ctx: Any, saved_tensors: tuple[Any, ...], *mask: Any) -> None:
        self._ctx = ctx
        self.saved_tensors = saved_tensors
        if mask:
            self.attn_mask = mask[0]

    def __getattr__(self, name: str) -> Any:
        if name == "_ctx":  # not set yet (an object made without __init__, as torch.compile may): no recursion
            raise AttributeError(name)
        return getattr(self._ctx, name)


class _StepKept:
    """Stands in for the autograd context in a ring step after the first, where the op must not save into the
    real one: what the op keeps for a backward (its mask as it handed it to the kernel) is read from here; the
    saved tensors are dropped (the backward recomputes each step from the merged output)."""

    def save_for_backward(self, *tensors: Any) -> None:
        pass


def build(
    shipped: Lookup,
    broken: frozenset[str],
    ops: dict[str, Any],
    facts: Any,
    *,
    collectives: Any = None,
    step_ops: Any = None,
) -> dict[str, Any]:
    """The corrected ring where ``ring_grad_route`` is broken, calling ``collectives`` (default
    :data:`COLLECTIVES`) and driving the backward ops of ``step_ops`` (default: those it knows: the package's,
    ``ops``, built before it, the corrected ones reading a step's saved tensors, and 0.40 on diffusers' own)."""
    if ring_grad_route.FIX_ID not in broken:
        return {}
    saved = facts.ring_reuses_first_step  # targets.Facts: read off diffusers' ring
    if step_ops is None:
        steps = {} if saved else {shipped(n): False for n in ring_grad_route.OPS if shipped(n) is not None}
        if CUDNN_BACKWARD in ops:
            steps[ops[CUDNN_BACKWARD]] = cudnn_backward_kv.FIX_ID in broken
        if FLASH_BACKWARD in ops:
            steps[ops[FLASH_BACKWARD]] = True  # built only where it corrects the K/V
        # The ops that read a step's mask from ctx.attn_mask: diffusers' own cuDNN op (0.40 on) and the package's.
        masked = {shipped(n) for n in ring_grad_route.MASK_OPS} | {ops.get(CUDNN_BACKWARD)}
        step_ops = StepOps(steps, frozenset(op for op in masked if op in steps))
    collectives = COLLECTIVES if collectives is None else collectives
    forward = ring_forward(collectives)
    backward = ring_backward(step_ops, saved=saved, collectives=collectives)
    return {RING_FORWARD: staticmethod(forward), RING_BACKWARD: staticmethod(backward)}


def ring_backward(steps: StepOps, *, saved: bool, collectives: Any) -> Callable[..., tuple[torch.Tensor | None, ...]]:
    """``TemplatedRingAttention.backward``'s replacement driving the ops of ``steps``: from their saved tensors
    (``saved``, 0.36-0.39: :func:`saved_step_backward`) or their keywords (:func:`keyword_step_backward`); the
    K/V gradients passed round the ring through ``collectives``."""
    step_backward = saved_step_backward if saved else keyword_step_backward

    def ring_attention_backward(ctx: Any, grad_out: torch.Tensor, *args: Any) -> tuple[torch.Tensor | None, ...]:
        return step_backward(ctx, grad_out, steps, collectives)

    return ring_attention_backward


def _split_kv(chunk: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's K and V out of its flat (K, V) chunk of the all-gathered buffer, shaped as ours."""
    return chunk[: key.numel()].reshape_as(key), chunk[key.numel() :].reshape_as(value)


def _wait(tensor: torch.Tensor, collectives: Any) -> torch.Tensor:
    """The collective's result, waited for (functional collectives return a tensor that completes later)."""
    return tensor.wait() if isinstance(tensor, collectives.AsyncCollectiveTensor) else tensor


def ring_forward(collectives: Any) -> Callable[..., Any]:
    """``TemplatedRingAttention.forward``'s replacement, gathering K/V (and masks) through ``collectives``."""

    def ring_attention_forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
        return_lse: bool,
        forward_op: Any,
        backward_op: Any,
        _parallel_config: Any = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Stands in for ``TemplatedRingAttention.forward``: the shipped computation, plus what the backward needs.

        Step ``i`` attends to the K/V of ring rank ``rank + i`` (with that chunk's mask columns); the steps are
        merged through their log-sum-exps (docs/kernel-facts.md). Only the first step saves the op's autograd
        context, as shipped; with a mask, the later steps' ops keep theirs in a :class:`_StepKept`, whose mask the
        backward hands that step.
        """
        if _ledger.recording:
            _ledger.reached(ring_grad_route.FIX_ID)
        config = _parallel_config.context_parallel_config
        group = config._ring_mesh.get_group()
        rank, world = config._ring_local_rank, config.ring_degree
        ctx.forward_op = forward_op
        ctx.backward_op = backward_op
        ctx.q_shape = query.shape
        ctx.kv_shape = key.shape
        ctx._parallel_config = _parallel_config

        masks = None
        if attn_mask is not None:
            masks = ring_grad_route.ring_masks(
                attn_mask, query, key, config,
                gather=lambda mask: _gathered_mask(mask, config, collectives),
                in_rank_order=lambda mask: _in_rank_order(mask, config),
            )  # fmt: skip
            if masks is not None and (getattr(config, "ulysses_degree", 1) or 1) > 1:
                # Unified attention: q holds this rank's heads after Ulysses' all-to-all; a per-head mask (LTX's) came
                # with every head. Cut after the gather along the keys, which needs every rank's whole mask.
                masks = tuple(rank_heads(mask, query.shape[2], config) for mask in masks)
        kept: list[Any] = [None] * world
        gathered = collectives.all_gather_tensor(
            torch.cat([key.flatten(), value.flatten()]).contiguous(), gather_dim=0, group=group
        ).chunk(world)
        out = lse = None
        for step in range(world):
            owner = (rank + step) % world
            step_key, step_value = (key, value) if step == 0 else _split_kv(gathered[owner], key, value)
            step_ctx = ctx if step == 0 or masks is None else _StepKept()
            step_out, step_lse = forward_op(
                step_ctx, query, step_key, step_value, None if masks is None else masks[owner], dropout_p, is_causal,
                scale, enable_gqa, True, _save_ctx=step == 0 or masks is not None, _parallel_config=_parallel_config,
            )  # fmt: skip
            if masks is not None:  # what the op keeps for its backward (an op that keeps no mask takes none)
                kept[owner] = getattr(step_ctx, "attn_mask", masks[owner])
            if config.convert_to_fp32:
                step_out, step_lse = step_out.to(torch.float32), step_lse.to(torch.float32)
            # (B, S, H) or, from the cuDNN op on torch >= 2.9, already (B, S, H, 1): broadcast against (B, S, H, D).
            if step_lse.dim() == 3:
                step_lse = step_lse.unsqueeze(-1)
            if out is None or lse is None:
                out, lse = step_out, step_lse
                if masks is not None:  # rows whose keys are all masked: output 0 (a kernel may give NaN there)
                    out = out.masked_fill(torch.isneginf(lse), 0.0)
            elif masks is None:
                out = out - torch.sigmoid(step_lse - lse) * (out - step_out)
                lse = lse - F.logsigmoid(lse - step_lse)
            else:
                out, lse = _merged_masked(out, lse, step_out, step_lse)
        assert out is not None and lse is not None  # world >= 1
        out, lse = out.to(query.dtype), lse.squeeze(-1)
        refused = ring_grad_route.refusal(world, dropout_p, is_causal, enable_gqa)
        setattr(ctx, RECORD, RingRecord(out.detach(), lse.detach(), refused, None if masks is None else tuple(kept)))
        return (out, lse) if return_lse else out

    return ring_attention_forward


def _merged_masked(
    out: torch.Tensor, lse: torch.Tensor, step_out: torch.Tensor, step_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shipped merge of a step into (out, lse), where a row whose keys were all masked so far (``lse`` -inf)
    or in this step (``step_lse`` -inf) contributes nothing: the shipped formulas give NaN there (-inf - -inf);
    elsewhere the very same values."""
    empty, step_empty = torch.isneginf(lse), torch.isneginf(step_lse)
    step_out = step_out.masked_fill(step_empty, 0.0)
    weight = torch.where(step_empty, 0.0, torch.where(empty, 1.0, torch.sigmoid(step_lse - lse)))
    merged_lse = torch.where(step_empty, lse, torch.where(empty, step_lse, lse - F.logsigmoid(lse - step_lse)))
    return out - weight * (out - step_out), merged_lse


def _gathered_mask(mask: torch.Tensor, config: Any, collectives: Any) -> torch.Tensor:
    """Every rank's shard of the mask, along the keys in the order of the ring's K/V chunks: the Ulysses group's
    first (its all-to-all lays the sequence out in its ranks' order), then the ring's. A bool mask travels as
    bytes (not every process-group backend takes bool). ``collectives``: the forward's."""
    flat = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    ulysses = getattr(config, "ulysses_degree", 1) or 1
    for degree, mesh in ((ulysses, "_ulysses_mesh"), (config.ring_degree, "_ring_mesh")):
        if degree == 1:
            continue
        group = getattr(config, mesh).get_group()
        parts = collectives.all_gather_tensor(flat.contiguous().flatten(), gather_dim=0, group=group)
        flat = torch.cat([part.view(flat.shape) for part in _wait(parts, collectives).chunk(degree)], dim=-1)
    return flat.view(torch.bool) if mask.dtype == torch.bool else flat


def _in_rank_order(mask: torch.Tensor, config: Any) -> torch.Tensor | None:
    """A mask over the whole key length in the ring's K/V order (rank order), or None where that order cannot be
    known. Only QwenImage's joint mask up to 0.38.0 is in another order ([all text, all image], each stream
    sharded apart): inside its attention processor (its text length handed on) it is reordered as the package
    reorders it for Ulysses, once per mask object; elsewhere while that model is loaded, its order is unknown."""
    if not qwen_joint_mask_order._unsharded_qwen_loaded():
        return mask
    world = config.ring_degree * (getattr(config, "ulysses_degree", 1) or 1)
    if torch.compiler.is_compiling():  # no text length while traced: asks dynamo to run the call eagerly
        raise UnsafeAttentionError(
            explain(
                f"a mask over the whole key length reached ring attention (context-parallel degree {world}) inside "
                "a torch.compile graph, in a diffusers whose QwenImage hands its joint mask in another token order "
                "than the ring's K/V chunks.",
                "Traced, the package cannot read the mask's order (padded prompts would train silently wrong), so it "
                "asks for this call to run eagerly.",
                ring_grad_route.ORDER_WAY_OUT,
                ring_grad_route.DOCS,
            )
        )
    text = qwen_joint_mask_order.TEXT_LEN.get()
    if text is None:
        return None
    lengths = (text * world, mask.shape[-1] - text * world, world)
    try:
        return remembered(_rank_ordered, mask, lengths)
    except ValueError:
        return None


def _rank_ordered(mask: torch.Tensor, lengths: tuple[int, int, int]) -> torch.Tensor:
    """``qwen_joint_mask_order.rank_ordered_mask`` of ``mask`` (2-D (B, S) read as [B, 1, 1, S], as there)."""
    return qwen_joint_mask_order.rank_ordered_mask(mask[:, None, None, :] if mask.dim() == 2 else mask, *lengths)


def _finite_lse(record: RingRecord) -> torch.Tensor:
    """The merged log-sum-exp as the steps' backward ops take it: with a mask, 0 in the rows whose keys are all
    masked (-inf there, where every score is -inf too: exp(-inf - 0) is their weight, 0, not NaN)."""
    return record.lse if record.masks is None else record.lse.masked_fill(torch.isneginf(record.lse), 0.0)


def _recorded(ctx: Any, steps: StepOps | None = None) -> RingRecord:
    """What the corrected forward kept on ``ctx``; raises where the backward must not run (with ``steps``: also
    where it has a mask and its backward op does not take a ring step's mask)."""
    record = getattr(ctx, RECORD, None)
    if not isinstance(record, RingRecord):
        raise UnsafeAttentionError(
            explain(
                "this ring attention's forward ran before the package corrected the ring (apply() between a "
                "forward and its backward?).",
                "Its backward cannot be corrected, and diffusers' own would give wrong K/V gradients.",
                "Call apply() before the forward (import the package first). " + ring_grad_route.WAY_OUT,
                ring_grad_route.DOCS,
            )
        )
    if record.refusal is not None:
        raise UnsafeAttentionError(
            explain(
                f"ring context parallelism's backward is corrected without dropout, causal attention or GQA; this "
                f"call has {record.refusal}.",
                "Its gradients would be wrong, so the backward is refused.",
                ring_grad_route.WAY_OUT,
                ring_grad_route.DOCS,
            )
        )
    if record.masks is not None and steps is not None and ctx.backward_op not in steps.reads_mask:
        raise UnsafeAttentionError(ring_grad_route.mask_op_message(ctx.backward_op))
    return record


def saved_step_backward(
    ctx: Any, grad_out: torch.Tensor, steps: StepOps, collectives: Any
) -> tuple[torch.Tensor | None, ...]:
    """0.36 to 0.39: each ring step's gradients from the package's corrected backward op, handed that step's
    K/V with the merged output and log-sum-exp as its saved tensors."""
    if not steps.reads_saved.get(ctx.backward_op, False):
        degree = ctx._parallel_config.context_parallel_config.ring_degree
        raise UnsafeAttentionError(
            ring_grad_route.unsupported_backend_message(ctx.backward_op, degree, first_step=True)
        )
    record = _recorded(ctx, steps)
    # What the forward op saved (kernel layout): q, the local K/V, then the rest as the op keeps it. The
    # step's output and log-sum-exp are replaced by the merged ones, laid out as the kernel takes them.
    query, key, value, _, _, *rest = ctx.saved_tensors
    (out,) = kernel_layout(record.out)
    lse = _finite_lse(record).to(torch.float32).transpose(1, 2).contiguous()
    # grad_out laid out as the op will hand it to the kernel (out's strides): copied once, not per step.
    grad_out = with_strides_of(grad_out.transpose(1, 2), out).transpose(1, 2)

    def step_grads(owner: int, step_key: torch.Tensor, step_value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mask = () if record.masks is None else (record.masks[owner],)
        step_ctx = StepContext(ctx, (query, step_key, step_value, out, lse, *rest), *mask)
        return tuple(ctx.backward_op(step_ctx, grad_out)[:3])

    return ring_gradients(ctx, grad_out, key, value, step_grads, collectives)


def keyword_step_backward(
    ctx: Any, grad_out: torch.Tensor, steps: StepOps, collectives: Any
) -> tuple[torch.Tensor | None, ...]:
    """0.40 on: each ring step's gradients from diffusers' own backward op (behind the package's wrapper, if
    any), handed that step's K/V with the merged output and log-sum-exp as keywords, as 0.40 does."""
    record = _recorded(ctx, steps)
    degree = ctx._parallel_config.context_parallel_config.ring_degree
    if degree > ring_grad_route.RIGHT_UP_TO and ctx.backward_op not in steps.reads_saved:
        raise UnsafeAttentionError(
            ring_grad_route.unsupported_backend_message(ctx.backward_op, degree, first_step=False)
        )
    # What the forward op saved at the first ring step: q and the local K/V, in model layout (B, S, H, D). Read
    # once: each step's op gets them from a StepContext (non-reentrant checkpointing unpacks a saved tensor once).
    saved = ctx.saved_tensors
    query, key, value = saved[:3]
    lse = _finite_lse(record)

    def step_grads(owner: int, step_key: torch.Tensor, step_value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        step_ctx = StepContext(ctx, saved, *(() if record.masks is None else (record.masks[owner],)))
        grads = ctx.backward_op(
            step_ctx, grad_out, query=query, key=step_key, value=step_value, out=record.out, lse=lse
        )
        return tuple(grads[:3])

    return ring_gradients(ctx, grad_out, key, value, step_grads, collectives)


def ring_gradients(
    ctx: Any,
    grad_out: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    step_grads: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]],
    collectives: Any,
) -> tuple[torch.Tensor | None, ...]:
    """The ring backward's gradients for every input of ``TemplatedRingAttention.forward``.

    Step ``i`` works on the K/V chunk of ring rank ``rank - i``: ``step_grads(rank - i, K, V)`` returns that
    chunk's (dQ, dK, dV) for our queries. dQ is summed here; the chunk's dK/dV are added to the accumulator that
    arrived from rank ``rank - 1`` (which has just worked on the same chunk) and passed on to rank
    ``rank + 1``: after the last step that is the chunk's owner, for any ring degree. ``collectives``: those the
    replacement's builder was handed.
    """
    config = ctx._parallel_config.context_parallel_config
    group = config._ring_mesh.get_group()
    rank, world = config._ring_local_rank, config.ring_degree
    to_next = [(r + 1) % world for r in range(world)]  # rank r sends to r + 1

    gathered = collectives.all_gather_tensor(
        torch.cat([key.flatten(), value.flatten()]).contiguous(), gather_dim=0, group=group
    ).chunk(world)
    accum_dtype = torch.float32 if config.convert_to_fp32 else grad_out.dtype
    grad_query = torch.zeros(ctx.q_shape, dtype=accum_dtype, device=grad_out.device)
    arriving = None
    for step in range(world):
        owner = (rank - step) % world
        step_kv = (key, value) if step == 0 else realigned_all(*_split_kv(gathered[owner], key, value))
        grad_q, grad_k, grad_v = step_grads(owner, *step_kv)
        grad_query += grad_q
        grad_kv = torch.cat([grad_k.flatten(), grad_v.flatten()]).to(accum_dtype)
        if arriving is not None:
            grad_kv += _wait(arriving, collectives)
        arriving = collectives.permute_tensor(grad_kv, to_next, group=group)
    assert arriving is not None  # world >= 1
    grad_kv = _wait(arriving, collectives)
    grad_key, grad_value = grad_kv.to(grad_out.dtype).reshape(2, *ctx.kv_shape).unbind()
    return (grad_query.to(grad_out.dtype), grad_key, grad_value, *(None,) * (INPUTS - 3))
