"""Property-based search (hypothesis) over diffusers' context-parallel attention, on the CPU stand-in kernels.

Run in a fresh interpreter, one diffusers release first on the path (``tests/test_properties.py`` does it
through ``releases.run``)::

    python -c "import subprocess_property_search as s; s.main('package')"   # with diffusers_cudnn_fix
    python -c "import subprocess_property_search as s; s.main('none')"      # diffusers as shipped

The property, for every example the search draws: diffusers' attention either gives the right answer
(output, log-sum-exp when asked for, the gradients of q/k/v and of a mask that requires grad, all against a
float32 reference) or raises a *clear* error. A silent wrong result fails, and so does an error that does
not name its cause. Each kind of failure is shrunk on its own and printed, with the shrunk example, in the
JSON line this script prints last.

What is searched (``examples``):

* paths: diffusers' op pair (``_cudnn_attention_forward_op``/``_backward_op``, and the native-flash pair
  where the release has it) inside an ``autograd.Function`` as ``TemplatedUlyssesAttention`` drives it
  (inputs detached, context-parallel config of world size 2); diffusers' own ``TemplatedUlyssesAttention``
  and ``TemplatedRingAttention`` at world size 1 in a one-process gloo group.
* shapes: B 1-2, H == S or free S_q/S_kv (1-9), grouped K/V heads (H_kv | H_q), D 4/8/16. The Ulysses path
  draws self-attention with H_kv == H_q only: diffusers' Ulysses reshapes K/V (forward) and their gradients
  (backward) with the query's heads and sequence length on every release, so anything else fails in a
  reshape with or without this package (see subprocess_ulysses_grads.py); that is outside the package's contract.
* dtypes: q/k/v all bf16, all fp16, all fp32, or each drawn on its own (mixed).
* masks (cuDNN only: diffusers' native-flash backend raises ``attn_mask is not supported`` before the op):
  none, bool, integer (int64/int32/uint8 0/1), floating point of q's dtype or of bf16/fp16/fp32, with
  ``requires_grad``, with fully masked rows, shaped [B,1,Sq,Skv], [1,1,Sq,Skv], [B,H,Sq,Skv], [B,1,1,Skv]
  or [Sq,Skv], contiguous, expanded (stride 0) or with transposed storage.
* layouts: contiguous, slices of one fused QKV (or KV) buffer, (B,H,S,D) storage seen transposed, last-dim
  stride 2, contiguous views one element into their buffers (off 16 bytes: the stand-ins misread them as
  cuDNN does, or fail as flash does with "misaligned address"); ``grad_out`` contiguous, transposed
  storage, last-dim stride 2, or expanded (stride 0).
* ``is_causal``, ``scale``, ``return_lse``, ``enable_gqa``, ring's ``convert_to_fp32``.
* launch order: one call; the same mask object used again; the mask changed in place between two calls
  (the package caches converted masks), by an ordinary in-place op or through ``.data`` (which autograd's
  version counter does not see); two forwards before one joint backward; a second call in the other half
  dtype with the same mask; a forward-only call under ``torch.inference_mode()`` or ``torch.no_grad()``
  (its output checked) followed by a training call with the same mask; a forward-only call in inference
  mode with a mask made there (an inference tensor).

What is right: the reference is ``standin_kernels.reference_attention`` in float32 on the same (rounded)
inputs. A bool mask means what it means in ``F.scaled_dot_product_attention`` (True = attend; a fully masked
row gives 0); a float mask is added to the scores; an integer mask, if it is not refused, is read as
``mask != 0``. A value passes when its max-abs error is within
``max(5 x the error of the same attention computed eagerly (math SDPA) in the inputs' least precise dtype,
3 x the error of a right fused kernel that stores ``out`` in that dtype (``kernel_style``), 1% of its
magnitude, 1e-5)`` (PyTorch's fused-attention rule, with subprocess_op_pair_grads.py's floor); the log-sum-exp within
``1e-3 + 1% of its magnitude``, and one whose shape differs from (B, S_q, H) only by size-1 dims is compared
by value; NaN fails.

What counts as a clear error:

* ``diffusers_cudnn_fix.UnsafeAttentionError`` whose message names a cause the example really has: q/k/v
  dtypes that are not one shared float16/bfloat16 (the message says "dtype" or names one of the dtypes),
  an integer mask or a mask that requires grad (the message says "mask"), a bool or other-dtype float mask
  when ``DIFFUSERS_CUDNN_FIX_MASK=error`` ("mask").
  An ``UnsafeAttentionError`` for an example without such a cause is a failure of its own kind (a valid
  input refused).
* ``ValueError`` from diffusers naming ``enable_gqa``/GQA when ``enable_gqa=True`` was passed; with
  ``enable_gqa=True`` it is the only clear error (diffusers refuses it itself, so its error must come before
  any of the package's, issue #29).
* the flash kernel's own errors, which the real kernel raises too: "FlashAttention only support fp16 and
  bf16 data type" for a non-half dtype, and the stand-in's "must have the same dtype" for mixed dtypes
  (the real flash kernel checks that). The same mixed-dtype error from the *cuDNN* stand-in does not count:
  the real cuDNN op checks no dtype (docs/behaviour.md), so on a GPU that input gives garbage.

Everything else (a stand-in error such as the cuDNN head-count message raised because K/V arrive
transposed, a reshape error, a missing log-sum-exp) is an unclear error and fails.

Environment: ``HYPOTHESIS_PROFILE`` = ``ci`` (default: derandomized, bounded, no database) or ``thorough``;
``PROPERTY_MAX_EXAMPLES`` overrides the number of examples; ``PROPERTY_SHRINK=0`` reports the first
failures found without shrinking them; ``PROPERTY_ONLY_VALID=1`` (a debugging aid) draws only inputs the
contract says must give a result (one half dtype, no integer mask, no mask requiring grad, no enable_gqa);
``PROPERTY_EXCLUDE="sequence=mutate_mask_untracked;mask_requires_grad=true"`` (a debugging aid) leaves out
examples with those values, to look past a known failure; ``PROPERTY_TRACE=FILE`` appends each example to
FILE before running it (to find the example a crashing process died in).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
import types
import warnings
from collections import Counter
from typing import Any

from harness import op_pair, pair_config, ring_attention, ulysses_attention, ulysses_config

BACKENDS = {
    "cudnn": ("_cudnn_attention_forward_op", "_cudnn_attention_backward_op"),
    "flash": ("_native_flash_attention_forward_op", "_native_flash_attention_backward_op"),
}
PATHS = ("pair", "ulysses", "ring")
HALF = ("bfloat16", "float16")
PROFILES = {
    # name: hypothesis settings on top of the common ones in search() (registered as profiles of these names)
    # bounded, the same examples every run. 400: every verdict the search reaches with 800 examples it reaches
    # by 200 (0.36.0, 0.39.0, 0.42.1), and by 300 every value of every drawn field but 10 of the 27 mixed-dtype
    # triples (0.39.0, PROPERTY_TRACE); the control finds a silent wrong result within its first 30 examples.
    # "thorough" is the deep search.
    "ci": {"max_examples": 400, "derandomize": True, "print_blob": False},
    "thorough": {"max_examples": 1500, "derandomize": False, "print_blob": True},  # a new seed each run
    # .ci/run's torch legs (the oldest and newest torch): the same examples every run, a fraction of "ci"'s.
    "short": {"max_examples": 150, "derandomize": True, "print_blob": False},
}

KINDS = ("SILENT WRONG RESULT", "UNCLEAR ERROR", "VALID INPUT REFUSED")
FLASH_DTYPE_TEXT = "FlashAttention only support fp16 and bf16 data type"
SAME_DTYPE_TEXT = "must have the same dtype"
#: The cuDNN backward's refusal of S_q = S_kv = 1 (the real kernel's, mirrored by the stand-in).
SINGLE_POSITION_TEXT = "s_q = s_kv = 1 is not supported"


# --------------------------------------------------------------------------------------------------
# The search space
# --------------------------------------------------------------------------------------------------
def examples(backends: tuple[str, ...]) -> Any:
    """A hypothesis strategy of examples: plain JSON-able dicts (so a shrunk one prints readably).

    Choices are ordered so that shrinking heads for the plainest case (first element, False, small ints),
    and weighted (repeated entries) so that most examples are valid inputs whose results get checked.
    """
    from hypothesis import strategies as st

    @st.composite
    def draw_example(draw: Any) -> dict[str, Any]:
        ex: dict[str, Any] = {}
        ex["path"] = path = draw(st.sampled_from(("pair", "pair", "ulysses", "ulysses", "ring")))
        ex["backend"] = backend = draw(st.sampled_from(backends))
        ex["batch"] = draw(st.integers(1, 2))
        heads = draw(st.sampled_from((2, 4, 1, 3, 6)))
        ex["heads"] = heads
        grouped = path != "ulysses" and heads > 1 and draw(st.booleans())
        groups = draw(st.sampled_from([g for g in range(2, heads + 1) if heads % g == 0])) if grouped else 1
        ex["heads_kv"] = heads // groups
        if draw(st.sampled_from(("heads_eq_seq", "free", "free"))) == "heads_eq_seq":
            ex["seq_q"] = ex["seq_kv"] = heads
        else:
            ex["seq_q"] = draw(st.integers(1, 9))
            ex["seq_kv"] = ex["seq_q"] if path == "ulysses" or draw(st.booleans()) else draw(st.integers(1, 9))
        ex["dim"] = draw(st.sampled_from((8, 4, 16)))

        kind = draw(st.sampled_from(("half",) * 6 + ("fp32", "mixed")))
        if kind == "half":
            ex["dtypes"] = [draw(st.sampled_from(HALF))] * 3
        elif kind == "fp32":
            ex["dtypes"] = ["float32"] * 3
        else:
            ex["dtypes"] = [draw(st.sampled_from(("bfloat16", "float16", "float32"))) for _ in range(3)]

        mask = (
            "none" if backend == "flash" else draw(st.sampled_from(("none", "bool", "bool", "float", "float", "int")))
        )
        ex["mask"] = mask
        if mask != "none":
            ex["mask_shape"] = draw(st.sampled_from(("b1qk", "11qk", "bhqk", "b11k", "qk")))
            ex["mask_layout"] = draw(st.sampled_from(("contiguous", "expanded", "transposed")))
            ex["mask_dead_rows"] = draw(st.booleans())
            if mask == "float":
                ex["mask_dtype"] = draw(st.sampled_from(("same", "same", "bfloat16", "float16", "float32")))
                ex["mask_requires_grad"] = draw(st.sampled_from((False, False, False, True)))
            elif mask == "int":
                ex["mask_dtype"] = draw(st.sampled_from(("int64", "int32", "uint8")))

        ex["layout"] = draw(st.sampled_from(("contiguous", "fused", "transposed", "strided_d", "misaligned")))
        ex["grad_layout"] = draw(st.sampled_from(("contiguous", "transposed", "strided_d", "expanded")))
        ex["is_causal"] = draw(st.booleans())
        ex["scale"] = draw(st.sampled_from((None, 0.5, 1.0, 0.125, 2.0)))
        ex["return_lse"] = draw(st.booleans())
        ex["enable_gqa"] = draw(st.sampled_from((False,) * 15 + (True,)))
        if path == "ring":
            ex["convert_to_fp32"] = draw(st.sampled_from((True, False)))
        ex["sequence"] = draw(
            st.sampled_from(
                ("once",) * 4
                # Not "mutate_mask_untracked" (a change through .data): the conversion cache keys on the
                # version counter, which .data writes bypass (docs/behaviour.md).
                + ("repeat", "mutate_mask", "interleave", "other_dtype")
                + ("inference_then_train", "no_grad_then_train", "inference_only")
            )
        )
        ex["seed"] = draw(st.integers(0, 2**16))
        if os.environ.get("PROPERTY_ONLY_VALID") == "1":
            # Debugging aid: only inputs the contract says must give a result.
            valid = (
                ex["dtypes"][0] in HALF
                and len(set(ex["dtypes"])) == 1
                and mask != "int"
                and not ex.get("mask_requires_grad")
                and not ex["enable_gqa"]
            )
            draw(st.just(valid).filter(bool))
        excluded = [item.split("=", 1) for item in os.environ.get("PROPERTY_EXCLUDE", "").split(";") if "=" in item]
        if any(
            json.dumps(ex.get(key.strip())) in (value.strip(), json.dumps(value.strip())) for key, value in excluded
        ):
            draw(st.just(False).filter(bool))  # debugging aid: leave out a known failure to look for others
        return ex

    return draw_example()


# --------------------------------------------------------------------------------------------------
# Building the tensors of one call
# --------------------------------------------------------------------------------------------------
def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _least_precise(names: list[str]) -> Any:
    import torch

    order = ("bfloat16", "float16", "float32")
    return getattr(torch, min(names, key=order.index))


def make_qkv(ex: dict[str, Any], dtypes: list[str], seed: int) -> list[Any]:
    """q, k, v in model layout (B, S, H, D) with the example's memory layout, as leaves requiring grad."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    b, sq, skv, h, hkv, d = (ex[n] for n in ("batch", "seq_q", "seq_kv", "heads", "heads_kv", "dim"))
    dq, dk, dv = (_dtype(n) for n in dtypes)
    layout = ex["layout"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    if layout == "contiguous":
        q, k, v = randn(b, sq, h, d).to(dq), randn(b, skv, hkv, d).to(dk), randn(b, skv, hkv, d).to(dv)
    elif layout == "transposed":
        q, k, v = (
            randn(b, hh, s, d).to(t).transpose(1, 2) for hh, s, t in ((h, sq, dq), (hkv, skv, dk), (hkv, skv, dv))
        )
    elif layout == "strided_d":
        q, k, v = (randn(b, s, hh, 2 * d).to(t)[..., ::2] for hh, s, t in ((h, sq, dq), (hkv, skv, dk), (hkv, skv, dv)))
    elif layout == "fused":
        if sq == skv and dq == dk == dv:
            buf = randn(b, sq, h + 2 * hkv, d).to(dq)
            q, k, v = buf[:, :, :h], buf[:, :, h : h + hkv], buf[:, :, h + hkv :]
        else:
            q = randn(b, sq, h, d).to(dq)
            buf = randn(b, skv, 2 * hkv, d).to(dk)
            k, v = buf[:, :, :hkv], buf[:, :, hkv:]
            if dv != dk:
                v = v.to(dv)
    elif layout == "misaligned":  # contiguous views one element into their buffers: off 16 bytes
        q, k, v = (
            randn(b * s * hh * d + 1).to(t)[1:].view(b, s, hh, d)
            for hh, s, t in ((h, sq, dq), (hkv, skv, dk), (hkv, skv, dv))
        )
    else:
        raise ValueError(layout)
    return [x.detach().requires_grad_(True) for x in (q, k, v)]


def make_grad_out(ex: dict[str, Any], dtype: Any, seed: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed + 7919)
    b, sq, h, d = (ex[n] for n in ("batch", "seq_q", "heads", "dim"))
    layout = ex["grad_layout"]
    if layout == "contiguous":
        return torch.randn(b, sq, h, d, generator=gen).to(dtype)
    if layout == "transposed":
        return torch.randn(b, h, sq, d, generator=gen).to(dtype).transpose(1, 2)
    if layout == "strided_d":
        return torch.randn(b, sq, h, 2 * d, generator=gen).to(dtype)[..., ::2]
    if layout == "expanded":
        return torch.randn(b, 1, h, d, generator=gen).to(dtype).expand(b, sq, h, d)
    raise ValueError(layout)


MASK_SHAPES = {
    "b1qk": lambda b, h, q, k: (b, 1, q, k),
    "11qk": lambda b, h, q, k: (1, 1, q, k),
    "bhqk": lambda b, h, q, k: (b, h, q, k),
    "b11k": lambda b, h, q, k: (b, 1, 1, k),
    "qk": lambda b, h, q, k: (q, k),
}


def _mask_base_shape(ex: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, base shape): an ``expanded`` mask is a stride-0 view of a base with size-1 leading dims."""
    shape = MASK_SHAPES[ex["mask_shape"]](ex["batch"], ex["heads"], ex["seq_q"], ex["seq_kv"])
    if ex.get("mask_layout") == "expanded":
        return shape, tuple(1 if i < len(shape) - 1 else n for i, n in enumerate(shape))
    return shape, shape


def mask_values(ex: dict[str, Any], seed: int) -> tuple[Any, Any]:
    """(keep, additive) in the mask's base shape: keep is bool (True = attend); additive is float32 with
    -inf where keep is False and small exactly representable values (0, 0.5, -1, -3) elsewhere."""
    import torch

    gen = torch.Generator().manual_seed(seed + 104729)
    _, shape = _mask_base_shape(ex)
    keep = torch.rand(shape, generator=gen) < 0.7
    if ex.get("mask_dead_rows"):
        if ex["mask_shape"] == "b11k" and ex.get("mask_layout") != "expanded":
            keep[0] = False  # every query row of batch 0 is fully masked
        else:
            keep[..., -1, :] = False  # the last query row is fully masked (every row, for a (..,1,Skv) base)
    choices = torch.tensor([0.0, 0.5, -1.0, -3.0])
    bias = choices[torch.randint(0, 4, shape, generator=gen)]
    additive = bias.masked_fill(~keep, float("-inf"))
    return keep, additive


def _as_mask_dtype(ex: dict[str, Any], keep: Any, additive: Any, q_dtype: Any) -> Any:
    if ex["mask"] == "bool":
        return keep.clone()
    if ex["mask"] == "int":
        return keep.to(_dtype(ex["mask_dtype"]), copy=True)
    return additive.to(q_dtype if ex["mask_dtype"] == "same" else _dtype(ex["mask_dtype"]), copy=True)


def make_mask(ex: dict[str, Any], keep: Any, additive: Any, q_dtype: Any) -> tuple[Any, Any]:
    """(mask as the caller passes it to diffusers, write): ``write(keep, additive, tracked)`` changes the
    mask's contents in place, seen by autograd's version counter (``tracked``) or through ``.data`` (not)."""
    shape, _ = _mask_base_shape(ex)
    base = _as_mask_dtype(ex, keep, additive, q_dtype)
    layout = ex.get("mask_layout", "contiguous")
    if layout == "contiguous":
        mask = storage = base
    elif layout == "expanded":
        storage = base
        mask = base.expand(shape)
    elif layout == "transposed":
        storage = base.transpose(-1, -2).contiguous()
        mask = storage.transpose(-1, -2)
    else:
        raise ValueError(layout)
    if ex.get("mask_requires_grad") and not mask.is_inference():
        mask.requires_grad_(True)

    def write(new_keep: Any, new_additive: Any, tracked: bool) -> None:
        import torch

        values = _as_mask_dtype(ex, new_keep, new_additive, q_dtype)
        target = storage if tracked else storage.data
        with torch.no_grad():
            if layout == "transposed":
                target.copy_(values.transpose(-1, -2))
            else:
                target.copy_(values)

    return mask, write


def read_mask(ex: dict[str, Any], mask: Any) -> tuple[Any, Any]:
    """(keep, additive) as the reference reads the current contents of ``mask``."""
    import torch

    if mask is None:
        return None, None
    if ex["mask"] in ("bool", "int"):
        return (mask != 0).detach().clone(), None
    return None, mask.detach().to(torch.float32).clone()


# --------------------------------------------------------------------------------------------------
# The reference
# --------------------------------------------------------------------------------------------------
def reference(
    ex: dict[str, Any], leaves: list[Any], grad_out: Any, keep: Any, additive: Any, mask_grad: bool
) -> dict[str, Any]:
    """float32 reference out (B,S,H,D), lse (B,S,H), dq/dk/dv (model layout) and dmask."""
    import torch
    from standin_kernels import reference_attention

    ref = [x.detach().to(torch.float32).transpose(1, 2).requires_grad_(True) for x in leaves]
    add = None
    if additive is not None:
        add = additive.clone().requires_grad_(mask_grad)
    out = reference_attention(*ref, bool_mask=keep, additive_mask=add, is_causal=ex["is_causal"], scale=ex["scale"])
    out.backward(grad_out.to(torch.float32).transpose(1, 2))
    result = {"out": out.detach().transpose(1, 2)}
    for name, x in zip(("dq", "dk", "dv"), ref):
        result[name] = x.grad.transpose(1, 2)
    if mask_grad:
        result["dmask"] = add.grad
    result["lse"] = reference_lse(ex, ref, keep, additive)
    result["eager"] = eager_low_precision(ex, leaves, grad_out, keep, additive, mask_grad)
    result["kernel"] = kernel_style(ex, leaves, grad_out, keep, additive)
    return result


def kernel_style(ex: dict[str, Any], leaves: list[Any], grad_out: Any, keep: Any, additive: Any) -> dict[str, Any]:
    """What a right fused kernel computes: float32 math, ``out`` stored in the inputs' least precise dtype
    and the backward's ``rowsum(dO * out)`` taken from that stored ``out`` (as FlashAttention and cuDNN do).
    Its error against the float32 reference is the part of the error a right kernel cannot avoid; the
    eager low-precision yardstick does not have it (its softmax backward never reads a rounded ``out``)."""
    import torch
    from standin_kernels import _backward_fp32, _forward_fp32

    dtype = _least_precise([str(x.dtype).replace("torch.", "") for x in leaves])
    q, k, v = (x.detach().to(torch.float32).transpose(1, 2) for x in leaves)
    bias = None
    if keep is not None:
        bias = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    elif additive is not None:
        bias = additive
    shape = (q.size(0), q.size(1), q.size(2), k.size(2))
    bias = None if bias is None else torch.broadcast_to(bias, shape)
    scale = ex["scale"] if ex["scale"] is not None else 1.0 / math.sqrt(q.size(-1))
    out, lse = _forward_fp32(q, k, v, bias, ex["is_causal"], scale)
    stored = out.to(dtype).float()
    grads = _backward_fp32(grad_out.float().transpose(1, 2), q, k, v, stored, lse, bias, ex["is_causal"], scale)
    result = {"out": stored.transpose(1, 2)}
    for name, grad in zip(("dq", "dk", "dv"), grads):
        result[name] = grad.to(dtype).float().transpose(1, 2)
    return result


def eager_low_precision(
    ex: dict[str, Any], leaves: list[Any], grad_out: Any, keep: Any, additive: Any, mask_grad: bool
) -> dict[str, Any]:
    """The same attention computed eagerly in the inputs' least precise dtype (math SDPA and autograd):
    the yardstick of PyTorch's fused-attention tests. Rows that come out NaN (fully masked) are zeroed."""
    import torch

    dtype = _least_precise([str(x.dtype).replace("torch.", "") for x in leaves])
    low = [x.detach().to(dtype).transpose(1, 2).requires_grad_(True) for x in leaves]
    mask = leaf = None
    causal = torch.ones(low[0].size(2), low[1].size(2), dtype=torch.bool).tril() if ex["is_causal"] else None
    if keep is not None:
        mask = keep if causal is None else keep & causal
    elif additive is not None:
        mask = leaf = additive.to(dtype).requires_grad_(mask_grad)
        if causal is not None:
            mask = mask.masked_fill(~causal, float("-inf"))
    elif causal is not None:
        mask = causal
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            *low, attn_mask=mask, scale=ex["scale"], enable_gqa=low[1].size(1) != low[0].size(1)
        )
    out.backward(grad_out.to(dtype).transpose(1, 2))
    result = {"out": out.detach().transpose(1, 2)}
    for name, x in zip(("dq", "dk", "dv"), low):
        result[name] = x.grad.transpose(1, 2)
    if mask_grad:
        result["dmask"] = leaf.grad
    return {name: torch.nan_to_num(t.float(), nan=0.0) for name, t in result.items()}


