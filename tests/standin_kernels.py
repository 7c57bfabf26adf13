"""CPU stand-in kernels for PyTorch's cuDNN and flash SDPA ATen ops.

``aten::_scaled_dot_product_cudnn_attention`` and ``aten::_scaled_dot_product_flash_attention``
(and their ``_backward`` ops) have only CUDA (and Meta) kernels. The tests of
``diffusers_cudnn_fix`` must run diffusers' real context-parallel attention functions on a CPU-only
machine, so this module registers CPU kernels for those four ops.

The stand-ins are deliberately *faithful* rather than convenient. The bugs under test are layout and
bookkeeping bugs (K/V transposed in the backward, a log-sum-exp that was never computed, a bool mask
read as numbers), and a forgiving stand-in would hide them. So the stand-ins:

* take inputs in "kernel layout" ``(B, H, S, D)``, accept any strides except a last-dim stride other
  than 1 (cuDNN's own requirement), and compute correctly on strided views;
* check head counts the way cuDNN does, so a ``(B, S, H, D)`` tensor passed as ``(B, H, S, D)`` with
  ``H != S`` raises the real "group-query attention" error, and with ``H == S`` silently gives
  wrong gradients, exactly like the GPU;
* compute the backward from the log-sum-exp and ``out`` they are *given* (not recomputed), so a
  missing or stale log-sum-exp is exposed;
* reproduce the real ops' silent misbehaviours (documented one by one below): fp32 inputs give
  garbage, a bool or wrongly typed ``attn_bias`` is misread, a ``grad_out`` whose strides differ from
  ``out``'s gives wrong gradients, a fully masked query row with one key/value position gets wrong
  gradients from the backward. Two of these can be turned into errors with
  :func:`strict_dtype` and :func:`strict_grad_out_strides`.

Public API: :func:`register`, :func:`is_registered`, :func:`strict_dtype`,
:func:`strict_grad_out_strides`, :func:`lse_is_4d`, :data:`LSE_IS_4D`, :func:`reference_attention`,
:func:`max_abs_error`.

Facts mirrored here come from ``docs/kernel-facts.md`` (measured on an H200) and from
torch's own meta kernels (``torch/_meta_registrations.py``), which describe the output metadata of
the CUDA kernels.
"""

from __future__ import annotations

import math
import re
import sys
import threading
import types

import torch

__all__ = [
    "LSE_IS_4D",
    "is_registered",
    "lse_is_4d",
    "max_abs_error",
    "reference_attention",
    "register",
    "strict_dtype",
    "strict_grad_out_strides",
]

OP_NAMES: tuple[str, ...] = (
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
)

# The real error texts, copied so that code matching on them (and tests) behaves as on the GPU.
CUDNN_GQA_MESSAGE = (
    "cuDNN Frontend error: For group-query attention, number of heads for key and query must be a "
    "factor of number of heads for query"
)
FLASH_GQA_MESSAGE = "Number of heads in key/value must divide number of heads in query"
FLASH_DTYPE_MESSAGE = "FlashAttention only support fp16 and bf16 data type"
STATS_DIM_MESSAGE = "cuDNN Frontend error: Stats dim is invalid"
# The cuDNN backward refuses one query and one key position (measured on an H200, cuDNN 9.19; the forward runs).
SINGLE_POSITION_MESSAGE = "cuDNN Frontend error: s_q = s_kv = 1 is not supported."
MISSING_LSE_MESSAGE = "stand-in: logsumexp is missing (the forward was run with compute_log_sumexp=False)"

_HALF_DTYPES = (torch.float16, torch.bfloat16)
# Flash-style kernels evaluate the softmax as exp2(s * log2(e) - max). A score below
# -finfo(float32).max / log2(e) (about -2.36e38) overflows to -inf there and the key counts as masked.
# That is why an additive mask of finfo(bf16).min (-3.39e38) gives a fully masked row 0 on the H200
# while -65504 does not (docs/kernel-facts.md); the stand-ins reproduce it (see _apply_exp2_overflow).
_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------------
# Version-dependent log-sum-exp layout
# --------------------------------------------------------------------------------------------------
def lse_is_4d(version: str | None = None) -> bool:
    """Whether the cuDNN SDPA ops use a 4-D ``(B, H, S_q, 1)`` log-sum-exp for torch ``version``.

    torch 2.9 changed the cuDNN log-sum-exp from ``(B, H, S_q)`` to ``(B, H, S_q, 1)`` and the
    backward started rejecting the 3-D form ("Stats dim is invalid"). ``version`` defaults to the
    running ``torch.__version__``; local tags such as ``+cpu`` or ``a0`` are ignored.
    """
    return _torch_at_least((2, 9), version)


