"""Every launch order that differs: import diffusers' attention module, import the package, apply(), revert().

In the style of dd-trace-py's ``tests/contrib/patch.py``: each order that depends on what happens at the
*first* import of ``diffusers.models.attention_dispatch`` (who imports it, and whether the hook is armed
then) gets a fresh interpreter; the steps after that first import (apply / revert / re-apply, in any
order) do not depend on first-import state, so they run on in the same interpreter, and the state is
read after every step. Releases: 0.39.0 (every bug), 0.42.1 (only the guards) and 0.35.2 (nothing to do).

What is read after each step is what a user can observe (docs/behaviour.md, "apply / revert, in any
order"): ``is_patched(target)``, whether the module attribute is the object ``get_original(target)``
returns (and whether that is the very object diffusers shipped), ``status()`` fields, and, with the CPU
stand-in kernels, a real gradient of diffusers' cuDNN op pair (right when patched, wrong when reverted on
0.39.0) and what fp32 inputs do (refused when guarded, garbage when not).
"""

from __future__ import annotations

import pytest
from expected_fixes import applied
from releases import release_dir, run

pytestmark = pytest.mark.slow

FWD, BWD = "_cudnn_attention_forward_op", "_cudnn_attention_backward_op"
FLASH_BWD = "_native_flash_attention_backward_op"
TARGETS = (FWD, BWD, FLASH_BWD)

# The steps. "package": import diffusers_cudnn_fix; "diffusers": import diffusers' attention module.
PACKAGE, DIFFUSERS, APPLY, REVERT = "package", "diffusers", "apply", "revert"


# What each release looks like, patched and reverted.
PATCHED_TARGETS = {
    "0.39.0": {FWD, BWD, FLASH_BWD},
    # The mask and input-dtype guards wrap the forward, the masked-row guard the backward; the gradient ops are
    # right as shipped.
    "0.42.1": {FWD, BWD},
    "0.35.2": set(),  # the ops do not exist
}
APPLIED = {version: applied(version) for version in PATCHED_TARGETS}

# Expected states: "before" (diffusers' module not imported yet), "patched", "reverted".
BEFORE, PATCHED, REVERTED = "before", "patched", "reverted"


def _problems(version: str, snap: dict, state: str) -> list[str]:
    """What in one snapshot contradicts ``state``; empty when it matches."""
    where = f"after {snap['step']!r} (expected {state})"
    bad: list[str] = []

    def expect(what: str, got: object, want: object) -> None:
        if got != want:
            bad.append(f"{where}: {what} is {got!r}, expected {want!r}")

    if "patched" not in snap:  # the package is not imported yet: only diffusers' module can be
        return bad
    expect("queries_imported_it", snap["queries_imported_it"], False)
    expect("status().enabled", snap["enabled"], True)
    if state == BEFORE:
        expect("module loaded", snap["loaded"], False)
        expect("status().module_loaded", snap["module_loaded"], False)
        expect("is_patched", snap["patched"], {t: False for t in TARGETS})
        expect("applied fixes", snap["applied"], [])
        return bad
    patched = state == PATCHED
    want_patched = PATCHED_TARGETS[version] if patched else set()
    expect("module loaded", snap["loaded"], True)
    expect("status().module_loaded", snap["module_loaded"], True)
    expect("is_patched", snap["patched"], {t: t in want_patched for t in TARGETS})
    expect("module attribute is get_original()", snap["live_is_original"], {t: t not in want_patched for t in TARGETS})
    expect("get_original() is the shipped object", snap["original_is_shipped"], {t: True for t in TARGETS})
    expect("applied fixes", snap["applied"], APPLIED[version] if patched else [])
    # A release the table lists with a bug is not OK while that bug is unfixed.
    expect("status().ok", snap["ok"], patched or version == "0.35.2")
    expect("'NOT SAFE' in str(status())", "NOT SAFE" in snap["text"], not (patched or version == "0.35.2"))
    cudnn, fp32 = snap["grads"]["cudnn"], snap["grads"]["fp32"]
    if version == "0.35.2":
        expect("cudnn gradient", cudnn["status"], "absent")
    elif version == "0.39.0" and not patched:
        if cudnn["status"] == "pass":
            bad.append(f"{where}: the shipped 0.39.0 cuDNN gradient passed: the package is still in the path")
    else:
        expect("cudnn gradient", cudnn, {"status": "pass", "error": ""})
    if version != "0.35.2":
        refused = fp32["status"] == "raised" and "UnsafeAttentionError" in fp32["error"]
        expect("fp32 inputs refused with UnsafeAttentionError", refused, patched)
        if not patched:
            expect("fp32 inputs (unguarded: garbage)", fp32["status"], "wrong")
    return bad


