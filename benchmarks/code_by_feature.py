"""Code lines of the package by what they are for: what dropping a feature would save.

python3 benchmarks/code_by_feature.py

Counts as ``code_size.py`` does (lines holding code), per top-level statement, and adds each statement to the
feature ``OWNERS`` names for it (``path:name``), else to its file's (``path``); a fix module not listed is its
fix's ("fix <id>"), any other file a feature of its own ("other: <path>"), so the table always adds up to
``code_size.py``'s total.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from code_size import code_line_numbers

ROOT = Path(__file__).resolve().parents[1] / "diffusers_cudnn_fix"

CORE = "core: hook, registry, fix table, switches, warnings, status, public API"
HARNESS = "CPU checks: the recorded-ATen harness"
CONTRACT = "CPU checks: torch's ATen op contract"
STAND_INS = "CPU checks: Ulysses runs on stand-in collectives"
REBIND = "rebinding copies of shipped ops in other modules"
PLUMBING = "replacements: cuDNN / flash / Ulysses wrappers, layout helpers"
KEY_PADDING = "key-padding trim (speed: valid keys only)"
ZERO_COPY = "zero-copy views (speed: verified per device by the probe)"
PROBE = "GPU probe (first CUDA call, per device)"
DOCTOR = "doctor (the command line's default)"
LAUNCHER = "run: the launcher and its start-up hook"
VERIFY = "verify: a tiny real transformer, CP against one process"
RING = "fix ring_grad_route"


def _each(path: str, names: str, feature: str) -> dict[str, str]:
    return {f"{path}:{name}": feature for name in names.split()}


#: ``path`` (relative to the package) or ``path:name`` (a top-level statement) -> feature.
OWNERS = {
    **dict.fromkeys(
        ("__init__.py", "_hook.py", "_fix.py", "_switches.py", "_warnings.py", "_report.py", "_target_names.py"), CORE
    ),
    **dict.fromkeys(("_registry.py", "fixes/__init__.py", "_key_padding.py:remembered"), CORE),
    **_each("_registry.py", "_SCAN_SKIP _scanned_package _rebind_references", REBIND),
    **dict.fromkeys(("targets/__init__.py", "targets/cudnn.py", "targets/ulysses.py", "targets/flash.py"), PLUMBING),
    "targets/ulysses.py:backward": "fix ulysses_grad_count",
    "targets/flash.py:guarded_backend": "fix flash_cp_ignored",
    "targets/ring.py": RING,
    "_layout.py": PLUMBING,
    **_each("_layout.py", "aligned kernel_layout", ZERO_COPY),
    "_key_padding.py": KEY_PADDING,
    "_detect.py": HARNESS,
    **_each("_detect.py", "ATEN_SIGNATURES aten_signature _meta_lse_ndim _difference aten_contract_problem", CONTRACT),
    **_each(
        "_detect.py",
        "with_globals with_stand_ins FAKE_MESH ReachedOp _all_gather "
        "ULYSSES_STAND_INS ULYSSES_ANYTHING_STAND_INS _reach_op call_ulysses mask_entering _reach_gather op_reached "
        "run_ulysses_backward",
        STAND_INS,
    ),
    **_each("_detect.py", "RING_FORWARD_PARAMS installed_ring ring_collectives run_ring", RING),
    **dict.fromkeys(("_probe.py", "_devices.py"), PROBE),
    **_each("_devices.py", "trying_views zero_copy_allowed", ZERO_COPY),
    "__main__.py": DOCTOR,
    **_each("__main__.py", "RUN_EXIT_STATUSES RUN_DESCRIPTION", LAUNCHER),
    **dict.fromkeys(("_launcher.py", "site-bootstrap/sitecustomize.py"), LAUNCHER),
    "_verify.py": VERIFY,
}


def _statement_name(node: ast.stmt) -> str:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return node.name
    if isinstance(node, ast.Assign | ast.AnnAssign):
        return ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)
    return ""  # imports, ``if __name__ == ...``: the file's feature


def owner(path: str, name: str) -> str:
    if f"{path}:{name}" in OWNERS:
        return OWNERS[f"{path}:{name}"]
    if path in OWNERS:
        return OWNERS[path]
    return f"fix {Path(path).stem}" if path.startswith("fixes/") else f"other: {path}"


def main() -> None:
    totals: Counter[str] = Counter()
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text()
        lines = code_line_numbers(source)
        for node in ast.parse(source).body:
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            count = sum(1 for n in lines if first <= n <= (node.end_lineno or node.lineno))
            totals[owner(path.relative_to(ROOT).as_posix(), _statement_name(node))] += count
    for feature, count in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"{count:6d}  {feature}")
    print(f"{sum(totals.values()):6d}  total")


if __name__ == "__main__":
    main()
