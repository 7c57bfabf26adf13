"""Every release, both import orders, fresh interpreters: diffusers' own ops give reference gradients.

Each case drives diffusers' installed forward/backward op pair (cuDNN and native flash) on CPU stand-in
kernels, with return_lse False and True, for num_heads == seq_len, num_heads != seq_len and S_q != S_kv,
and compares out / dQ / dK / dV with an fp32 reference (``scenario_grads.py``). The same run without the
package must fail on the broken releases: that is what makes the passing runs mean something.
"""

from __future__ import annotations

import pytest
from releases import BROKEN_CUDNN, BROKEN_FLASH, RELEASES, release_dir, run

pytestmark = pytest.mark.slow

SCRIPT = "import scenario_grads; scenario_grads.main({order!r})"


def _backend_cases(result: dict, backend: str) -> dict[str, dict]:
    return {k: v for k, v in result["cases"].items() if k.startswith(backend + "/")}


def _expect_absent(version: str, backend: str) -> bool:
    # 0.35.2 predates the templated ops; 0.36.0 has the cuDNN pair but no native-flash pair.
    return version == "0.35.2" or (backend == "flash" and version == "0.36.0")


@pytest.mark.parametrize("order", ["package_first", "diffusers_first"])
@pytest.mark.parametrize("version", RELEASES)
def test_gradients_match_reference_with_the_package(version: str, order: str) -> None:
    result = run(release_dir(version), SCRIPT.format(order=order))
    assert result["version"] == version
    for backend in ("cudnn", "flash"):
        cases = _backend_cases(result, backend)
        if _expect_absent(version, backend):
            assert {c["status"] for c in cases.values()} == {"absent"}, cases
            continue
        failing = {k: v for k, v in cases.items() if v["status"] != "pass"}
        assert not failing, failing
    status = result["status"]
    assert status["ok"], status
    applied = {f["id"] for f in status["fixes"] if f["applied"]}
    expected = set()
    if version != "0.35.2":  # every release with the cuDNN CP op misreads masks and fp32 inputs
        expected |= {"cudnn_bool_mask", "cudnn_input_dtypes"}
    if version in BROKEN_CUDNN:
        expected |= {"cudnn_forward_lse", "cudnn_backward_kv", "ring_backward"}
    if version in BROKEN_FLASH:
        expected |= {"flash_backward_kv"}
    if version == "0.36.0":
        expected |= {"ulysses_grad_count"}
    assert applied == expected


@pytest.mark.parametrize("version", RELEASES)
def test_without_the_package_broken_releases_fail(version: str) -> None:
    """The control: the very same checks, package not imported."""
    result = run(release_dir(version), SCRIPT.format(order="none"))
    assert result["status"] is None
    for backend, broken in (("cudnn", BROKEN_CUDNN), ("flash", BROKEN_FLASH)):
        cases = _backend_cases(result, backend)
        if _expect_absent(version, backend):
            continue
        statuses = {k: v["status"] for k, v in cases.items()}
        if version in broken:
            # Every shape and both return_lse settings go wrong (garbage or a raise), not just some.
            assert all(s in ("wrong", "raised") for s in statuses.values()), statuses
            # num_heads == seq_len with the log-sum-exp present: shapes fit, so garbage comes back silently.
            assert statuses[f"{backend}/heads_eq_seq/return_lse=True"] == "wrong"
        else:
            assert set(statuses.values()) == {"pass"}, statuses


ULYSSES = "import scenario_ulysses; scenario_ulysses.main({order!r})"
# 0.36.0's Ulysses backward raises for every backend (11 gradients for 12 inputs): test_guards.py has it.
ULYSSES_RELEASES = tuple(v for v in RELEASES if v not in ("0.35.2", "0.36.0"))


@pytest.mark.parametrize("order", ["package_first", "none"])
@pytest.mark.parametrize("version", ULYSSES_RELEASES)
def test_through_templated_ulysses_attention(version: str, order: str) -> None:
    """diffusers' own TemplatedUlyssesAttention in a one-process gloo group, both backends."""
    result = run(release_dir(version), ULYSSES.format(order=order))
    for backend, broken in (("cudnn", BROKEN_CUDNN), ("flash", BROKEN_FLASH)):
        statuses = {k: v["status"] for k, v in _backend_cases(result, backend).items()}
        if order == "none" and version in broken:
            assert all(s in ("wrong", "raised") for s in statuses.values()), statuses
        else:
            assert set(statuses.values()) == {"pass"}, _backend_cases(result, backend)
