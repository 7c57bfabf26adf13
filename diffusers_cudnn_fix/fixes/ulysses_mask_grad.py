"""Ulysses context parallelism gives an attention mask that requires grad no gradient, without a word.

Bug: the Ulysses backward returns None for the mask, so a learnable mask keeps ``.grad`` None, for every
backend (from 0.39.0 the mask is all-gathered first, so nothing downstream can tell). Every release with the
class, 0.36.0 up to at least 0.42.1.
Detection: the mask's gradient from the backward; does the forward, or the CP entry (upstream's fix), refuse it?
The package: the Ulysses forward's replacement raises :class:`UnsafeAttentionError` for a mask that
requires grad, under ``torch.no_grad()`` too (it cannot be told apart there; docs/fixes.md).
"""

from __future__ import annotations

import types

import torch

from .. import _detect, _ledger
from .._fix import Finding, Lookup
from .._target_names import TEMPLATED_ATTENTION
from .._warnings import UnsafeAttentionError, explain
from . import ULYSSES_BACKWARD, ULYSSES_FORWARD

#: The record's id (the module is named after it: the registry finds the check so), for the policy's mark.
FIX_ID = __name__.rpartition(".")[2]

#: diffusers' context-parallel entry, which calls the Ulysses class (and every other templated class).

#: The mask's position among the forward's inputs (q, k, v, mask, ...), and so among the backward's gradients.
MASK_INPUT = 3

MESSAGE = explain("the attention mask requires grad, but diffusers' Ulysses context-parallel attention gives it none.",
                  "Its .grad would silently stay None, so the call is refused (under torch.no_grad() too).",
                  "A mask that requires grad gets no gradient here: pass attn_mask.detach(), or train it without "
                  "context parallelism.", "fixes.md#ulysses_mask_grad")  # fmt: skip


def refuse_mask_grad(attn_mask: torch.Tensor) -> None:
    """Raises for a mask that requires grad (diffusers gives it none)."""
    if _ledger.recording:
        _ledger.reached(FIX_ID)
    if attn_mask.requires_grad:
        raise UnsafeAttentionError(MESSAGE)


def check(lookup: Lookup) -> Finding:
    forward, backward = lookup(ULYSSES_FORWARD), lookup(ULYSSES_BACKWARD)
    if forward is None or backward is None:
        return Finding("absent", "this diffusers has no TemplatedUlyssesAttention")
    grads, error = _detect.run_ulysses_backward(lookup)
    if grads is None or len(grads) <= MASK_INPUT:
        return Finding("unknown", f"the Ulysses backward could not be run in one process ({error or len(grads or ())})")
    if grads[MASK_INPUT] is not None:
        return Finding("ok", "the Ulysses backward returns a gradient for the mask")
    # Does the forward (Ulysses degree 1, stand-in collectives) refuse a mask that requires grad?
    mask = torch.zeros(1, 1, 4, 4, requires_grad=True)
    reached = _detect.op_reached(lookup, ULYSSES_FORWARD, mask, degree=1)
    if isinstance(reached, str):
        if reached.startswith(UnsafeAttentionError.__name__):
            return Finding(
                "ok", "the Ulysses forward refuses a mask that requires grad, which its backward never gives"
            )
        return Finding("unknown", f"the Ulysses forward could not be run in one process ({reached})")
    # It takes one (diffusers' own forward): does the context-parallel entry that calls it refuse it?
    if _entry_refuses(lookup(TEMPLATED_ATTENTION)):
        return Finding(
            "ok", f"{TEMPLATED_ATTENTION} refuses a mask that requires grad, which the Ulysses backward never gives"
        )
    return Finding("broken", "the Ulysses backward gives the mask no gradient, and the forward takes one requiring it")


class _ReachedUlysses(Exception):
    """The context-parallel entry went on to the Ulysses class (stood in)."""


class _StandInUlysses:
    @staticmethod
    def apply(*args: object) -> None:
        raise _ReachedUlysses


def _entry_refuses(templated: object) -> bool:
    """Whether diffusers' context-parallel entry (Ulysses degree 2, grad enabled) refuses a mask that requires
    grad where the same call with the mask detached goes on to the Ulysses class; False where it cannot be run."""
    if not callable(templated) or not hasattr(templated, "__code__"):
        return False
    cp = types.SimpleNamespace(ring_degree=1, ulysses_degree=2, ring_anything=False, ulysses_anything=False)
    run = _detect.with_globals(templated, TemplatedUlyssesAttention=_StandInUlysses)
    q = torch.zeros(1, 4, 2, 4)
    mask = torch.zeros(1, 1, 4, 4, requires_grad=True)
    outcomes = []
    for attn_mask in (mask.detach(), mask):
        try:
            with torch.enable_grad():
                run(q, q, q, attn_mask, forward_op=None, backward_op=None,
                    _parallel_config=types.SimpleNamespace(context_parallel_config=cp))  # fmt: skip
            outcomes.append("returned")
        except _ReachedUlysses:
            outcomes.append("reached")
        except Exception:  # noqa: BLE001 - a refusal, or an entry this check cannot run: told apart below
            outcomes.append("raised")
    return outcomes == ["reached", "raised"]