def reference_lse(ex: dict[str, Any], ref: list[Any], keep: Any, additive: Any) -> Any:
    import torch

    q, k = (x.detach() for x in ref[:2])
    if k.size(1) != q.size(1):
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    scale = ex["scale"] if ex["scale"] is not None else 1.0 / math.sqrt(q.size(-1))
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if additive is not None:
        scores = scores + additive
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool)
    if ex["is_causal"]:
        allowed = allowed.tril()
    allowed = allowed.expand(scores.shape)
    if keep is not None:
        allowed = allowed & keep.expand(scores.shape)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.logsumexp(scores, dim=-1).transpose(1, 2)  # (B, S_q, H)


class Wrong(Exception):
    """A silent wrong result (raised by the checks, never by the code under test)."""


class HarnessError(Exception):
    """The reference or the checks themselves failed: a bug of this script, reported as such."""


def compare(ex: dict[str, Any], stage: str, got: dict[str, Any], golden: dict[str, Any], lowp: Any) -> None:
    import torch
    from standin_kernels import max_abs_error

    problems = []
    for name, value in got.items():
        want = golden[name]
        if value is None:
            problems.append(f"{name}: no value (None) where the reference has one")
            continue
        if name == "lse":
            value = value.detach()
            while value.dim() > 3 and value.size(-1) == 1:
                value = value.squeeze(-1)
            if (
                tuple(value.shape) != tuple(want.shape)
                and value.numel() == want.numel()
                and [n for n in value.shape if n != 1] == [n for n in want.shape if n != 1]
            ):
                # Differs only by size-1 dims: diffusers 0.37.x's ring forward squeezes a one-head
                # (B, S_q, 1) lse to (B, S_q) (upstream, outside the package); compare the values.
                value = value.reshape(want.shape)
            if tuple(value.shape) != tuple(want.shape):
                problems.append(f"lse: shape {tuple(value.shape)}, expected (B, S_q, H) = {tuple(want.shape)}")
                continue
            err = max_abs_error(value.float(), want)
            finite = want[torch.isfinite(want)]
            mag = float(finite.abs().max()) if finite.numel() else 0.0
            tol = 1e-3 + 0.01 * mag
        else:
            if tuple(value.shape) != tuple(want.shape):
                problems.append(f"{name}: shape {tuple(value.shape)}, expected {tuple(want.shape)}")
                continue
            err = max_abs_error(value.float(), want)
            mag = float(want.abs().max()) if want.numel() else 0.0
            eager_err = max_abs_error(golden["eager"][name], want)
            kernel = golden["kernel"].get(name)
            kernel_err = 0.0 if kernel is None else max_abs_error(kernel, want)
            tol = max(5 * eager_err, 3 * kernel_err, 0.01 * mag, 1e-5)
        if not err <= tol:  # NaN fails too
            problems.append(f"{name}: max-abs error {err:.4g} > tolerance {tol:.3g} (reference magnitude {mag:.3g})")
    if problems:
        raise Wrong(f"{stage}: " + "; ".join(problems))


