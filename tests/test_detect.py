"""The behavioural check itself: its answers follow the op contract, and its two call catchers agree.

* ``_answer`` (what the check hands back for a watched ATen call) against the ops' meta kernels, and the
  log-sum-exp rank it assumes against the meta kernel of the torch in use.
* On every release, each run the checks make (shipped ops, replacements, guards) gives the same record on
  the fast path as under the ``TorchDispatchMode`` (``scenario_detect.py``, fresh interpreters).
* The fast path hands over to the mode where it cannot vouch for its record: code reaching the op through
  an alias the view of torch does not cover is still recorded.
"""

from __future__ import annotations

import types

import pytest
import torch
from releases import RELEASES, release_dir, run

from diffusers_cudnn_fix import _detect


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.bfloat16, device="meta")


def _layout(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), tuple(value.stride()), value.dtype
    return value


@pytest.mark.parametrize("seq_q, seq_kv, heads", [(5, 7, 3), (16, 16, 16), (12, 20, 4)])
def test_answers_match_the_meta_kernels(seq_q: int, seq_kv: int, heads: int) -> None:
    batch, dim = 2, 8
    q, k, v = _meta(batch, heads, seq_q, dim), _meta(batch, heads, seq_kv, dim), _meta(batch, heads, seq_kv, dim)
    aten = torch.ops.aten
    checks = {
        _detect.CUDNN_FORWARD: (aten._scaled_dot_product_cudnn_attention(q, k, v, None, True), (0, 1, 4, 5)),
        _detect.FLASH_FORWARD: (aten._scaled_dot_product_flash_attention(q, k, v), (0, 1, 4, 5)),
    }
    for op, (meta_out, compared) in checks.items():
        cpu = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in (("query", q), ("key", k), ("value", v))}
        answer = _detect._answer(op, {**cpu, "compute_log_sumexp": True})
        for i in compared:  # output, log-sum-exp, max_q, max_k
            assert _layout(answer[i]) == _layout(meta_out[i]), (op, i)
    grads = _detect._answer(_detect.CUDNN_BACKWARD, {"query": q, "key": k, "value": v})
    assert [_layout(g) for g in grads] == [_layout(t) for t in (q, k, v)]


def test_lse_rank_matches_the_meta_kernel_of_this_torch() -> None:
    q = _meta(1, 2, 4, 8)
    lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, True)[1]
    assert _detect.cudnn_lse_ndim() == lse.dim()


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_fast_path_records_what_the_dispatch_mode_records(version: str) -> None:
    result = run(release_dir(version), "import scenario_detect; scenario_detect.main()")
    assert not result["mismatches"], result["mismatches"][:2]
    assert result["ok"]
    if version != "0.35.2":
        # Shipped ops, replacements and guards were all compared, not just a run or two.
        assert len(result["compared"]) >= 6, result["compared"]
        assert "cudnn_bool_mask" in result["applied"]


ALIASED_OP = '''
import torch
aten = torch.ops.aten  # an alias the fast path's view of torch does not cover

def forward(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    q, k, v = (x.transpose(1, 2).contiguous() for x in (query, key, value))
    out = aten._scaled_dot_product_cudnn_attention(q, k, v, attn_mask, True, dropout_p, is_causal, False)[0]
    return out.transpose(1, 2).contiguous()
'''


def test_calls_the_view_misses_are_recorded_by_the_dispatch_mode(dispatch_module: types.ModuleType) -> None:
    # dispatch_module: the CPU stand-in kernels are registered, so the missed call does not even raise.
    namespace: dict = {}
    exec(compile(ALIASED_OP, "<aliased>", "exec"), namespace)
    forward = namespace["forward"]
    fast = _detect._run_pair(forward, None, return_lse=False, mask=None, dtype=torch.bfloat16, thorough=False)
    assert fast.first(_detect.CUDNN_FORWARD) is None  # the fast path alone is blind here
    trace = _detect._run_pair(forward, None, return_lse=False, mask=None, dtype=torch.bfloat16)
    call = trace.first(_detect.CUDNN_FORWARD)
    assert call is not None
    assert call.tensor("query").shape == _detect.kernel_shapes()["query"]


def test_the_view_leaves_the_checked_functions_untouched(dispatch_module: types.ModuleType) -> None:
    forward = dispatch_module._cudnn_attention_forward_op
    globals_before = dict(forward.__globals__)
    trace = _detect._run_pair(forward, None, return_lse=False, mask=None, dtype=torch.bfloat16, thorough=False)
    assert trace.first(_detect.CUDNN_FORWARD) is not None
    assert forward.__globals__["torch"] is torch
    assert dict(forward.__globals__) == globals_before
