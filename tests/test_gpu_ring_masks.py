"""Ring attention with masks on the real kernels (issue #43): ``gpu_checks.ring_masks`` per release in a fresh
interpreter, on one GPU (a thread per ring rank, ring degrees 2 - 4: the package's ring at world size 1 reaches
the real cuDNN ops only this way).

Every mask kind and layout of ``threaded_ring.MASK_KINDS`` through the package's ring on the cuDNN ops must be
right within the probe's rule (5 x the error of the same attention in bf16, + 1e-3, against fp32) at both
shapes; a mask that masks nothing reaches no op. The flash ops take no mask: a masked ring on them is refused
(``UnsafeAttentionError``). The control: diffusers' own ring with a key-padding mask is wrong or raises on every
release (the package replaces it on all of them).

The GPU cases are marked ``gpu`` (skipped without a CUDA GPU, reason shown). The same check also runs on the CPU
stand-in kernels (``test_ring_masks_check_runs_on_the_cpu_standins``), so CI runs the code the GPU session
depends on, and it can be shown failing: with ``DIFFUSERS_CUDNN_FIX_SKIP=ring_grad_route`` every masked case
goes through diffusers' own ring.
"""

from __future__ import annotations

from typing import Any

import pytest
from releases import keep, release_dir, run

from diffusers_cudnn_fix.fixes import ring_grad_route

RELEASES = ("0.39.0", "0.42.1")


def assert_ring_masks(result: dict[str, Any], *, device: str) -> None:
    cases = result["ring_masks"]["cases"]
    assert result["ring_masks"]["ring_replaced"] == ["backward", "forward"], result["ring_masks"]
    assert {c.split("/")[2] for c in cases} == {"world=2", "world=3", "world=4"}, sorted(cases)
    for name, case in cases.items():
        if name.endswith("/shipped ring"):
            assert case["status"] in ("wrong", "raised"), (name, case)  # the control: the bug is there
        elif name.startswith("flash/"):
            assert case["status"] == "raised" and case["raised"] == "UnsafeAttentionError", (name, case)
        else:
            assert case["status"] == "pass", (name, case)
            if device == "cuda":
                assert case["rule_passed"], (name, case)
            assert (case["masked_calls"] == 0) == case["masks_nothing"], (name, case)


@pytest.mark.gpu
@pytest.mark.parametrize("version", RELEASES)
def test_ring_with_masks_on_the_real_kernels(version: str) -> None:
    result = run(release_dir(version), "import gpu_checks; gpu_checks.main_ring_masks()", timeout=300)
    result.pop("_stderr", None)
    keep(f"gpu-ring-masks-{version}.json", result)
    assert_ring_masks(result, device="cuda")


CPU_SCRIPT = """
import json, standin_kernels, gpu_checks
standin_kernels.register()
gpu_checks.RING_MASK_SHAPES = {"tiny": gpu_checks.RING_MASK_SHAPES["tiny"]}
print(json.dumps({"ring_masks": gpu_checks.ring_masks(device="cpu")}, default=str))
"""


@pytest.mark.parametrize("skip", [None, ring_grad_route.FIX_ID])
def test_ring_masks_check_runs_on_the_cpu_standins(skip: str | None) -> None:
    """The GPU check's own code on the CPU stand-ins (tiny shape), on 0.42.1; without the package's ring every
    masked cuDNN case is wrong or raises at some degree (the check can fail)."""
    env = {"DIFFUSERS_CUDNN_FIX_SKIP": skip} if skip else {}
    result = run(release_dir("0.42.1"), CPU_SCRIPT, timeout=300, env=env)
    if skip is None:
        assert_ring_masks(result, device="cpu")
        return
    assert result["ring_masks"]["ring_replaced"] == [], result["ring_masks"]
    statuses = {
        name: case["status"]
        for name, case in result["ring_masks"]["cases"].items()
        if name.startswith("cudnn/") and case.get("masked_calls", 1) and "padded_chunk" in name
    }
    assert statuses and any(status != "pass" for status in statuses.values()), statuses