# --------------------------------------------------------------------------------------------------
# Driving diffusers
# --------------------------------------------------------------------------------------------------
class Runner:
    def __init__(self, module: types.ModuleType, mesh: Any) -> None:
        self.module = module
        self.mesh = mesh

    def forward(self, ex: dict[str, Any], leaves: list[Any], mask: Any) -> tuple[Any, Any]:
        """One attention call as diffusers makes it; returns (out, lse or None)."""
        module = self.module
        fwd_name, bwd_name = BACKENDS[ex["backend"]]
        fwd, bwd = getattr(module, fwd_name), getattr(module, bwd_name)
        flags = {
            "is_causal": ex["is_causal"],
            "scale": ex["scale"],
            "enable_gqa": ex["enable_gqa"],
            "return_lse": ex["return_lse"],
        }
        if ex["path"] == "pair":
            # What TemplatedUlyssesAttention does around the ops, minus the all-to-alls (the inputs reach the op
            # as fresh tensors that do not require grad, in the caller's layout).
            pair = op_pair(fwd, bwd, **flags, keep_lse=True, parallel_config=pair_config(), inputs="detach")
            result = pair.apply(*leaves, mask)
        elif ex["path"] == "ulysses":
            config = ulysses_config(self.mesh)
            result = ulysses_attention(module, *leaves, mask, **flags, forward_op=fwd, backward_op=bwd, config=config)
        else:
            config = types.SimpleNamespace(
                context_parallel_config=types.SimpleNamespace(
                    _ring_mesh=self.mesh,
                    _ring_local_rank=0,
                    ring_degree=1,
                    ulysses_degree=1,
                    _world_size=2,
                    convert_to_fp32=ex["convert_to_fp32"],
                    ring_anything=False,
                    ulysses_anything=False,
                )
            )
            result = ring_attention(module, *leaves, mask, **flags, forward_op=fwd, backward_op=bwd, config=config)
        if ex["return_lse"]:
            return result[0], result[1]
        return result, None


