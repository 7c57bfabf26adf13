"""``cp_no_accelerator`` (fixes/cp_no_accelerator.py, #51 item 2): diffusers 0.42's
``ModelMixin._resolve_parallel_config`` computes ``rank % torch.accelerator.device_count()``, which is 0 on a CPU-
only torch: ``enable_parallelism`` raises ZeroDivisionError before anything runs (0.41.0 counted the CPU as one
device). The package runs diffusers' own method seeing an accelerator count of 1 where it is 0.

* The check: broken on 0.42.0 and 0.42.1, ok on 0.41.0 (its method counts the CPU), absent before (no such method).
* The policy and the control, on this CPU-only torch, two gloo ranks: a tiny Flux through diffusers' own
  ``enable_parallelism`` trains as one process with the package, raises ZeroDivisionError without it; on a machine
  with an accelerator the count is read through unchanged (a stand-in torch counting 2).
* ``verify --nproc 2`` on 0.42.1 with and without the package: tests/test_verify.py; every model on 0.42.1:
  tests/test_verify_models.py.
"""

from __future__ import annotations

import types

import pytest
from releases import RELEASES, fix_states, release_dir, run

FIX = "cp_no_accelerator"
#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them): 0.42.0 and
#: 0.42.1 divide by torch.accelerator.device_count(); 0.41.0 by torch.get_device_module("cpu").device_count(), 1.
CARRIES = frozenset({"0.42.0", "0.42.1"})
CORRECTION = True  # a correction: the package makes the result right (False: a guard)


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_the_check_finds_the_bug_on_0_42_only(version: str) -> None:
    found = fix_states(version, models_first=True)[FIX]
    if version in CARRIES:
        assert found == ["broken", True, "fixed"], version
    elif version == "0.41.0":
        assert found == ["ok", False, "not_needed"], version
    else:
        assert found == ["absent", False, "not_applicable"], version


@pytest.mark.parametrize("package", [True, False], ids=["package", "without-package"])
def test_context_parallelism_runs_on_a_cpu_only_torch_with_the_package(package: bool) -> None:
    """Two gloo ranks, a tiny Flux, diffusers' own enable_parallelism on 0.42.1: with the package it trains as one
    process does; without it, ZeroDivisionError (the control)."""
    script = "import subprocess_no_trace as s; s.train({!r})".format("package_first" if package else "without")
    found = run(release_dir("0.42.1"), script, preloaded=True)
    ranks = (found["0"], found["1"])
    if not package:
        assert all("ZeroDivisionError" in rank.get("error", "") for rank in ranks), found
        return
    assert not [rank.get("error") for rank in ranks if rank.get("error")], found
    import torch

    got, ref = torch.tensor(ranks[0]["grads"]), torch.tensor(found["one"]["grads"])
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_with_an_accelerator_the_count_is_read_through() -> None:
    """Where torch has an accelerator the policy changes nothing: its count, whatever it is, reaches diffusers."""
    from diffusers_cudnn_fix.fixes.cp_no_accelerator import torch_counting_the_cpu

    counts = iter([2, 0])
    stand_in = types.SimpleNamespace(accelerator=types.SimpleNamespace(device_count=lambda: next(counts)), x=7)
    seen = torch_counting_the_cpu(stand_in)
    assert seen.accelerator.device_count() == 2  # an accelerator: as it is
    assert seen.accelerator.device_count() == 1  # none: the CPU, one device
    assert seen.x == 7  # the rest read through
