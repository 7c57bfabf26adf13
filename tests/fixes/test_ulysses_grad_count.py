"""``ulysses_grad_count`` (fixes/ulysses_grad_count.py, #14274): 0.36.0's Ulysses backward returns 11 gradients for
the forward's 12 inputs, so every backend's backward raises. The package pads the gradients.

* The check: broken on 0.36.0, ok on 0.37.0 (fixed upstream).
* The policy and the control: 0.36.0 through diffusers' Ulysses attention, with the package (right) and
  without it (autograd's "incorrect number of gradients").

Each in a fresh interpreter (0.36.0 only). A training step on 0.36.0: tests/test_cp_training.py::test_036_recorded.
"""

from __future__ import annotations

import pytest
from releases import fix_states, release_dir, run

FIX = "ulysses_grad_count"
#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them).
CARRIES = frozenset({"0.36.0"})
CORRECTION = True  # a correction: the package makes the result right (False: a guard)


@pytest.mark.slow
def test_the_check_finds_the_bug_on_0_36_0_and_not_on_0_37_0() -> None:
    assert fix_states("0.36.0")[FIX] == ["broken", True, "fixed"]
    assert fix_states("0.37.0")[FIX] == ["ok", False, "not_needed"]


@pytest.mark.parametrize("order", ["package_first", "none"])
def test_ulysses_on_0_36_0(order: str) -> None:
    """0.36.0's Ulysses backward (11 gradients for 12 inputs) raises for every backend; padded, it is right."""
    result = run(release_dir("0.36.0"), f"import subprocess_ulysses_grads as s; s.main({order!r})", preloaded=True)
    cudnn = {k: v for k, v in result["cases"].items() if k.startswith("cudnn/")}
    if order == "none":
        assert all(v["status"] == "raised" for v in cudnn.values())
        assert any("incorrect number of gradients" in v["error"] for v in cudnn.values())
    else:
        assert {v["status"] for v in cudnn.values()} == {"pass"}, cudnn
