# To add to tests/models/test_attention_dispatch.py (diffusers). The CPU test checks what the context-parallel
# cuDNN backward op hands the kernel (ATen calls answered by a dispatch mode); the GPU test checks the gradients.
import types

import pytest
import torch
from diffusers.models.attention_dispatch import _cudnn_attention_backward_op, _cudnn_attention_forward_op
from torch.utils._python_dispatch import TorchDispatchMode

_CP_CONFIG = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(_world_size=2))


class _Ctx:
    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


class _RecordAttentionOps(TorchDispatchMode):
    """Records the arguments of the cuDNN attention ATen ops and answers them with zeros of the shapes their meta
    kernels give."""

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


@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.bfloat16).min], ids=["-inf", "finfo.min"])
def test_cudnn_cp_backward_gives_fully_masked_rows_no_gradient(fill):
    # One key position: a query row whose key is masked is fully masked, and cuDNN's backward gets such rows wrong.
    query = torch.randn(2, 6, 2, 16, dtype=torch.bfloat16)
    key, value = (torch.randn(2, 1, 2, 16, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.zeros(2, 1, 6, 1, dtype=torch.bfloat16)
    mask[:, :, ::2] = fill
    ctx = _Ctx()
    with _RecordAttentionOps() as record:
        _cudnn_attention_forward_op(ctx, query, key, value, mask, _parallel_config=_CP_CONFIG)
        _cudnn_attention_backward_op(ctx, torch.ones_like(query))
    grad_out = record.calls["_scaled_dot_product_cudnn_attention_backward"]["grad_out"]  # (B, H, S_q, D)
    assert (grad_out[:, :, ::2] == 0).all(), "fully masked rows reached cuDNN's backward with a gradient"
    assert (grad_out[:, :, 1::2] == 1).all(), "rows that see their key must keep their gradient"


def test_cudnn_cp_backward_leaves_grad_out_alone_with_several_keys():
    query, key, value = (torch.randn(1, 6, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.zeros(1, 1, 6, 6, dtype=torch.bfloat16)
    mask[:, :, 0] = float("-inf")
    ctx = _Ctx()
    with _RecordAttentionOps() as record:
        _cudnn_attention_forward_op(ctx, query, key, value, mask, _parallel_config=_CP_CONFIG)
        _cudnn_attention_backward_op(ctx, torch.ones_like(query))
    assert (record.calls["_scaled_dot_product_cudnn_attention_backward"]["grad_out"] == 1).all()


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.backends.cudnn.is_available()), reason="needs a CUDA device with cuDNN"
)
@pytest.mark.parametrize("s_q", [2, 7])
def test_cudnn_cp_ops_fully_masked_rows_match_reference(s_q):
    torch.manual_seed(0)
    query, grad_out = (torch.randn(2, s_q, 1, 32, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    key, value = (torch.randn(2, 1, 1, 32, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.zeros(2, 1, s_q, 1, device="cuda", dtype=torch.bfloat16)
    # One masked row in the middle: the kernel's fault was seen with this pattern at S_q 2 and 7, in bf16.
    mask[:, :, s_q // 2] = float("-inf")

    class CPAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value):
            return _cudnn_attention_forward_op(ctx, query, key, value, mask, _parallel_config=_CP_CONFIG)

        @staticmethod
        def backward(ctx, grad_out):
            return _cudnn_attention_backward_op(ctx, grad_out)[:3]

    inputs = [x.clone().requires_grad_(True) for x in (query, key, value)]
    # The memory the kernels are handed next holds finite garbage, as it does mid-training.
    torch.empty(64 << 20, device="cuda").normal_()
    grads = torch.autograd.grad(CPAttention.apply(*inputs), inputs, grad_out)
    # Reference: with one key, a row that sees it puts all its weight on it (output = value: no gradient for query
    # or key), and a masked row has no weight at all (output 0, no gradient).
    keep = (mask == 0).transpose(1, 2).float()  # (B, S_q, 1, 1)
    ref_grads = (
        torch.zeros(query.shape, device="cuda"),
        torch.zeros(key.shape, device="cuda"),
        (keep * grad_out.float()).sum(dim=1, keepdim=True),
    )
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
