"""Where the import hook's time goes, per phase: medians of fresh interpreters (a diagnostic beside
``bench_import.py``, whose figures are the ones the targets are held to).

    python benchmarks/hook_phases.py [--runs 11] [--versions 0.39.0 0.42.1] [--out FILE]

Each child loads diffusers' attention module in the given order. The package's hook-time modules are
imported first and timed as one phase (in real use the hook imports them, or, diffusers first,
``import diffusers_cudnn_fix`` does); then the hook runs with each phase timed: each fix's check, build and
verification, the reference check (diffusers first only: references counted, ``sys.modules`` scanned
only if something else holds a shipped op), the announcement, and, overlapping those, the cyclic
garbage collector's collections.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from releases import release_dir  # noqa: E402

CHILD = r"""
import gc, json, os, sys, time
T = time.perf_counter
out = {}
gc_on = [False, 0.0]
def gc_clock(phase, info):
    if gc_on[0]:
        if phase == "start":
            gc_on[1] = T()
        else:
            out["(gc collections, inside the above)"] = out.get("(gc collections, inside the above)", 0.0) + (T() - gc_on[1]) * 1e3
gc.callbacks.append(gc_clock)
late = sys.argv[1] == "diffusers_first"
if late:
    import diffusers.models.attention_dispatch
else:
    import torch  # diffusers loads it before its attention module, so before the hook
import wrapt
os.environ["DIFFUSERS_CUDNN_FIX"] = "0"  # import without the hook firing; it is run by hand below
gc_on[0] = True
t = T()
import diffusers_cudnn_fix
import diffusers_cudnn_fix._registry as registry, diffusers_cudnn_fix.fixes
out["imports (package and hook-time modules)"] = (T() - t) * 1e3
import diffusers_cudnn_fix._probe  # untimed: the hook imports it only where CUDA is up
gc_on[0] = False
del os.environ["DIFFUSERS_CUDNN_FIX"]
from diffusers_cudnn_fix import _hook, _probe

def timed(name, fn):
    def wrapper(*args, **kwargs):
        t = T()
        try:
            return fn(*args, **kwargs)
        finally:
            out[name] = out.get(name, 0.0) + (T() - t) * 1e3
    return wrapper

apply_one = registry._apply_one
registry._apply_one = lambda module, fix, *, skip: timed("fix " + fix.id, apply_one)(module, fix, skip=skip)
registry._rebind_references = timed("references (counted; scanned if held)", registry._rebind_references)
registry._announce = timed("announce", registry._announce)

def on_import(module):
    gc_on[0] = True
    t = T()
    _hook.on_import(module)
    out["hook (all but imports)"] = (T() - t) * 1e3
    gc_on[0] = False
if late:
    _hook._late = True
    on_import(sys.modules["diffusers.models.attention_dispatch"])
else:
    _hook._late = False
    wrapt.register_post_import_hook(on_import, "diffusers.models.attention_dispatch")
    import diffusers.models.attention_dispatch
assert diffusers_cudnn_fix.status().ok
out["total"] = out["imports (package and hook-time modules)"] + out["hook (all but imports)"]
print(json.dumps(out))
"""


def child(order: str, site: Path) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    inherited = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), *inherited])
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, order], env=env, capture_output=True, text=True, check=True, cwd=str(ROOT)
    )
    return json.loads(proc.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--versions", nargs="+", default=["0.39.0", "0.42.1"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    compileall.compile_dir(str(ROOT / "diffusers_cudnn_fix"), quiet=1)
    results: dict = {"date": time.strftime("%Y-%m-%d"), "command": "python " + " ".join(sys.argv), "runs": args.runs}
    for version in args.versions:
        for order in ("package_first", "diffusers_first"):
            rows = [child(order, release_dir(version)) for _ in range(args.runs)]
            names = list(dict.fromkeys(k for row in rows for k in row))
            table = {n: statistics.median(row.get(n, 0.0) for row in rows) for n in names}
            results[f"{version} {order}"] = table
            print(f"diffusers {version}, {order} (medians of {args.runs}, ms):")
            for name, ms in table.items():
                print(f"  {name:<45} {ms:7.2f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
