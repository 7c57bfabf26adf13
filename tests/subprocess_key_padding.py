"""Key-padding masks (``diffusers_cudnn_fix/_key_padding.py``): the harness the tests share, and the runs made
in fresh interpreters.

* ``tests/fixes/test_cudnn_bool_mask.py`` (CPU stand-ins) imports the helpers; its 0.42.1 case runs
  :func:`main_cases`.
* ``tests/test_gpu_key_padding.py`` runs :func:`main` per release on real cuDNN (``DCF_KEYPAD_DEVICE=cpu``: the
  same on the CPU stand-ins, to try it without a GPU).

The op pair is driven as diffusers' templated attention drives it (``ctx.backward_op`` set before the forward
op runs); the biased path is the same call with a context whose backward op cannot scatter, which the forward
must then leave alone. What reaches the kernel is read with a dispatch mode, which also counts host syncs
outside the kernels. Imports nothing beyond torch and the test helpers (the GPU machine has no hypothesis).
"""

from __future__ import annotations

import json
import os
import random
import traceback
from typing import Any

from harness import op_pair, pair_config

FORWARD = "_scaled_dot_product_cudnn_attention"
SYNC_OPS = ("_local_scalar_dense", "nonzero")
CONFIG = pair_config()
MASK_SHAPES = ("key", "rows", "heads_rows", "shared")
MASK_KINDS = ("bool", "float32", "bfloat16")
#: Seeded random cases per release in :func:`main`.
RANDOM_CASES = 60


class Seen:
    """A dispatch mode recording the cuDNN forward kernel's K length and bias, and host syncs outside kernels."""

    def __init__(self) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self
        self.kernels: list[tuple[int, tuple[int, ...] | None]] = []
        self.syncs = 0
        self.inside = False

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = func._schema.name.split("::")[-1]
                if name.startswith("_scaled_dot_product_cudnn_attention"):
                    if name == FORWARD:
                        bias = kwargs.get("attn_bias", args[3] if len(args) > 3 else None)
                        key = kwargs.get("key", args[1] if len(args) > 1 else None)
                        seen.kernels.append((key.shape[2], None if bias is None else tuple(bias.shape)))
                    seen.inside = True
                    try:
                        return func(*args, **kwargs)
                    finally:
                        seen.inside = False
                if name in SYNC_OPS and not seen.inside:
                    seen.syncs += 1
                return func(*args, **kwargs)

        self._mode = Mode()
        self._tolist = torch.Tensor.tolist

    def __enter__(self) -> Seen:
        import torch

        tolist = self._tolist

        def counting_tolist(tensor):
            if not self.inside:
                self.syncs += 1
            return tolist(tensor)

        torch.Tensor.tolist = counting_tolist
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        self._mode.__exit__(*exc)
        torch.Tensor.tolist = self._tolist


def run_pair(module, q, k, v, mask, grad_out, *, restoring: bool = True, config=CONFIG, dropout: float = 0.0):
    """out, dq, dk, dv of the installed op pair, and what the kernel saw. ``restoring``: set ``ctx.backward_op``
    to the installed backward op before the forward op runs, as diffusers' templated classes do."""
    fwd, bwd = module._cudnn_attention_forward_op, module._cudnn_attention_backward_op
    pair = op_pair(fwd, bwd, dropout=dropout, parallel_config=config, set_backward_op=restoring)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    with Seen() as seen:
        out = pair.apply(*leaves, mask)
        out.backward(grad_out)
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}, seen


def make_mask(keep_rows, shape: str, kind: str, heads: int, seq_q: int):
    """(B|1, S_kv) keep flags as a key-padding mask of ``shape`` and ``kind`` (bool, or 0/-inf additive)."""
    import torch

    batch, seq_kv = keep_rows.shape
    keep = keep_rows[:, None, None, :]
    if shape == "rows":
        keep = keep.expand(batch, 1, seq_q, seq_kv).contiguous()
    elif shape == "heads_rows":
        keep = keep.expand(batch, heads, seq_q, seq_kv).contiguous()
    elif shape == "shared":
        keep = keep[:1].contiguous()
    if kind == "bool":
        return keep
    return torch.zeros(keep.shape, dtype=getattr(torch, kind)).masked_fill_(~keep, float("-inf"))


