"""Key-padding masks on real cuDNN (marker ``gpu``): the op on the valid keys alone against the biased path.

One fresh interpreter per release (0.39.0: the package's corrected op pair; 0.42.1: diffusers' own ops behind
the package's wrappers) runs :func:`scenario`: the fixed cases of ``tests/test_key_padding.py`` at a larger size
and seeded random cases (B 1..3, fully padded batch elements, every mask shape, bool and additive, padding in
the middle), each run with the fast path and on the biased path (a context whose backward op cannot scatter),
both against an fp32 reference; the dropped keys' dK/dV must be exactly 0. Set ``DIFFUSERS_CUDNN_FIX_RESULTS``
to keep the raw JSON (``gpu-key-padding-<version>.json``).
"""

from __future__ import annotations

import json
import os
import random
import traceback
from pathlib import Path
from typing import Any

import pytest
from releases import release_dir, run

pytestmark = pytest.mark.gpu

RELEASES = ("0.39.0", "0.42.1")
RANDOM_CASES = 60


def one_case(module: Any, device, batch, seq_q, seq_kv, heads, dim, keep_rows, shape, kind, seed) -> dict[str, Any]:
    """Fast vs biased path of one case on ``device``; a dict with ``ok`` and what the kernel saw."""
    import test_key_padding as t

    mask = t.make_mask(keep_rows, shape, kind, heads, seq_q).to(device)
    q, k, v, g = (x.to(device) for x in t.inputs(batch, seq_q, seq_kv, heads, dim, seed))
    biased, seen_biased = t.run_pair(module, q, k, v, mask, g, restoring=False)
    fast, seen = t.run_pair(module, q, k, v, mask, g)
    result: dict[str, Any] = {"kernels": seen.kernels, "biased_kernels": seen_biased.kernels, "ok": True}
    try:
        t.assert_same_as_biased(fast, biased, t.golden(q, k, v, g, mask if kind == "bool" else mask == 0), ulps=2)
        dropped = ~keep_rows.expand(batch, seq_kv)
        for name in ("dk", "dv"):
            assert fast[name].cpu()[dropped].eq(0).all(), f"{name} of a dropped key is not 0"
        for name, tensor in fast.items():
            assert not tensor.isnan().any(), f"NaN in {name}"
    except AssertionError as exc:
        result.update(ok=False, error=str(exc))
    return result


def scenario() -> None:
    """Run by :func:`test_key_padding_on_cudnn` in a fresh interpreter: prints one JSON line. On the CPU
    stand-ins with ``DCF_KEYPAD_DEVICE=cpu`` (to try the scenario itself without a GPU)."""
    import warnings

    import diffusers.models.attention_dispatch as module
    import test_key_padding as t
    import torch

    import diffusers_cudnn_fix  # noqa: F401  (patches diffusers' attention module, before or after its import)

    device = os.environ.get("DCF_KEYPAD_DEVICE", "cuda")
    if device == "cpu":
        import standin_kernels

        standin_kernels.register()
    warnings.simplefilter("ignore")
    results: dict[str, Any] = {"fixed": {}, "random": []}
    for name, batch, seq_q, _, heads, _, rows, shape, kind, _ in t.CASES:
        seq_kv = 256
        keep_rows = t.case_keep_rows(batch, 16, rows).repeat_interleave(16, dim=1)  # the same pattern, 16x
        try:
            size = (batch, seq_q * 16, seq_kv, heads * 2, 64)
            results["fixed"][name] = one_case(module, device, *size, keep_rows, shape, kind, 0)
        except Exception:  # a failure is a result
            results["fixed"][name] = {"ok": False, "error": traceback.format_exc()[-2000:]}
    rng = random.Random(0)
    for i in range(RANDOM_CASES):
        batch, heads, dim = rng.randint(1, 3), rng.randint(1, 4), rng.choice((64, 128))
        seq_q, seq_kv = rng.randint(1, 300), rng.randint(2, 300)
        shape, kind = rng.choice(t.MASK_SHAPES), rng.choice(t.MASK_KINDS)
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


@pytest.mark.parametrize("version", RELEASES)
def test_key_padding_on_cudnn(version: str) -> None:
    result = run(release_dir(version), "import test_gpu_key_padding as g; g.scenario()", timeout=300)
    result.pop("_stderr", None)
    folder = os.environ.get("DIFFUSERS_CUDNN_FIX_RESULTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, f"gpu-key-padding-{version}.json").write_text(json.dumps(result, indent=1))
    failed = {n: r for n, r in result["fixed"].items() if not r["ok"]}
    failed.update({f"random {i}": r for i, r in enumerate(result["random"]) if not r["ok"]})
    assert not failed, failed
    assert result["fast_path_taken"] >= len(result["fixed"]) - 1 + RANDOM_CASES // 4, result["fast_path_taken"]
