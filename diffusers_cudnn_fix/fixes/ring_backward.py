"""Ring (and unified) context parallelism's backward reuses the first ring step's tensors.

Bug: ``TemplatedRingAttention.forward`` merges each ring step's output and log-sum-exp into the
attention over the whole sequence, but keeps only the first step's autograd context (the local K/V and that
step's own output and log-sum-exp). ``TemplatedRingAttention.backward`` rotates K/V around the ring and calls
the backward op as ``ctx.backward_op(ctx, grad_out)`` on every step, so every step recomputes the first
step's attention against the first step's output. Parameter gradients are wrong for every attention backend
(one step of a tiny Flux transformer, ring degree 2: off by 31x their size as shipped, 2.6x with the
package's other fixes). Unified attention (Ulysses and ring degree > 1) runs the same class. The forward's
merge also fails on one log-sum-exp rank: 0.36.0 adds a dimension whatever the rank (the cuDNN op's is
already 4-D from torch 2.9 on), 0.37.x adds none from torch 2.9 on (the flash op's is 3-D). See
docs/kernel-facts.md, "Ring attention".

Releases: 0.36.0 to 0.39.0. Fixed upstream in 0.40.0 (huggingface/diffusers#14274).

Detection: run the installed forward and backward for ring degree 2 in one process with stand-in
collectives (rank 1's K/V differ from rank 0's) and recording forward/backward ops: does each ring step's
backward get that step's K, and the merged output rather than a single step's?

Replacement, for the backward ops this package corrects (``_native_cudnn``, ``_native_flash``):

* :func:`ring_attention_forward` computes what the shipped forward computes, the same arithmetic in the
  same order (inference results are unchanged), takes a 3-D or 4-D log-sum-exp, and keeps the merged output
  and log-sum-exp for the backward.
* :func:`ring_attention_backward` hands the backward op, for each ring step, that step's K/V with the merged
  output and log-sum-exp (the corrected ops recompute the step's share of the softmax from them), sums the
  query gradient locally and passes the K/V gradient accumulator around the ring once per step, so that it
  ends on the rank owning the chunk.

Any other backward op (another backend, or a shipped op left in place by ``DIFFUSERS_CUDNN_FIX_SKIP``), and
what the corrected ring does not cover (a mask, dropout or ``is_causal`` with ring degree > 1, whose
per-step meaning is wrong upstream; ``enable_gqa``), make the backward raise :class:`UnsafeAttentionError`
naming the cause and the way out. The forward never raises where the shipped one would not.

The ring degree is not limited: the chunk order and the accumulator's route are chosen so that each chunk's
gradient ends on its owner for any degree (diffusers' own route, even 0.40's, is right for degree 2 only;
``ring_grad_route`` installs this forward and the same route on 0.40 on).

Revert: the class's original ``forward`` and ``backward`` staticmethods are put back (the registry keeps
them).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .. import _detect
from .._fix import Finding, Fix, Lookup
from .._layout import realigned, to_kernel_layout, with_strides_of
from .._warnings import UnsafeAttentionError
from .cudnn_backward_kv import cudnn_attention_backward_op
from .flash_backward_kv import native_flash_attention_backward_op

if torch.distributed.is_available():
    from torch.distributed import _functional_collectives as funcol
else:  # a torch without distributed support never reaches ring attention
    funcol = None  # type: ignore[assignment]

CLASS = "TemplatedRingAttention"
FORWARD = f"{CLASS}.forward"
BACKWARD = f"{CLASS}.backward"
FIX_ID = "ring_backward"

#: The backward ops whose per-step use this module has verified, by identity -> the backend that hands them
#: to the ring. Both read the step's tensors from ``ctx.saved_tensors`` in kernel layout. Read at every
#: call (the check substitutes its recording op through the function's globals).
STEP_BACKWARD_OPS: Mapping[Any, str] = {
    cudnn_attention_backward_op: "_native_cudnn",
    native_flash_attention_backward_op: "_native_flash",
}

#: Positional parameters of ``TemplatedRingAttention.forward`` in 0.36.0 to 0.42.1 (the op's, with the op pair
#: in place of ``_save_ctx``); a class whose forward takes others is left alone.
FORWARD_PARAMS = (*_detect.FORWARD_PARAMS[:-2], "forward_op", "backward_op", "_parallel_config")
#: The inputs ``apply`` takes (every parameter but ``ctx``): the backward returns one gradient for each.
INPUTS = len(FORWARD_PARAMS) - 1

#: Where the corrected forward leaves what the corrected backward needs, on the autograd context.
RECORD = "_diffusers_cudnn_fix_ring"


def way_out(fix_id: str) -> str:
    """The way out of a refused ring backward, naming the fix whose skip lets diffusers' own backward run."""
    return (
        "Train with Ulysses context parallelism (ContextParallelConfig(ulysses_degree=...)) for these inputs. "
        f"DIFFUSERS_CUDNN_FIX_SKIP={fix_id} lets diffusers' own ring backward run (wrong gradients)."
    )


