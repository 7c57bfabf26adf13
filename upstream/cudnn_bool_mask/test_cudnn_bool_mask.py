# To add to tests/models/test_attention_dispatch.py (diffusers). The CPU test checks what the context-parallel
# cuDNN op pair hands the kernels (ATen calls answered by a dispatch mode); the GPU test checks the numbers.
import types

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import _cudnn_attention_backward_op, _cudnn_attention_forward_op
from torch.utils._python_dispatch import TorchDispatchMode

# What `_cudnn_attention_forward_op` reads from the parallel config inside context parallelism (world size 2).
_CP_CONFIG = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(_world_size=2))


class _Ctx:
    """Stands in for the autograd ctx of `TemplatedUlyssesAttention`."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


class _RecordAttentionOps(TorchDispatchMode):
    """Records the arguments of the fused-attention ATen ops and answers them with zeros of the shapes their meta
    kernels give, so that what diffusers hands the kernels can be checked on any device."""

    OPS = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name not in self.OPS:
            return func(*args, **kwargs)
        self.calls[name] = {**dict(zip((a.name for a in func._schema.arguments), args, strict=False)), **kwargs}
        to_meta = lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x  # noqa: E731
        outputs = func(*(to_meta(x) for x in args), **{k: to_meta(x) for k, x in kwargs.items()})
        return tuple(torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) else x for x in outputs)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_cudnn_cp_op_hands_the_kernel_an_additive_mask_of_query_dtype(mask_dtype):
    query, key, value = (torch.randn(1, 8, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    keep = torch.rand(1, 1, 8, 8) > 0.5
    expected = torch.zeros(keep.shape, dtype=torch.bfloat16).masked_fill(~keep, float("-inf"))
    mask = keep if mask_dtype == torch.bool else expected.to(mask_dtype)

    ctx = _Ctx()
    with _RecordAttentionOps() as record:
        _cudnn_attention_forward_op(ctx, query, key, value, mask, _parallel_config=_CP_CONFIG)
        _cudnn_attention_backward_op(ctx, torch.randn_like(query))

    for op in _RecordAttentionOps.OPS:
        bias = record.calls[op]["attn_bias"]
        assert bias.dtype == query.dtype, f"{op} got a {bias.dtype} attn_bias with {query.dtype} query"
        torch.testing.assert_close(bias, expected, rtol=0, atol=0)


def test_cudnn_cp_op_refuses_an_integer_mask():
    query, key, value = (torch.randn(1, 8, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    with _RecordAttentionOps() as record, pytest.raises(ValueError, match="boolean or floating-point"):
        _cudnn_attention_forward_op(_Ctx(), query, key, value, torch.ones(1, 1, 8, 8, dtype=torch.int64))
    assert not record.calls


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.backends.cudnn.is_available()), reason="needs a CUDA device with cuDNN"
)
def test_cudnn_cp_op_bool_mask_matches_sdpa():
    torch.manual_seed(0)
    query, key, value, grad_out = (torch.randn(1, 32, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    keep = torch.rand(1, 1, 32, 32, device="cuda") > 0.3
    keep[..., 0] = True  # every query sees a key

    class CPAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value):
            return _cudnn_attention_forward_op(ctx, query, key, value, keep, _parallel_config=_CP_CONFIG)

        @staticmethod
        def backward(ctx, grad_out):
            return _cudnn_attention_backward_op(ctx, grad_out)[:3]

    inputs = [x.clone().requires_grad_(True) for x in (query, key, value)]
    out = CPAttention.apply(*inputs)
    grads = torch.autograd.grad(out, inputs, grad_out)
    refs = [x.float().requires_grad_(True) for x in (query, key, value)]
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in refs), attn_mask=keep).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, refs, grad_out.float())
    for got, want in zip((out, *grads), (ref, *ref_grads), strict=True):
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
