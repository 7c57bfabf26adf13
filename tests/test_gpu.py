"""GPU checks on real cuDNN (marker ``gpu``; skipped with the reason shown where there is no such GPU).

Each release runs ``scenario_gpu.py`` in a fresh interpreter. Set ``DIFFUSERS_CUDNN_FIX_RESULTS`` to a folder
to keep each release's raw JSON (``gpu-results-<version>.json``); results/ in the repository holds the ones
quoted in the README.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from releases import release_dir, run

pytestmark = pytest.mark.gpu

RELEASES = ("0.36.0", "0.39.0", "0.42.1")
CORRECTED = ("0.36.0", "0.39.0")


@pytest.fixture(scope="module", params=RELEASES)
def gpu_result(request) -> dict:
    version = request.param
    result = run(release_dir(version), "import scenario_gpu; scenario_gpu.main()", timeout=480)
    result.pop("_stderr", None)
    folder = os.environ.get("DIFFUSERS_CUDNN_FIX_RESULTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, f"gpu-results-{version}.json").write_text(json.dumps(result, indent=1))
    return result


def test_probe_fails_on_shipped_ops_and_passes_on_corrected_ones(gpu_result: dict) -> None:
    probes = gpu_result["probes"]
    if gpu_result["version"] in CORRECTED:
        assert probes["shipped"]["state"] == "failed", probes["shipped"]  # proof the probe can fail
    else:
        assert probes["shipped"]["state"] == "passed", probes["shipped"]  # 0.42.1: nothing to correct
    assert probes["corrected"]["state"] == "passed", probes["corrected"]
    backends = {c["backend"] for c in probes["corrected"]["cases"]}
    assert backends == ({"cudnn"} if gpu_result["version"] == "0.36.0" else {"cudnn", "flash"})
    # Its cost is measured by benchmarks/bench_gpu.py, not asserted here.


def test_templated_ulysses_attention_over_nccl_gives_reference_gradients(gpu_result: dict) -> None:
    for case, result in gpu_result["ulysses_nccl"].items():
        assert "raised" not in result, (case, result)
        assert result["passed"], (case, result)


def test_mask_conversion_against_math_sdpa(gpu_result: dict) -> None:
    masks = gpu_result["masks"]
    converted = masks["bool mask, mode convert"]
    assert not converted["nan"] and converted["dead_row_max"] == 0.0
    assert max(converted["errors"].values()) < 0.05, converted
    passed_through = masks["bool mask, mode warn"]
    assert passed_through["errors"]["out"] > 0.5, passed_through  # the bug, on real cuDNN
    assert "UnsafeAttentionError" in masks["bool mask, mode error"]["raised"]
