"""Ulysses context parallelism gives an attention mask that requires grad no gradient, without a word.

Bug: ``TemplatedUlyssesAttention.backward`` returns None for the mask input, so a learnable mask (a bias
that requires grad) trained under Ulysses context parallelism keeps ``.grad`` None, for every attention
backend. Up to 0.38.0 the mask reaches the cuDNN op as it came, and this package's mask guard
(``cudnn_bool_mask``) refuses it there. From 0.39.0 the forward all-gathers a sequence-local mask into a
fresh tensor before the op; that tensor does not require grad, so nothing downstream can see the problem
(docs/behaviour.md).

Releases: every release with the class, 0.36.0 up to at least 0.42.1 (diffusers' context parallelism
never computes a mask gradient).

Detection: run the installed backward in one process (stand-in collectives, Ulysses degree 1) and read the
gradient it returns for the mask; then run the installed forward with a mask that needs grad and see
whether it refuses it before reaching the attention op.

Replacement: the installed forward behind a check that raises :class:`UnsafeAttentionError` when the mask
requires grad, as the op-level guard does. Inside ``autograd.Function.forward`` grad mode is always off and
``ctx.needs_input_grad`` follows ``requires_grad`` alone, so a call under ``torch.no_grad()`` cannot be told
apart: such a mask is refused there too, and the message says to detach it.

Revert: the class's original ``forward`` staticmethod is put back (the registry keeps it).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import _detect
from .._fix import Finding, Fix, Lookup
from .._warnings import UnsafeAttentionError
from .ulysses_grad_count import run_backward

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


def refusing_mask_grad(shipped: Callable[..., Any]) -> Callable[..., Any]:
    """``shipped`` (``TemplatedUlyssesAttention.forward``) that refuses a mask that requires grad."""

    @functools.wraps(shipped)  # keeps the signature, which the other Ulysses fix reads
    def forward(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad:
            raise UnsafeAttentionError(MESSAGE)
        return shipped(ctx, query, key, value, attn_mask, *args, **kwargs)

    forward.__doc__ = "diffusers' Ulysses forward, refusing a mask that requires grad (diffusers gives it none)."
    return forward


class _ReachedOp(Exception):
    """The forward handed the mask on to the attention op: it did not refuse it."""


def _forward_refuses(forward: Any) -> tuple[bool | None, str | None]:
    """Whether ``forward`` refuses a mask that requires grad (Ulysses degree 1, stand-in collectives)."""
    batch, seq, heads, dim = 1, 4, 2, 8

    def forward_op(*args: Any, **kwargs: Any) -> Any:
        raise _ReachedOp

    def all_gather(out: list[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> None:
        for part in out:
            part.copy_(tensor)

    stand_ins = {"_all_to_all_single": lambda x, group=None: x, "dist": types.SimpleNamespace(all_gather=all_gather)}
    run = _detect.with_globals(forward, **stand_ins) if isinstance(forward, types.FunctionType) else forward
    config = types.SimpleNamespace(_ulysses_mesh=_detect.FAKE_MESH, ulysses_degree=1, _world_size=2)
    parallel_config = types.SimpleNamespace(context_parallel_config=config)
    ctx = types.SimpleNamespace()
    q, k, v = (torch.zeros(batch, seq, heads, dim) for _ in range(3))
    mask = torch.zeros(batch, 1, seq, seq, requires_grad=True)
    try:
        with torch.no_grad():  # as inside autograd.Function.forward
            run(ctx, q, k, v, mask, 0.0, False, None, False, False, forward_op, None, parallel_config)
    except UnsafeAttentionError:
        return True, None
    except _ReachedOp:
        return False, None
    except Exception as exc:  # noqa: BLE001 - an unknown build: say so
        return None, f"{type(exc).__name__}: {exc}"
    return None, "the forward returned without calling the attention op"


def check(lookup: Lookup) -> Finding:
    forward, backward = lookup(TARGET), lookup(f"{CLASS}.backward")
    if forward is None or backward is None:
        return Finding("absent", "this diffusers has no TemplatedUlyssesAttention")
    grads, error = run_backward(backward)
    if grads is None or len(grads) <= MASK_INPUT:
        return Finding("unknown", f"the Ulysses backward could not be run in one process ({error or len(grads or ())})")
    if grads[MASK_INPUT] is not None:
        return Finding("ok", "the Ulysses backward returns a gradient for the mask")
    refuses, error = _forward_refuses(forward)
    if refuses is None:
        return Finding("unknown", f"the Ulysses forward could not be run in one process ({error})")
    if refuses:
        return Finding("ok", "the Ulysses forward refuses a mask that requires grad, which its backward never gives")
    return Finding("broken", "the Ulysses backward gives the mask no gradient, and the forward takes one requiring it")


def build(lookup: Lookup) -> Mapping[str, Any]:
    return {TARGET: staticmethod(refusing_mask_grad(lookup(TARGET)))}


FIX = Fix(
    id="ulysses_mask_grad",
    title="Ulysses context parallelism gives a mask that requires grad no gradient, silently",
    upstream="not reported upstream as of diffusers 0.42.1",
    affected=">=0.36.0",
    targets=(TARGET,),
    check=check,
    build=build,
    kind="guard",
)