def inputs(batch: int, seq_q: int, seq_kv: int, heads: int, dim: int, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    q, k, v, g = (
        torch.randn(batch, s, heads, dim, generator=gen).to(torch.bfloat16) for s in (seq_q, seq_kv, seq_kv, seq_q)
    )
    return q, k, v, g


def golden(q, k, v, grad_out, keep):
    """fp32 reference (out, dq, dk, dv) in model layout; ``keep`` broadcasts to (B, H, S_q, S_kv)."""
    from standin_kernels import reference_attention

    leaves = [x.float().cpu().transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v)]
    out = reference_attention(*leaves, bool_mask=keep.cpu())
    out.backward(grad_out.float().cpu().transpose(1, 2))
    return dict(zip(("out", "dq", "dk", "dv"), (t.transpose(1, 2) for t in (out.detach(), *(x.grad for x in leaves)))))


def assert_same_as_biased(fast: dict, biased: dict, ref: dict, *, ulps: int = 1) -> None:
    """Within ``ulps`` bf16 roundings of the biased path, and about as close to the fp32 reference as it is."""
    from standin_kernels import max_abs_error

    for name in ("out", "dq", "dk", "dv"):
        magnitude = float(ref[name].abs().max())
        rounding = ulps * 2**-7 * magnitude + 1e-6
        got, biased_got = fast[name].float().cpu(), biased[name].float().cpu()
        assert max_abs_error(got, biased_got) <= rounding, (name, max_abs_error(got, biased_got), magnitude)
        biased_error = max_abs_error(biased_got, ref[name])
        assert max_abs_error(got, ref[name]) <= max(2 * biased_error, rounding), name


def keep_rows_of(batch: int, seq_kv: int, lengths: list[int], *, offset: int = 0):
    """(B, S_kv): element b keeps ``lengths[b]`` keys from ``offset`` (wrapping)."""
    import torch

    keep = torch.zeros(batch, seq_kv, dtype=torch.bool)
    for b, n in enumerate(lengths):
        keep[b, [(offset + j) % seq_kv for j in range(n)]] = True
    return keep


# (name, B, S_q, S_kv, H, D, keep rows as (lengths, offset) or "qwen", mask shape, mask kind,
#  expected (K length at the kernel, bias shape or None))
CASES = (
    ("b1_suffix_padded", 1, 12, 16, 2, 16, ([14], 0), "key", "bool", (14, None)),
    ("b1_qwen_text_padded", 1, 12, 16, 2, 16, "qwen", "key", "bool", (13, None)),
    ("b1_rows_additive", 1, 12, 16, 2, 16, ([10], 3), "rows", "float32", (10, None)),
    ("b2_prefix_lengths", 2, 12, 16, 2, 16, ([9, 13], 0), "key", "bool", (13, (2, 1, 1, 13))),
    ("b3_fully_padded", 3, 12, 16, 2, 16, ([5, 0, 11], 2), "heads_rows", "bfloat16", (11, (3, 1, 1, 11))),
    ("b2_equal_counts", 2, 12, 16, 2, 16, ([8, 8], 0), "key", "bool", (8, None)),
    ("b2_shared_mask", 2, 12, 16, 2, 16, ([12], 4), "shared", "bool", (12, None)),
    ("b2_all_valid", 2, 12, 16, 2, 16, ([16, 16], 0), "key", "bool", (16, None)),
)


def case_keep_rows(batch: int, seq_kv: int, rows: Any):
    if rows == "qwen":  # QwenImage's joint sequence [text padded at its end, image]: a gap in the middle
        keep = keep_rows_of(1, seq_kv, [seq_kv])
        keep[0, 4:7] = False
        return keep
    lengths, offset = rows
    return keep_rows_of(len(lengths), seq_kv, lengths, offset=offset)


def main_cases() -> None:
    """The fixed cases on the installed diffusers (CPU stand-ins): prints one JSON object, one entry per case."""
    import warnings

    import diffusers.models.attention_dispatch as module
    import standin_kernels

    import diffusers_cudnn_fix  # noqa: F401  (patches diffusers' attention module, before or after its import)

    standin_kernels.register()
    warnings.simplefilter("ignore")
    results = {}
    for name, batch, seq_q, seq_kv, heads, dim, rows, shape, kind, expected in CASES:
        keep_rows = case_keep_rows(batch, seq_kv, rows)
        result = one_case(module, "cpu", batch, seq_q, seq_kv, heads, dim, keep_rows, shape, kind, 0, ulps=1)
        results[name] = {**result, "expected": [list(expected)]}
    print(json.dumps(results))


