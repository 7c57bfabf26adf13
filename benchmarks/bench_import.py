"""Import costs on the CPU, side by side in one run: medians of interleaved fresh interpreters.

    python benchmarks/bench_import.py [--runs 9] [--versions 0.39.0 0.42.1] [--out FILE]

* ``import wrapt`` vs ``import diffusers_cudnn_fix`` (diffusers absent). Budget: at most ``import wrapt``
  + 5 ms, loading neither torch, diffusers nor packaging.
* ``import diffusers.models.attention_dispatch`` (torch imported beforehand, untimed) without the package,
  and with it in either order (package first: ``import diffusers_cudnn_fix`` then diffusers' module, both
  timed; diffusers first: the same two imports the other way round). Budget: the package and its hook add
  at most 5 % to diffusers' import.

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

DIFFUSERS = {
    "without the package": "import diffusers.models.attention_dispatch",
    "package first": "import diffusers_cudnn_fix\nimport diffusers.models.attention_dispatch",
    "diffusers first": "import diffusers.models.attention_dispatch\nimport diffusers_cudnn_fix",
}
DIFFUSERS_CHILD = """
import time, sys
import torch
t = time.perf_counter()
{imports}
elapsed = (time.perf_counter() - t) * 1e3
ours = sys.modules.get("diffusers_cudnn_fix")
assert ours is None or ours.status().ok
print(elapsed)
"""


def child(code: str, site: Path | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    inherited = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []  # e.g. a --target folder of wheels
    env["PYTHONPATH"] = os.pathsep.join(([str(site)] if site else []) + [str(ROOT)] + inherited)
    # cwd: `python -c` puts the working directory first on sys.path, so it must be the tree being measured.
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return proc.stdout.split()


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
    print(f"{results['cpu']}, {results['cpus']} CPUs, Python {results['python']}, {args.runs} runs each")

    samples: dict[str, list[float]] = {"wrapt": [], "diffusers_cudnn_fix": []}
    heavy: set[str] = set()
    for _ in range(args.runs):  # interleaved, so drift on a busy machine hits both alike
        for name in samples:
            ms, loaded = child(IMPORT_ONE.format(name=name), None)
            samples[name].append(float(ms))
            if name == "diffusers_cudnn_fix" and loaded != "-":
                heavy.add(loaded)
    wrapt_ms, ours_ms = (statistics.median(samples[n]) for n in ("wrapt", "diffusers_cudnn_fix"))
    results["import"] = {"wrapt_ms": wrapt_ms, "package_ms": ours_ms, "heavy_modules_loaded": sorted(heavy)}
    print(f"import wrapt               median {wrapt_ms:7.1f} ms")
    print(f"import diffusers_cudnn_fix median {ours_ms:7.1f} ms  (+{ours_ms - wrapt_ms:.1f} ms; budget +5 ms)")
    print(f"  heavy modules loaded by it: {sorted(heavy) or 'none'}")

    for version in args.versions:
        site = release_dir(version)
        times: dict[str, list[float]] = {label: [] for label in DIFFUSERS}
        for i in range(args.runs):
            labels = list(DIFFUSERS) if i % 2 == 0 else list(DIFFUSERS)[::-1]
            for label in labels:
                times[label].append(float(child(DIFFUSERS_CHILD.format(imports=DIFFUSERS[label]), site)[0]))
        base = statistics.median(times["without the package"])
        entry = {"without_ms": base}
        print(f"diffusers {version}: import diffusers.models.attention_dispatch median {base:7.1f} ms")
        for label in ("package first", "diffusers first"):
            med = statistics.median(times[label])
            added = (med - base) / base * 100
            entry[label] = {"median_ms": med, "added_percent": added}
            print(f"  with the package, {label:<15}: median {med:7.1f} ms (+{added:.1f} %; budget +5 %)")
        results[version] = entry
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
