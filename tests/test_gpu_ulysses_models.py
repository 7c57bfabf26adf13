"""Ulysses attention on the real kernels at world size 1 (issue #42): ``gpu_checks.ulysses_models`` per release in a
fresh interpreter, on one GPU (a one-process NCCL group: diffusers' own ``TemplatedUlyssesAttention`` at Ulysses
degree 1, with the package's forward and backward).

The two findings of #42 that a world of one process reaches, through the installed cuDNN ops and, where the release
has them, the native-flash ones: cross-attention with keys shorter than the queries (``ulysses_kv_length``: diffusers'
backward reshapes dK/dV with the queries' length, at any world size), at the threaded ring's head dim and a real
model's; and a per-head bool mask of padded keys (``ulysses_head_mask``'s path, cuDNN only: at degree 1 the rank holds
every head, so the mask must reach the op whole). Every case must be right within the probe's rule (5 x the error of
the same attention in bf16, + 1e-3, against fp32). The control: diffusers' shipped backward on the key-length case
raises or is wrong.

The GPU cases are marked ``gpu`` (skipped without a CUDA GPU, reason shown). The same check also runs on the CPU
stand-in kernels in a one-process gloo group (``test_ulysses_models_check_runs_on_the_cpu_standins``), so CI runs the
code the GPU session depends on, and it can be shown failing: with ``DIFFUSERS_CUDNN_FIX_SKIP=ulysses_kv_length``
every case goes through diffusers' own backward and raises.
"""

from __future__ import annotations

from typing import Any

import pytest
from releases import keep, release_dir, run

from diffusers_cudnn_fix.fixes import ulysses_kv_length

RELEASES = ("0.39.0", "0.42.1")
#: diffusers' own error: dK/dV reshaped with the queries' length.
SHIPPED_ERROR = "is invalid for input of size"
#: Every case the check runs on these releases (both have the native-flash ops), and its control.
CASES = {
    f"{backend}/{shape}/{kind}"
    for shape in ("tiny", "model")
    for backend, kind in (("cudnn", "kv_length"), ("flash", "kv_length"), ("cudnn", "head_mask"))
} | {"cudnn/model/kv_length/shipped backward"}


def assert_ulysses_models(result: dict[str, Any], *, device: str) -> None:
    cases = result["ulysses_models"]["cases"]
    assert result["ulysses_models"]["backward_replaced"], result["ulysses_models"]
    assert set(cases) == CASES, sorted(cases)
    for name, case in cases.items():
        if name.endswith("/shipped backward"):
            assert case["status"] in ("wrong", "raised"), (name, case)  # the control: the bug is there
        else:
            assert case["status"] == "pass", (name, case)
            if device == "cuda":
                assert case["rule_passed"], (name, case)


#: A layer stack's bf16 result against the same stack in fp32: rounding only (a wrong key is off by far more).
STACK_TOLERANCE = 5e-2
#: The least the two ways may differ by on a GPU: two units in the last place of bf16 at the largest gradient (as
#: verify's least tolerance). cuDNN's backward may accumulate in another order each run: on an H100 (session 20)
#: the two ways differed by 0.5 - 0.8 % of the largest input gradient, about one unit in the last place.
WAYS_FLOOR = 2 * 2**-7


def assert_mask_syncs(result: dict[str, Any], *, device: str) -> None:
    """Issue #40, item 3: one plan per step for the model's mask where the control planned in every layer, the
    same gradients both ways (within the kernels' run-to-run noise), both right. On a GPU a step's host syncs fall
    by one per layer after the first. The median step is compared: the first H100 run (session 19) took the most
    in any step and saw one sync more in the package's way; its ``sync_sites`` (session 20) put it in one step of
    ten, at a frame in an ``__init__.py``, not in the package."""
    found = result["ulysses_mask_syncs"]
    layers = found["stack"]["layers"]
    package, control = found["ways"]["package"], found["ways"]["per_gathered_tensor"]
    assert (package["plans"], control["plans"]) == (1, layers), found
    assert max(package["error"], control["error"]) <= STACK_TOLERANCE, found
    if device == "cpu":  # the stand-in kernels are deterministic: the same plan gives the very same gradients
        assert found["ways_differ_by"] == found["repeat_differs_by"] == 0, found
        return
    assert found["ways_differ_by"] <= max(4 * found["repeat_differs_by"], WAYS_FLOOR), found
    assert package["syncs"] <= control["syncs"] - (layers - 1), found


@pytest.mark.gpu
@pytest.mark.parametrize("version", RELEASES)
def test_ulysses_models_on_the_real_kernels(version: str) -> None:
    result = run(release_dir(version), "import gpu_checks; gpu_checks.main_ulysses_models()", timeout=300)
    result.pop("_stderr", None)
    keep(f"gpu-ulysses-models-{version}.json", result)
    assert_ulysses_models(result, device="cuda")
    assert_mask_syncs(result, device="cuda")


CPU_SCRIPT = """
import json, standin_kernels, gpu_checks
standin_kernels.register()
result = {"ulysses_models": gpu_checks.ulysses_models(device="cpu")}
result["ulysses_mask_syncs"] = gpu_checks.ulysses_mask_syncs(device="cpu")
print(json.dumps(result, default=str))
"""


@pytest.mark.parametrize("skip", [None, ulysses_kv_length.FIX_ID])
def test_ulysses_models_check_runs_on_the_cpu_standins(skip: str | None) -> None:
    """The GPU check's own code on the CPU stand-ins (both shapes, gloo), on 0.42.1; without the package's backward
    every case, cross-attention all of them, raises diffusers' reshape error (the check can fail)."""
    env = {"DIFFUSERS_CUDNN_FIX_SKIP": skip} if skip else {}
    result = run(release_dir("0.42.1"), CPU_SCRIPT, timeout=300, env=env)
    if skip is None:
        assert_ulysses_models(result, device="cpu")
        assert_mask_syncs(result, device="cpu")
        return
    assert not result["ulysses_models"]["backward_replaced"], result["ulysses_models"]
    cases = result["ulysses_models"]["cases"]
    assert set(cases) == CASES, sorted(cases)
    for name, case in cases.items():
        assert case["status"] == "raised" and SHIPPED_ERROR in case["error"], (name, case)