def run_example(runner: Runner, ex: dict[str, Any]) -> None:
    """Runs the example's call sequence; returns if every result is right, raises ``Wrong`` if one is not,
    and lets any error of the code under test through."""
    import torch

    seed = ex["seed"]
    dtypes = list(ex["dtypes"])
    keep0, add0 = mask_values(ex, seed) if ex["mask"] != "none" else (None, None)
    mask = write = None
    if ex["mask"] != "none":
        if ex["sequence"] == "inference_only":
            with torch.inference_mode():  # an inference tensor, as a mask built inside inference code is
                mask, write = make_mask(ex, keep0, add0, _dtype(dtypes[0]))
        else:
            mask, write = make_mask(ex, keep0, add0, _dtype(dtypes[0]))
    mask_grad = bool(mask is not None and mask.requires_grad)

    def start(call: int, call_dtypes: list[str], grad_mode: Any = None) -> dict[str, Any]:
        leaves = make_qkv(ex, call_dtypes, seed + 1000 * call)
        state: dict[str, Any] = {"leaves": leaves, "lowp": _least_precise(call_dtypes)}
        state["keep"], state["additive"] = read_mask(ex, mask)
        state["grad_out"] = make_grad_out(ex, leaves[0].dtype, seed + 1000 * call)
        if grad_mode is None:
            out, lse = runner.forward(ex, leaves, mask)
        else:
            with grad_mode():  # a forward-only (inference) call
                out, lse = runner.forward(ex, leaves, mask)
        state["out"], state["lse"] = out, lse
        try:
            golden = reference(ex, leaves, state["grad_out"], state["keep"], state["additive"], mask_grad)
        except Exception as exc:
            raise HarnessError(f"the reference failed: {type(exc).__name__}: {exc}") from exc
        state["golden"] = golden
        got = {"out": out}
        if ex["return_lse"]:
            got["lse"] = lse
        compare(ex, f"call {call} forward", got, golden, state["lowp"])
        return state

    def finish(call: int, state: dict[str, Any]) -> None:
        got = {name: x.grad for name, x in zip(("dq", "dk", "dv"), state["leaves"])}
        if mask_grad:
            got["dmask"] = mask.grad
        compare(ex, f"call {call} backward", got, state["golden"], state["lowp"])

    def clear_mask_grad() -> None:
        if mask_grad:
            mask.grad = None

    sequence = ex["sequence"]
    if sequence == "interleave":
        first = start(0, dtypes)
        second = start(1, dtypes)
        torch.autograd.backward([first["out"], second["out"]], [first["grad_out"], second["grad_out"]])
        if mask_grad:
            # Both calls add into the same mask's grad: compare the sum.
            for golden in (first["golden"], first["golden"]["eager"]):
                other = second["golden"] if golden is first["golden"] else second["golden"]["eager"]
                golden["dmask"] = golden["dmask"] + other["dmask"]
            second["golden"]["dmask"] = first["golden"]["dmask"]
            second["golden"]["eager"]["dmask"] = first["golden"]["eager"]["dmask"]
        finish(0, first)
        finish(1, second)
        return

    if sequence == "inference_only":
        start(0, dtypes, torch.inference_mode)
        return

    if sequence in ("inference_then_train", "no_grad_then_train"):
        # An inference call first (its output checked), then a training call with the same mask object.
        start(0, dtypes, torch.inference_mode if sequence == "inference_then_train" else torch.no_grad)
        clear_mask_grad()
        state = start(1, dtypes)
        state["out"].backward(state["grad_out"])
        finish(1, state)
        return

    state = start(0, dtypes)
    state["out"].backward(state["grad_out"])
    finish(0, state)
    if sequence == "once":
        return
    second_dtypes = dtypes
    if sequence in ("mutate_mask", "mutate_mask_untracked") and mask is not None:
        keep1, add1 = mask_values(ex, seed + 1)
        write(keep1, add1, tracked=sequence == "mutate_mask")
    elif sequence == "other_dtype" and dtypes[0] in HALF and len(set(dtypes)) == 1:
        other = HALF[1 - HALF.index(dtypes[0])]
        second_dtypes = [other] * 3
    clear_mask_grad()
    state = start(1, second_dtypes)
    state["out"].backward(state["grad_out"])
    finish(1, state)


