# To add to tests/models/test_attention_dispatch.py (diffusers). The CPU test checks what the context-parallel
# cuDNN op pair hands the kernels (ATen calls answered by a dispatch mode); the GPU test checks the numbers.
import types

import pytest
import torch
import torch.nn.functional as F
from diffusers.models import attention_dispatch
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


class _Mesh:
    """Stands in for the Ulysses DeviceMesh; the stand-in collectives below ignore its group."""

    def get_group(self):
        return None


@pytest.mark.parametrize("ulysses_anything", [False, True])
def test_ulysses_gathers_the_cudnn_mask_as_an_additive_mask_of_query_dtype(monkeypatch, ulysses_anything):
    # torch.compile (inductor) mistypes an all-gathered bool tensor, so under Ulysses a mask for the cuDNN op must
    # already be the additive mask the op uses when it is gathered. One rank: the collectives hand back their input.
    gathered = []

    def all_gather(tensors, tensor, group=None):
        gathered.append(tensor)
        for out in tensors:
            out.copy_(tensor)

    dist = types.SimpleNamespace(all_gather=all_gather, get_world_size=lambda group=None: 1)
    monkeypatch.setattr(attention_dispatch, "dist", dist)
    monkeypatch.setattr(attention_dispatch, "_all_to_all_single", lambda x, group=None: x)
    monkeypatch.setattr(attention_dispatch, "gather_size_by_comm", lambda size, group=None: [size])
    for name in ("all_to_all_single_any_qkv_async", "all_to_all_single_any_o_async"):
        monkeypatch.setattr(attention_dispatch, name, lambda x, group=None, **kwargs: lambda: x)
    cp_config = types.SimpleNamespace(_ulysses_mesh=_Mesh(), ulysses_degree=1, _world_size=2)
    attention = (
        attention_dispatch.TemplatedUlyssesAnythingAttention
        if ulysses_anything
        else attention_dispatch.TemplatedUlyssesAttention
    )

    query, key, value = (torch.randn(1, 8, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    keep = torch.rand(1, 1, 8, 8) > 0.5
    expected = torch.zeros(keep.shape, dtype=torch.bfloat16).masked_fill(~keep, float("-inf"))
    with torch.no_grad(), _RecordAttentionOps() as record:  # no grad: as inside `autograd.Function.forward`
        attention.forward(
            _Ctx(), query, key, value, keep, 0.0, False, None, False, False, _cudnn_attention_forward_op,
            _cudnn_attention_backward_op, types.SimpleNamespace(context_parallel_config=cp_config),
        )  # fmt: skip

    assert len(gathered) == 1, "the local mask was not all-gathered"
    assert gathered[0].dtype == query.dtype, f"a {gathered[0].dtype} mask was all-gathered with {query.dtype} query"
    torch.testing.assert_close(gathered[0], expected, rtol=0, atol=0)
    torch.testing.assert_close(record.calls[_RecordAttentionOps.OPS[0]]["attn_bias"], expected, rtol=0, atol=0)


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
