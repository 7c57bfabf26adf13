"""The package's own per-call cost on the installed cuDNN ops, this tree against another, side by side (CPU).

    python benchmarks/bench_hot_path.py --baseline PATH [--rounds 7] [--out results.json]

``PATH`` holds another version of the package (a ``git worktree`` of an older commit). Each round runs one fresh
interpreter per tree, alternating which goes first: diffusers 0.39.0 (every policy of the cuDNN pair installed),
the tests' CPU stand-in kernels, tiny bf16 tensors (B=1 S=8 H=2 D=16) so that the kernels cost little and the
Python around them shows. Timed per call (median of batches of calls): the installed forward op without a mask,
with a bool [B, 1, S, S] mask (converted once, then served from the cache), the installed backward, and, as the
floor, the stand-in forward kernel called bare; the forward's time less the floor is the package's part.
Printed: microseconds per call per tree, and the ratios this / baseline (median over rounds). On the GPU the host
runs ahead of the kernels when layers are issued back to back, so this bounds what the package's Python costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]
from releases import release_dir  # noqa: E402

CHILD = r"""
import json, statistics, sys, time, types, warnings
import torch
torch.set_num_threads(1)
import diffusers.models.attention_dispatch as module
import standin_kernels
import diffusers_cudnn_fix
standin_kernels.register()
diffusers_cudnn_fix.apply()
assert diffusers_cudnn_fix.__file__.startswith(sys.argv[1]), diffusers_cudnn_fix.__file__
warnings.simplefilter("ignore")
forward, backward = module._cudnn_attention_forward_op, module._cudnn_attention_backward_op
ctx = types.SimpleNamespace(needs_input_grad=(True,) * 12)
ctx.save_for_backward = lambda *t: setattr(ctx, "saved_tensors", t)
q, k, v, grad = (torch.randn(1, 8, 2, 16).to(torch.bfloat16) for _ in range(4))
mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
mask[0, ..., -2:] = False
kwargs = {"_save_ctx": True, "_parallel_config": None}
qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

def per_call_us(fn, batches=25, calls=40):
    for _ in range(calls):
        fn()
    found = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        found.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(found)

with torch.no_grad():
    def call(attn_mask):
        return lambda: forward(ctx, q, k, v, attn_mask, 0.0, False, None, False, False, **kwargs)

    out = {"forward, no mask": per_call_us(call(None)), "forward, bool mask": per_call_us(call(mask))}
    forward(ctx, q, k, v, None, 0.0, False, None, False, False, **kwargs)
    out["backward"] = per_call_us(lambda: backward(ctx, grad))
    out["floor: bare stand-in forward kernel"] = per_call_us(
        lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
            query=qt, key=kt, value=vt, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, is_causal=False
        )
    )
floor = out["floor: bare stand-in forward kernel"]
for name in ("forward, no mask", "forward, bool mask"):
    out[f"the package's part: {name} - floor"] = out[name] - floor
print(json.dumps(out))
"""


def measure(tree: Path) -> dict[str, float]:
    env_path = [str(release_dir("0.39.0")), str(tree), str(ROOT / "tests")]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": ":".join(env_path), "PATH": "/usr/bin:/bin"},
        cwd=tree,  # ``-c`` puts the working directory first on the path
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {proc.stderr}")
    result: dict[str, float] = json.loads(proc.stdout.splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a tree with another version of the package")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = {"this": ROOT, "baseline": args.baseline.resolve()}
    runs: dict[str, list[dict[str, float]]] = {"this": [], "baseline": []}
    for index in range(args.rounds):
        for name in ("this", "baseline") if index % 2 == 0 else ("baseline", "this"):
            runs[name].append(measure(trees[name]))
    names = list(runs["this"][0])
    print(f"per call, microseconds, median of {args.rounds} rounds (fresh interpreters, alternating order)")
    summary: dict[str, dict[str, float]] = {}
    for name in names:
        this = statistics.median(r[name] for r in runs["this"])
        base = statistics.median(r[name] for r in runs["baseline"])
        ratios = [a[name] / b[name] for a, b in zip(runs["this"], runs["baseline"], strict=True)]
        summary[name] = {"this_us": this, "baseline_us": base, "ratio_median": statistics.median(ratios)}
        print(f"  {name:<40} this {this:8.1f}   baseline {base:8.1f}   this/baseline {statistics.median(ratios):.3f}")
    if args.out:
        args.out.write_text(json.dumps({"baseline": str(args.baseline), "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
