"""The cuDNN context-parallel path under ``torch.compile`` on the GPU (marker ``gpu``).

Each release runs ``subprocess_compile_matrix`` on CUDA in a fresh interpreter (real cuDNN kernels, a one-rank NCCL
group, bf16 B=2 S=256 H=8 D=64, the shape the compile fault was measured at): not compiled, inductor with
``fullgraph=True``, inductor allowing graph breaks, and ``mode="max-autotune-no-cudagraphs"``; every mask kind
(none; bool, additive bf16, additive fp32, each key-padding [B, 1, 1, S] and [B, 1, S, S]); through the op
pair and through diffusers' own ``TemplatedUlyssesAttention``. Every case is within the suite's fp32 rule and
0.02 of fp32 (out and each gradient), and a compiled case within 0.02 of the eager one. Set
``DIFFUSERS_CUDNN_FIX_RESULTS`` to a folder to keep each release's raw JSON (``gpu-compile-<version>.json``).
"""

from __future__ import annotations

import pytest
from releases import keep, release_dir, run

pytestmark = pytest.mark.gpu

#: The error bound the issue's table asks for, against fp32 eager attention.
LIMIT = 0.02


#: One head per rank (here with q/k/v one element off 16 bytes): on the H200 under inductor such calls gave
#: wrong gradients (out 0.71, dK 0.96 off fp32; eager right), so the package refuses them while tracing: an error
#: with fullgraph=True, the call run eagerly without it.
ONE_HEAD = "pair-odd-offset-h1"
FULLGRAPH = ("inductor", "max-autotune")


def _refused(name: str) -> bool:
    return ONE_HEAD in name and name.split("/")[0] in FULLGRAPH


@pytest.fixture(
    scope="module",
    params=[("0.36.0", "package_first"), ("0.39.0", "diffusers_first"), ("0.42.1", "diffusers_first")],
    ids=lambda p: p[0],
)
def compiled_cases(request) -> dict:
    version, order = request.param
    result = run(
        release_dir(version),
        f"import subprocess_compile_matrix as s; s.main({order!r}, s.GPU_BACKENDS, device='cuda')",
        timeout=540,
    )
    # The interpreter's own exit, after the compiled Ulysses path with bool masks: no traceback the package caused
    # (the mask cache's weakref callback once ran after module teardown: "Exception ignored in ... remembered").
    stderr = result.pop("_stderr", "")
    assert "Exception ignored" not in stderr, stderr[-4000:]
    keep(f"gpu-compile-{version}.json", result)
    return result["cases"]


def _bad(cases: dict) -> dict:
    return {
        name: case
        for name, case in cases.items()
        if case["status"] != "pass" or max(case["errors"].values()) > LIMIT or case.get("from_eager", 0.0) > LIMIT
    }


def test_compiled_masked_attention_on_cudnn(compiled_cases: dict) -> None:
    for name in filter(_refused, compiled_cases):
        case = compiled_cases[name]
        assert case["status"] == "raised" and "inside a torch.compile graph" in case["error"], (name, case)
    bad = _bad({name: case for name, case in compiled_cases.items() if not _refused(name)})
    assert not bad, bad
