"""A bool (or wrongly typed) attention mask is fed raw into cuDNN's additive-bias slot.

Bug: the kernel reads the mask's memory as q's dtype: a bool mask out of bounds, an fp32 mask against bf16 q
as garbage, an integer 0/1 mask as +0/+1. Every release with the op, 0.36.0 up to at least 0.42.1 (#14342).
Detection: bool, fp32 and integer masks: what bias reaches the kernels, and what mask enters Ulysses (or, where
diffusers converts it itself, what mask its Ulysses all-gathers).
The package: :func:`mask_policy` by mode (``DIFFUSERS_CUDNN_FIX_MASK``, docs/behaviour.md), in the cuDNN
forward and where the mask enters Ulysses attention (ulysses_anything's too), before it is gathered (docs/fixes.md).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _detect, _ledger, _switches, _warnings
from .._fix import Finding, Lookup, built_of
from .._key_padding import remembered
from .._warnings import MaskConvertedWarning, MaskMisreadWarning, UnsafeAttentionError, explain
from . import CUDNN_BACKWARD, CUDNN_FORWARD, ULYSSES_ANYTHING_FORWARD, ULYSSES_FORWARD

#: The record's id (the module is named after it: the registry finds the check so), for the policy's mark.
FIX_ID = __name__.rpartition(".")[2]

ISSUE = "huggingface/diffusers#14342"
SECTION = "fixes.md#cudnn_bool_mask"


_warned: set[type[Warning]] = set()


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as an additive mask in ``dtype``; a float mask cast to ``dtype``."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


def _warn_once(category: type[_warnings.DiffusersCudnnFixWarning], message: str) -> None:
    """Warn once per process (the caller asks only while ``category`` is not in ``_warned``), filed under the
    user's frame (the first outside diffusers, torch and this package), which the logged line names too."""
    if torch.compiler.is_compiling():
        return
    # Marked only once said: where an error filter raises it, every such call raises, as Python's warnings do.
    _warnings.report(message, category, say_where=True, may_raise=True)
    _warned.add(category)


def mask_policy(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    mode: str | None = None,
    *,
    notify: bool = True,
) -> torch.Tensor | None:
    """The mask to hand the kernel, by ``mode`` (docs/behaviour.md; None: the switch's, read here), or
    :class:`UnsafeAttentionError`. Its dtype is the one the op computes in: q's, or autocast's where autocast is
    on. ``notify``: say the once-per-process notice of the mode (not where the mode is a check's own)."""
    if attn_mask is None:
        return None
    if _ledger.recording:
        _ledger.reached(FIX_ID)
    if attn_mask.requires_grad:
        raise UnsafeAttentionError(explain("the attention mask requires grad, but diffusers' context-parallel cuDNN op"
            " gives it no gradient.", "Its .grad would silently stay None, so the call is refused.",
            "Pass attn_mask.detach(), or train the mask with another backend.", SECTION))  # fmt: skip
    # The dtype the op computes in: autocast's where it is on for q's device, else q's own.
    dtype = query.dtype
    if torch.is_autocast_enabled(query.device.type) and query.is_floating_point():
        dtype = torch.get_autocast_dtype(query.device.type)
    if attn_mask.dtype == dtype:
        return attn_mask
    if not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
        raise UnsafeAttentionError(explain(f"{_reached(attn_mask)}: 0/1 keep flags or an additive bias? F.sdpa refuses"
            " it too.", "The kernel would add it as a bias, so the call is refused.",
            "Pass a bool mask (True = attend) or an additive mask of q's dtype.", SECTION))  # fmt: skip
    mode, var = mode or _switches.mask_mode(), _switches.MASK_VAR
    if mode == "error":
        raise UnsafeAttentionError(explain(
            _reached(attn_mask, dtype), "Refused in error mode: outputs and gradients would be wrong.",
            f"Set {var}=convert to convert it, or pass an additive mask of {dtype}.", SECTION))  # fmt: skip
    if mode == "convert":
        if notify and MaskConvertedWarning not in _warned:
            _warn_once(MaskConvertedWarning, explain(
                _reached(attn_mask, dtype), f"It was converted to an additive {dtype} mask (said once per process).",
                f"{var}=warn passes masks through as diffusers does, {var}=error refuses them.", SECTION))  # fmt: skip
        return remembered(additive_mask, attn_mask, dtype)
    if notify and MaskMisreadWarning not in _warned:
        _warn_once(MaskMisreadWarning, explain(
            _reached(attn_mask, dtype), f"It was passed through ({var}=warn): outputs and gradients are wrong.",
            f"Unset {var} (or set it to convert) to convert masks (said once per process).", SECTION))  # fmt: skip
    return attn_mask


