# To add to tests/models/test_attention_dispatch.py (diffusers). The CPU test checks the addresses the native-flash
# context-parallel op pair hands the kernels (ATen calls answered by a dispatch mode); the GPU test runs the kernel.
import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import (
    _native_flash_attention_backward_op,
    _native_flash_attention_forward_op,
)
from torch.utils._python_dispatch import TorchDispatchMode


class _RecordFlashAttention(TorchDispatchMode):
    """Records the tensor arguments of the flash attention ATen ops and answers them with zeros of the shapes their
    meta kernels give."""

    OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward")

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


class _Ctx:
    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _view_off_alignment(shape, dtype, device="cpu"):
    # A contiguous view one element into its buffer: 2 bytes past a 16-byte boundary in bf16.
    buffer = torch.randn(torch.Size(shape).numel() + 1, device=device).to(dtype)
    return buffer[1:].view(shape)


@pytest.mark.parametrize("shape", [(1, 16, 1, 64), (2, 1, 4, 64)], ids=["one-head", "one-token"])
def test_native_flash_cp_ops_hand_the_kernel_aligned_tensors(shape):
    query, key, value, grad_out = (_view_off_alignment(shape, torch.bfloat16) for _ in range(4))
    ctx = _Ctx()
    with _RecordFlashAttention() as record:
        _native_flash_attention_forward_op(ctx, query, key, value)
        _native_flash_attention_backward_op(ctx, grad_out)
    for op, args in record.calls.items():
        for name in ("grad_out", "query", "key", "value", "out"):
            if name in args:
                assert args[name].data_ptr() % 16 == 0, f"{op} got `{name}` off 16-byte alignment"
    assert len(record.calls) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_native_flash_cp_ops_misaligned_views_match_sdpa():
    shape = (1, 16, 1, 64)
    query, key, value, grad_out = (_view_off_alignment(shape, torch.bfloat16, "cuda") for _ in range(4))

    class CPAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value):
            return _native_flash_attention_forward_op(ctx, query, key, value)

        @staticmethod
        def backward(ctx, grad_out):
            return _native_flash_attention_backward_op(ctx, grad_out)[:3]

    inputs = [x.requires_grad_(True) for x in (query, key, value)]
    out = CPAttention.apply(*inputs)
    grads = torch.autograd.grad(out, inputs, grad_out)
    refs = [x.detach().float().requires_grad_(True) for x in (query, key, value)]
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in refs)).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, refs, grad_out.float())
    for got, want in zip((out, *grads), (ref, *ref_grads), strict=True):
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
