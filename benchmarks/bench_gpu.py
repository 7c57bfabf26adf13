"""Side-by-side GPU timings of the corrected cuDNN ops, in one process, printed as ratios.

    python benchmarks/bench_gpu.py [--out results.json]
    python benchmarks/bench_gpu.py --dry-run   # on the CPU: what each section builds and calls, once, untimed

Exit status 1 when a section raised (its traceback is printed and kept in the results, the other sections run).
``--dry-run`` runs every section on the CPU stand-in kernels (``tests/standin_kernels.py``) at tiny shapes, each
timed call made once and not timed, so that a rename in the package or in diffusers fails there
(``tests/test_benchmarks.py``) rather than in a GPU session.

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
  shape first, as a training run's first attention call does), and later calls;
* masks (``--sections mask``), B=1 S=4096 H=24 D=128, a bool [B, 1, S, S] mask (key padding: the last
  eighth of the keys masked) reused by N=8 layers per step, mask mode ``convert``: the installed forward
  (guards + corrected op) for 8 layers with no mask, with an additive mask in q's dtype (passed on), with
  the bool mask converted once per step (the mask tensor is modified in place before each step, so the
  package's cache must convert it again, then serve the other 7 layers), with the same bool mask every step
  (cache hits only), and converted at every layer (modified before each layer: the cost without a cache).
  Every variant touches a mask-sized bool tensor the same number of times per step, so the in-place
  modification costs all of them the same. Ratios are of medians measured side by side in one process;
* key-padding masks (``--sections keypad``), B=1 S=4096 H=24 D=128: fwd+bwd of the installed op pair, driven as
  diffusers' templated attention drives it (``ctx.backward_op`` set, so the forward may run on the valid keys
  alone): no mask; a bool [B, 1, 1, S] mask padding the last 1/8, 1/4, 1/2 of the keys; the same masks on the
  biased path (a context whose backward op cannot scatter: what the package did before); 1/8 padded in the
  middle (QwenImage's joint sequence, gathered); an additive [B, 1, 1, S] mask; B=2 with 7/8 and 5/8 valid
  (trimmed with a bias); a [B, 1, S, S] mask that is not key padding (one query row sees one more key), with
  and without the fast path. Targets: key padding at 1/8 at most 1.0x the no-mask call, the speed-up growing
  with the padding; the non-key-padding mask never slower than the biased path. ``--release 0.42.1`` times
  diffusers' own ops behind the package's wrappers instead of 0.39.0's corrected ones.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from harness import op_pair, pair_config  # noqa: E402
from releases import release_dir  # noqa: E402

SHAPES = ((1, 4096, 24, 128), (2, 1024, 16, 64))
#: The one shape of the mask and key-padding sections.
SECTION_SHAPE = (1, 4096, 24, 128)
#: ``--dry-run``: tiny shapes of the same kinds (the key-padding section pads up to half of the keys by eighths).
DRY_SHAPES = ((1, 64, 2, 16), (2, 32, 2, 16))
DRY_SECTION_SHAPE = (1, 64, 2, 16)
CP = pair_config()
#: Set by ``--dry-run``: each timed call runs once, untimed (the timers below return 1.0 ms).
DRY_RUN = False


class Ctx:
    needs_input_grad = (True,) * 12

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors


def cuda_median_ms(fn: Callable[[], Any], warmup: int = 10, iters: int = 50) -> float:
    import torch

    if DRY_RUN:
        fn()
        return 1.0
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


def cuda_loop_ms(fn: Callable[[], Any], warmup: int = 2, iters: int = 15) -> float:
    """Mean time of ``iters`` calls of ``fn`` issued back to back (one synchronisation at the end), as the
    layers of a model run: the host's work for a call overlaps the GPU's work for the one before."""
    import torch

    if DRY_RUN:
        fn()
        return 1.0
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def interleaved_ratios(
    variants: dict[str, Callable[[], Any]],
    base: str,
    names: list[str],
    rounds: int = 12,
    iters: int = 15,
    timer: Callable[..., float] = cuda_median_ms,
) -> dict[str, dict[str, float]]:
    """For each of ``names``: its time over ``base``'s, per round (``timer`` over ``iters`` calls each, the two
    measured back to back, which one first alternating by round); the median, min and max of those ratios."""
    per_round: dict[str, list[float]] = {name: [] for name in names}
    rounds = 1 if DRY_RUN else rounds
    for index in range(rounds):
        for name in names:
            order = [base, name] if index % 2 == 0 else [name, base]
            got = {which: timer(variants[which], warmup=2, iters=iters) for which in order}
            per_round[name].append(got[name] / got[base])
    return {
        name: {"median": statistics.median(r), "min": min(r), "max": max(r), "rounds": float(len(r))}
        for name, r in per_round.items()
    }


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


def mask_section(
    m039: Any,
    torch: Any,
    dev: Any,
    results: dict[str, Any],
    layers: int = 8,
    shape: tuple[int, int, int, int] = SECTION_SHAPE,
) -> None:
    """Cost of the bool-mask conversion (``convert`` mode) on a real shape; see the module docstring."""
    import warnings

    import diffusers_cudnn_fix

    diffusers_cudnn_fix.set_mask_mode("convert")
    batch, seq, heads, dim = shape
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(batch, seq, heads, dim, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    keep = torch.ones(batch, 1, seq, seq, dtype=torch.bool, device=dev)
    keep[..., seq - seq // 8 :] = False  # key padding
    additive = torch.zeros(keep.shape, dtype=torch.bfloat16, device=dev).masked_fill_(~keep, float("-inf"))
    dummy = torch.ones_like(keep)
    fwd = m039._cudnn_attention_forward_op  # as installed: the guards around the (corrected) op
    ctx = Ctx()

    def touch(t: Any) -> None:  # a new version of the tensor, same values
        t.bitwise_not_().bitwise_not_()

    def layer(mask: Any) -> Any:
        return fwd(ctx, q, k, v, mask, 0.0, False, None, False, False, _save_ctx=True, _parallel_config=CP)

    def steps(mask: Any, per_step: Any, per_layer: Any) -> Callable[[], None]:
        def step() -> None:
            touch(per_step)
            for _ in range(layers):
                touch(per_layer)
                layer(mask)

        return step

    variants = {
        "no mask": steps(None, dummy, dummy),
        "additive bf16 mask (q's dtype), passed on": steps(additive, dummy, dummy),
        "bool mask, converted once per step (new version each step)": steps(keep, keep, dummy),
        "bool mask, same mask every step (cache hits only)": steps(keep, dummy, dummy),
        "bool mask, converted at every layer (cache defeated)": steps(keep, dummy, keep),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        same = (layer(keep) - layer(additive)).abs().max().item()
        ms = {name: cuda_median_ms(fn, warmup=5, iters=40) for name, fn in variants.items()}
        ms["conversion alone (zeros + masked_fill, one mask)"] = cuda_median_ms(
            lambda: torch.zeros(keep.shape, dtype=torch.bfloat16, device=dev).masked_fill_(~keep, float("-inf"))
        )
        ms["one touch (two in-place bitwise_not on the mask)"] = cuda_median_ms(lambda: touch(dummy))
    # Interleaved second pass: the same variants again, to see the run-to-run spread of these medians.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = {name: cuda_median_ms(fn, warmup=2, iters=40) for name, fn in variants.items()}
    diffusers_cudnn_fix.set_mask_mode("warn")
    base, add = ms["no mask"], ms["additive bf16 mask (q's dtype), passed on"]
    once = ms["bool mask, converted once per step (new version each step)"]
    ratios = {
        "additive / no mask": add / base,
        "bool converted once per step / no mask": once / base,
        "bool converted once per step / additive": once / add,
        "bool same mask (cache hits) / additive": ms["bool mask, same mask every step (cache hits only)"] / add,
        "bool converted every layer / converted once per step": ms[
            "bool mask, converted at every layer (cache defeated)"
        ]
        / once,
    }
    key = f"masks: B={batch} S={seq} H={heads} D={dim}, {layers} layer forwards per step"
    results[key] = {
        "ms_per_step": ms,
        "ms_per_step_second_pass": again,
        "ratios": ratios,
        "max_abs_diff_converted_vs_additive": same,
    }
    print(f"\n{key} (mask [B,1,S,S], last eighth of the keys masked; mode convert)")
    for name, value in ms.items():
        second = f"   (second pass {again[name]:8.3f})" if name in again else ""
        print(f"  {name:<62} {value:8.3f} ms{second}")
    for name, ratio in ratios.items():
        print(f"  {name:<62} {ratio:8.3f}x")
    print(f"  bool converted vs additive: max abs difference of the outputs {same}")


def kernel_times(fn: Callable[[], Any], torch: Any, calls: int = 10) -> str:
    """GPU kernel time per call of ``fn`` under torch.profiler: the total and the kernels that take most."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    if DRY_RUN:
        return "not profiled (dry run)"
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in kernels) / calls / 1000
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:6]
    parts = ", ".join(f"{e.key[:48]} {e.self_device_time_total / calls / 1000:.3f} ms x{e.count // calls}" for e in top)
    return f"{total:.3f} ms of kernels per call ({parts})"


