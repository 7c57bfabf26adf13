"""``diffusers-cudnn-fix verify`` on a CUDA GPU with the real cuDNN and flash kernels (marker ``gpu``; skipped
with the reason shown where there is none). docs/verify.md.

diffusers runs no context parallelism in a world of one (``ContextParallelConfig`` refuses Ulysses and ring
degree 1), so the PASS checks need one GPU per rank over NCCL (two GPUs or more): the same tiny model,
diffusers' own ``enable_parallelism``, the real ``_native_cudnn`` / ``_native_flash`` kernels, eager and
inductor-compiled, on 0.39.0 (the package's corrections) and 0.42.1 (upstream's ops behind the package's
guards): PASS; the control, 0.39.0 ring degree 2 on cuDNN without the package: MISMATCH (exit 1).
``benchmarks/verify_two_gpu.sh`` runs them by hand. On one GPU: a world of one is refused with the way out,
and two ranks sharing the GPU over gloo end, without a hang, in a verdict or a plain "could not run" (on an
H200 with torch 2.11, rank 1 was killed by SIGSEGV in the context-parallel step: docs/verify.md).
``DIFFUSERS_CUDNN_FIX_RESULTS``: a folder for each run's JSON (``verify-<case>.json``).
"""

from __future__ import annotations

import pytest
from releases import keep
from test_verify import result, verify

pytestmark = pytest.mark.gpu

RELEASES = ("0.39.0", "0.42.1")
BACKENDS = ("_native_cudnn", "_native_flash")
TIMEOUT_S = 420  # inductor compiles the model in each rank
ONE_GPU = ("--nproc", "2", "--dist-backend", "gloo")


def _keep(name: str, found: dict) -> None:
    keep(f"verify-{name}.json", found)


def _two_gpus() -> bool:
    import torch

    return torch.cuda.device_count() >= 2


def test_a_world_of_one_is_refused_on_the_gpu() -> None:
    code, out, err, _ = verify("0.39.0", "--nproc", "1", timeout=TIMEOUT_S)
    assert code == 2, f"{out}\n{err}"
    assert "needs at least 2 ranks" in out


def test_two_ranks_sharing_one_gpu_over_gloo_end_in_a_verdict_or_say_why() -> None:
    code, out, err, wall = verify("0.39.0", *ONE_GPU, "--json", timeout=TIMEOUT_S)
    found = result(out)
    found["wall_s"] = round(wall, 1)
    _keep("0.39.0-one-gpu-gloo", found)
    assert code in (0, 2), f"exit {code}\n{out}\n{err}"  # never a MISMATCH on the corrected ops, never a hang
    if code == 2:
        assert "killed by" in found["reason"] or "gloo" in found["reason"], found


@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA GPUs (NCCL, one GPU per rank)")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("version", RELEASES)
def test_verify_passes_over_nccl_on_the_real_kernels(version: str, backend: str, compiled: bool) -> None:
    args = ("--nproc", "2", "--backend", backend, "--json", *(("--compile",) if compiled else ()))
    code, out, err, wall = verify(version, *args, timeout=TIMEOUT_S)
    found = result(out)
    found["wall_s"] = round(wall, 1)
    _keep(f"{version}-{backend}-{'compiled' if compiled else 'eager'}", found)
    assert code == 0, f"exit {code}\n{out}\n{err}"
    assert found["setup"]["device"].startswith("cuda") and found["setup"]["package_ok"]


@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA GPUs (NCCL, one GPU per rank)")
def test_verify_finds_the_039_ring_without_the_package_on_the_gpu() -> None:
    args = ("--nproc", "2", "--ring", "2", "--backend", "_native_cudnn", "--without-package", "--json")
    code, out, err, _ = verify("0.39.0", *args, timeout=TIMEOUT_S)
    found = result(out)
    _keep("0.39.0-ring2-without-package", found)
    assert code == 1, f"exit {code}\n{out}\n{err}"
    assert found["verdict"] == "mismatch"


@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA GPUs (NCCL, one GPU per rank)")
@pytest.mark.parametrize("ring", ["1", "2"], ids=["ulysses2", "ring2"])
@pytest.mark.parametrize("version", RELEASES)
def test_verify_passes_over_nccl(version: str, ring: str) -> None:
    code, out, err, _ = verify(version, "--nproc", "2", "--ring", ring, "--json", timeout=TIMEOUT_S)
    found = result(out)
    _keep(f"{version}-nccl-ring{ring}", found)
    assert code == 0, f"exit {code}\n{out}\n{err}"


@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA GPUs (NCCL, one GPU per rank)")
@pytest.mark.parametrize("package", [True, False], ids=["package", "without-package"])
def test_helios_under_ring_over_nccl(package: bool) -> None:
    """#51 under ring attention on the real cuDNN kernels (on a CPU Helios' cross-attention, which diffusers runs
    outside context parallelism, has no ``_native_cudnn`` kernel): the package's correction PASS, the control
    MISMATCH."""
    flag = () if package else ("--without-package",)
    args = ("--nproc", "2", "--ring", "2", "--model", "helios", "--json", *flag)
    code, out, err, _ = verify("0.42.1", *args, timeout=TIMEOUT_S)
    found = result(out)
    _keep(f"0.42.1-helios-ring2-{'package' if package else 'without-package'}", found)
    assert code == (0 if package else 1), f"exit {code}\n{out}\n{err}"
