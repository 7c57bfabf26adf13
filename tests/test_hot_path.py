"""The installed cuDNN ops run few of the package's Python functions per call (issue #20's budget).

One forward call of the installed cuDNN forward op on diffusers 0.39.0 (every policy of the target in it) runs at
most 10 of the package's functions without a mask and 14 with a bool mask; one backward call at most 6. Counted
with ``sys.setprofile``: every Python call whose code lives under ``diffusers_cudnn_fix/``, in process, on the
CPU stand-in kernels, after a warm-up call (the once-per-process notices are not the hot path).
"""

from __future__ import annotations

import sys
import types
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

PACKAGE_DIR = str(Path(__file__).resolve().parents[1] / "diffusers_cudnn_fix") + "/"
FORWARD_BUDGET, MASKED_FORWARD_BUDGET, BACKWARD_BUDGET = 10, 14, 6


def _counted(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, Counter[str]]:
    calls: Counter[str] = Counter()

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE_DIR):
            calls[frame.f_code.co_qualname] += 1

    sys.setprofile(profile)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return result, calls


@pytest.mark.filterwarnings("ignore::diffusers_cudnn_fix.MaskConvertedWarning")
@pytest.mark.parametrize("mask", [None, "bool"], ids=["no mask", "bool mask"])
def test_one_cudnn_call_runs_few_package_functions(patched: types.ModuleType, mask: str | None) -> None:
    import torch

    import diffusers_cudnn_fix

    assert diffusers_cudnn_fix.is_patched("_cudnn_attention_forward_op")
    forward, backward = patched._cudnn_attention_forward_op, patched._cudnn_attention_backward_op
    ctx = types.SimpleNamespace(needs_input_grad=(True,) * 12)
    ctx.save_for_backward = lambda *t: setattr(ctx, "saved_tensors", t)
    q, k, v, grad = (torch.randn(2, 16, 4, 32).to(torch.bfloat16) for _ in range(4))
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.ones(2, 1, 16, 16, dtype=torch.bool)
        attn_mask[1, ..., -4:] = False
    args = (ctx, q, k, v, attn_mask, 0.0, False, None, False, False)
    kwargs = {"_save_ctx": True, "_parallel_config": None}
    with torch.no_grad():
        forward(*args, **kwargs)  # warm-up: the mask notice, once per process
        _, forward_calls = _counted(forward, *args, **kwargs)
        _, backward_calls = _counted(backward, ctx, grad)
    budget = MASKED_FORWARD_BUDGET if mask else FORWARD_BUDGET
    assert sum(forward_calls.values()) <= budget, forward_calls
    assert sum(backward_calls.values()) <= BACKWARD_BUDGET, backward_calls