def keypad_section(
    module: Any,
    torch: Any,
    dev: Any,
    results: dict[str, Any],
    shape: tuple[int, int, int, int] = SECTION_SHAPE,
    profile: bool = False,
) -> None:
    """Key-padding masks on the valid keys alone vs the biased path; see the module docstring."""
    import warnings

    import diffusers_cudnn_fix

    diffusers_cudnn_fix.set_mask_mode("convert")
    _, seq, heads, dim = shape
    fwd, bwd = module._cudnn_attention_forward_op, module._cudnn_attention_backward_op  # as installed

    # restoring: ctx.backward_op set before the forward op runs, as diffusers' templated classes do.
    pairs = {
        restoring: op_pair(fwd, bwd, parallel_config=CP, inputs="as_given", set_backward_op=restoring)
        for restoring in (True, False)
    }

    def tensors(batch: int) -> list[Any]:
        gen = torch.Generator(device=dev).manual_seed(batch)
        return [
            torch.randn(batch, seq, heads, dim, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_(i < 3)
            for i in range(4)
        ]

    inputs = {1: tensors(1), 2: tensors(2)}

    def keep_rows(batch: int, valid: list[tuple[int, int]]) -> Any:
        keep = torch.zeros(batch, seq, dtype=torch.bool, device=dev)
        for b, (start, stop) in enumerate(valid):
            keep[b, start:stop] = True
        return keep

    def key_mask(keep: Any) -> Any:
        return keep[:, None, None, :]

    def additive(mask: Any) -> Any:
        return torch.zeros(mask.shape, dtype=torch.bfloat16, device=dev).masked_fill_(~mask, float("-inf"))

    def call(mask: Any, restoring: bool = True, batch: int = 1) -> Callable[[], Any]:
        q, k, v, g = inputs[batch]

        def step() -> Any:
            out = pairs[restoring].apply(q, k, v, mask)
            return out, torch.autograd.grad(out, (q, k, v), g)

        return step

    def call_valid_keys_only(count: int) -> Callable[[], Any]:  # the limit: the op handed the valid keys, no mask
        q, k, v, g = inputs[1]

        def step() -> Any:
            out = pairs[True].apply(q, k[:, :count], v[:, :count], None)
            return out, torch.autograd.grad(out, (q, k, v), g)

        return step

    padded = {f"1/{n}": key_mask(keep_rows(1, [(0, seq - seq // n)])) for n in (8, 4, 2)}
    middle = keep_rows(1, [(0, seq)])
    middle[0, seq // 16 : seq // 16 + seq // 8] = False  # QwenImage: [text, its padding, image]
    rows = key_mask(keep_rows(1, [(0, seq - seq // 8)])).expand(1, 1, seq, seq).clone()
    rows[0, 0, 0, seq - 1] = True  # one query row sees one more key: not key padding
    variants: dict[str, Callable[[], Any]] = {"no mask": call(None)}
    variants["no mask, 7/8 of the keys (the limit for 1/8)"] = call_valid_keys_only(seq - seq // 8)
    for name, mask in padded.items():
        variants[f"key padding {name}, bool [B,1,1,S]"] = call(mask)
        variants[f"key padding {name}, bool [B,1,1,S], biased path"] = call(mask, restoring=False)
    variants["key padding 1/8 in the middle, bool [B,1,1,S] (gathered)"] = call(key_mask(middle))
    variants["key padding 1/8, additive bf16 [B,1,1,S]"] = call(additive(padded["1/8"]))
    variants["key padding 1/8, additive bf16 [B,1,1,S], biased path"] = call(additive(padded["1/8"]), False)
    variants["not key padding, bool [B,1,S,S]"] = call(rows)
    variants["not key padding, bool [B,1,S,S], biased path"] = call(rows, restoring=False)
    two = key_mask(keep_rows(2, [(0, seq - seq // 8), (0, seq - 3 * seq // 8)]))
    variants["B=2 no mask"] = call(None, batch=2)
    variants["B=2 key padding 1/8 and 3/8, bool [B,1,1,S]"] = call(two, batch=2)
    variants["B=2 key padding 1/8 and 3/8, bool [B,1,1,S], biased path"] = call(two, restoring=False, batch=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast_out, fast_grads = variants["key padding 1/8, bool [B,1,1,S]"]()
        biased_out, biased_grads = variants["key padding 1/8, bool [B,1,1,S], biased path"]()
        diffs = {
            name: (a - b).abs().max().item()
            for name, a, b in zip(("out", "dq", "dk", "dv"), (fast_out, *fast_grads), (biased_out, *biased_grads))
        }
        ms = {name: cuda_median_ms(fn) for name, fn in variants.items()}
        again = {name: cuda_median_ms(fn, warmup=3) for name, fn in variants.items()}
        # The target's ratio again, measured in rounds that alternate the two calls (clock and other drift
        # then hit both alike): the median of the per-round ratios, and their spread.
        # Two timings: each call on an idle GPU (synchronised per call: the host's work before the first kernel
        # counts in full) and calls issued back to back (a model's layers: the host runs ahead of the GPU).
        targets = ["no mask, 7/8 of the keys (the limit for 1/8)"]
        targets += [f"key padding {n}, bool [B,1,1,S]" for n in padded]
        rounds = {
            "per call": interleaved_ratios(variants, "no mask", targets),
            "back to back": interleaved_ratios(variants, "no mask", targets, timer=cuda_loop_ms),
        }
    base = ms["no mask"]
    ratios = {f"key padding {n} / no mask": ms[f"key padding {n}, bool [B,1,1,S]"] / base for n in padded}
    for n in padded:
        ratios[f"key padding {n} biased path / no mask"] = ms[f"key padding {n}, bool [B,1,1,S], biased path"] / base
    ratios["middle 1/8 (gathered) / no mask"] = ms["key padding 1/8 in the middle, bool [B,1,1,S] (gathered)"] / base
    ratios["additive 1/8 / no mask"] = ms["key padding 1/8, additive bf16 [B,1,1,S]"] / base
    ratios["additive 1/8 / its biased path"] = (
        ms["key padding 1/8, additive bf16 [B,1,1,S]"] / ms["key padding 1/8, additive bf16 [B,1,1,S], biased path"]
    )
    ratios["not key padding [B,1,S,S] / its biased path (<= ~1.0: never slower)"] = (
        ms["not key padding, bool [B,1,S,S]"] / ms["not key padding, bool [B,1,S,S], biased path"]
    )
    two_ms = ms["B=2 key padding 1/8 and 3/8, bool [B,1,1,S]"]
    ratios["B=2 1/8 and 3/8 / B=2 no mask"] = two_ms / ms["B=2 no mask"]
    ratios["B=2 1/8 and 3/8 / its biased path"] = (
        two_ms / ms["B=2 key padding 1/8 and 3/8, bool [B,1,1,S], biased path"]
    )
    key = f"key-padding masks: fwd+bwd, B=1 S={seq} H={heads} D={dim}, diffusers {module.__file__.split('/')[-4]}"
    results[key] = {
        "ms": ms,
        "ms_second_pass": again,
        "ratios": ratios,
        "max_abs_diff_fast_vs_biased_1_8": diffs,
        "interleaved_ratios_to_no_mask": rounds,
    }
    print(f"\n{key} (mode convert; fast path = the valid keys alone)")
    for name, value in ms.items():
        print(f"  {name:<62} {value:8.3f} ms   (second pass {again[name]:8.3f})")
    for name, ratio in ratios.items():
        print(f"  {name:<72} {ratio:6.3f}x")
    print(f"  fast vs biased path at 1/8, max abs difference: {diffs}")
    if profile:
        for name in ("no mask", "no mask, 7/8 of the keys (the limit for 1/8)", "key padding 1/8, bool [B,1,1,S]"):
            print(f"  profile of {name}: {kernel_times(variants[name], torch)}")
    for timing, found_by_name in rounds.items():
        for name, found in found_by_name.items():
            print(
                f"  interleaved ({timing}), {name} / no mask: median {found['median']:.3f}x over"
                f" {found['rounds']:.0f} rounds (min {found['min']:.3f}x, max {found['max']:.3f}x)"
            )


def main() -> None:
    global DRY_RUN
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--sections",
        default="probe,ops,mask,keypad",
        help="comma-separated: probe, ops, mask, keypad (and profile: keypad's kernels too)",
    )
    parser.add_argument("--release", default="0.39.0", help="diffusers release to import (probe/ops/mask need 0.39.0)")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU stand-ins, tiny shapes, nothing timed")
    args = parser.parse_args()
    DRY_RUN = args.dry_run
    if DRY_RUN:
        print("dry run: the CPU stand-in kernels at tiny shapes; every time below is a placeholder, not a measurement")
    sections = set(args.sections.split(","))
    sys.path.insert(0, str(release_dir(args.release)))
    import diffusers.models.attention_dispatch as m039
    import torch

    if DRY_RUN:
        import standin_kernels

        standin_kernels.register()  # before the package's import, as the tests do
    import diffusers_cudnn_fix
    from diffusers_cudnn_fix import _probe as probe

    assert diffusers_cudnn_fix.status().ok
    dev = torch.device("cpu" if DRY_RUN else "cuda")
    shapes, shape = (DRY_SHAPES, DRY_SECTION_SHAPE) if DRY_RUN else (SHAPES, SECTION_SHAPE)
    torch.ones(1, device=dev)  # the CUDA context exists from here on
    # Load cuDNN's SDPA engines with one call at a shape the probe does not use, as a training run's own first
    # attention call does: the probe's first call then pays for its own shapes only.
    warm = torch.randn(1, 4, 256, 128, device=dev, dtype=torch.bfloat16)
    torch.ops.aten._scaled_dot_product_cudnn_attention(warm, warm, warm, None, True)
    if not DRY_RUN:
        torch.cuda.synchronize()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": "none (dry run)" if DRY_RUN else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "command": "python benchmarks/bench_gpu.py " + " ".join(sys.argv[1:]),
    }

    # Each section on its own: one that raises is reported and fails the run (exit 1); the others still run.
    runs: dict[str, Callable[[], None]] = {
        "probe_and_ops": lambda: probe_and_ops(sections, results, torch, dev, m039, probe, shapes),
        "mask": lambda: mask_section(m039, torch, dev, results, shape=shape),
        "keypad": lambda: keypad_section(m039, torch, dev, results, shape=shape, profile="profile" in sections),
    }
    wanted = {"probe_and_ops": bool(sections & {"probe", "ops"}), "mask": "mask" in sections}
    wanted["keypad"] = "keypad" in sections
    failed = []
    for name, run in runs.items():
        if not wanted[name]:
            continue
        try:
            run()
        except Exception:
            import traceback

            results[f"{name}_failed"] = traceback.format_exc()
            print(f"\nsection {name} failed:\n{results[f'{name}_failed']}", file=sys.stderr)
            failed.append(name)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    if failed:
        sys.exit(f"bench_gpu.py: section(s) failed: {', '.join(failed)}")
    if DRY_RUN:
        print(f"dry run: sections {', '.join(n for n in runs if wanted[n])} built and called once each")


def probe_and_ops(
    sections: set[str],
    results: dict[str, Any],
    torch: Any,
    dev: Any,
    m039: Any,
    probe: Any,
    shapes: tuple[tuple[int, int, int, int], ...] = SHAPES,
) -> None:
    import diffusers_cudnn_fix
    from diffusers_cudnn_fix import _devices
    from diffusers_cudnn_fix._detect import CUDNN_FORWARD_KERNEL, refuses_gqa
    from diffusers_cudnn_fix._registry import callable_of
    from diffusers_cudnn_fix._target_names import CUDNN_BACKWARD, CUDNN_FORWARD
    from diffusers_cudnn_fix.targets import cudnn

    ops040 = load_040_ops()
    shipped_fwd = diffusers_cudnn_fix.get_original(CUDNN_FORWARD)
    # The corrected ops alone: the replacements built with the K/V and log-sum-exp corrections only.
    gqa_refused = refuses_gqa(callable_of(shipped_fwd), CUDNN_FORWARD_KERNEL)
    corrected_fwd = cudnn.forward_op(callable_of(shipped_fwd), frozenset({"cudnn_forward_lse"}), gqa_refused)
    corrected_bwd = cudnn.backward_op(
        callable_of(diffusers_cudnn_fix.get_original(CUDNN_BACKWARD)), frozenset({"cudnn_backward_kv"})
    )

    # The probe first: its first call in this process is what a training run pays.
    _devices._results.clear()
    t0 = time.perf_counter()
    first = probe.probe(dev)
    first_ms = (time.perf_counter() - t0) * 1e3
    later = []
    for _ in range(10):
        _devices._results.clear()
        t0 = time.perf_counter()
        probe.probe(dev)
        later.append((time.perf_counter() - t0) * 1e3)
    results["probe"] = {
        "state": first.state,
        "zero_copy": first.zero_copy,
        "first_ms": first_ms,
        "later_median_ms": statistics.median(later),
    }
    print(
        f"probe: {first.state}, zero-copy {first.zero_copy}; first call {first_ms:.1f} ms, "
        f"later calls median {statistics.median(later):.1f} ms"
    )
    if "ops" not in sections:
        return

    for batch, seq, heads, dim in shapes:
        key = f"B={batch} S={seq} H={heads} D={dim}"
        gen = torch.Generator(device=dev).manual_seed(0)
        q, k, v, g = (
            torch.randn(batch, seq, heads, dim, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4)
        )
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

        # Copies: the probe's verdict recorded without views; views: the probe's own trial switch.
        _devices.record(dataclasses.replace(first, zero_copy=False))
        call, ctx = fwd_of(corrected_fwd)
        row["fwd corrected (copies)"] = cuda_median_ms(call)
        row["bwd corrected (copies)"] = cuda_median_ms(lambda: corrected_bwd(ctx, g))
        with _devices.trying_views():
            call, ctx = fwd_of(corrected_fwd)
            row["fwd corrected (views)"] = cuda_median_ms(call)
            row["bwd corrected (views)"] = cuda_median_ms(lambda: corrected_bwd(ctx, g))
        _devices.record(first)
        call, ctx = fwd_of(m039._cudnn_attention_forward_op)
        row["fwd as installed (guards + corrected)"] = cuda_median_ms(call)
        call, _ = fwd_of(callable_of(shipped_fwd))
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


if __name__ == "__main__":
    main()