# --------------------------------------------------------------------------------------------------
# Which errors are clear
# --------------------------------------------------------------------------------------------------
def contract_causes(ex: dict[str, Any], version: tuple[int, ...], mask_mode: str) -> dict[str, tuple[str, ...]]:
    """The causes for which the contract lets the package raise, each with words its message must contain
    (any one of them)."""
    causes: dict[str, tuple[str, ...]] = {}
    dtypes = ex["dtypes"]
    if len(set(dtypes)) > 1 or dtypes[0] not in HALF:
        causes["dtype"] = ("dtype", *sorted(set(dtypes)))
    if ex["mask"] == "int":
        causes["integer mask"] = ("mask",)
    if ex.get("mask_requires_grad"):
        causes["mask requiring grad"] = ("mask",)
    if mask_mode == "error" and ex["mask"] in ("bool", "float"):
        q_dtype = dtypes[0]
        # The "other_dtype" sequence's second call passes the same mask with q in the other half dtype.
        if ex["mask"] == "bool" or ex["mask_dtype"] not in ("same", q_dtype) or ex["sequence"] == "other_dtype":
            causes["mask mode error"] = ("mask",)
    # Ring attention on diffusers <= 0.39 is corrected (one ring chunk here: masks and is_causal are right too).
    return causes


