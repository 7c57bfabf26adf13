# To add to tests/models/test_attention_dispatch.py (diffusers). Runs on any device: the ATen call is answered by
# a dispatch mode that records it, so the test sees whether the inputs would reach the cuDNN kernel at all.
import types

import pytest
import torch
from diffusers.models.attention_dispatch import _cudnn_attention_forward_op
from torch.utils._python_dispatch import TorchDispatchMode

_CP_CONFIG = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(_world_size=2))


class _RecordCudnnAttention(TorchDispatchMode):
    """Records calls of the cuDNN attention ATen op and answers them with zeros of the shapes its meta kernel gives."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ != "_scaled_dot_product_cudnn_attention":
            return func(*args, **kwargs)
        self.calls.append((args, kwargs))
        to_meta = lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x  # noqa: E731
        outputs = func(*(to_meta(x) for x in args), **{k: to_meta(x) for k, x in kwargs.items()})
        return tuple(torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) else x for x in outputs)


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.float16, torch.float16),
        (torch.float16, torch.bfloat16, torch.bfloat16),
    ],
    ids=["fp32", "bf16-q-fp16-kv", "fp16-q-bf16-kv"],
)
def test_cudnn_cp_op_refuses_unsupported_dtypes(dtypes):
    query, key, value = (torch.randn(1, 8, 2, 16, dtype=dtype) for dtype in dtypes)
    ctx = types.SimpleNamespace(save_for_backward=lambda *tensors: None)
    with _RecordCudnnAttention() as record, pytest.raises(ValueError, match="must"):
        _cudnn_attention_forward_op(ctx, query, key, value, _parallel_config=_CP_CONFIG)
    assert not record.calls, "unsupported dtypes reached the raw cuDNN op, which returns garbage for them"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cudnn_cp_op_takes_supported_dtypes(dtype):
    query, key, value = (torch.randn(1, 8, 2, 16, dtype=dtype) for _ in range(3))
    ctx = types.SimpleNamespace(save_for_backward=lambda *tensors: None)
    with _RecordCudnnAttention() as record:
        _cudnn_attention_forward_op(ctx, query, key, value, _parallel_config=_CP_CONFIG)
    assert len(record.calls) == 1
