"""cuDNN's SDPA backward returns wrong dQ/dK/dV for a fully masked query row when there is one key position.

PyTorch-level, no diffusers: the raw ATen ops `_scaled_dot_product_cudnn_attention` and its `_backward` (what
diffusers' context-parallel cuDNN ops call), with S_kv = 1 and an additive mask that masks that key (`-inf`) for
some query rows. Such a row has no attention weights: its output is 0 and it contributes nothing to any
gradient. The forward gets that right; the backward does not, silently, in bf16 with fewer than 8 query
positions (H200, torch 2.11.0+cu130, cuDNN 9.19). The same shapes through `F.scaled_dot_product_attention` with
the cuDNN backend are run too, where PyTorch picks cuDNN for them.

`--through-diffusers` runs the same case through diffusers' own `_cudnn_attention_forward_op` /
`_cudnn_attention_backward_op` instead (the installed diffusers), to check a workaround there.

Needs a CUDA GPU with cuDNN attention (sm80+). Exit status: 1 when some case gives wrong gradients, 0 when every
case is right, 3 when there is no such GPU (nothing checked).

    python reproduce.py [--through-diffusers]
"""

import argparse
import itertools
import sys
import types

import torch
import torch.nn.functional as F

# Max abs error above which a gradient counts as wrong, relative to max(1, max |reference|): with one key position
# the exact dQ and dK are 0 (the softmax over one key is constant), so a plain relative error would divide by 0.
# Correct bf16 results are about 1e-2 off; the fault gives errors of 1 to 30 (H200).
TOLERANCE = 0.05
#: (B, H, D): the first two are shapes where benchmarks' probe of the bare kernels found the fault on an H200
#: (bf16, S_q 2 and 7, one fully masked row: every case wrong, errors up to 33); the third is the shape of this file's
#: first version, which masked every other row and found none. With one masked row it shows the fault too (H100).
SHAPES = ((2, 1, 32), (2, 1, 128), (1, 2, 64))


def _reference(q, k, v, bias, grad_out):
    """fp32 attention (B, H, S, D) whose fully masked rows give 0 and no gradient, and its q/k/v gradients."""
    q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + bias.float()
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
    probs = torch.where(dead, 0.0, torch.where(dead, 0.0, scores).softmax(dim=-1))
    out = probs @ v
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out.float())]


def _raw_ops(q, k, v, bias, grad_out):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, bias, True, 0.0, False, False
    )
    grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, 0.0, False
    )
    return [out, *grads]


#: What the memory the kernels are handed holds beforehand: each case runs once per fill, so that a wrong answer
#: cannot be hidden by an earlier right one left in memory. On an H100 both fills gave the same errors.
FILLS = ("nan", "noise")


def _fill_freed_memory(fill):
    """Fill the memory the caching allocator hands out next with NaN or with random finite values, so that
    neither a correct earlier run's leftovers nor one kind of garbage decides the outcome."""
    junk = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    if fill == "nan":
        junk.fill_(float("nan"))
    else:
        junk.normal_()
    del junk


def _public_api(q, k, v, bias, grad_out):
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(*inputs, attn_mask=bias)
    return [out, *torch.autograd.grad(out, inputs, grad_out)]


def _diffusers_ops(q, k, v, bias, grad_out):
    import diffusers.models.attention_dispatch as ops

    config = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(_world_size=2))

    class CPAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value):
            return ops._cudnn_attention_forward_op(ctx, query, key, value, bias, _parallel_config=config)

        @staticmethod
        def backward(ctx, grad):
            return ops._cudnn_attention_backward_op(ctx, grad)[:3]

    inputs = [x.transpose(1, 2).clone().requires_grad_() for x in (q, k, v)]  # diffusers' (B, S, H, D) layout
    out = CPAttention.apply(*inputs)
    grads = torch.autograd.grad(out, inputs, grad_out.transpose(1, 2))
    return [x.transpose(1, 2) for x in (out, *grads)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--through-diffusers", action="store_true")
    through_diffusers = parser.parse_args().through_diffusers
    if not torch.cuda.is_available() or not torch.backends.cudnn.is_available():
        print("skipped: needs a CUDA GPU with cuDNN (the fault is the kernel's; nothing to check on a CPU)")
        return 3
    paths = {"diffusers' cuDNN op pair": _diffusers_ops} if through_diffusers else {"raw ATen ops": _raw_ops}
    if not through_diffusers:
        paths["F.sdpa, cuDNN backend"] = _public_api
    props = torch.cuda.get_device_properties(0)
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {props.name}; S_kv=1")
    if through_diffusers:
        import diffusers

        print(f"diffusers {diffusers.__version__}")

    wrong = 0
    cases = [(shape, dtype, s_q) for shape in SHAPES for dtype in (torch.bfloat16, torch.float16) for s_q in (2, 7, 8)]
    for (B, H, D), dtype, s_q in cases:
        gen = torch.Generator().manual_seed(s_q)
        q = torch.randn(B, H, s_q, D, generator=gen).to("cuda", dtype)
        k, v = (torch.randn(B, H, 1, D, generator=gen).to("cuda", dtype) for _ in range(2))
        grad_out = torch.randn(B, H, s_q, D, generator=gen).to("cuda", dtype)
        bias = torch.zeros(B, 1, s_q, 1, device="cuda", dtype=dtype)
        bias[:, :, s_q // 2] = float("-inf")  # the middle query row sees no key
        ref = _reference(q, k, v, bias, grad_out)
        for (label, run), fill in itertools.product(paths.items(), FILLS):
            where = f"{label:26} {fill:5} B={B} H={H} D={D:3} {dtype!s:14} S_q={s_q:2}"
            try:
                _fill_freed_memory(fill)
                got = run(q, k, v, bias, grad_out)
            except RuntimeError as exc:
                print(f"  {where}: not run ({str(exc).splitlines()[0][:80]})")
                continue
            rel = [
                ((a.float() - b).abs().max() / b.abs().max().clamp_min(1.0)).item()
                for a, b in zip(got, ref, strict=True)
            ]
            bad = not all(e <= TOLERANCE for e in rel[1:])  # a NaN error (memory never written) is wrong too
            wrong += bad
            text = ", ".join(f"{n} {e:.3f}" for n, e in zip(("out", "dQ", "dK", "dV"), rel, strict=True))
            print(f"  {where}: error {text}{'  WRONG' if bad else ''}")
    if wrong:
        print(f"BUG: {wrong} case(s) with wrong gradients for fully masked rows (tolerance {TOLERANCE})")
        return 1
    print("ok: fully masked rows with one key position get the right gradients")
    return 0


if __name__ == "__main__":
    sys.exit(main())
