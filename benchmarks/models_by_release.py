"""Every model of ``verify --model list`` on every diffusers release that has it, with and without the package (CPU).

    python benchmarks/models_by_release.py [--jobs 2] [--out models.json]

For each release from 0.36.0 to 0.42.1 (under ``.cache/diffusers``, as the tests install them) and each model that
release ships with a context-parallel plan: ``diffusers-cudnn-fix verify --nproc 2 --model M --json`` (Ulysses 2 on
two gloo ranks, the ``native`` backend, bf16; LTX and LTX2 and QwenImage with ``--mask padded``), once with the
package and once ``--without-package``. 0.42.x runs through the tests' seam (``--preload verify_seams``: a CPU-only
torch has no accelerator count). Printed: a table of exit statuses and verdicts, release by model; ``--out``
keeps every run's verdict line. The README's model table and docs/verify.md quote it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from releases import RELEASES, release_dir  # noqa: E402

from diffusers_cudnn_fix._verify_models import MODELS  # noqa: E402

MASKED = ("qwen", "ltx", "ltx2")
VERDICTS = {0: "PASS", 1: "MISMATCH", 2: "COULD NOT RUN", 64: "USAGE"}


def has_plan(version: str, name: str) -> bool:
    """Whether ``version`` ships the model with a plan (read from its source file, as ``--model list`` does)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(release_dir(version)), str(ROOT)])}
    code = f"from diffusers_cudnn_fix._verify_models import MODELS, installed; print(installed(MODELS[{name!r}]))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    return proc.stdout.strip() == "plan"


def run(version: str, name: str, package: bool) -> dict[str, object]:
    args = ["--nproc", "2", "--model", name, "--preload", "verify_seams"]
    if name in MASKED:
        args += ["--mask", "padded"]
    if not package:
        args.append("--without-package")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFUSERS_CUDNN_FIX", "RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = os.pathsep.join([str(release_dir(version)), str(ROOT), str(ROOT / "tests")])
    proc = subprocess.run(
        [sys.executable, "-m", "diffusers_cudnn_fix", "verify", *args],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip
    lines = proc.stdout.rstrip().splitlines()
    verdict = next((line for line in reversed(lines) if line.startswith("verdict:")), proc.stderr[-300:])
    return {"release": version, "model": name, "package": package, "exit": proc.returncode, "verdict": verdict}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--release", action="append", help="only these releases (repeatable)")
    args = parser.parse_args()
    releases = args.release or RELEASES[RELEASES.index("0.36.0") :]
    cases = [
        (version, name, package)
        for version in releases
        for name, entry in MODELS.items()
        if entry.plan and has_plan(version, name)
        for package in (True, False)
    ]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda case: run(*case), cases))
    names = [name for name, entry in MODELS.items() if entry.plan]
    print("release  " + "  ".join(f"{name:>16}" for name in names) + "    (with the package / without)")
    for version in releases:
        cells = []
        for name in names:
            got = {r["package"]: r["exit"] for r in results if r["release"] == version and r["model"] == name}
            cells.append(f"{got[True]} / {got[False]}" if got else "-")
        print(f"{version:8} " + "  ".join(f"{cell:>16}" for cell in cells))
    print("\nexit: 0 PASS, 1 MISMATCH, 2 could not run (the verdict says why), - the release has no such model")
    for r in results:
        print(f"{r['release']} {r['model']:10} {'package' if r['package'] else 'without':7} {r['verdict']}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
