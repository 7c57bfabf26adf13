"""A bool (or wrongly typed) attention mask is fed raw into cuDNN's additive-bias slot.

Bug: the context-parallel cuDNN forward op passes ``attn_mask`` straight to
``aten::_scaled_dot_product_cudnn_attention(attn_bias=...)``, which adds it to the scores without a dtype
check: a bool mask becomes +0/+1 instead of masking, and a float mask of another dtype than q (an fp32
mask with bf16 q) is read as q's dtype, i.e. garbage. H200, B=1 S=32 H=2: output error 1.94 with a bool
mask; the same mask as an additive bf16 mask: 0.0045. The backward gets the same (wrong) bias.

Releases: every release with the op, 0.36.0 up to at least 0.42.1 (upstream issue
huggingface/diffusers#14342, open as of 0.42.1).

Detection: run the installed forward and backward with a bool mask, and with an fp32 mask against bf16 q,
and read the bias reaching the kernels. A release that converts masks itself needs nothing.

Replacement: a thin wrapper around the installed forward op (the shipped one or this package's) that acts
when a mask reaches it, by mode (``DIFFUSERS_CUDNN_FIX_MASK`` or ``diffusers_cudnn_fix.set_mask_mode()``):

* ``warn`` (default): pass the mask through unchanged and warn once per process, naming #14342, the call
  site and the switch;
* ``convert``: a bool mask becomes an additive mask in q's dtype (0 where True, ``-inf`` where False; a
  fully masked row then gives 0, as with the bool mask in F.sdpa's math backend; PyTorch's own -65504
  would give that row 0.54 and NaN gradients on cuDNN), a float mask is cast to q's dtype; the backward
  reads the converted mask the forward saved;
* ``error``: raise :class:`UnsafeAttentionError`.

Revert: the object that was there before is put back (the registry keeps it).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .. import _detect
from .._config import MASK_VAR, mask_mode
from .._fix import Finding, Fix, Lookup
from .._warnings import DiffusersCudnnFixWarning, UnsafeAttentionError, logger
from ._forward_guard import guard_forward

TARGET = "_cudnn_attention_forward_op"
ISSUE = "huggingface/diffusers#14342"

_mode = "warn"  # read by the wrapper at call time; set when the fix is built and by set_mask_mode()
_warned = False


class MaskMisreadWarning(DiffusersCudnnFixWarning):
    """A bool or wrongly typed mask reached the cuDNN context-parallel op and was passed through."""


@contextlib.contextmanager
def _forced_mode(mode: str) -> Iterator[None]:
    global _mode
    saved, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = saved


def _misread(mask: torch.Tensor | None, query: torch.Tensor) -> bool:
    return mask is not None and mask.dtype != query.dtype


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as an additive mask in ``dtype``; a float mask cast to ``dtype``."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


_NOT_CALLERS = frozenset({"diffusers", "torch", "diffusers_cudnn_fix", "importlib", "contextlib", "functools"})


def _call_site() -> tuple[str, int, str]:
    """(file, line, module) of the first frame outside diffusers, torch and this package: the user's call."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.partition(".")[0] not in _NOT_CALLERS:
            return frame.f_code.co_filename, frame.f_lineno, module
        frame = frame.f_back
    return "<unknown>", 0, "<unknown>"


def _warn_once(mask: torch.Tensor, query: torch.Tensor) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    filename, lineno, module = _call_site()
    message = (
        f"diffusers_cudnn_fix: a {mask.dtype} attention mask reached diffusers' context-parallel cuDNN op, "
        f"which adds it to the scores as a {query.dtype} bias ({ISSUE}): attention outputs and gradients "
        f"are wrong. Called from {filename}:{lineno}. Set {MASK_VAR}=convert to convert masks "
        "(or =error to stop)."
    )
    logger.warning(message)
    with contextlib.suppress(Warning):  # an "error" filter must not turn the warning into a crash
        warnings.warn_explicit(message, MaskMisreadWarning, filename, lineno, module=module)


def mask_policy(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """Applies the mask mode to a bool or wrongly typed mask (see the module's docstring)."""
    if not _misread(attn_mask, query):
        return attn_mask
    if _mode == "convert":
        return additive_mask(attn_mask, query.dtype)
    if _mode == "error":
        raise UnsafeAttentionError(
            f"diffusers_cudnn_fix: a {attn_mask.dtype} attention mask reached diffusers' context-parallel "
            f"cuDNN op, which would misread it as a {query.dtype} additive bias ({ISSUE}). "
            f"Set {MASK_VAR}=convert to convert it, or pass an additive mask of q's dtype."
        )
    if not torch.compiler.is_compiling():
        _warn_once(attn_mask, query)
    return attn_mask


def _bias(trace: _detect.Trace, op: str) -> torch.Tensor | None:
    call = trace.first(op)
    return None if call is None else call.args.get("attn_bias")


def check(lookup: Lookup) -> Finding:
    forward, backward = lookup(TARGET), lookup("_cudnn_attention_backward_op")
    if forward is None or backward is None:
        return Finding("absent", "the cuDNN op pair does not exist in this diffusers")
    if not _detect.signature_matches(forward, _detect.FORWARD_PARAMS):
        return Finding("unknown", "the forward op's signature differs from every known release")
    want = _detect.check_mask("float32").to(torch.bfloat16)
    # Our own wrapper is checked in convert mode: that is the code path which must be right (the shipped
    # forward ignores the mode). The bool mask's run includes the backward, to see that the backward kernel
    # gets the very bias the forward kernel got.
    with _forced_mode("convert"):
        for kind in ("bool", "float32"):
            trace = _detect.run_pair(forward, backward if kind == "bool" else None, return_lse=True, mask=kind)
            fwd = _bias(trace, _detect.CUDNN_FORWARD)
            if trace.first(_detect.CUDNN_FORWARD) is None:
                return Finding("unknown", f"with a {kind} mask the forward never reached the kernel ({trace.error})")
            if not isinstance(fwd, torch.Tensor) or fwd.dtype != torch.bfloat16:
                found = getattr(fwd, "dtype", fwd)
                return Finding("broken", f"a {kind} mask reaches the cuDNN kernel's additive bias as {found} with bf16 q")
            if not torch.equal(fwd, want):
                return Finding("broken", f"a {kind} mask reaches the kernel converted to the wrong values")
            if kind == "bool":
                bwd = _bias(trace, _detect.CUDNN_BACKWARD)
                if bwd is not fwd and not (isinstance(bwd, torch.Tensor) and torch.equal(bwd, fwd)):
                    return Finding("broken", "the backward kernel gets another bias than the forward")
    return Finding("ok", "bool and float masks reach the cuDNN kernels as an additive mask in q's dtype")


def build(lookup: Lookup) -> Mapping[str, Any]:
    global _mode
    _mode = mask_mode()  # an unknown value in the environment was reported by mask_mode()
    return {TARGET: guard_forward(lookup(TARGET), mask_policy)}


FIX = Fix(
    id="cudnn_bool_mask",
    title="bool or wrongly typed attention masks are read as an additive bias by the cuDNN CP op",
    upstream="https://github.com/huggingface/diffusers/issues/14342",
    affected=">=0.36.0",
    targets=(TARGET,),
    check=check,
    build=build,
    kind="guard",
    note=lambda: f"mode: {_mode}",
)