def classify(exc: BaseException, ex: dict[str, Any], version: tuple[int, ...], mask_mode: str) -> tuple[str, str]:
    """(verdict, label): verdict is "clear", "unclear" or "refused" (an UnsafeAttentionError without a cause
    in the contract)."""
    text = str(exc)
    name = type(exc).__name__
    package = sys.modules.get("diffusers_cudnn_fix")
    unsafe = getattr(package, "UnsafeAttentionError", None) if package is not None else None
    if unsafe is not None and isinstance(exc, unsafe):
        if ex["enable_gqa"]:
            # diffusers' ops refuse enable_gqa themselves: their ValueError must come first (issue #29).
            return "unclear", "UnsafeAttentionError where diffusers' own enable_gqa error must surface"
        causes = contract_causes(ex, version, mask_mode)
        if not causes:
            return "refused", "UnsafeAttentionError without a cause"
        lowered = text.lower()
        for cause, words in causes.items():
            if any(word.lower() in lowered for word in words):
                return "clear", f"UnsafeAttentionError ({cause})"
        return "unclear", "UnsafeAttentionError not naming the cause (" + ", ".join(causes) + ")"
    if isinstance(exc, ValueError) and ex["enable_gqa"] and ("enable_gqa" in text or "GQA" in text):
        return "clear", "ValueError (enable_gqa)"
    if isinstance(exc, RuntimeError) and ex["backend"] == "cudnn" and ex["seq_q"] == ex["seq_kv"] == 1:
        if SINGLE_POSITION_TEXT in text:
            return "clear", "RuntimeError (cuDNN: one query and one key position)"
    if isinstance(exc, RuntimeError) and ex["backend"] == "flash":
        if FLASH_DTYPE_TEXT in text and any(d not in HALF for d in ex["dtypes"]):
            return "clear", "RuntimeError (flash dtype)"
        if SAME_DTYPE_TEXT in text and len(set(ex["dtypes"])) > 1:
            return "clear", "RuntimeError (flash mixed dtypes)"
    return "unclear", f"{name}"


