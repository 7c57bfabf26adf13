"""``flash_cp_ignored``: diffusers 0.36.0's ``_native_flash`` backend takes the context-parallel config and ignores
it, so a run that sets the backend after ``enable_parallelism`` (``set_attention_backend``, or the
``attention_backend()`` context manager entered later) attends to each rank's shard alone, silently. With the
package the call is refused, naming the way out; diffusers' own errors for that backend still come first.

* The check: broken on 0.36.0, ok on 0.37.0 and 0.42.1 (the backend runs context-parallel attention there).
* The policy: on 0.36.0 the call is refused; without context parallelism the backend runs as shipped.
* The control: reverted, 0.36.0's call returns each rank's shard's attention without a word.

Each release in a fresh interpreter: diffusers' own ``dispatch_attention_fn`` inside its own
``attention_backend("_native_flash")`` context manager, with diffusers' own ``ParallelConfig`` of Ulysses degree 2
(on the CPU, where F.scaled_dot_product_attention has a flash kernel).
"""

from __future__ import annotations

import pytest
from releases import release_dir, run

#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them).
# 0.36.0's _native_flash backend takes _parallel_config and never reads it (0.37.0 routes it through the
# templated context-parallel path; 0.35.2 has no context parallelism).
CARRIES = frozenset({"0.36.0"})
CORRECTION = False  # a guard: the package refuses or converts the input (True: a correction)

SCRIPT = """
import json, torch, diffusers_cudnn_fix
import diffusers.models.attention_dispatch as m
from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=2))
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, 2, 16, generator=gen).to(torch.bfloat16) for _ in range(3))
def call(parallel_config, **kwargs):
    try:
        with m.attention_backend("_native_flash"):
            return m.dispatch_attention_fn(q, k, v, parallel_config=parallel_config, attention_kwargs=kwargs)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
def said(x):
    return x if isinstance(x, str) else "returned"
found = {f.id: [f.detected, f.applied] for f in diffusers_cudnn_fix.status().fixes}.get("flash_cp_ignored")
out = {"status": found, "cp": said(call(config)), "cp_lse": said(call(config, return_lse=True))}
plain = call(None)
diffusers_cudnn_fix.revert()
out["plain_unchanged"] = torch.equal(plain, call(None))
out["reverted_cp"] = said(call(config))
out["reverted_cp_lse"] = said(call(config, return_lse=True))
print(json.dumps(out))
"""


def test_036_native_flash_under_context_parallelism_is_refused() -> None:
    result = run(release_dir("0.36.0"), SCRIPT, preloaded=True)
    # With the package: refused, naming the cause and the way out.
    assert result["cp"].startswith("UnsafeAttentionError:"), result
    # The bug, as shipped: attention of each rank's shard alone, returned without a word.
    assert result["reverted_cp"] == "returned", result
    assert result["status"] == ["broken", True], result
    assert "ignores context parallelism" in result["cp"] and "_native_cudnn" in result["cp"], result
    assert "0.37.0" in result["cp"], result
    # diffusers' own error for an input it rejects comes first, as shipped (issue #29, item 4).
    assert result["cp_lse"] == result["reverted_cp_lse"], result
    assert result["cp_lse"].startswith("ValueError:") and "return_lse" in result["cp_lse"], result
    # Without context parallelism the backend runs as shipped.
    assert result["plain_unchanged"], result


@pytest.mark.parametrize("version", ["0.37.0", "0.42.1"])
def test_later_native_flash_runs_context_parallel_attention(version: str) -> None:
    """0.37.0 on route the backend through the templated context-parallel path: nothing to refuse."""
    result = run(release_dir(version), SCRIPT, preloaded=True)
    assert result["status"] == ["ok", False], result
    assert result["cp"] == result["reverted_cp"], result
