"""diffusers' context-parallel cuDNN attention feeds a bool (or wrongly typed) mask raw into cuDNN's bias slot.

Standalone: needs torch and diffusers only. It calls diffusers' own `_cudnn_attention_forward_op` /
`_cudnn_attention_backward_op` the way `TemplatedUlyssesAttention` does once q/k/v are all-to-all'ed, with a
bool mask and with an fp32 mask against bf16 q, and compares output and gradients with
`F.scaled_dot_product_attention` in fp32 given the same mask.

On a GPU the real kernels run. On a CPU (no cuDNN) this file registers small CPU kernels for the two ATen ops
that read `attn_bias` the way the CUDA kernel does, as an additive bias in q's dtype with no dtype check: a
float mask of another dtype has its bytes read as q's dtype; a bool mask is read as 0/1 (the mildest reading:
the CUDA kernel reads its bytes as q's dtype, twice their size, i.e. out of bounds).

Exit status: 1 when a mask is misread (the bug), 0 when every case matches the reference.

    python reproduce.py [--device cpu|cuda]
"""

import argparse
import sys
import types
from math import inf

import torch
import torch.nn.functional as F

TOLERANCE = 0.05  # max abs error; bf16 attention against fp32 is ~0.01 off
B, S, H, D = 1, 32, 2, 64
LSE_4D = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 9)  # cuDNN's (B, H, S, 1) log-sum-exp
seen_bias = []  # dtype of every attn_bias reaching a kernel (CPU kernels only)


def _bias_as_kernel_reads(bias, dtype):
    if bias is None or bias.dtype == dtype:
        return bias
    if bias.dtype == torch.bool:
        return bias.to(dtype)  # 0 / 1 added to the scores
    return bias.contiguous().view(-1).view(dtype)[: bias.numel()].view(bias.shape)  # its bytes read as `dtype`


def _probabilities(query, key, bias, scale):
    scores = (query.float() @ key.float().transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + _bias_as_kernel_reads(bias, query.dtype).float()
    return scores.softmax(dim=-1), scores.logsumexp(dim=-1)


def _cudnn_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                   return_debug_mask=False, *, scale=None):  # fmt: skip
    seen_bias.append(None if attn_bias is None else attn_bias.dtype)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    probs, lse = _probabilities(query, key, attn_bias, scale)
    out = probs @ value.float()
    lse = (lse.unsqueeze(-1) if LSE_4D else lse) if compute_log_sumexp else None
    seed = offset = torch.zeros((), dtype=torch.int64)
    return out.to(query.dtype), lse, None, None, query.shape[2], key.shape[2], seed, offset, None


def _cudnn_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
                    cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):  # fmt: skip
    seen_bias.append(None if attn_bias is None else attn_bias.dtype)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    probs, _ = _probabilities(query, key, attn_bias, scale)
    q, k, v, do = (x.float() for x in (query, key, value, grad_out))
    grad_probs = do @ v.transpose(-2, -1)
    grad_scores = probs * (grad_probs - (grad_probs * probs).sum(dim=-1, keepdim=True))
    grads = (grad_scores @ k * scale, grad_scores.transpose(-2, -1) @ q * scale, probs.transpose(-2, -1) @ do)
    return tuple(g.to(x.dtype) for g, x in zip(grads, (query, key, value), strict=True))


def _register_cpu_kernels():
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_cudnn_attention", _cudnn_forward, "CPU")
    lib.impl("_scaled_dot_product_cudnn_attention_backward", _cudnn_backward, "CPU")
    return lib


def _cp_attention(ops):
    """diffusers' cuDNN op pair inside an autograd.Function, as TemplatedUlyssesAttention calls it (world size 2)."""
    config = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(_world_size=2))

    class CPAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value, attn_mask):
            return ops._cudnn_attention_forward_op(
                ctx, query, key, value, attn_mask, 0.0, False, None, False, False, _parallel_config=config
            )

        @staticmethod
        def backward(ctx, grad_out):
            return (*ops._cudnn_attention_backward_op(ctx, grad_out)[:3], None)

    return CPAttention.apply


def _errors(attention, q, k, v, grad_out, mask, ref_mask):
    """Max abs error of out, dq, dk, dv against fp32 SDPA given `ref_mask` (model layout (B, S, H, D))."""
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attention(*ins, mask)
    grads = torch.autograd.grad(out, ins, grad_out)
    refs = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in refs), attn_mask=ref_mask).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, refs, grad_out.float())
    got, want = [out, *grads], [ref, *ref_grads]
    names = ("out", "dq", "dk", "dv")
    return {n: (a.float() - b).abs().max().nan_to_num(nan=inf).item() for n, a, b in zip(names, got, want, strict=True)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = parser.parse_args().device
    lib = _register_cpu_kernels() if device == "cpu" else None  # noqa: F841

    import diffusers
    import diffusers.models.attention_dispatch as ops

    attention = _cp_attention(ops)
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(B, S, H, D, generator=gen).to(device, torch.bfloat16) for _ in range(4))
    keep = torch.rand(B, 1, S, S, generator=gen).to(device) > 0.3  # True = attend
    keep[..., 0] = True  # every row sees at least one key
    additive = torch.zeros(keep.shape, device=device).masked_fill(~keep, float("-inf"))
    cases = {"bool mask": keep, "fp32 additive mask, bf16 q": additive}

    print(f"diffusers {diffusers.__version__}, torch {torch.__version__}, {device}, bf16 B={B} S={S} H={H} D={D}")
    broken = False
    for label, mask in cases.items():
        seen_bias.clear()
        try:
            errors = _errors(attention, q, k, v, grad_out, mask, keep)
        except Exception as exc:  # noqa: BLE001 - SDPA computes this case: failing to is the bug too
            print(f"  {label}: raised {type(exc).__name__}: {str(exc).splitlines()[0]} WRONG")
            broken = True
            continue
        text = ", ".join(f"{n} {e:.3f}" for n, e in errors.items())
        reached = f" (attn_bias reaching the kernels: {sorted(set(map(str, seen_bias)))})" if seen_bias else ""
        wrong = max(errors.values()) > TOLERANCE
        broken |= wrong
        print(f"  {label}: max abs error vs fp32 SDPA {text}{reached}{' WRONG' if wrong else ''}")
    if broken:
        print(f"BUG: a mask reaches cuDNN's additive-bias slot unconverted (tolerance {TOLERANCE})")
        return 1
    print("ok: masks reach the kernel as additive masks in q's dtype")
    return 0


if __name__ == "__main__":
    sys.exit(main())