def _run_order(version: str, steps: list[str], env: dict[str, str] | None = None) -> list[dict]:
    """``steps`` in a fresh interpreter (``subprocess_import_order``, forked preloaded); the snapshot after each."""
    script = f"import subprocess_import_order as s; s.main({TARGETS!r}, {steps!r})"
    result = run(release_dir(version), script, env=env, preloaded=True)
    snapshots = result["snapshots"]
    assert [s["step"] for s in snapshots] == steps
    return snapshots


def _check(version: str, snapshots: list[dict], states: list[str]) -> None:
    problems = [p for snap, state in zip(snapshots, states) for p in _problems(version, snap, state)]
    assert not problems, "\n".join(problems)


# Each order: the steps, and the state expected after each step. The first import of diffusers' module
# happens at a different point (and with the hook armed or not) in each: one interpreter per order.
ORDERS = {
    # Package first: the hook patches at diffusers' import; apply/revert/re-apply, each twice (idempotent).
    "package_diffusers_then_apply_revert": (
        [PACKAGE, DIFFUSERS, APPLY, REVERT, REVERT, APPLY, APPLY, REVERT, APPLY],
        [BEFORE, PATCHED, PATCHED, REVERTED, REVERTED, PATCHED, PATCHED, REVERTED, PATCHED],
    ),
    # Diffusers first: the hook fires at the package's import.
    "diffusers_package_then_revert_apply": (
        [DIFFUSERS, PACKAGE, REVERT, APPLY, REVERT, APPLY],
        [None, PATCHED, REVERTED, PATCHED, REVERTED, PATCHED],
    ),
    # revert() before diffusers is imported disarms the hook: the import patches nothing; apply() patches.
    "revert_before_diffusers_disarms": (
        [PACKAGE, REVERT, DIFFUSERS, APPLY, REVERT, APPLY],
        [BEFORE, BEFORE, REVERTED, PATCHED, REVERTED, PATCHED],
    ),
    # apply() before diffusers is imported imports it and patches; a later import changes nothing.
    "apply_before_diffusers": (
        [PACKAGE, APPLY, DIFFUSERS, REVERT, APPLY],
        [BEFORE, PATCHED, PATCHED, REVERTED, PATCHED],
    ),
    # revert() twice, then apply() before diffusers is imported: re-armed, imported, patched once.
    "revert_revert_apply_before_diffusers": (
        [PACKAGE, REVERT, REVERT, APPLY, DIFFUSERS, REVERT],
        [BEFORE, BEFORE, BEFORE, PATCHED, PATCHED, REVERTED],
    ),
}

# Every order on 0.39.0; elsewhere (guards only, nothing at all) the orders that differ by who imports
# diffusers' module, and with the hook armed or not: each interpreter costs seconds of torch import.
ELSEWHERE = (
    "package_diffusers_then_apply_revert",
    "diffusers_package_then_revert_apply",
    "revert_before_diffusers_disarms",
)
CASES = [
    pytest.param(version, name, id=f"{version}-{name}")
    for version in ("0.39.0", "0.42.1", "0.35.2")
    for name in ORDERS
    if version == "0.39.0" or name in ELSEWHERE
]


@pytest.mark.parametrize(("version", "name"), CASES)
def test_order(version: str, name: str) -> None:
    steps, states = ORDERS[name]
    _check(version, _run_order(version, steps), states)


def test_the_checks_catch_a_missing_patch() -> None:
    """The control: with the K/V correction left out, the very checks above must fail, and say where."""
    steps, states = ORDERS["package_diffusers_then_apply_revert"]
    snapshots = _run_order("0.39.0", steps[:4], env={"DIFFUSERS_CUDNN_FIX_SKIP": "cudnn_backward_kv"})
    with pytest.raises(AssertionError) as failure:
        _check("0.39.0", snapshots, states[:4])
    message = str(failure.value)
    assert "after 'diffusers' (expected patched): applied fixes" in message
    assert "cudnn gradient" in message
    # ... while the reverted state still matches, and is not taken for the patched one: the checks tell
    # the states apart.
    assert not _problems("0.39.0", snapshots[3], REVERTED)
    assert _problems("0.39.0", snapshots[3], PATCHED)
