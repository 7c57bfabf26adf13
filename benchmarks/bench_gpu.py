"""Side-by-side GPU timings of the corrected cuDNN ops, in one process, printed as ratios.

    python benchmarks/bench_gpu.py [--out results.json]

Needs a CUDA GPU with cuDNN SDPA and diffusers 0.39.0 and 0.40.0 in ``.cache/diffusers`` (``tests/releases.py``
installs them; ``DIFFUSERS_WHEELS`` points pip at local wheels). 0.39.0 is imported and patched; 0.40.0's
own op pair is read from its wheel's source and compiled into this process (only to time it, never shipped).

Measured, bf16, CUDA events, median of 50 after 10 warm-up calls, at B=1 S=4096 H=24 D=128 and
B=2 S=1024 H=16 D=64:

* backward: the bare ATen cuDNN backward on tensors already in kernel layout (the floor), the corrected op
  with the dense copies the shipped op makes, the corrected op with zero-copy views, diffusers 0.40's op;
* forward: the bare ATen forward with the log-sum-exp (the floor), the shipped 0.39 forward (no
  log-sum-exp: wrong for training), the corrected op (copies / views), diffusers 0.40's op;
* the probe: first call in a process whose CUDA context and cuDNN are loaded (one cuDNN call at another
  shape first, as a training run's first attention call does), and later calls.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from releases import release_dir  # noqa: E402

SHAPES = ((1, 4096, 24, 128), (2, 1024, 16, 64))
CP = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(_world_size=2, ring_degree=1, ulysses_degree=2))


class Ctx:
    needs_input_grad = (True,) * 12

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors


def cuda_median_ms(fn: Callable[[], Any], warmup: int = 10, iters: int = 50) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def load_040_ops() -> dict[str, Any]:
    """diffusers 0.40.0's cuDNN op pair, compiled from its source into a private namespace."""
    import torch

    source = (release_dir("0.40.0") / "diffusers" / "models" / "attention_dispatch.py").read_text()
    tree = ast.parse(source)
    wanted = {"_cudnn_attention_forward_op", "_cudnn_attention_backward_op"}
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    module = ast.Module(body=body, type_ignores=[])
    namespace: dict[str, Any] = {
        "torch": torch,
        "_CUDNN_LSE_HAS_TRAILING_DIM": tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 9),
        "ParallelConfig": object,
    }
    flags = __import__("__future__").annotations.compiler_flag  # its annotations name a type it imports lazily
    exec(compile(module, "diffusers-0.40.0/attention_dispatch.py", "exec", flags=flags), namespace)
    return {n: namespace[n] for n in wanted}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(release_dir("0.39.0")))
    import torch

    import diffusers_cudnn_fix
    import diffusers.models.attention_dispatch as m039
    from diffusers_cudnn_fix import _layout
    from diffusers_cudnn_fix import _probe as probe
    from diffusers_cudnn_fix.fixes.cudnn_backward_kv import cudnn_attention_backward_op as corrected_bwd
    from diffusers_cudnn_fix.fixes.cudnn_forward_lse import cudnn_attention_forward_op as corrected_fwd

    assert diffusers_cudnn_fix.status().ok
    dev = torch.device("cuda")
    torch.ones(1, device=dev)  # the CUDA context exists from here on
    # Load cuDNN's SDPA engines with one call at a shape the probe does not use, as a training run's own first
    # attention call does: the probe's first call then pays for its own shapes only.
    warm = torch.randn(1, 4, 256, 128, device=dev, dtype=torch.bfloat16)
    torch.ops.aten._scaled_dot_product_cudnn_attention(warm, warm, warm, None, True)
    torch.cuda.synchronize()
    ops040 = load_040_ops()
    shipped_fwd = diffusers_cudnn_fix.get_original("_cudnn_attention_forward_op")
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "command": "python benchmarks/bench_gpu.py --out results/bench-gpu.json",
    }

    # The probe first: its first call in this process is what a training run pays.
    probe._results.clear()
    t0 = time.perf_counter()
    first = probe.probe(dev)
    first_ms = (time.perf_counter() - t0) * 1e3
    later = []
    for _ in range(10):
        probe._results.clear()
        t0 = time.perf_counter()
        probe.probe(dev)
        later.append((time.perf_counter() - t0) * 1e3)
    results["probe"] = {"state": first.state, "zero_copy": first.zero_copy, "first_ms": first_ms, "later_median_ms": statistics.median(later)}
    print(f"probe: {first.state}, zero-copy {first.zero_copy}; first call {first_ms:.1f} ms, later calls median {statistics.median(later):.1f} ms")

    for batch, seq, heads, dim in SHAPES:
        key = f"B={batch} S={seq} H={heads} D={dim}"
        gen = torch.Generator(device=dev).manual_seed(0)
        q, k, v, g = (torch.randn(batch, seq, heads, dim, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        aten_fwd = torch.ops.aten._scaled_dot_product_cudnn_attention
        aten_bwd = torch.ops.aten._scaled_dot_product_cudnn_attention_backward
        o = aten_fwd(qt, kt, vt, None, True)
        out, lse, cq, ck, mq, mk, seed, offset = o[:8]
        gt = g.transpose(1, 2).contiguous()
        row: dict[str, float] = {}
        row["fwd floor (ATen, kernel layout, with LSE)"] = cuda_median_ms(lambda: aten_fwd(qt, kt, vt, None, True))
        row["bwd floor (ATen, kernel layout)"] = cuda_median_ms(
            lambda: aten_bwd(gt, qt, kt, vt, out, lse, seed, offset, None, cq, ck, mq, mk, 0.0, False)
        )

        def fwd_of(fn: Callable[..., Any]) -> tuple[Callable[[], Any], Ctx]:
            ctx = Ctx()
            call = lambda: fn(ctx, q, k, v, None, 0.0, False, None, False, False, _save_ctx=True, _parallel_config=CP)  # noqa: E731
            call()
            return call, ctx

        for label, zero_copy in (("copies", False), ("views", True)):
            _layout.zero_copy = zero_copy
            call, ctx = fwd_of(corrected_fwd)
            row[f"fwd corrected ({label})"] = cuda_median_ms(call)
            row[f"bwd corrected ({label})"] = cuda_median_ms(lambda: corrected_bwd(ctx, g))
        _layout.zero_copy = first.zero_copy
        call, ctx = fwd_of(m039._cudnn_attention_forward_op)
        row["fwd as installed (guards + corrected)"] = cuda_median_ms(call)
        call, _ = fwd_of(diffusers_cudnn_fix._registry.callable_of(shipped_fwd))
        row["fwd 0.39 shipped (no LSE)"] = cuda_median_ms(call)
        call, ctx = fwd_of(ops040["_cudnn_attention_forward_op"])
        row["fwd 0.40 op"] = cuda_median_ms(call)
        row["bwd 0.40 op"] = cuda_median_ms(lambda: ops040["_cudnn_attention_backward_op"](ctx, g))

        fl_b, fl_f = row["bwd floor (ATen, kernel layout)"], row["fwd floor (ATen, kernel layout, with LSE)"]
        ratios = {
            "bwd corrected (copies) / floor": row["bwd corrected (copies)"] / fl_b,
            "bwd corrected (views) / floor": row["bwd corrected (views)"] / fl_b,
            "bwd 0.40 / floor": row["bwd 0.40 op"] / fl_b,
            "bwd corrected (copies) / 0.40": row["bwd corrected (copies)"] / row["bwd 0.40 op"],
            "bwd corrected (views) / 0.40": row["bwd corrected (views)"] / row["bwd 0.40 op"],
            "fwd corrected (copies) / floor": row["fwd corrected (copies)"] / fl_f,
            "fwd corrected (views) / floor": row["fwd corrected (views)"] / fl_f,
            "fwd corrected (copies) / 0.39 shipped": row["fwd corrected (copies)"] / row["fwd 0.39 shipped (no LSE)"],
            "fwd corrected (views) / 0.40": row["fwd corrected (views)"] / row["fwd 0.40 op"],
        }
        results[key] = {"ms": row, "ratios": ratios}
        print(f"\n{key}")
        for name, ms in row.items():
            print(f"  {name:<44} {ms:8.3f} ms")
        for name, ratio in ratios.items():
            print(f"  {name:<44} {ratio:8.2f}x")
    _layout.zero_copy = False
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
