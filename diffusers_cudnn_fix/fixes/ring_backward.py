"""Ring (and unified) context parallelism's backward reuses the first ring step's tensors.

Bug: the forward merges every ring step but keeps the first step's context, so every step's backward
recomputes the first step: wrong gradients for every backend. Releases 0.36.0-0.39.0 (fixed in 0.40.0, #14274).
Detection: ring degree 2 in one process: does each step's backward get that step's K and the merged output?
The package: the corrected ring (``targets/ring.py``) drives the corrected cuDNN / flash backward step by
step; other ops, and a mask, dropout, causal or GQA at degree > 1, are refused (docs/fixes.md)."""

from __future__ import annotations

from typing import Any

import torch

from .. import _detect
from .._fix import Finding, Lookup

FIX_ID = "ring_backward"
CLASS = _detect.RING_CLASS
FORWARD = f"{CLASS}.forward"
BACKWARD = f"{CLASS}.backward"


def way_out(fix_id: str) -> str:
    """The way out of a refused ring backward, naming the fix whose skip lets diffusers' own backward run."""
    return (
        "Train with Ulysses context parallelism (ContextParallelConfig(ulysses_degree=...)) for these inputs. "
        f"DIFFUSERS_CUDNN_FIX_SKIP={fix_id} lets diffusers' own ring backward run (wrong gradients)."
    )


def refusal(world: int, attn_mask: Any, dropout_p: float, is_causal: bool, enable_gqa: bool) -> str | None:
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


def unsupported_backend_message(backward_op: Any) -> str:
    name = f"{getattr(backward_op, '__module__', '?')}.{getattr(backward_op, '__qualname__', repr(backward_op))}"
    return (
        "diffusers_cudnn_fix: ring context parallelism (ring_degree > 1, also unified attention) in this diffusers "
        "computes wrong gradients: every ring step's backward reuses the first step's tensors (fixed in diffusers "
        "0.40.0, huggingface/diffusers#14274). The package corrects it for the _native_cudnn and _native_flash "
        f"backends with their corrected backward ops (fixes cudnn_backward_kv, flash_backward_kv); this call's is "
        f"{name}. Use one of those backends, Ulysses (ContextParallelConfig(ulysses_degree=...)), or diffusers >= "
        "0.40 (right with every backend at ring_degree 2, at any with these two and this package). "
        f"DIFFUSERS_CUDNN_FIX_SKIP={FIX_ID} lets diffusers' own (wrong) ring backward run."
    )


# ------------------------------------------------------------------------------------------------------------
# The behavioural check
# ------------------------------------------------------------------------------------------------------------
_BATCH, _SEQ, _HEADS, _DIM = 1, 4, 2, 8


def _mean(x: torch.Tensor) -> float:
    return float(x.float().mean())


def _drive(forward: Any, backward: Any, lse_ndim: int) -> tuple[dict[str, list[float]], float | None, str | None]:
    """Run ``forward`` then ``backward`` for ring degree 2 as rank 0, in this process.

    Our K/V are zeros and rank 1's ones (the stand-in all-gather adds 1), so a step that uses them shows it.
    The stand-in forward op saves kernel-layout tensors as the 0.36-0.39 ops do and returns a log-sum-exp of
    ``lse_ndim`` dims; each step's output differs, so the merged output differs from every step's. Returns
    what the ops saw (each tensor by its mean: the tensors are constant, so the mean names one whatever its
    layout; per forward step the K, per backward call the K and the output), the mean of the forward's output
    and the error text of a failure (None if none).
    """
    seen: dict[str, list[float]] = {"forward_keys": [], "backward_keys": [], "backward_outs": []}

    def step(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen["forward_keys"].append(_mean(k))
        return k + 2.0, (k[..., 0].clone() if lse_ndim == 3 else k[..., :1].clone())

    def backward_op(ctx: Any, grad: torch.Tensor, *a: Any, **kw: Any) -> tuple[torch.Tensor, ...]:
        saved = ctx.saved_tensors
        seen["backward_keys"].append(_mean(kw["key"] if kw.get("key") is not None else saved[1]))
        seen["backward_outs"].append(_mean(kw["out"] if kw.get("out") is not None else saved[3]))
        return torch.zeros(ctx.q_shape), torch.zeros(ctx.kv_shape), torch.zeros(ctx.kv_shape)

    try:
        result, _ = _detect.run_ring(
            forward, backward, step, backward_op, world=2, permute=lambda x, ranks, group=None: x,
            gather=lambda x, gather_dim=0, group=None: torch.cat([x, x + 1.0]), shape=(_BATCH, _SEQ, _HEADS, _DIM),
        )  # fmt: skip
        merged = _mean(result[0] if isinstance(result, tuple) else result)
    except Exception as exc:  # noqa: BLE001 - an unknown build, or the package's refusal: the caller decides
        return seen, None, f"{type(exc).__name__}: {exc}"
    return seen, merged, None


def check(lookup: Lookup) -> Finding:
    found = _detect.installed_ring(lookup)
    if isinstance(found, Finding):
        return found
    forward, backward = found
    # The cuDNN op's log-sum-exp is 4-D from torch 2.9 on, the flash op's 3-D: try the 4-D one first.
    note = ""
    seen, merged, error = _drive(forward, backward, lse_ndim=4)
    if error is not None and not seen["backward_keys"]:
        note = f" (the forward also fails on a 4-D log-sum-exp: {error})"
        seen, merged, error = _drive(forward, backward, lse_ndim=3)
    if error is not None or len(seen["backward_keys"]) != 2 or len(seen["forward_keys"]) != 2:
        return Finding(
            "unknown", f"the ring attention could not be run in one process ({error or len(seen['backward_keys'])})"
        )
    if sorted(seen["backward_keys"]) != sorted(seen["forward_keys"]):
        return Finding("broken", f"the ring steps' backward does not see each step's K/V{note}")
    if any(out != merged for out in seen["backward_outs"]):
        return Finding("broken", f"the ring steps' backward is handed a single step's output, not the merged one{note}")
    if note:
        return Finding("broken", f"each ring step's backward sees that step's K/V, but{note}")
    return Finding("ok", "each ring step's backward sees that step's K/V and the merged output")
