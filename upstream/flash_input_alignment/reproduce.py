"""diffusers' context-parallel native-flash attention hands the flash kernel q/k/v off 16-byte alignment.

Standalone: needs torch and diffusers only. It calls diffusers' own `_native_flash_attention_forward_op` /
`_native_flash_attention_backward_op` the way the templated context-parallel functions do, with (B, S, H=1, D)
bf16 q/k/v that are contiguous views one element into their buffers. The ops turn them into kernel layout with
`transpose(1, 2).contiguous()`, which copies nothing here (with one head the transposed view already is
contiguous), so the kernel gets the view as it is.

On a GPU the real flash kernel runs: "CUDA error: misaligned address", which also ends the process's CUDA
context. On a CPU this file registers small CPU kernels for the two ATen ops that check the alignment the CUDA
kernel needs (it reads 16-byte vectors) and otherwise compute attention in fp32.

Exit status: 1 when a misaligned tensor reaches the kernel (the bug), 0 when the output and gradients match fp32
`F.scaled_dot_product_attention`.

    python reproduce.py [--device cpu|cuda]
"""

import argparse
import sys
from math import inf

import torch
import torch.nn.functional as F

TOLERANCE = 0.05  # max abs error; bf16 attention against fp32 is ~0.01 off
B, S, H, D = 1, 16, 1, 64


def _check_aligned(op, **tensors):
    off = [f"{name} (address % 16 = {t.data_ptr() % 16})" for name, t in tensors.items() if t.data_ptr() % 16]
    if off:  # what the CUDA kernel does with these, measured on an H200
        raise RuntimeError(f"the {op} kernel got {', '.join(off)}: on a GPU, 'CUDA error: misaligned address'")


def _flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    _check_aligned("flash forward", query=query, key=key, value=value)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (query.float() @ key.float().transpose(-2, -1)) * scale
    lse = scores.logsumexp(dim=-1)
    out = (scores - lse[..., None]).exp() @ value.float()
    rng_state, unused = torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    debug = torch.empty(0, dtype=query.dtype)
    return out.to(query.dtype), lse, None, None, query.shape[2], key.shape[2], rng_state, unused, debug


def _flash_backward(
    grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
    philox_seed, philox_offset, *, scale=None,
):  # fmt: skip
    _check_aligned("flash backward", grad_out=grad_out, query=query, key=key, value=value, out=out)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, do, o = (x.float() for x in (query, key, value, grad_out, out))
    p = ((q @ k.transpose(-2, -1)) * scale - logsumexp[..., None].float()).exp()
    ds = p * (do @ v.transpose(-2, -1) - (do * o).sum(dim=-1, keepdim=True))
    dq, dk, dv = ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ do
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def _cp_attention(ops):
    """diffusers' native-flash op pair inside an autograd.Function, as the templated CP functions call it."""

    class CPAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value):
            return ops._native_flash_attention_forward_op(ctx, query, key, value)

        @staticmethod
        def backward(ctx, grad_out):
            return ops._native_flash_attention_backward_op(ctx, grad_out)[:3]

    return CPAttention.apply


def _off_by_one_element(x):
    """`x` as a contiguous view one element into a fresh buffer: 2 bytes off 16-byte alignment in bf16."""
    buffer = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    view = buffer[1:].view(x.shape)
    view.copy_(x)
    return view


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = parser.parse_args().device
    if device == "cpu":
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("_scaled_dot_product_flash_attention", _flash_forward, "CPU")
        lib.impl("_scaled_dot_product_flash_attention_backward", _flash_backward, "CPU")

    import diffusers
    import diffusers.models.attention_dispatch as ops

    gen = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(B, S, H, D, generator=gen).to(device, torch.bfloat16) for _ in range(4))
    refs = [x.float().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in refs)).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, refs, grad_out.float())

    print(f"diffusers {diffusers.__version__}, torch {torch.__version__}, {device}, bf16 B={B} S={S} H={H} D={D}")
    inputs = [_off_by_one_element(x).requires_grad_() for x in (q, k, v)]
    print(f"  q/k/v are contiguous views at address % 16 = {inputs[0].data_ptr() % 16}")
    try:
        out = _cp_attention(ops)(*inputs)
        grads = torch.autograd.grad(out, inputs, grad_out)
        if device == "cuda":
            torch.cuda.synchronize()
    except RuntimeError as exc:
        print(f"BUG: {str(exc).splitlines()[0]}")
        return 1
    names = ("out", "dq", "dk", "dv")
    pairs = zip(names, (out, *grads), (ref, *ref_grads), strict=True)
    errors = {n: (a.float() - b).abs().max().nan_to_num(nan=inf).item() for n, a, b in pairs}
    print("  max abs error vs fp32 SDPA: " + ", ".join(f"{n} {e:.4f}" for n, e in errors.items()))
    if max(errors.values()) > TOLERANCE:
        print(f"BUG: wrong results (tolerance {TOLERANCE})")
        return 1
    print("ok: misaligned views reach the flash kernel as aligned copies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
