"""One launch order in a fresh interpreter, for ``tests/test_ordering.py``: import diffusers' attention module,
import the package, ``apply()``, ``revert()``, in the order given, and what a user can observe after each step.

Run with one diffusers release first on ``PYTHONPATH`` (``releases.run`` does it)::

    python -c "import subprocess_import_order as s; s.main(TARGETS, ['diffusers', 'package', 'revert'])"

Prints one JSON line, ``{"snapshots": [...]}``, one snapshot per step (``snapshot`` says what is read). Imports
neither diffusers nor the package until a step does: the first import of diffusers' module is what the orders
differ in.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

warnings.simplefilter("always")
MOD = "diffusers.models.attention_dispatch"
TARGETS: tuple[str, ...] = ()
shipped: dict[str, Any] = {}  # what the module held before the package could touch it (only seen with diffusers first)
first_original: dict[str, Any] = {}
standins: list[bool] = []


def grads(module: Any) -> dict[str, Any]:
    import subprocess_op_pair_grads

    if not standins:
        import standin_kernels

        standin_kernels.register()
        standins.append(True)
    case = subprocess_op_pair_grads.CASES[0]  # num_heads == seq_len: no shape check can catch a transposition
    out = {}
    # return_lse=False is the training path (0.39.0's shipped forward saves no log-sum-exp there).
    out["cudnn"] = subprocess_op_pair_grads.run_case(module, "cudnn", case, False)
    out["fp32"] = subprocess_op_pair_grads.run_case(module, "cudnn", case, True, dtype="float32")
    return {k: {"status": v["status"], "error": v.get("error", "")} for k, v in out.items()}


def snapshot(step: str) -> dict[str, Any]:
    s: dict[str, Any] = {"step": step, "loaded": MOD in sys.modules}
    pkg = sys.modules.get("diffusers_cudnn_fix")
    if pkg is None:
        if s["loaded"]:
            module = sys.modules[MOD]
            shipped.update({t: getattr(module, t, None) for t in TARGETS})
        return s
    report = pkg.status()
    data = report.to_dict()
    s["ok"] = report.ok
    s["text"] = str(report)
    s["enabled"] = data["enabled"]
    s["module_loaded"] = data["module_loaded"]
    s["applied"] = sorted(f["id"] for f in data["fixes"] if f["applied"])
    s["patched"] = {t: pkg.is_patched(t) for t in TARGETS}
    originals = {t: pkg.get_original(t) for t in TARGETS}
    # Asking must not import diffusers' module (that would change every order that follows).
    s["queries_imported_it"] = not s["loaded"] and MOD in sys.modules
    if s["loaded"]:
        module = sys.modules[MOD]
        s["live_is_original"] = {t: getattr(module, t, None) is originals[t] for t in TARGETS}
        s["original_is_shipped"] = {}
        for t in TARGETS:
            first_original.setdefault(t, originals[t])
            same = originals[t] is first_original[t] and (t not in shipped or originals[t] is shipped[t])
            # Never one of the package's own objects (a hook and an apply() both patching would do that).
            foreign = originals[t] is not None and getattr(originals[t], "__module__", "") != MOD
            s["original_is_shipped"][t] = same and not foreign
        s["grads"] = grads(module)
    return s


def main(targets: tuple[str, ...], steps: list[str]) -> None:
    """Run ``steps`` (each ``package``, ``diffusers``, ``apply`` or ``revert``) on ``targets``; print the snapshots."""
    global TARGETS
    TARGETS = tuple(targets)
    snapshots = []
    for step in steps:
        if step == "package":
            import diffusers_cudnn_fix
        elif step == "diffusers":
            import diffusers.models.attention_dispatch  # noqa: F401
        elif step == "apply":
            diffusers_cudnn_fix.apply()
        elif step == "revert":
            diffusers_cudnn_fix.revert()
        else:
            raise ValueError(step)
        snapshots.append(snapshot(step))
    print(json.dumps({"snapshots": snapshots}))