def _torch_at_least(release: tuple[int, int], version: str | None = None) -> bool:
    text = str(torch.__version__ if version is None else version)
    match = re.match(r"\s*(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(f"cannot parse a torch version from {text!r}")
    return (int(match.group(1)), int(match.group(2))) >= release


#: The cuDNN log-sum-exp layout of the running torch (``True``: ``(B, H, S_q, 1)``).
LSE_IS_4D: bool = lse_is_4d()
#: The cuDNN forward's output keeps query's memory order from torch 2.8 (``alloc_with_matching_layout``);
#: before, it is a dense (B, H, S, D) tensor (the meta kernels of 2.5 - 2.7, docs/kernel-facts.md).
CUDNN_OUT_MATCHES_QUERY: bool = _torch_at_least((2, 8))
#: The flash forward's philox state: (2,) and () uint64 tensors from torch 2.7, 0-d int64 seed and offset before.
FLASH_RNG_UINT64: bool = _torch_at_least((2, 7))


# --------------------------------------------------------------------------------------------------
# Process-global state
# --------------------------------------------------------------------------------------------------
# The dispatcher is process-global, but this file can be imported twice under different module names
# (``standin_kernels`` with pytest's prepend import mode, ``tests.standin_kernels`` once a package or
# conftest appears). If each copy kept its own Library and flags, the second register() would
# override the first copy's kernels with a warning, and a flag set through one copy would not reach
# kernels registered by the other. So the Library object and the flags live in one holder module
# stored in sys.modules, shared by every copy of this file.
_STATE_KEY = "_diffusers_cudnn_fix_tests_standin_state"


def _state() -> types.ModuleType:
    state = sys.modules.get(_STATE_KEY)
    if state is None:
        state = types.ModuleType(_STATE_KEY, "Shared state of tests/standin_kernels.py")
        state.lock = threading.Lock()
        state.library = None  # keeps the registrations alive; a collected Library deregisters
        state.strict_dtype = False
        state.strict_grad_out_strides = False
        state = sys.modules.setdefault(_STATE_KEY, state)
    return state


def strict_dtype(enabled: bool | None = None) -> bool:
    """Set (or, with no argument, read) strict dtype mode; returns the previous setting.

    Default off: float32 query/key/value given to the cuDNN stand-in give a deterministic *wrong*
    result, because the real op accepts fp32 and silently returns garbage. When on, the cuDNN
    stand-in raises ``RuntimeError`` instead. The flash stand-in always raises for fp32, as the real
    flash kernel does.
    """
    state = _state()
    previous = bool(state.strict_dtype)
    if enabled is not None:
        state.strict_dtype = bool(enabled)
    return previous


def strict_grad_out_strides(enabled: bool | None = None) -> bool:
    """Set (or, with no argument, read) strict grad_out-stride mode; returns the previous setting.

    Default off: the cuDNN backward stand-in, given a ``grad_out`` whose strides differ from
    ``out``'s, reads ``grad_out``'s memory as if it had ``out``'s layout and so returns wrong
    gradients (the real op caches its graph without dO strides in the key; see docs/kernel-facts.md).
    When on, it raises ``RuntimeError`` instead.
    """
    state = _state()
    previous = bool(state.strict_grad_out_strides)
    if enabled is not None:
        state.strict_grad_out_strides = bool(enabled)
    return previous


# --------------------------------------------------------------------------------------------------
# Checks shared by the kernels
# --------------------------------------------------------------------------------------------------
def _check_4d_last_stride(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 4:
        raise RuntimeError(f"stand-in: {name} must be 4-D (B, H, S, D), got shape {tuple(tensor.shape)}")
    # cuDNN (and flash) need unit stride in the head dimension; every other stride is free.
    if tensor.size(-1) > 1 and tensor.stride(-1) != 1:
        raise RuntimeError(
            f"stand-in: {name} must have stride 1 in its last dimension (cuDNN stride requirement), "
            f"got strides {tuple(tensor.stride())}"
        )


def _check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, flash: bool) -> None:
    """Shape, stride and head-count checks of the real kernels."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _check_4d_last_stride(name, tensor)
    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError(
            f"stand-in: query, key and value must have the same dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not (query.size(0) == key.size(0) == value.size(0)):
        raise RuntimeError(
            "stand-in: query, key and value must have the same batch size, got "
            f"{query.size(0)}, {key.size(0)}, {value.size(0)}"
        )
    if query.size(-1) != key.size(-1):
        raise RuntimeError(f"stand-in: query and key head dims differ ({query.size(-1)} vs {key.size(-1)})")
    if flash and value.size(-1) != query.size(-1):
        raise RuntimeError(
            "stand-in: FlashAttention needs query, key and value to share the head dim, got "
            f"{query.size(-1)} and {value.size(-1)}"
        )
    if key.size(2) != value.size(2):
        raise RuntimeError(f"stand-in: key and value sequence lengths differ ({key.size(2)} vs {value.size(2)})")
    # The head-count rule is what turns a (B, S, H, D) tensor passed as (B, H, S, D) into an error
    # when H != S (its "heads" are then S). The real cuDNN text is kept verbatim.
    if key.size(1) == 0 or query.size(1) % key.size(1) != 0 or key.size(1) != value.size(1):
        raise RuntimeError(FLASH_GQA_MESSAGE if flash else CUDNN_GQA_MESSAGE)


#: The GPU kernels read their operands in 16-byte vectors. An operand whose data pointer is off 16 bytes (a
#: view one element into a buffer) is misread by cuDNN, silently, and ends the flash kernel with "CUDA error:
#: misaligned address" (measured on an H200; docs/kernel-facts.md).
ALIGNMENT = 16
MISALIGNED_MESSAGE = "stand-in: CUDA error: misaligned address (the flash kernel got {name} off 16 bytes)"


def _misaligned(**tensors: torch.Tensor | None) -> list[str]:
    return [n for n, t in tensors.items() if t is not None and t.numel() > 0 and t.data_ptr() % ALIGNMENT != 0]


def _check_flash_aligned(**tensors: torch.Tensor | None) -> None:
    off = _misaligned(**tensors)
    if off:
        raise RuntimeError(MISALIGNED_MESSAGE.format(name=", ".join(off)))


def _check_dropout(dropout_p: float) -> None:
    if dropout_p > 0.0:
        raise NotImplementedError("stand-in: dropout_p > 0 is not supported by the CPU stand-ins")


def _fp32_mode_cudnn(dtype: torch.dtype) -> bool:
    """True when the cuDNN stand-in must return garbage (fp32 in non-strict mode)."""
    if dtype in _HALF_DTYPES:
        return False
    if dtype == torch.float32:
        if _state().strict_dtype:
            raise RuntimeError(
                "stand-in (strict_dtype): cuDNN SDPA supports only float16/bfloat16; the real op "
                "accepts float32 and silently returns garbage"
            )
        return True
    raise RuntimeError(f"stand-in: cuDNN SDPA does not support dtype {dtype}")


def _check_flash_dtype(dtype: torch.dtype) -> None:
    if dtype not in _HALF_DTYPES:
        raise RuntimeError(FLASH_DTYPE_MESSAGE)


def _fp32_garbage(tensor: torch.Tensor) -> torch.Tensor:
    """The deterministic wrong answer returned for fp32 inputs: ``1 - roll(x, 1, dim=2)``.

    The real cuDNN op, given fp32 tensors, returns numbers unrelated to attention. The stand-in does
    not try to reproduce those numbers; it returns a result that is reproducible (so tests are
    stable) and differs from the right one for every realistic input (rows shifted by one along the
    sequence and reflected around 0.5).
    """
    return 1.0 - torch.roll(tensor, shifts=1, dims=2)


def _scale_of(query: torch.Tensor, scale: float | None) -> float:
    # Same default as sdp::calculate_scale.
    return float(scale) if scale is not None else 1.0 / math.sqrt(query.size(-1))


# --------------------------------------------------------------------------------------------------
# attn_bias as the real cuDNN op reads it
# --------------------------------------------------------------------------------------------------
def _read_bias(
    attn_bias: torch.Tensor | None, q_dtype: torch.dtype, shape: tuple[int, int, int, int]
) -> torch.Tensor | None:
    """``attn_bias`` as the cuDNN kernel sees it, in float32, broadcast to ``(B, H, S_q, S_kv)``.

    The real op has no dtype check on ``attn_bias`` and always treats it as an *additive* bias of
    ``q.dtype``:

    * a bool mask is added as 0/1 (True -> +1, False -> 0), so masked keys are not masked at all;
    * a floating bias of ``q.dtype`` is added as is (``-inf`` and ``finfo.min`` mask keys);
    * any other dtype (e.g. an fp32 mask with bf16 q) is *misread*: its contiguous bytes are
      reinterpreted as ``q.dtype`` and the first ``numel`` elements taken in its shape, which is
      what reading the buffer with the graph's dtype does. If the buffer is too short for that
      (narrower dtype than q), the missing bytes read as zero (the GPU would read past the end).
    """
    if attn_bias is None:
        return None
    if attn_bias.dim() not in (2, 3, 4):
        raise RuntimeError(f"cuDNN SDPA expects either a 2D, 3D, or 4D attn_bias but got {attn_bias.dim()}D")
    if attn_bias.dtype == torch.bool:
        values = attn_bias.to(torch.float32)
    elif attn_bias.dtype == q_dtype:
        values = attn_bias.to(torch.float32)
    else:
        item = torch.empty((), dtype=q_dtype).element_size()
        needed = attn_bias.numel() * item
        raw = attn_bias.contiguous().reshape(-1).view(torch.uint8)
        if raw.numel() < needed:
            raw = torch.cat([raw, raw.new_zeros(needed - raw.numel())])
        values = raw[:needed].view(q_dtype).reshape(attn_bias.shape).to(torch.float32)
    try:
        return torch.broadcast_to(values, shape)
    except RuntimeError as exc:
        raise RuntimeError(
            f"stand-in: attn_bias of shape {tuple(attn_bias.shape)} does not broadcast to {shape}"
        ) from exc


# --------------------------------------------------------------------------------------------------
# The math (float32)
# --------------------------------------------------------------------------------------------------
def _apply_exp2_overflow(scores: torch.Tensor) -> torch.Tensor:
    # See _LOG2E: scores whose exp2-domain value overflows to -inf count as masked, as on the GPU.
    return torch.where(torch.isneginf(scores * _LOG2E), float("-inf"), scores)


def _scores(
    q32: torch.Tensor,
    k32: torch.Tensor,
    bias32: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    """``q k^T * scale (+ bias)`` with the causal mask, (B, H, S_q, S_kv) float32."""
    scores = torch.matmul(q32, k32.transpose(-2, -1)) * scale
    if bias32 is not None:
        scores = scores + bias32
    if is_causal:
        # Top-left aligned, torch.tril semantics: query i sees keys 0..i.
        s_q, s_kv = scores.shape[-2:]
        keep = torch.ones(s_q, s_kv, dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return _apply_exp2_overflow(scores)


def _expand_heads(tensor: torch.Tensor, heads_q: int) -> torch.Tensor:
    # GQA: query head h uses key/value head h // (H_q / H_kv), i.e. repeat_interleave on dim 1.
    repeat = heads_q // tensor.size(1)
    return tensor if repeat == 1 else tensor.repeat_interleave(repeat, dim=1)


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(scores - lse)`` with rows whose lse is not finite (fully masked) set to 0, no NaN."""
    finite = torch.isfinite(lse).unsqueeze(-1)
    safe_lse = torch.where(finite, lse.unsqueeze(-1), torch.zeros((), dtype=lse.dtype))
    return torch.where(finite, torch.exp(scores - safe_lse), torch.zeros((), dtype=scores.dtype))


def _forward_fp32(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias32: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output (B, H, S_q, D_v) and log-sum-exp (B, H, S_q), both float32."""
    heads = query.size(1)
    q32 = query.to(torch.float32)
    k32 = _expand_heads(key.to(torch.float32), heads)
    v32 = _expand_heads(value.to(torch.float32), heads)
    scores = _scores(q32, k32, bias32, is_causal, scale)
    lse = torch.logsumexp(scores, dim=-1)  # -inf for a fully masked row
    out = torch.matmul(_probabilities(scores, lse), v32)  # fully masked row -> 0, like cuDNN
    return out, lse


def _backward_fp32(
    grad_out32: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out32: torch.Tensor,
    lse32: torch.Tensor,
    bias32: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2 style backward from the *given* ``out`` and log-sum-exp, float32.

    P = exp(S - lse); dV = P^T dO; dP = dO V^T; Delta = rowsum(dO * out); dS = P (dP - Delta);
    dQ = dS K scale; dK = dS^T Q scale. Using the given ``out`` and ``lse`` (rather than recomputing
    them) is what makes a stale or undefined log-sum-exp visible, as on the GPU.
    """
    batch, heads_q = query.shape[:2]
    heads_kv = key.size(1)
    q32 = query.to(torch.float32)
    k32 = _expand_heads(key.to(torch.float32), heads_q)
    v32 = _expand_heads(value.to(torch.float32), heads_q)
    scores = _scores(q32, k32, bias32, is_causal, scale)
    probs = _probabilities(scores, lse32)
    grad_v = torch.matmul(probs.transpose(-2, -1), grad_out32)
    grad_p = torch.matmul(grad_out32, v32.transpose(-2, -1))
    delta = (grad_out32 * out32).sum(dim=-1, keepdim=True)
    grad_s = probs * (grad_p - delta)
    grad_q = torch.matmul(grad_s, k32) * scale
    grad_k = torch.matmul(grad_s.transpose(-2, -1), q32) * scale
    if heads_kv != heads_q:
        # Sum the gradients of the query heads that shared one key/value head.
        repeat = heads_q // heads_kv
        grad_k = grad_k.reshape(batch, heads_kv, repeat, *grad_k.shape[2:]).sum(dim=2)
        grad_v = grad_v.reshape(batch, heads_kv, repeat, *grad_v.shape[2:]).sum(dim=2)
    return grad_q, grad_k, grad_v


# --------------------------------------------------------------------------------------------------
# Output allocation, as the real kernels do it
# --------------------------------------------------------------------------------------------------
def _dense_strides_in_order(shape: tuple[int, ...], like_strides: tuple[int, ...]) -> list[int]:
    """Dense strides for ``shape`` whose dimension order follows ``like_strides`` (largest first)."""
    order = sorted(range(len(shape)), key=lambda idx: like_strides[idx], reverse=True)
    strides = [0] * len(shape)
    running = 1
    for idx in reversed(order):
        strides[idx] = running
        running *= shape[idx]
    return strides


def _alloc_with_matching_layout(query: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """Mirror of torch's ``alloc_with_matching_layout`` used by the cuDNN forward.

    The output keeps query's memory order: for a (B, H, S, D)-shaped transpose view of (B, S, H, D)
    memory it comes back with strides [S*H*D, D, H*D, 1], so turning it back to (B, S, H, D) is free
    (docs/kernel-facts.md). Callers that assume a contiguous output are exposed by this.
    """
    if not CUDNN_OUT_MATCHES_QUERY:
        return torch.empty(shape, dtype=query.dtype, device=query.device)
    if tuple(query.shape) == tuple(shape):
        return torch.empty_like(query)
    strides = _dense_strides_in_order(shape, tuple(query.stride()))
    return torch.empty_strided(shape, strides, dtype=query.dtype, device=query.device)


def _strides_match(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Strides of size-1 dimensions are meaningless, so they are not compared.
    return all(a.stride(i) == b.stride(i) for i in range(a.dim()) if a.size(i) > 1)


def _grad_out_as_cudnn_reads_it(grad_out: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``grad_out`` as the real cuDNN backward reads it when its strides differ from ``out``'s.

    The H200 run showed wrong gradients when dO's strides differed from those the cached graph was
    built for (the cache key ignores dO strides). The stand-in reads ``grad_out``'s memory image
    (dense, in grad_out's own dimension order) with the dense strides of ``out``'s dimension order.
    It does so on every call (the GPU only does after a matching call at the same shapes), so a fix
    must pass matching strides every time. If the two orders agree the reading is the right one.
    """
    order = sorted(range(grad_out.dim()), key=lambda idx: grad_out.stride(idx), reverse=True)
    memory = grad_out.permute(order).contiguous().reshape(-1)
    strides = _dense_strides_in_order(tuple(out.shape), tuple(out.stride()))
    return torch.as_strided(memory, tuple(out.shape), strides)


def _check_lse_present(logsumexp: torch.Tensor | None) -> torch.Tensor:
    if logsumexp is None or logsumexp.numel() == 0:
        # The real op would read an undefined buffer and return garbage without raising; for a
        # test stand-in a loud error points straight at the missing log-sum-exp.
        raise RuntimeError(MISSING_LSE_MESSAGE)
    return logsumexp


def _check_lse_shape(lse3: torch.Tensor, query: torch.Tensor) -> None:
    expected = tuple(query.shape[:3])
    if tuple(lse3.shape) != expected:
        raise RuntimeError(f"stand-in: logsumexp has shape {tuple(lse3.shape)}, expected {expected} (B, H, S_q)")


def _check_grad_out(grad_out: torch.Tensor, out: torch.Tensor, query: torch.Tensor, value: torch.Tensor) -> None:
    expected = (query.size(0), query.size(1), query.size(2), value.size(-1))
    for name, tensor in (("out", out), ("grad_out", grad_out)):
        _check_4d_last_stride(name, tensor)
        if tuple(tensor.shape) != expected:
            raise RuntimeError(f"stand-in: {name} has shape {tuple(tensor.shape)}, expected {expected}")


# --------------------------------------------------------------------------------------------------
# The four kernels. Their Python signatures must carry the schema defaults: the dispatcher drops
# arguments equal to their default before calling a Python kernel.
# --------------------------------------------------------------------------------------------------
def _cudnn_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | None,
    compute_log_sumexp: bool,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> tuple:
    """CPU kernel for ``aten::_scaled_dot_product_cudnn_attention``."""
    _check_dropout(dropout_p)
    _check_qkv(query, key, value, flash=False)
    garbage = _fp32_mode_cudnn(query.dtype) or bool(_misaligned(query=query, key=key, value=value, bias=attn_bias))
    batch, heads, s_q = query.shape[:3]
    s_kv = key.size(2)
    bias32 = _read_bias(attn_bias, query.dtype, (batch, heads, s_q, s_kv))
    out32, lse32 = _forward_fp32(query, key, value, bias32, is_causal, _scale_of(query, scale))
    if garbage:
        out32, lse32 = _fp32_garbage(out32), _fp32_garbage(lse32.unsqueeze(-1)).squeeze(-1)

    out = _alloc_with_matching_layout(query, (batch, heads, s_q, value.size(-1)))
    out.copy_(out32)
    logsumexp = None  # the real op returns an undefined tensor when not asked for the LSE
    if compute_log_sumexp:
        logsumexp = (lse32.unsqueeze(-1) if LSE_IS_4D else lse32).contiguous()
    # Remaining outputs as the meta kernel gives them: no cumulative sequence lengths, max_q/max_k
    # as ints, 0-d int64 philox seed/offset, no debug mask.
    seed = torch.empty((), dtype=torch.long)
    offset = torch.empty((), dtype=torch.long)
    return out, logsumexp, None, None, s_q, s_kv, seed, offset, None


def _single_key_masked_row_fault(
    query: torch.Tensor, key: torch.Tensor, bias32: torch.Tensor | None, lse3: torch.Tensor, scale: float
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The cuDNN backward's fault with one key/value position: (bias, log-sum-exp) as it computes with them.

    Measured on an H200 (cuDNN 9.19, bare kernels): with S_kv = 1, a query row whose only key is masked
    gets wrong dQ/dK/dV from the backward in bf16 with S_q < 8 (fp16, longer queries and every other S_kv
    are right; the forward's 0 for that row is right). Modelled as the backward treating the row as
    unmasked: its probability is 1 instead of 0. A ``grad_out`` of 0 in that row makes every gradient right
    again, on the GPU as here.
    """
    if bias32 is None or key.size(2) != 1 or query.dtype != torch.bfloat16 or query.size(2) >= 8:
        return bias32, lse3
    masked = torch.isneginf(_apply_exp2_overflow(bias32)).all(dim=-1)  # (B, H, S_q)
    if not bool(masked.any()):
        return bias32, lse3
    unmasked = bias32.masked_fill(masked.unsqueeze(-1), 0.0)
    scores = _scores(query.float(), _expand_heads(key.float(), query.size(1)), unmasked, False, scale)
    return unmasked, torch.where(masked, scores[..., 0], lse3)


def _cudnn_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor | None,
    philox_seed: torch.Tensor | None,
    philox_offset: torch.Tensor | None,
    attn_bias: torch.Tensor | None,
    cum_seq_q: torch.Tensor | None,
    cum_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU kernel for ``aten::_scaled_dot_product_cudnn_attention_backward``."""
    _check_dropout(dropout_p)
    if cum_seq_q is not None or cum_seq_k is not None:
        raise NotImplementedError("stand-in: the nested (cum_seq) cuDNN backward is not supported")
    lse = _check_lse_present(logsumexp)
    # From torch 2.9 the backward takes the stats as (B, H, S_q, 1) and cuDNN rejects other ranks.
    if lse.dim() != (4 if LSE_IS_4D else 3):
        raise RuntimeError(STATS_DIM_MESSAGE)
    _check_qkv(query, key, value, flash=False)
    _check_grad_out(grad_out, out, query, value)
    lse3 = lse.squeeze(-1) if LSE_IS_4D else lse
    _check_lse_shape(lse3, query)
    if query.size(2) == 1 and key.size(2) == 1:
        raise RuntimeError(SINGLE_POSITION_MESSAGE)
    if max_q != query.size(2) or max_k != key.size(2):
        # The real op builds its graph from max_q/max_k; a mismatch would read out of bounds.
        raise RuntimeError(
            f"stand-in: max_q/max_k ({max_q}, {max_k}) do not match the query/key sequence lengths "
            f"({query.size(2)}, {key.size(2)})"
        )
    garbage = _fp32_mode_cudnn(query.dtype) or bool(
        _misaligned(grad_out=grad_out, query=query, key=key, value=value, out=out, bias=attn_bias)
    )

    if not _strides_match(grad_out, out):
        if _state().strict_grad_out_strides:
            raise RuntimeError(
                "stand-in (strict_grad_out_strides): grad_out strides "
                f"{tuple(grad_out.stride())} differ from out strides {tuple(out.stride())}; "
                "the real cuDNN backward can return wrong gradients for this"
            )
        grad_out = _grad_out_as_cudnn_reads_it(grad_out, out)

    batch, heads, s_q = query.shape[:3]
    bias32 = _read_bias(attn_bias, query.dtype, (batch, heads, s_q, key.size(2)))
    bias32, lse3 = _single_key_masked_row_fault(query, key, bias32, lse3, _scale_of(query, scale))
    grads = _backward_fp32(
        grad_out.to(torch.float32),
        query,
        key,
        value,
        out.to(torch.float32),
        lse3.to(torch.float32),
        bias32,
        is_causal,
        _scale_of(query, scale),
    )
    if garbage:
        grads = tuple(_fp32_garbage(g) for g in grads)
    # dq/dk/dv = empty_like(query/key/value) in the real kernel (and the meta kernel): the gradients
    # keep the memory layout of the inputs.
    results = []
    for grad, like in zip(grads, (query, key, value)):
        result = torch.empty_like(like)
        result.copy_(grad)
        results.append(result)
    return results[0], results[1], results[2]


def _flash_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> tuple:
    """CPU kernel for ``aten::_scaled_dot_product_flash_attention``."""
    _check_dropout(dropout_p)
    if return_debug_mask:
        raise NotImplementedError("stand-in: return_debug_mask=True is not supported")
    _check_qkv(query, key, value, flash=True)
    _check_flash_dtype(query.dtype)
    _check_flash_aligned(query=query, key=key, value=value)
    s_q, s_kv = query.size(2), key.size(2)
    out32, lse32 = _forward_fp32(query, key, value, None, is_causal, _scale_of(query, scale))
    out = torch.empty_like(query)  # flash's output keeps query's layout (meta: empty_like(query))
    out.copy_(out32)
    # Flash's log-sum-exp is (B, H, S_q) float32 on every torch version. rng_state / unused are the
    # (2,) and () uint64 tensors of the meta kernel (0-d int64 before torch 2.7); the debug mask is an empty
    # tensor of q.dtype.
    rng_dtype = torch.uint64 if FLASH_RNG_UINT64 else torch.long
    rng_state = torch.empty((2,) if FLASH_RNG_UINT64 else (), dtype=rng_dtype)
    unused = torch.empty((), dtype=rng_dtype)
    debug_mask = torch.empty(0, dtype=query.dtype)
    return out, lse32.contiguous(), None, None, s_q, s_kv, rng_state, unused, debug_mask


def _flash_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor | None,
    cum_seq_q: torch.Tensor | None,
    cum_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    philox_seed: torch.Tensor | None,
    philox_offset: torch.Tensor | None,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU kernel for ``aten::_scaled_dot_product_flash_attention_backward``."""
    _check_dropout(dropout_p)
    if cum_seq_q is not None or cum_seq_k is not None:
        raise NotImplementedError("stand-in: the varlen (cum_seq) flash backward is not supported")
    lse = _check_lse_present(logsumexp)
    _check_qkv(query, key, value, flash=True)
    _check_flash_dtype(query.dtype)
    _check_flash_aligned(grad_out=grad_out, query=query, key=key, value=value, out=out)
    _check_grad_out(grad_out, out, query, value)
    if lse.dim() != 3:
        raise RuntimeError(f"stand-in: flash logsumexp must be 3-D (B, H, S_q), got {lse.dim()}-D")
    _check_lse_shape(lse, query)
    # The real flash backward makes grad_out and out contiguous itself, so no stride trap here.
    grads = _backward_fp32(
        grad_out.to(torch.float32),
        query,
        key,
        value,
        out.to(torch.float32),
        lse.to(torch.float32),
        None,
        is_causal,
        _scale_of(query, scale),
    )
    results = []
    for grad, like in zip(grads, (query, key, value)):
        result = torch.empty_like(like)  # as the real kernel and the meta kernel
        result.copy_(grad)
        results.append(result)
    return results[0], results[1], results[2]


_KERNELS = {
    "_scaled_dot_product_cudnn_attention": _cudnn_forward,
    "_scaled_dot_product_cudnn_attention_backward": _cudnn_backward,
    "_scaled_dot_product_flash_attention": _flash_forward,
    "_scaled_dot_product_flash_attention_backward": _flash_backward,
}


# --------------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------------
def _has_cpu_kernel(op_name: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op_name}", "CPU")


def register() -> None:
    """Register the four CPU stand-in kernels; idempotent and process-global.

    Only the CPU dispatch key is touched, so the meta kernels (``device="meta"``, torch.compile
    tracing) and the autograd formulas stay as torch ships them: calling the forward op on CPU
    tensors that require grad routes the backward through the stand-in backward.

    Raises ``RuntimeError`` if a CPU kernel that is not ours is already registered for one of the
    ops (a future torch with real CPU kernels, or another helper): overriding it silently would test
    against the wrong thing.
    """
    state = _state()
    with state.lock:
        if state.library is not None:
            return
        foreign = [name for name in OP_NAMES if _has_cpu_kernel(name)]
        if foreign:
            raise RuntimeError(
                "stand-in: a CPU kernel is already registered for " + ", ".join(foreign) + "; refusing to override it"
            )
        library = torch.library.Library("aten", "IMPL")
        for name in OP_NAMES:
            library.impl(name, _KERNELS[name], "CPU")
        state.library = library


def is_registered() -> bool:
    """Whether :func:`register` has run in this process and the CPU kernels are in place."""
    return _state().library is not None and all(_has_cpu_kernel(name) for name in OP_NAMES)


# --------------------------------------------------------------------------------------------------
# Test helpers
# --------------------------------------------------------------------------------------------------
def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bool_mask: torch.Tensor | None = None,
    additive_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain-torch float32 attention in (B, H, S, D) layout, differentiable with autograd.

    ``bool_mask`` follows F.scaled_dot_product_attention (True = attend); ``additive_mask`` is added
    to the scores. Causal masking is top-left aligned (torch.tril). A fully masked row gives output
    0 and zero gradients, like fp32 math SDPA and cuDNN. Key/value heads that divide the query heads
    are repeated (GQA). Pass float32 leaf tensors to read their ``.grad`` after ``.backward()``.
    """
    q32, k32, v32 = q.to(torch.float32), k.to(torch.float32), v.to(torch.float32)
    heads = q32.size(1)
    if k32.size(1) != heads:
        k32 = _expand_heads(k32, heads)
        v32 = _expand_heads(v32, heads)
    scale_value = float(scale) if scale is not None else 1.0 / math.sqrt(q32.size(-1))
    scores = torch.matmul(q32, k32.transpose(-2, -1)) * scale_value
    if additive_mask is not None:
        scores = scores + additive_mask.to(torch.float32)
    keep = torch.ones(scores.shape[-2:], dtype=torch.bool)
    if is_causal:
        keep = keep.tril()
    keep = keep.expand(scores.shape)
    if bool_mask is not None:
        keep = keep & bool_mask.to(torch.bool).expand(scores.shape)
    scores = scores.masked_fill(~keep, float("-inf"))
    # Rows without any finite score would make softmax NaN (and its gradient NaN even where the
    # result is discarded), so those rows get zeros before the softmax and a zero result after.
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
    scores = torch.where(dead, torch.zeros((), dtype=scores.dtype), scores)
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(dead, torch.zeros((), dtype=probs.dtype), probs)
    return torch.matmul(probs, v32)


def max_abs_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest ``|a - b|`` in float32; ``inf`` where only one side is NaN/inf or values are NaN.

    Positions where both sides are equal (including equal infinities such as the ``-inf``
    log-sum-exp of fully masked rows) count as 0.
    """
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    a32 = a.detach().to(torch.float32)
    b32 = b.detach().to(torch.float32)
    if a32.numel() == 0:
        return 0.0
    diff = torch.where(a32 == b32, torch.zeros((), dtype=torch.float32), (a32 - b32).abs())
    diff = torch.nan_to_num(diff, nan=float("inf"))
    return float(diff.max().item())
