"""Import costs on the CPU, side by side in one run: interleaved fresh interpreters, min / median / max.

    python benchmarks/bench_import.py [--runs 9] [--versions 0.39.0 0.42.1] [--out FILE]

Every figure is given as the spread of the runs (min / median / max), so that one run on a loaded machine
cannot pass for the typical cost; the budgets are checked at the median.

* ``import wrapt`` vs ``import diffusers_cudnn_fix`` (diffusers absent). Budget: at most ``import wrapt``
  + 5 ms, loading neither torch, diffusers nor packaging.
* ``import diffusers.models.attention_dispatch`` (torch imported beforehand, untimed) with the package in
  either order. Each child measures diffusers' own import and the package's share (its import and its
  hook, which runs inside diffusers' import when the package came first) in the same interpreter; the
  figure is the median share. Budget: the package and its hook add at most 5 % to diffusers' import.

Children run with bytecode compiled (``compileall`` first), as an installed package does. Needs the
releases in ``.cache/diffusers`` (``python tests/releases.py``).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from releases import release_dir  # noqa: E402

IMPORT_ONE = """
import sys, time
t = time.perf_counter()
import {name}
heavy = [m for m in ("torch", "diffusers", "packaging") if m in sys.modules]
print((time.perf_counter() - t) * 1e3, ",".join(heavy) or "-")
"""

# Each child prints (diffusers' import without our share, our share) in ms, both measured in that child:
# wall medians of separate interpreters move by 10-20 % on a small shared machine, the share does not.
DIFFUSERS = {
    # Package first: our share is our import plus the hook, which runs inside diffusers' import.
    "package first": """
t = time.perf_counter()
import diffusers_cudnn_fix
from diffusers_cudnn_fix import _hook
ours = (time.perf_counter() - t) * 1e3
hooked = _hook.on_import
def timed(module):
    global ours
    t = time.perf_counter()
    hooked(module)
    ours += (time.perf_counter() - t) * 1e3
_hook.on_import = timed
import wrapt
wrapt.importer._post_import_hooks["diffusers.models.attention_dispatch"] = [timed]
before_hook = ours
t = time.perf_counter()
import diffusers.models.attention_dispatch
theirs = (time.perf_counter() - t) * 1e3 - (ours - before_hook)
""",
    # diffusers first: our share is our import, the hook included (it fires at once).
    "diffusers first": """
t = time.perf_counter()
import diffusers.models.attention_dispatch
theirs = (time.perf_counter() - t) * 1e3
t = time.perf_counter()
import diffusers_cudnn_fix
ours = (time.perf_counter() - t) * 1e3
""",
}
DIFFUSERS_CHILD = """
import time, sys
import torch
{imports}
assert sys.modules["diffusers_cudnn_fix"].status().ok
print(theirs, ours)
"""


def child(code: str, site: Path | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    inherited = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []  # e.g. a --target folder of wheels
    env["PYTHONPATH"] = os.pathsep.join(([str(site)] if site else []) + [str(ROOT)] + inherited)
    # cwd: `python -c` puts the working directory first on sys.path, so it must be the tree being measured.
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return proc.stdout.split()


def spread(values: list[float]) -> dict[str, float]:
    """min / median / max of repeated runs."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def fmt(s: dict[str, float], unit: str, signed: bool = False) -> str:
    f = "{:+.1f}" if signed else "{:.1f}"
    return " / ".join(f.format(s[k]) for k in ("min", "median", "max")) + f" {unit}"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--versions", nargs="+", default=["0.39.0", "0.42.1"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    compileall.compile_dir(str(ROOT / "diffusers_cudnn_fix"), quiet=1)
    results: dict = {
        "date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0], "runs": args.runs,
        "command": "python " + " ".join(sys.argv), "cpu": _cpu(), "cpus": os.cpu_count(),
    }  # fmt: skip
    results["load_average_at_start"] = os.getloadavg()[0]  # other work on the machine widens the spread
    print(
        f"{results['cpu']}, {results['cpus']} CPUs, Python {results['python']}, {args.runs} runs each, "
        f"load average {results['load_average_at_start']:.1f} at the start"
    )

    samples: dict[str, list[float]] = {"wrapt": [], "diffusers_cudnn_fix": []}
    heavy: set[str] = set()
    for _ in range(args.runs):  # interleaved, so drift on a busy machine hits both alike
        for name in samples:
            ms, loaded = child(IMPORT_ONE.format(name=name), None)
            samples[name].append(float(ms))
            if name == "diffusers_cudnn_fix" and loaded != "-":
                heavy.add(loaded)
    wrapt_ms, ours_ms = (spread(samples[n]) for n in ("wrapt", "diffusers_cudnn_fix"))
    # Paired: each run's two children ran back to back, so their difference sees the same load.
    diff_ms = spread([o - w for o, w in zip(samples["diffusers_cudnn_fix"], samples["wrapt"], strict=True)])
    within = diff_ms["median"] <= 5.0
    results["import"] = {
        "wrapt_ms": wrapt_ms, "package_ms": ours_ms, "package_minus_wrapt_ms": diff_ms,
        "within_budget_at_median": within, "heavy_modules_loaded": sorted(heavy),
    }  # fmt: skip
    print("min / median / max of the runs")
    print(f"import wrapt               {fmt(wrapt_ms, 'ms')}")
    print(f"import diffusers_cudnn_fix {fmt(ours_ms, 'ms')}")
    print(
        f"  paired difference        {fmt(diff_ms, 'ms', signed=True)} (budget +5 ms at the median: "
        f"{'within' if within else 'OVER'})"
    )
    print(f"  heavy modules loaded by it: {sorted(heavy) or 'none'}")

    for version in args.versions:
        site = release_dir(version)
        rows: dict[str, list[tuple[float, float]]] = {label: [] for label in DIFFUSERS}
        for i in range(args.runs):
            labels = list(DIFFUSERS) if i % 2 == 0 else list(DIFFUSERS)[::-1]
            for label in labels:
                theirs, ours = child(DIFFUSERS_CHILD.format(imports=DIFFUSERS[label]), site)
                rows[label].append((float(theirs), float(ours)))
        entry = {}
        print(f"diffusers {version}:")
        for label, pairs in rows.items():
            theirs = spread([p[0] for p in pairs])
            ours = spread([p[1] for p in pairs])
            share = spread([p[1] / p[0] * 100 for p in pairs])  # each child's own pair: the same load
            within = share["median"] <= 5.0
            entry[label] = {
                "diffusers_import_ms": theirs, "package_and_hook_ms": ours, "added_percent": share,
                "within_budget_at_median": within,
            }  # fmt: skip
            print(f"  {label}:")
            print(f"    import diffusers.models.attention_dispatch {fmt(theirs, 'ms')}")
            print(f"    the package and its hook                   {fmt(ours, 'ms')}")
            print(
                f"    added                                      {fmt(share, '%', signed=True)} "
                f"(budget +5 % at the median: {'within' if within else 'OVER'})"
            )
        results[version] = entry
    results["load_average_at_end"] = os.getloadavg()[0]
    print(f"load average {results['load_average_at_end']:.1f} at the end")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
