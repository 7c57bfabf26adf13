"""diffusers' context-parallel cuDNN attention hands fp32 or mixed-dtype q/k/v to the raw cuDNN op.

Standalone: needs torch and diffusers only. It calls diffusers' own `_cudnn_attention_forward_op` the way
`TemplatedUlyssesAttention` does once q/k/v are all-to-all'ed, with fp32 q/k/v and with bf16 q and fp16 k/v.
`F.scaled_dot_product_attention` checks the dtypes before it picks cuDNN; the raw ATen op does not, and cuDNN
supports q, k and v of one dtype, float16 or bfloat16, only.

On a GPU the real kernel runs and its output is compared with fp32 SDPA: garbage. On a CPU (no cuDNN) this file
registers a small CPU kernel for the ATen op that records the dtypes reaching it: what diffusers would hand cuDNN
there is the bug (the garbage itself needs the GPU).

Exit status: 1 when such q/k/v reach the kernel (CPU) or give a wrong output (GPU), 0 when diffusers refuses
them (or they come out right).

    python reproduce.py [--device cpu|cuda]
"""

import argparse
import sys
import types
from math import inf

import torch
import torch.nn.functional as F

TOLERANCE = 0.05  # max abs error of the output against fp32 SDPA
B, S, H, D = 1, 64, 2, 64
LSE_4D = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 9)  # cuDNN's (B, H, S, 1) log-sum-exp
reached = []  # (q, k, v) dtypes of every call reaching the CPU kernel


def _cudnn_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                   return_debug_mask=False, *, scale=None):  # fmt: skip
    reached.append((query.dtype, key.dtype, value.dtype))
    out = torch.zeros(*query.shape[:3], value.shape[-1], dtype=query.dtype)
    lse = torch.zeros(*query.shape[:3], *((1,) if LSE_4D else ()))
    seed = offset = torch.zeros((), dtype=torch.int64)
    return out, lse, None, None, query.shape[2], key.shape[2], seed, offset, None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = parser.parse_args().device
    if device == "cpu":
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("_scaled_dot_product_cudnn_attention", _cudnn_forward, "CPU")

    import diffusers
    import diffusers.models.attention_dispatch as ops

    config = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(_world_size=2))
    ctx = types.SimpleNamespace(save_for_backward=lambda *tensors: None)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, generator=gen).to(device) for _ in range(3))
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    cases = {"fp32 q/k/v": (torch.float32,) * 3, "bf16 q, fp16 k/v": (torch.bfloat16, torch.float16, torch.float16)}

    print(f"diffusers {diffusers.__version__}, torch {torch.__version__}, {device}, B={B} S={S} H={H} D={D}")
    broken = False
    for label, dtypes in cases.items():
        reached.clear()
        inputs = [x.to(dtype) for x, dtype in zip((q, k, v), dtypes, strict=True)]
        try:
            out = ops._cudnn_attention_forward_op(ctx, *inputs, None, _parallel_config=config)
        except (ValueError, RuntimeError) as exc:
            print(f"  {label}: refused: {type(exc).__name__}: {exc}")
            continue
        if device == "cpu":
            broken = True
            print(f"  {label}: reached the raw cuDNN op as {', '.join(map(str, reached[0]))} (on a GPU: garbage)")
        else:
            error = (out.float() - ref).abs().max().nan_to_num(nan=inf).item()
            broken |= error > TOLERANCE
            verdict = " WRONG" if error > TOLERANCE else ""
            print(f"  {label}: max abs error of the output vs fp32 SDPA {error:.3f}{verdict}")
    if broken:
        print("BUG: q/k/v of dtypes cuDNN does not support reach the raw cuDNN attention op unchecked")
        return 1
    print("ok: unsupported q/k/v dtypes are refused before the kernel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