# --------------------------------------------------------------------------------------------------
# The property and the search
# --------------------------------------------------------------------------------------------------
def _show(ex: dict[str, Any]) -> str:
    return json.dumps(ex, sort_keys=True)


# One function per failure kind, each raising from its own line: hypothesis tells failures apart by where
# they are raised, so each kind is shrunk and reported on its own.
def fail_wrong_result(ex: dict[str, Any], detail: str) -> None:
    raise AssertionError(f"SILENT WRONG RESULT: {detail}\n  example: {_show(ex)}")


def fail_unclear_error(ex: dict[str, Any], detail: str) -> None:
    raise AssertionError(f"UNCLEAR ERROR: {detail}\n  example: {_show(ex)}")


def fail_refused_valid_input(ex: dict[str, Any], detail: str) -> None:
    raise AssertionError(f"VALID INPUT REFUSED: {detail}\n  example: {_show(ex)}")


def search(runner: Runner, backends: tuple[str, ...], version: tuple[int, ...], profile: str) -> dict[str, Any]:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.reporting import with_reporter

    # No deadline (the first call of a path pays for imports), no example database (nothing written, nothing
    # replayed from an earlier run), every health check off (the strategy filters and the examples are slow
    # on purpose), every distinct failure reported.
    common = {
        "deadline": None,
        "database": None,
        "suppress_health_check": list(HealthCheck),
        "report_multiple_bugs": True,
    }
    for name, values in PROFILES.items():
        settings.register_profile(name, **common, **values)
    chosen = settings.get_profile(profile)
    overrides: dict[str, Any] = {}
    if "PROPERTY_MAX_EXAMPLES" in os.environ:
        overrides["max_examples"] = int(os.environ["PROPERTY_MAX_EXAMPLES"])
    if os.environ.get("PROPERTY_SHRINK", "1") == "0":
        overrides["phases"] = [p for p in Phase if p not in (Phase.shrink, Phase.explain)]
    chosen = settings(chosen, **overrides)
    max_examples = chosen.max_examples
    phases = list(chosen.phases)
    mask_mode = os.environ.get("DIFFUSERS_CUDNN_FIX_MASK", "").strip().lower()
    tally: Counter = Counter()
    trace = open(os.environ["PROPERTY_TRACE"], "a") if os.environ.get("PROPERTY_TRACE") else None

    @chosen
    @given(ex=examples(backends))
    def attention_is_right_or_refused_clearly(ex: dict[str, Any]) -> None:
        tally["examples"] += 1
        if trace is not None:  # debugging aid: the example about to run, should the process die in it
            trace.write(_show(ex) + "\n")
            trace.flush()
        try:
            run_example(runner, ex)
        except Wrong as wrong:
            tally["wrong"] += 1
            fail_wrong_result(ex, str(wrong))
        except HarnessError:
            raise
        except Exception as exc:  # every error of the code under test is judged
            verdict, label = classify(exc, ex, version, mask_mode)
            tally[f"{verdict}: {label}"] += 1
            detail = f"{type(exc).__name__}: {str(exc)[:500]}"
            if verdict == "refused":
                fail_refused_valid_input(ex, detail)
            elif verdict == "unclear":
                fail_unclear_error(ex, detail)
            return
        tally["right"] += 1

    report: list[str] = []
    failures: list[dict[str, str]] = []
    with with_reporter(report.append):
        try:
            attention_is_right_or_refused_clearly()
        except BaseException as exc:  # AssertionError or an ExceptionGroup of them
            for item in getattr(exc, "exceptions", [exc]):
                text = str(item)
                kind = next((k for k in KINDS if text.startswith(k)), type(item).__name__)
                notes = "".join(f"\n  {note}" for note in getattr(item, "__notes__", ()))  # "Falsifying example: ..."
                failures.append({"kind": kind, "text": f"{type(item).__name__}: {text}{notes}"})
    return {
        "profile": profile,
        "max_examples": max_examples,
        "shrink": Phase.shrink in phases,
        "tally": dict(tally),
        "failures": failures,
        "report": report,
    }


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def main(mode: str = "package") -> None:
    """``mode``: ``package`` (import diffusers_cudnn_fix first) or ``none`` (diffusers as shipped)."""
    started = time.monotonic()
    # No writes into the checkout: hypothesis keeps a cache of source constants in its storage directory
    # even without an example database; give it a temporary one (removed below) unless one is set.
    scratch = None
    if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        scratch = tempfile.mkdtemp(prefix="hypothesis-")
        os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = scratch
    warnings.simplefilter("ignore")
    if mode == "package":
        import diffusers_cudnn_fix  # noqa: F401
    elif mode != "none":
        raise ValueError(mode)
    import torch

    torch.set_num_threads(1)
    import diffusers
    import diffusers.models.attention_dispatch as module
    import standin_kernels
    from subprocess_ulysses_grads import _init_gloo

    standin_kernels.register()
    mesh = _init_gloo()
    backends = tuple(b for b, names in BACKENDS.items() if all(hasattr(module, n) for n in names))
    profile = os.environ.get("HYPOTHESIS_PROFILE", "ci").strip().lower() or "ci"
    if profile not in PROFILES:
        raise ValueError(f"HYPOTHESIS_PROFILE={profile!r}: use one of {sorted(PROFILES)}")
    result = {
        "version": diffusers.__version__,
        "mode": mode,
        "package": getattr(sys.modules.get("diffusers_cudnn_fix"), "__file__", None),
        "backends": list(backends),
    }
    result.update(search(Runner(module, mesh), backends, _version_tuple(diffusers.__version__), profile))
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown noise


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "package")
