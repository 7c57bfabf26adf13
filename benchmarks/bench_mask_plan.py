"""Step time and host syncs of a layer stack under Ulysses with a padded-prompt mask: the key-padding plan kept for
the model's mask (the package) against one plan per layer (as before issue #40, item 3), side by side.

    python benchmarks/bench_mask_plan.py [--release 0.42.1] [--tokens 4096 --layers 24] [--out result.json]
    python benchmarks/bench_mask_plan.py --dry-run   # on the CPU stand-in kernels, a tiny stack, two steps

One fresh interpreter per release: ``tests/gpu_checks.ulysses_mask_syncs`` (diffusers' ``TemplatedUlyssesAttention``
as installed, in a one-process NCCL group, on the package's cuDNN ops; bf16; the mask made once per step and handed
to every layer, which diffusers all-gathers in every layer), the two ways' steps interleaved. Printed per way:
plans and host syncs per step (``torch.cuda.set_sync_debug_mode``; the median step's, and the most in a step), the
median step time, the error against fp32 (a deep stack of random layers amplifies bf16 rounding: there only the two
ways' difference, printed after them beside one way's difference between two runs, says they compute the same),
and the ratio of the step times (per-layer plan / package).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]
from releases import release_dir, run  # noqa: E402

CHILD = """
import json, gpu_checks
{register}
print(json.dumps(gpu_checks.ulysses_mask_syncs(device={device!r}, stack={stack!r}, steps={steps!r})))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", action="append", help="diffusers release (repeatable; default 0.39.0, 0.42.1)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dry-run", action="store_true", help="on the CPU stand-in kernels: a tiny stack, untimed")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    stack = (2, 32, 2, 16, 4) if args.dry_run else (1, args.tokens, 24, 128, args.layers)
    steps = 2 if args.dry_run else args.steps
    register = "import standin_kernels; standin_kernels.register()" if args.dry_run else ""
    results = {}
    for version in args.release or ["0.39.0", "0.42.1"]:
        child = CHILD.format(register=register, device=device, stack=stack, steps=steps)
        found = run(release_dir(version), child, timeout=600)
        found.pop("_stderr", None)
        results[version] = found
        ways = found["ways"]
        print(f"diffusers {version}, {found['stack']}, padding {found['padding']}:")
        for way, row in ways.items():
            syncs = "-" if row["syncs"] is None else f"{row['syncs']:g} (most {row['syncs_max']})"
            timed = "(dry run)" if args.dry_run else f"{row['step_ms']:8.2f} ms"
            print(f"  {way:<20} plans {row['plans']:>3}  syncs {syncs:>10}  step {timed}  error {row['error']:.2e}")
        print(
            f"  the two ways' input gradients differ by at most {found['ways_differ_by']:.3g} (relative); two runs "
            f"of one way by {found['repeat_differs_by']:.3g}"
        )
        if not args.dry_run:
            ratio = ways["per_gathered_tensor"]["step_ms"] / ways["package"]["step_ms"]
            print(f"  step time, one plan per layer / the package's: {ratio:.3f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
