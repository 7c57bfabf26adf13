"""Ulysses context parallelism gives an attention mask that requires grad no gradient, without a word.

Bug: the Ulysses backward returns None for the mask, so a learnable mask keeps ``.grad`` None, for every
backend (from 0.39.0 the mask is all-gathered first, so nothing downstream can tell). Every release with the
class, 0.36.0 up to at least 0.42.1.
Detection: the mask's gradient from the backward (stand-in collectives); does the forward refuse such a mask?
The package: the Ulysses forward's replacement raises :class:`UnsafeAttentionError` for a mask that
requires grad, under ``torch.no_grad()`` too (it cannot be told apart there; docs/fixes.md).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _detect
from .._fix import Finding, Lookup, shipped_of
from .._warnings import UnsafeAttentionError

CLASS = "TemplatedUlyssesAttention"
TARGET = f"{CLASS}.forward"
#: The mask's position among the forward's inputs (q, k, v, mask, ...), and so among the backward's gradients.
MASK_INPUT = 3

MESSAGE = (
    "diffusers_cudnn_fix: the attention mask requires grad, but diffusers' Ulysses context-parallel attention "
    "gives the mask no gradient (its backward returns none for it, so the mask's .grad would silently stay "
    "None). Pass attn_mask.detach() if the mask needs no gradient, or train the mask without context "
    "parallelism."
)


def refuse_mask_grad(attn_mask: torch.Tensor) -> None:
    """Raises for a mask that requires grad (diffusers gives it none)."""
    if attn_mask.requires_grad:
        raise UnsafeAttentionError(MESSAGE)


def _forward_refuses(forward: Any, shipped: Any) -> tuple[bool | None, str | None]:
    """Whether ``forward`` refuses a mask that requires grad (Ulysses degree 1, stand-in collectives)."""
    run = _detect.with_stand_ins(forward, shipped, **_detect.ULYSSES_STAND_INS)
    try:
        _detect.call_ulysses(run, torch.zeros(1, 1, 4, 4, requires_grad=True), _detect.FAKE_MESH, degree=1)
    except UnsafeAttentionError:
        return True, None
    except _detect.ReachedOp:
        return False, None
    except Exception as exc:  # noqa: BLE001 - an unknown build: say so
        return None, f"{type(exc).__name__}: {exc}"
    return None, "the forward returned without calling the attention op"


def check(lookup: Lookup) -> Finding:
    forward, backward = lookup(TARGET), lookup(f"{CLASS}.backward")
    if forward is None or backward is None:
        return Finding("absent", "this diffusers has no TemplatedUlyssesAttention")
    grads, error = _detect.run_ulysses_backward(backward, shipped_of(lookup, f"{CLASS}.backward"))
    if grads is None or len(grads) <= MASK_INPUT:
        return Finding("unknown", f"the Ulysses backward could not be run in one process ({error or len(grads or ())})")
    if grads[MASK_INPUT] is not None:
        return Finding("ok", "the Ulysses backward returns a gradient for the mask")
    refuses, error = _forward_refuses(forward, shipped_of(lookup, TARGET))
    if refuses is None:
        return Finding("unknown", f"the Ulysses forward could not be run in one process ({error})")
    if refuses:
        return Finding("ok", "the Ulysses forward refuses a mask that requires grad, which its backward never gives")
    return Finding("broken", "the Ulysses backward gives the mask no gradient, and the forward takes one requiring it")
