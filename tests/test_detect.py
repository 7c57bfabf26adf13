"""The behavioural check itself: its answers follow the op contract, and it sees every call.

* ``_answer`` (what the check hands back for a watched ATen call) against the ops' meta kernels, and the
  log-sum-exp rank it assumes against the meta kernel of the torch in use.
* The dispatch mode records a watched op however the code reaches it (an alias, arguments by position or
  by keyword), with the schema's defaults filled in, and leaves the checked functions untouched.
"""

from __future__ import annotations

import types

import pytest
import torch

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
        _detect.CUDNN_FORWARD_KERNEL: (aten._scaled_dot_product_cudnn_attention(q, k, v, None, True), (0, 1, 4, 5)),
        _detect.FLASH_FORWARD_KERNEL: (aten._scaled_dot_product_flash_attention(q, k, v), (0, 1, 4, 5)),
    }
    for op, (meta_out, compared) in checks.items():
        cpu = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in (("query", q), ("key", k), ("value", v))}
        answer = _detect._answer(op, {**cpu, "compute_log_sumexp": True})
        for i in compared:  # output, log-sum-exp, max_q, max_k
            assert _layout(answer[i]) == _layout(meta_out[i]), (op, i)
    grads = _detect._answer(_detect.CUDNN_BACKWARD_KERNEL, {"query": q, "key": k, "value": v})
    assert [_layout(g) for g in grads] == [_layout(t) for t in (q, k, v)]


def test_lse_rank_matches_the_meta_kernel_of_this_torch() -> None:
    q = _meta(1, 2, 4, 8)
    lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, True)[1]
    assert _detect.cudnn_lse_ndim() == lse.dim()


ALIASED_OP = """
import torch
aten = torch.ops.aten  # an alias: the check must not depend on how the code spells the op

def forward(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    q, k, v = (x.transpose(1, 2).contiguous() for x in (query, key, value))
    if return_lse:  # by keyword, the way the package's own ops call it
        op = aten._scaled_dot_product_cudnn_attention.default
        out = op(query=q, key=k, value=v, attn_bias=attn_mask, compute_log_sumexp=True)[0]
    else:  # by position, defaults left out
        out = aten._scaled_dot_product_cudnn_attention(q, k, v, attn_mask, True)[0]
    return out.transpose(1, 2).contiguous()
"""


@pytest.mark.parametrize("return_lse", [False, True])
def test_calls_are_recorded_however_they_are_spelled(dispatch_module: types.ModuleType, return_lse: bool) -> None:
    namespace: dict = {}
    exec(compile(ALIASED_OP, "<aliased>", "exec"), namespace)
    trace = _detect.run_pair(namespace["forward"], None, return_lse=return_lse)
    call = trace.first(_detect.CUDNN_FORWARD_KERNEL)
    assert call is not None, trace.error
    assert call.tensor("query").shape == _detect.kernel_shapes()["query"]
    # The schema's defaults are filled in, so readers see every argument whichever way it was passed.
    assert call.args["dropout_p"] == 0.0 and call.args["is_causal"] is False and call.args["scale"] is None


def test_the_check_leaves_the_checked_functions_untouched(dispatch_module: types.ModuleType) -> None:
    forward = dispatch_module._cudnn_attention_forward_op
    globals_before = dict(forward.__globals__)
    trace = _detect.run_pair(forward, None, return_lse=False)
    assert trace.first(_detect.CUDNN_FORWARD_KERNEL) is not None
    assert forward.__globals__["torch"] is torch
    assert dict(forward.__globals__) == globals_before
