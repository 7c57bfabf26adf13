"""How many of the package's own Python functions one attention call runs, by path (CPU, a call tracer).

    python benchmarks/trace_calls.py [--release 0.42.1] [--out calls.json]

In a fresh interpreter per release: diffusers' attention module with the package applied and the tests' CPU
stand-in kernels; ``TemplatedUlyssesAttention`` at degree 1 (its collectives answered in-process) on the
installed cuDNN ops, bf16 (B=1 S=8 H=2 D=16). Each path is called a few times first (the mask's conversion and
plan are then served from the cache, as in every layer after the first), then once under ``sys.setprofile``:
every Python call whose code lives in the package is counted, by function. Paths: the op pair without a mask and
with a bool key-padding mask, and the Ulysses forward without a mask, with a sequence-local bool mask (gathered
by diffusers) and with a joint-length one. Printed: the count per path and the functions behind it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]
from releases import release_dir, run  # noqa: E402

CHILD = r"""
import collections, json, sys, types, warnings
import torch
import diffusers.models.attention_dispatch as module
import standin_kernels
import diffusers_cudnn_fix
from harness import op_pair, pair_config, ulysses_attention, ulysses_config
standin_kernels.register()
diffusers_cudnn_fix.apply()
warnings.simplefilter("ignore")
package = diffusers_cudnn_fix.__file__.rpartition("/")[0]
module._all_to_all_single = lambda x, group=None: x
def all_gather(out, tensor, group=None):
    for part in out:
        part.copy_(tensor)
module.dist = types.SimpleNamespace(all_gather=all_gather)
config = ulysses_config(types.SimpleNamespace(get_group=lambda: None), ulysses_degree=1)
q, k, v = (torch.randn(1, 8, 2, 16).to(torch.bfloat16).requires_grad_() for _ in range(3))
keep = torch.ones(1, 1, 1, 8, dtype=torch.bool)
keep[..., -2:] = False
joint = keep.expand(1, 1, 8, 8).contiguous()  # made once, as a model hands one mask to every layer
pair = op_pair(module._cudnn_attention_forward_op, module._cudnn_attention_backward_op,
               parallel_config=pair_config(), set_backward_op=True)
paths = {
    "op pair, no mask": lambda: pair.apply(q, k, v, None),
    "op pair, bool key-padding mask": lambda: pair.apply(q, k, v, keep),
    "Ulysses forward, no mask": lambda: ulysses_attention(module, q, k, v, None, config=config),
    "Ulysses forward, bool mask (sequence-local, gathered)": lambda: ulysses_attention(
        module, q, k, v, keep, config=config),
    "Ulysses forward, bool mask [B, 1, S, S]": lambda: ulysses_attention(module, q, k, v, joint, config=config),
}
result = {}
for name, call in paths.items():
    for _ in range(3):
        call()
    counts = collections.Counter()
    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            counts[frame.f_code.co_qualname] += 1
    sys.setprofile(tracer)
    try:
        call()
    finally:
        sys.setprofile(None)
    result[name] = {"calls": sum(counts.values()), "by_function": dict(counts.most_common())}
print(json.dumps({"version": __import__("diffusers").__version__, "paths": result}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", action="append", help="diffusers release (repeatable; default 0.39.0, 0.42.1)")
    parser.add_argument("--out", type=Path, help="write the counts as JSON here")
    args = parser.parse_args()
    results = {}
    for version in args.release or ["0.39.0", "0.42.1"]:
        found = run(release_dir(version), CHILD, timeout=300)
        found.pop("_stderr", None)
        results[version] = found["paths"]
        print(f"diffusers {version}: package calls per attention call")
        for path, counted in found["paths"].items():
            print(f"  {counted['calls']:4d}  {path}")
            for function, n in counted["by_function"].items():
                print(f"          {n:3d}  {function}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