def one_case(
    module: Any, device, batch, seq_q, seq_kv, heads, dim, keep_rows, shape, kind, seed, *, ulps: int = 2
) -> dict[str, Any]:
    """Fast vs biased path of one case on ``device``; a dict with ``ok`` and what the kernel saw."""
    mask = make_mask(keep_rows, shape, kind, heads, seq_q).to(device)
    q, k, v, g = (x.to(device) for x in inputs(batch, seq_q, seq_kv, heads, dim, seed))
    biased, seen_biased = run_pair(module, q, k, v, mask, g, restoring=False)
    fast, seen = run_pair(module, q, k, v, mask, g)
    result: dict[str, Any] = {"kernels": seen.kernels, "biased_kernels": seen_biased.kernels, "ok": True}
    try:
        assert_same_as_biased(fast, biased, golden(q, k, v, g, mask if kind == "bool" else mask == 0), ulps=ulps)
        dropped = ~keep_rows.expand(batch, seq_kv)
        for name in ("dk", "dv"):
            assert fast[name].cpu()[dropped].eq(0).all(), f"{name} of a dropped key is not 0"
        for name, tensor in fast.items():
            assert not tensor.isnan().any(), f"NaN in {name}"
    except AssertionError as exc:
        result.update(ok=False, error=str(exc))
    return result


def main() -> None:
    """Run by ``tests/test_gpu_key_padding.py`` in a fresh interpreter: prints one JSON line. On the CPU
    stand-ins with ``DCF_KEYPAD_DEVICE=cpu`` (to try the scenario itself without a GPU)."""
    import warnings

    import diffusers.models.attention_dispatch as module
    import torch

    import diffusers_cudnn_fix  # noqa: F401  (patches diffusers' attention module, before or after its import)

    device = os.environ.get("DCF_KEYPAD_DEVICE", "cuda")
    if device == "cpu":
        import standin_kernels

        standin_kernels.register()
    warnings.simplefilter("ignore")
    results: dict[str, Any] = {"fixed": {}, "random": []}
    for name, batch, seq_q, _, heads, _, rows, shape, kind, _ in CASES:
        seq_kv = 256
        keep_rows = case_keep_rows(batch, 16, rows).repeat_interleave(16, dim=1)  # the same pattern, 16x
        try:
            size = (batch, seq_q * 16, seq_kv, heads * 2, 64)
            results["fixed"][name] = one_case(module, device, *size, keep_rows, shape, kind, 0)
        except Exception:  # a failure is a result
            results["fixed"][name] = {"ok": False, "error": traceback.format_exc()[-2000:]}
    rng = random.Random(0)
    for i in range(RANDOM_CASES):
        batch, heads, dim = rng.randint(1, 3), rng.randint(1, 4), rng.choice((64, 128))
        seq_q, seq_kv = rng.randint(1, 300), rng.randint(2, 300)
        shape, kind = rng.choice(MASK_SHAPES), rng.choice(MASK_KINDS)
        rows = 1 if shape == "shared" else batch
        keep_rows = torch.rand(rows, seq_kv, generator=torch.Generator().manual_seed(i)) < rng.random()
        if rng.random() < 0.5:  # one run of padding somewhere (QwenImage's text padding sits in the middle)
            start = rng.randint(0, seq_kv - 1)
            keep_rows[:, :] = True
            keep_rows[:, start : start + rng.randint(1, seq_kv)] = False
        if rows > 1 and rng.random() < 0.3:
            keep_rows[rng.randrange(rows)] = False  # a fully padded batch element
        spec = dict(batch=batch, seq_q=seq_q, seq_kv=seq_kv, heads=heads, dim=dim, shape=shape, kind=kind)
        try:
            result = one_case(module, device, batch, seq_q, seq_kv, heads, dim, keep_rows, shape, kind, i)
        except Exception:
            result = {"ok": False, "error": traceback.format_exc()[-2000:]}
        results["random"].append({**spec, "valid": keep_rows.sum(dim=1).tolist(), **result})
    results["fast_path_taken"] = sum(
        r["kernels"] != r["biased_kernels"] for r in [*results["fixed"].values(), *results["random"]] if "kernels" in r
    )
    print(json.dumps(results))