def _reached(mask: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """What reached the op, and (``dtype``) how the kernel reads it: the cause in every message about ``mask``."""
    reached = f"a {mask.dtype} attention mask reached diffusers' context-parallel cuDNN op"
    return reached if dtype is None else f"{reached}, which misreads it as a {dtype} additive bias ({ISSUE})."


def _bias(trace: _detect.Trace, op: str) -> Any:
    call = trace.first(op)
    return None if call is None else call.args.get("attn_bias")


def check(lookup: Lookup) -> Finding:
    forward, backward = lookup(CUDNN_FORWARD), lookup(CUDNN_BACKWARD)
    if (problem := _detect.op_problem(forward, backward)) is not None:
        return problem
    want = _detect.check_mask("float32").to(torch.bfloat16)
    # A replacement is checked in convert mode, whatever the mode in force: that is the path which must be right.
    # It is built again for that mode (the builder's seam: no notice, the mode is the check's, not the user's). The
    # bool mask's run includes the backward, to see that it gets the very bias the forward got.
    seams = {"mask_mode": "convert"}
    converting = built_of(lookup, CUDNN_FORWARD, _detect.shipped_of(lookup, CUDNN_FORWARD), **seams)
    for kind in ("bool", "float32"):
        trace = _detect.run_pair(
            converting, backward if kind == "bool" else None, return_lse=True, mask=_detect.check_mask(kind)
        )
        if trace.first(_detect.CUDNN_FORWARD_KERNEL) is None:
            return Finding("unknown", f"with a {kind} mask the forward never reached the kernel ({trace.error})")
        fwd = _bias(trace, _detect.CUDNN_FORWARD_KERNEL)
        if not isinstance(fwd, torch.Tensor) or fwd.dtype != torch.bfloat16:
            found = getattr(fwd, "dtype", fwd)
            return Finding("broken", f"a {kind} mask reaches the cuDNN kernel's bias as {found} with bf16 q")
        if not torch.equal(fwd, want):
            return Finding("broken", f"a {kind} mask reaches the kernel converted to the wrong values")
        if kind == "bool":
            bwd = _bias(trace, _detect.CUDNN_BACKWARD_KERNEL)
            if bwd is not fwd and not (isinstance(bwd, torch.Tensor) and torch.equal(bwd, fwd)):
                return Finding("broken", "the backward kernel gets another bias than the forward")
    trace = _detect.run_pair(converting, None, return_lse=True, mask=_detect.check_mask("int64"))
    if trace.first(_detect.CUDNN_FORWARD_KERNEL) is not None:
        return Finding("broken", "an integer mask reaches the cuDNN kernel's bias")
    # Where the mask enters diffusers' Ulysses attention (the plain class, and 0.37+'s ulysses_anything one),
    # before it may be all-gathered. The Ulysses forward is built for convert mode too; it is handed the op as
    # diffusers hands it (`forward`: the one it recognises).
    shape = (_detect.BATCH, _detect.SEQ_Q, _detect.HEADS, _detect.HEAD_DIM)
    mask = torch.ones(_detect.BATCH, 1, _detect.SEQ_Q, _detect.SEQ_Q, dtype=torch.bool)
    for target, stand_ins in ((ULYSSES_FORWARD, _detect.ULYSSES_STAND_INS),
                              (ULYSSES_ANYTHING_FORWARD, _detect.ULYSSES_ANYTHING_STAND_INS)):  # fmt: skip
        ulysses, name = lookup(target), target.partition(".")[0]
        if ulysses is None:
            continue
        call = dict(degree=2, forward_op=forward, shape=shape, dtype=torch.bfloat16, ring_degree=1,
                    ulysses_anything=target == ULYSSES_ANYTHING_FORWARD)  # fmt: skip
        gathered = entering = _detect.mask_entering(lookup, target, mask, seams=seams, **call)
        if isinstance(entering, str):
            return Finding("unknown", f"{name}'s forward could not be run in one process ({entering})")
        # A bool mask may still enter a diffusers that converts it itself before its all-gather (the upstream
        # fix, upstream/cudnn_bool_mask): then what it gathers must be the additive mask. Run whole, at degree 1
        # (the check's head count is odd), with `forward` as diffusers' cuDNN op (as at run time, where the op
        # handed to Ulysses is the module's, whoever replaced it).
        if entering.dtype != torch.bfloat16:
            stand_ins = {**stand_ins, CUDNN_FORWARD: forward}
            call["degree"] = 1
            reached = _detect.op_reached(lookup, target, mask, stand_ins=stand_ins, gather=True, seams=seams, **call)
            gathered = reached if isinstance(reached, str) else reached.mask
        additive = torch.zeros_like(mask, dtype=torch.bfloat16)
        if not (isinstance(gathered, torch.Tensor) and torch.equal(gathered, additive)):
            return Finding("broken", f"a bool mask enters diffusers' {name} as {entering.dtype}, which "
                           "torch.compile all-gathers into a wrongly typed buffer")  # fmt: skip
    return Finding(
        "ok", "in convert mode, bool and float masks reach Ulysses and the kernels as additive masks in q's dtype"
    )