@dataclass(frozen=True)
class RingRecord:
    """What the corrected forward keeps for the backward: the merged output (B, S, H, D) and log-sum-exp
    (B, S, H), detached, and what makes the backward refuse (None when it may run)."""

    out: torch.Tensor
    lse: torch.Tensor
    refusal: str | None


class StepContext:
    """The autograd context as one ring step's backward op sees it: that step's saved tensors, every other
    attribute (scale, max_q, max_k, the mask, ...) read from the real context."""

    __slots__ = ("_ctx", "saved_tensors")

    def __init__(self, ctx: Any, saved_tensors: tuple[Any, ...]) -> None:
        self._ctx = ctx
        self.saved_tensors = saved_tensors

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


def _refusal(world: int, attn_mask: Any, dropout_p: float, is_causal: bool, enable_gqa: bool) -> str | None:
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


def _split_kv(chunk: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's K and V out of its flat (K, V) chunk of the all-gathered buffer, shaped as ours."""
    return chunk[: key.numel()].reshape_as(key), chunk[key.numel() :].reshape_as(value)


def _wait(tensor: torch.Tensor, collectives: Any) -> torch.Tensor:
    """The collective's result, waited for (functional collectives return a tensor that completes later)."""
    if collectives is not None and isinstance(tensor, collectives.AsyncCollectiveTensor):
        return tensor.wait()
    return tensor


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

    Step ``i`` attends to the K/V of ring rank ``rank + i``; the steps are merged through their
    log-sum-exps (docs/kernel-facts.md). Only the first step saves the op's autograd context, as shipped.
    """
    config = _parallel_config.context_parallel_config
    group = config._ring_mesh.get_group()
    rank, world = config._ring_local_rank, config.ring_degree
    ctx.forward_op = forward_op
    ctx.backward_op = backward_op
    ctx.q_shape = query.shape
    ctx.kv_shape = key.shape
    ctx._parallel_config = _parallel_config

    gathered = funcol.all_gather_tensor(
        torch.cat([key.flatten(), value.flatten()]).contiguous(), gather_dim=0, group=group
    ).chunk(world)
    out = lse = None
    for step in range(world):
        step_key, step_value = (key, value) if step == 0 else _split_kv(gathered[(rank + step) % world], key, value)
        step_out, step_lse = forward_op(
            ctx, query, step_key, step_value, attn_mask, dropout_p, is_causal, scale, enable_gqa, True,
            _save_ctx=step == 0, _parallel_config=_parallel_config,
        )  # fmt: skip
        if config.convert_to_fp32:
            step_out, step_lse = step_out.to(torch.float32), step_lse.to(torch.float32)
        # (B, S, H) or, from the cuDNN op on torch >= 2.9, already (B, S, H, 1): broadcast against (B, S, H, D).
        if step_lse.dim() == 3:
            step_lse = step_lse.unsqueeze(-1)
        if out is None or lse is None:
            out, lse = step_out, step_lse
        else:
            out = out - torch.sigmoid(step_lse - lse) * (out - step_out)
            lse = lse - F.logsigmoid(lse - step_lse)
    assert out is not None and lse is not None  # world >= 1
    out = out.to(query.dtype)
    lse = lse.squeeze(-1)
    setattr(
        ctx,
        RECORD,
        RingRecord(out.detach(), lse.detach(), _refusal(world, attn_mask, dropout_p, is_causal, enable_gqa)),
    )
    return (out, lse) if return_lse else out


def ring_attention_backward(ctx: Any, grad_out: torch.Tensor, *args: Any) -> tuple[torch.Tensor | None, ...]:
    """Stands in for ``TemplatedRingAttention.backward`` (0.36 to 0.39): each ring step's gradients from that
    step's K/V, through the package's corrected backward ops (:func:`ring_gradients` routes them)."""
    backend = step_backend(ctx.backward_op, STEP_BACKWARD_OPS)  # the global as this function sees it (the check's)
    if backend is None:
        raise UnsafeAttentionError(unsupported_backend_message(ctx.backward_op))
    record = recorded(ctx, FIX_ID)

    # What the forward op saved (kernel layout): q, the local K/V, then the rest as the op keeps it. The
    # step's output and log-sum-exp are replaced by the merged ones, laid out as the kernel takes them.
    query, key, value, _, _, *rest = ctx.saved_tensors
    out = to_kernel_layout(record.out)
    lse = record.lse.to(torch.float32).transpose(1, 2).contiguous()
    # grad_out laid out as the op will hand it to the kernel (out's strides): copied once, not per step.
    grad_out = with_strides_of(grad_out.transpose(1, 2), out).transpose(1, 2)

    def step_grads(step_key: torch.Tensor, step_value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        step_ctx = StepContext(ctx, (query, step_key, step_value, out, lse, *rest))
        return tuple(ctx.backward_op(step_ctx, grad_out)[:3])

    return ring_gradients(ctx, grad_out, key, value, step_grads, funcol)


def recorded(ctx: Any, fix_id: str) -> RingRecord:
    """What the corrected forward kept on ``ctx``; raises where the backward must not run."""
    record = getattr(ctx, RECORD, None)
    if not isinstance(record, RingRecord):
        raise UnsafeAttentionError(
            "diffusers_cudnn_fix: this ring attention's forward ran before the package corrected the ring "
            f"(apply() between a forward and its backward?), so its backward cannot be corrected. {way_out(fix_id)}"
        )
    if record.refusal is not None:
        raise UnsafeAttentionError(
            f"diffusers_cudnn_fix: ring context parallelism's backward is corrected without masks, dropout, causal "
            f"attention or GQA; this call has {record.refusal}. {way_out(fix_id)}"
        )
    return record


def ring_gradients(
    ctx: Any,
    grad_out: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    step_grads: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]],
    collectives: Any,
) -> tuple[torch.Tensor | None, ...]:
    """The ring backward's gradients for every input of ``TemplatedRingAttention.forward``.

    Step ``i`` works on the K/V chunk of ring rank ``rank - i``: ``step_grads(K, V)`` returns that chunk's
    (dQ, dK, dV) for our queries. dQ is summed here; the chunk's dK/dV are added to the accumulator that
    arrived from rank ``rank - 1`` (which has just worked on the same chunk) and passed on to rank
    ``rank + 1``: after the last step that is the chunk's owner, for any ring degree. ``collectives`` is the
    caller's ``funcol`` (the checks and test harnesses hand the caller stand-ins through its globals).
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
        if step == 0:
            step_key, step_value = key, value
        else:
            step_key, step_value = _split_kv(gathered[(rank - step) % world], key, value)
            step_key, step_value = realigned(step_key), realigned(step_value)
        grad_q, grad_k, grad_v = step_grads(step_key, step_value)
        grad_query += grad_q
        grad_kv = torch.cat([grad_k.flatten(), grad_v.flatten()]).to(accum_dtype)
        if arriving is not None:
            grad_kv += _wait(arriving, collectives)
        arriving = collectives.permute_tensor(grad_kv, to_next, group=group)
    assert arriving is not None  # world >= 1
    grad_kv = _wait(arriving, collectives)
    numel = ctx.kv_shape.numel()  # a torch.Size
    grad_key = grad_kv[:numel].reshape(ctx.kv_shape)
    grad_value = grad_kv[numel:].reshape(ctx.kv_shape)
    dtype = grad_out.dtype
    return (grad_query.to(dtype), grad_key.to(dtype), grad_value.to(dtype), *(None,) * (INPUTS - 3))


def step_backend(backward_op: Any, known: Mapping[Any, str]) -> str | None:
    """The backend (by ``known``) whose corrected backward op ``backward_op`` is, also behind wrappers that
    name what they wrap (``functools.wraps``, as the masked-row guard's does); None for any other op."""
    op = backward_op
    for _ in range(8):  # a wrapper chain, not a cycle
        backend = known.get(op)
        if backend is not None or not hasattr(op, "__wrapped__"):
            return backend
        op = op.__wrapped__
    return None


def unsupported_backend_message(backward_op: Any) -> str:
    name = f"{getattr(backward_op, '__module__', '?')}.{getattr(backward_op, '__qualname__', repr(backward_op))}"
    return (
        "diffusers_cudnn_fix: ring context parallelism (ring_degree > 1, also unified attention) in this diffusers "
        "release computes wrong gradients (every ring step's backward reuses the first step's tensors; fixed "
        "upstream in diffusers 0.40.0, huggingface/diffusers#14274). The package corrects it for the "
        f"{' and '.join(sorted(set(STEP_BACKWARD_OPS.values())))} attention backends, with their corrected "
        f"backward ops in place (fixes cudnn_backward_kv, flash_backward_kv); this call's backward op is {name}. "
        "Use one of those backends for ring training, Ulysses context parallelism "
        "(ContextParallelConfig(ulysses_degree=...)), or diffusers >= 0.40 (ring right with every backend at "
        f"ring_degree 2, and at any degree with these two and this package). DIFFUSERS_CUDNN_FIX_SKIP={FIX_ID} "
        "lets diffusers' own (wrong) ring backward run."
    )


# ------------------------------------------------------------------------------------------------------------
# The behavioural check
# ------------------------------------------------------------------------------------------------------------
_BATCH, _SEQ, _HEADS, _DIM = 1, 4, 2, 8


@dataclass
class _Seen:
    """What the check's stand-in ops saw, each tensor by its mean (the check's tensors are constant, so the mean
    names one whatever its layout): per forward step the K, per backward call the K and the output."""

    forward_keys: list[float]
    backward_keys: list[float]
    backward_outs: list[float]


def _mean(x: torch.Tensor) -> float:
    return float(x.float().mean())


def _drive(forward: Any, backward: Any, lse_ndim: int) -> tuple[_Seen, float | None, str | None]:
    """Run ``forward`` then ``backward`` for ring degree 2 as rank 0, in this process.

    Our K/V are zeros and rank 1's ones (the stand-in all-gather adds 1), so a step that uses them shows it.
    The stand-in forward op saves kernel-layout tensors as the 0.36-0.39 ops do and returns a log-sum-exp of
    ``lse_ndim`` dims; each step's output differs, so the merged output differs from every step's. Returns
    what the ops saw, the mean of the forward's output and the error text of a failure (None if none).
    """
    seen = _Seen([], [], [])

    def forward_op(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *a: Any, **kw: Any) -> Any:
        seen.forward_keys.append(_mean(k))
        out = k + 2.0
        lse = k[..., 0].clone() if lse_ndim == 3 else k[..., :1].clone()
        if kw.get("_save_ctx"):
            kernel = (x.transpose(1, 2).contiguous() for x in (q, k, v, out))
            ctx.save_for_backward(*kernel, lse.transpose(1, 2).contiguous(), None, None, None, None)
        return out, lse

    def backward_op(ctx: Any, grad: torch.Tensor, *a: Any, **kw: Any) -> tuple[torch.Tensor, ...]:
        saved = ctx.saved_tensors
        seen.backward_keys.append(_mean(kw["key"] if kw.get("key") is not None else saved[1]))
        seen.backward_outs.append(_mean(kw["out"] if kw.get("out") is not None else saved[3]))
        return torch.zeros(ctx.q_shape), torch.zeros(ctx.kv_shape), torch.zeros(ctx.kv_shape)

    collectives = types.SimpleNamespace(
        all_gather_tensor=lambda x, gather_dim=0, group=None: torch.cat([x, x + 1.0]),
        permute_tensor=lambda x, ranks, group=None: x,
        AsyncCollectiveTensor=type("AsyncCollectiveTensor", (), {}),
    )
    config = types.SimpleNamespace(
        _ring_mesh=_detect.FAKE_MESH, _ring_local_rank=0, ring_degree=2, convert_to_fp32=False, _world_size=2
    )
    ctx = _detect.ProbeCtx()
    q, k, v = (torch.zeros(_BATCH, _SEQ, _HEADS, _DIM) for _ in range(3))
    merged = None
    try:
        result = _detect.with_globals(forward, funcol=collectives)(
            ctx, q, k, v, None, 0.0, False, None, False, False, forward_op, backward_op,
            types.SimpleNamespace(context_parallel_config=config),
        )  # fmt: skip
        merged = _mean(result[0] if isinstance(result, tuple) else result)
        _detect.with_globals(backward, funcol=collectives, STEP_BACKWARD_OPS={backward_op: "check"})(
            ctx, torch.zeros(_BATCH, _SEQ, _HEADS, _DIM)
        )
    except Exception as exc:  # noqa: BLE001 - an unknown build, or the package's refusal: the caller decides
        return seen, merged, f"{type(exc).__name__}: {exc}"
    return seen, merged, None


def installed_ring(lookup: Lookup) -> tuple[Any, Any] | Finding:
    """The installed ``TemplatedRingAttention`` forward and backward, or why they cannot be checked."""
    forward, backward = lookup(FORWARD), lookup(BACKWARD)
    if lookup(CLASS) is None or forward is None or backward is None:
        return Finding("absent", "this diffusers has no TemplatedRingAttention")
    if not all(isinstance(fn, types.FunctionType) for fn in (forward, backward)):
        return Finding("unknown", "TemplatedRingAttention's forward/backward are not plain functions")
    if not _detect.signature_matches(forward, FORWARD_PARAMS):
        return Finding("unknown", "TemplatedRingAttention.forward takes other parameters than every known release")
    return forward, backward


def check(lookup: Lookup) -> Finding:
    found = installed_ring(lookup)
    if isinstance(found, Finding):
        return found
    forward, backward = found
    # The cuDNN op's log-sum-exp is 4-D from torch 2.9 on, the flash op's 3-D: try the 4-D one first.
    note = ""
    seen, merged, error = _drive(forward, backward, lse_ndim=4)
    if error is not None and not seen.backward_keys:
        note = f" (the forward also fails on a 4-D log-sum-exp: {error})"
        seen, merged, error = _drive(forward, backward, lse_ndim=3)
    if error is not None or len(seen.backward_keys) != 2 or len(seen.forward_keys) != 2:
        return Finding(
            "unknown", f"the ring attention could not be run in one process ({error or len(seen.backward_keys)})"
        )
    if sorted(seen.backward_keys) != sorted(seen.forward_keys):
        return Finding("broken", f"the ring steps' backward does not see each step's K/V{note}")
    if any(out != merged for out in seen.backward_outs):
        return Finding("broken", f"the ring steps' backward is handed a single step's output, not the merged one{note}")
    if note:
        return Finding("broken", f"each ring step's backward sees that step's K/V, but{note}")
    return Finding("ok", "each ring step's backward sees that step's K/V and the merged output")


def build(lookup: Lookup) -> Mapping[str, Any]:
    return {FORWARD: staticmethod(ring_attention_forward), BACKWARD: staticmethod(ring_attention_backward)}


FIX = Fix(
    id=FIX_ID,
    title="ring/unified context parallelism's backward reuses the first ring step's tensors",
    upstream="https://github.com/huggingface/diffusers/pull/14274",
    affected=">=0.36.0,<0.40.0",
    targets=(FORWARD, BACKWARD),
    check=check,
    build=build,
)
