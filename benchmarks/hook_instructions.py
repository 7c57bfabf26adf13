"""Instructions the import hook executes, counted by valgrind (callgrind): a repeatable figure for A/B.

    python benchmarks/hook_instructions.py [--rev REV] [--versions 0.39.0 0.42.1]

Wall-clock medians on a small shared machine move by 20-40 % between runs of the same code; instruction
counts repeat to within 0.01 %. So code changes meant to make the hook cheaper are compared here, and the
wall-clock targets are checked with ``bench_import.py`` (on the GPU machine's CPU, where they are quoted).
Instructions are not time: a cache-missing first call costs more per instruction than a warm loop.

Counted: package first, ``_hook.on_import`` (the hook-time modules' import, the checks, installing,
verification, the announcement); diffusers first, ``import diffusers_cudnn_fix`` (the package's import as
well, and the reference check). Collection starts and stops through callgrind's client requests, made from
a tiny C library built here with gcc (``valgrind/callgrind.h``), so the rest of the interpreter's life runs
uninstrumented. ``--rev``: the same counts for a git revision (checked out into a temporary worktree), side
by side. Needs valgrind, gcc and the releases in ``.cache/diffusers`` (``python tests/releases.py``);
about a minute per count.
"""

from __future__ import annotations

import argparse
import compileall
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from releases import release_dir  # noqa: E402

CONTROL_C = """
#include <valgrind/callgrind.h>
void count_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void count_stop(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION; }
"""

PACKAGE_FIRST = """
import ctypes, sys
counter = ctypes.CDLL(sys.argv[1])
import diffusers_cudnn_fix, wrapt
from diffusers_cudnn_fix import _hook
def counted(module):
    counter.count_start()
    _hook.on_import(module)
    counter.count_stop()
wrapt.importer._post_import_hooks["diffusers.models.attention_dispatch"] = [counted]
import diffusers.models.attention_dispatch
assert diffusers_cudnn_fix.status().ok
"""

DIFFUSERS_FIRST = """
import ctypes, sys
counter = ctypes.CDLL(sys.argv[1])
import diffusers.models.attention_dispatch, wrapt
counter.count_start()
import diffusers_cudnn_fix
counter.count_stop()
assert diffusers_cudnn_fix.status().ok
"""


def build_control(folder: Path) -> Path:
    source, library = folder / "count.c", folder / "libcount.so"
    source.write_text(CONTROL_C)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def count(root: Path, version: str, code: str, library: Path, out: Path) -> int:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join([str(release_dir(version)), str(root)])
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
         f"--callgrind-out-file={out}", sys.executable, "-c", code, str(library)],
        env=env, capture_output=True, text=True, cwd=str(root),  # `-c` puts the working directory first on sys.path
    )
    found = re.search(r"Collected : (\d+)", proc.stderr)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"valgrind run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rev", help="a git revision to count beside the working tree")
    parser.add_argument("--versions", nargs="+", default=["0.39.0", "0.42.1"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        library = build_control(folder)
        roots = {"working tree": ROOT}
        if args.rev:
            worktree = folder / "rev"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.rev],
                           check=True, capture_output=True)
            roots = {args.rev: worktree, **roots}
        try:
            for root in roots.values():
                compileall.compile_dir(str(root / "diffusers_cudnn_fix"), quiet=1)
            jobs = [(label, version, order, code) for version in args.versions
                    for order, code in (("package first", PACKAGE_FIRST), ("diffusers first", DIFFUSERS_FIRST))
                    for label in roots]
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                counts = list(pool.map(
                    lambda job: count(roots[job[0]], job[1], job[3], library, folder / f"cg-{jobs.index(job)}.out"),
                    jobs,
                ))
        finally:
            if args.rev:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder / "rev")],
                               capture_output=True)
    table = {(label, version, order): n for (label, version, order, _), n in zip(jobs, counts)}
    print(f"Python {sys.version.split()[0]}; instructions executed by the hook (millions)")
    header = f"{'diffusers':<10} {'order':<16}" + "".join(f"{label:>16}" for label in roots)
    print(header + ("   ratio" if args.rev else ""))
    for version in args.versions:
        for order in ("package first", "diffusers first"):
            row = [table[(label, version, order)] for label in roots]
            line = f"{version:<10} {order:<16}" + "".join(f"{n / 1e6:16.2f}" for n in row)
            print(line + (f"   {row[-1] / row[0]:.2f}" if args.rev else ""))


if __name__ == "__main__":
    main()
