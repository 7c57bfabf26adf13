"""Key-padding masks on real cuDNN (marker ``gpu``): the op on the valid keys alone against the biased path.

One fresh interpreter per release (0.39.0: the package's corrected op pair; 0.42.1: diffusers' own ops behind
the package's wrappers) runs ``subprocess_key_padding.main``: the fixed key-padding cases of
``tests/fixes/test_cudnn_bool_mask.py`` at a larger size and seeded random cases (B 1..3, fully padded batch
elements, every mask shape, bool and additive, padding in the middle), each run with the fast path and on the
biased path (a context whose backward op cannot scatter),
both against an fp32 reference; the dropped keys' dK/dV must be exactly 0. Set ``DIFFUSERS_CUDNN_FIX_RESULTS``
to keep the raw JSON (``gpu-key-padding-<version>.json``).
"""

from __future__ import annotations

import pytest
from releases import keep, release_dir, run
from subprocess_key_padding import RANDOM_CASES

pytestmark = pytest.mark.gpu

RELEASES = ("0.39.0", "0.42.1")


@pytest.mark.parametrize("version", RELEASES)
def test_key_padding_on_cudnn(version: str) -> None:
    result = run(release_dir(version), "import subprocess_key_padding as s; s.main()", timeout=300)
    result.pop("_stderr", None)
    keep(f"gpu-key-padding-{version}.json", result)
    failed = {n: r for n, r in result["fixed"].items() if not r["ok"]}
    failed.update({f"random {i}": r for i, r in enumerate(result["random"]) if not r["ok"]})
    assert not failed, failed
    assert result["fast_path_taken"] >= len(result["fixed"]) - 1 + RANDOM_CASES // 4, result["fast_path_taken"]
