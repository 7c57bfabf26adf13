"""Every release, both import orders, fresh interpreters: diffusers' own ops give reference gradients.

Each case drives diffusers' installed forward/backward op pair (cuDNN and native flash) on CPU stand-in
kernels, with return_lse False and True, for num_heads == seq_len, num_heads != seq_len and S_q != S_kv,
and compares out / dQ / dK / dV with an fp32 reference (``subprocess_op_pair_grads.py``). The same run without the
package must fail on the broken releases: that is what makes the passing runs mean something.

Two fresh interpreters per release, one per import order, each shared by the tests below (``_job``), forked
from one that has imported torch only (``releases.run(preloaded=True)``: diffusers and the package are
imported by each in its order):
package first; and diffusers first, which runs the control (diffusers as shipped, the package not
imported yet) before it imports the package. Both also run the cases through TemplatedUlyssesAttention.
"""

from __future__ import annotations

import expected_fixes
import pytest
from releases import BROKEN_CUDNN, BROKEN_FLASH, RELEASES, release_dir, run

pytestmark = pytest.mark.slow

SCRIPT = "import subprocess_op_pair_grads as s; s.main({order!r}, control={control!r}, ulysses={ulysses!r})"
# 0.36.0's Ulysses backward raises for every backend (11 gradients for 12 inputs):
# tests/fixes/test_ulysses_grad_count.py has it.
ULYSSES_RELEASES = tuple(v for v in RELEASES if v not in ("0.35.2", "0.36.0"))

_jobs: dict[tuple[str, str], object] = {}


def _job(version: str, order: str) -> dict:
    """The (cached) result of the interpreter for ``version`` and ``order``; a failure is cached and re-raised.

    conftest.py keeps the tests of one release on one pytest-xdist worker, so each job runs once.
    """
    key = (version, order)
    if key not in _jobs:
        control = order == "diffusers_first"
        script = SCRIPT.format(order=order, control=control, ulysses=version in ULYSSES_RELEASES)
        try:
            _jobs[key] = run(release_dir(version), script, preloaded=True)
        except BaseException as exc:
            _jobs[key] = exc
    result = _jobs[key]
    if isinstance(result, BaseException):
        raise AssertionError(f"diffusers {version}, {order}: the interpreter failed") from result
    assert result["version"] == version and result["order"] == order, (version, order, result["version"])
    return result


def _backend_cases(result: dict, backend: str) -> dict[str, dict]:
    return {k: v for k, v in result["cases"].items() if k.startswith(backend + "/")}


def _expect_absent(version: str, backend: str) -> bool:
    # 0.35.2 predates the templated ops; 0.36.0 has the cuDNN pair but no native-flash pair.
    return version == "0.35.2" or (backend == "flash" and version == "0.36.0")


@pytest.mark.parametrize("order", ["package_first", "diffusers_first"])
@pytest.mark.parametrize("version", RELEASES)
def test_gradients_match_reference_with_the_package(version: str, order: str) -> None:
    result = _job(version, order)
    assert result["imported_first"] == order.partition("_")[0], (version, order, result["imported_first"])
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
    expected = set(expected_fixes.applied(version))  # the one test-side table of fix ids
    assert applied == expected


@pytest.mark.parametrize("version", RELEASES)
def test_without_the_package_broken_releases_fail(version: str) -> None:
    """The control: the very same checks, package not imported (yet: the diffusers-first interpreter)."""
    result = _job(version, "diffusers_first")["control"]
    assert result["package_loaded"] is False and result["status"] is None
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


@pytest.mark.parametrize("order", ["package_first", "diffusers_first", "none"])
@pytest.mark.parametrize("version", ULYSSES_RELEASES)
def test_through_templated_ulysses_attention(version: str, order: str) -> None:
    """diffusers' own TemplatedUlyssesAttention in a one-process gloo group, both backends."""
    job = _job(version, "package_first") if order == "package_first" else _job(version, "diffusers_first")
    phase = job["control"] if order == "none" else job
    assert phase["package_loaded"] is (order != "none")
    cases = {"cases": phase["ulysses"]}
    for backend, broken in (("cudnn", BROKEN_CUDNN), ("flash", BROKEN_FLASH)):
        statuses = {k: v["status"] for k, v in _backend_cases(cases, backend).items()}
        assert statuses, (version, order, backend)
        if order == "none" and version in broken:
            assert all(s in ("wrong", "raised") for s in statuses.values()), statuses
        else:
            assert set(statuses.values()) == {"pass"}, _backend_cases(cases, backend)
