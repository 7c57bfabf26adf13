"""GPU checks on real cuDNN (marker ``gpu``; skipped with the reason shown where there is no such GPU).

Each release runs ``gpu_checks.py`` in a fresh interpreter. Set ``DIFFUSERS_CUDNN_FIX_RESULTS`` to a folder
to keep each release's raw JSON (``gpu-results-<version>.json``); results/ in the repository holds the ones
quoted in the README and docs/doctor.md.

The launch matrix (``test_launch_order``): {package imported first, diffusers first} x {CUDA untouched before
the imports, CUDA initialised, a one-rank NCCL group initialised} x {0.36.0, 0.39.0, 0.42.1}, plus one run
under a real ``torchrun --nproc-per-node 1``; each case is ``gpu_launch_order.py`` in its own process group
with a timeout (``DCF_LAUNCH_TIMEOUT``, default 90 s; a case takes 10-15 s): a hang fails that case, with
the hung process's stacks (faulthandler, 10 s before the timeout) in the failure, and the group is killed.
The cases run side by side (``DCF_LAUNCH_JOBS``, default 8) on the one GPU. Raw JSON:
``launch-<version>-<order>-<state>.json``.

Training stacks (``test_training_stack_*``): ``gpu_training_stacks.py`` per release (0.39.0, 0.42.1), a small
QwenImage with padded prompts at world size 1 over NCCL, eager / inductor / autocast / checkpointing against
fp32 (docs/cp-training-tests.md). Raw JSON: ``gpu-stacks-<version>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from releases import ROOT, TESTS, keep, release_dir, run

pytestmark = pytest.mark.gpu

RELEASES = ("0.36.0", "0.39.0", "0.42.1")
CORRECTED = ("0.36.0", "0.39.0")


@pytest.fixture(scope="module", params=RELEASES)
def gpu_result(request) -> dict:
    version = request.param
    result = run(release_dir(version), "import gpu_checks; gpu_checks.main()", timeout=480)
    result.pop("_stderr", None)
    keep(f"gpu-results-{version}.json", result)
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


def assert_ring_chunks(ring: dict, version: str) -> None:
    """Ring attention with 2, 3 and 4 chunks (a thread per ring rank) on the real kernels.

    The package replaces the ring forward and backward on every release with ring attention
    (``ring_grad_route``): every case through it is right, within the probe's rule. The
    control, diffusers' own ring with the same ops: wrong or raises on <= 0.39; on 0.40+ right at 2 chunks and
    wrong K/V gradients from 3 (docs/kernel-facts.md).
    """
    assert ring["ring_patched"] is True, ring
    assert ring["ring_replaced"] == ["backward", "forward"], ring
    worlds = {case.split("/")[1] for case in ring["cases"]}
    assert worlds == {"world=2", "world=3", "world=4"}, worlds
    for case, result in ring["cases"].items():
        if not case.endswith("/shipped ring"):
            assert result["status"] == "pass" and result["rule_passed"] is True, (case, result)
        elif version in CORRECTED:
            assert result["status"] in ("wrong", "raised"), (case, result)
        elif "world=2" in case:
            assert result["status"] == "pass" and result["rule_passed"] is True, (case, result)
        else:
            assert result["status"] == "wrong" and result["rule_passed"] is False, (case, result)
            assert result["errors"]["out"] < 0.05 and result["errors"]["dq"] < 0.05, (case, result)


def test_ring_with_several_chunks_on_one_gpu(gpu_result: dict) -> None:
    assert_ring_chunks(gpu_result["ring_chunks"], gpu_result["version"])


def test_ring_at_degrees_3_and_4_on_040() -> None:
    """0.40.0, the first release with diffusers' own (misrouted) ring backward: only the ring cases (0.42.1 runs
    them in ``gpu_result``)."""
    result = run(release_dir("0.40.0"), "import gpu_checks; gpu_checks.main_ring()", timeout=240)
    result.pop("_stderr", None)
    keep("gpu-results-ring-0.40.0.json", result)
    assert result["version"] == "0.40.0"
    assert_ring_chunks(result["ring_chunks"], "0.40.0")


def test_mask_conversion_against_math_sdpa(gpu_result: dict) -> None:
    masks = gpu_result["masks"]
    converted = masks["bool mask, mode convert"]
    assert not converted["nan"] and converted["dead_row_max"] == 0.0
    assert max(converted["errors"].values()) < 0.05, converted
    passed_through = masks["bool mask, mode warn"]
    assert passed_through["errors"]["out"] > 0.5, passed_through  # the bug, on real cuDNN
    assert "UnsafeAttentionError" in masks["bool mask, mode error"]["raised"]


def test_fully_masked_rows_with_one_key_get_right_gradients(gpu_result: dict) -> None:
    """S_kv = 1, bf16, fully masked query rows: right through the installed ops (the masked-row guard); the
    backward it wraps, on the same inputs, returns wrong dQ/dK/dV on the real kernel (the control)."""
    cases = gpu_result["one_key_masked_rows"]
    assert cases["guarded"], cases
    for name in ("bool (converted)", "additive bf16, fill -inf", "additive bf16, fill finfo.min"):
        assert "raised" not in cases[name] and max(cases[name].values()) < 0.05, (name, cases[name])
    control = cases["additive bf16, fill -inf, unguarded"]
    assert control["out"] < 0.05 and max(control["dq"], control["dk"], control["dv"]) > 0.2, control


# --- launch orders -----------------------------------------------------------------------------------------

ORDERS = ("package_first", "diffusers_first")
CUDA_STATES = ("cold", "cuda", "nccl")
LAUNCH_CASES = (
    *((v, o, c) for v in RELEASES for o in ORDERS for c in CUDA_STATES),
    ("0.39.0", "package_first", "torchrun"),
)
LAUNCH_TIMEOUT = float(os.environ.get("DCF_LAUNCH_TIMEOUT", "90"))
LAUNCH_JOBS = int(os.environ.get("DCF_LAUNCH_JOBS", "8"))
_SWITCHES = ("DIFFUSERS_CUDNN_FIX", "DIFFUSERS_CUDNN_FIX_SKIP", "DIFFUSERS_CUDNN_FIX_MASK", "DIFFUSERS_CUDNN_FIX_PROBE")


def _case_id(case: tuple[str, str, str]) -> str:
    return "-".join(case)


def _launch(case: tuple[str, str, str]) -> dict[str, Any]:
    """One case in a fresh process group; killed (the whole group) at the timeout."""
    version, order, state = case
    env = {k: v for k, v in os.environ.items() if k not in _SWITCHES}
    paths = [str(release_dir(version)), str(ROOT), str(TESTS)]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("PYTHONWARNINGS", "default")
    env["DCF_LAUNCH_TIMEOUT"] = str(LAUNCH_TIMEOUT)
    result_file = Path(tempfile.mkdtemp(prefix="dcf-launch-")) / "result.json"
    env["DCF_LAUNCH_RESULT"] = str(result_file)
    script = [str(TESTS / "gpu_launch_order.py"), "--order", order, "--cuda", state]
    if state == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *script]
    else:
        # A file store, no TCP port to race for (the torchrun case rendezvouses on its own).
        env.update(DCF_INIT_METHOD=f"file://{result_file.parent / 'store'}", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        cmd = [sys.executable, *script]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    if os.environ.get("DCF_PGID_FILE"):  # gpu_session.sh ends any group left behind if pytest itself is stopped
        with open(os.environ["DCF_PGID_FILE"], "a") as fh:
            fh.write(f"{proc.pid}\n")
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    try:  # whatever is left of the group (a torchrun worker, an NCCL helper): gone before the next case
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    result: dict[str, Any] = {}
    if result_file.exists() and result_file.read_text().strip():
        result = json.loads(result_file.read_text())
    # A hang: killed at the timeout, or faulthandler's dump ("Timeout (0:01:20)!") and exit before it.
    hung = timed_out or (not result and "Timeout (" in stderr)
    result.update(
        case=_case_id(case),
        release=version,
        returncode=proc.returncode,
        timed_out=timed_out,
        hung=hung,
        wall_s=round(wall, 2),
        command=" ".join(cmd[1:]),
        stderr_tail=stderr[-6000:],
        stdout_tail=stdout[-2000:] if not result else "",
    )
    keep(f"launch-{_case_id(case)}.json", result)
    return result


@pytest.fixture(scope="module")
def launch_results() -> dict[str, dict[str, Any]]:
    """Every launch case, run side by side (each its own process group and timeout)."""
    for version in RELEASES:
        release_dir(version)  # installed before the clock starts
    with ThreadPoolExecutor(max_workers=LAUNCH_JOBS) as pool:
        done = list(pool.map(_launch, LAUNCH_CASES))
    return {r["case"]: r for r in done}


@pytest.mark.parametrize("case", LAUNCH_CASES, ids=_case_id)
def test_launch_order(case: tuple[str, str, str], launch_results: dict[str, dict[str, Any]]) -> None:
    r = launch_results[_case_id(case)]
    assert not r["hung"], f"HANG: no result within {LAUNCH_TIMEOUT:.0f} s; stacks:\n{r['stderr_tail']}"
    assert r["returncode"] == 0, f"exit status {r['returncode']}\n{r['stderr_tail']}"
    assert "raised" not in r, f"{r.get('raised')}\n{r.get('traceback')}"
    assert r["version"] == case[0]
    after = r["after_imports"]
    assert after["probes"] == [], f"the probe ran inside an import: {after['probes']}"
    if case[2] == "cold":
        assert not after["cuda_initialised"], "an import initialised CUDA"
    for name, res in r["ulysses"].items():
        if name == "rule":
            continue
        assert "raised" not in res, (name, res)
        assert res["passed"], (name, res)
    probes = r["probes_after"]
    assert len(probes) == 1, f"expected one probe result, got {probes}"
    (p,) = probes
    assert p["device"] == "cuda:0", p
    assert p["state"] == "passed", p
    assert "runs" in p, f"ProbeResult has no run count: {sorted(p)}"
    assert p["runs"] == 1, p


# --- training stacks (#19): QwenImage with padded prompts, eager / compiled / autocast / checkpointing ----------

#: Releases where a padded prompt's bool mask reaches the cuDNN CP op in the K/V's order (0.36.0 ignores the
#: mask, 0.37.x cannot build it, 0.38.0's is refused: docs/cp-training-tests.md).
STACK_RELEASES = ("0.39.0", "0.42.1")
#: The CP training tests' tolerance (5%), or twice the same model's bf16 noise floor where that is larger
#: (FlashAttention's rule: within 2x the low-precision reference's error).
STACK_TOLERANCE = 0.05
STACK_FLOOR_FACTOR = 2.0
#: The control (the bool mask passed through) must be at least this far off.
STACK_MISREAD_MIN = 0.10


@pytest.fixture(scope="module", params=STACK_RELEASES)
def stacks_result(request) -> dict:
    version = request.param
    result = run(release_dir(version), "import gpu_training_stacks as s; s.main()", timeout=420)
    result.pop("_stderr", None)
    keep(f"gpu-stacks-{version}.json", result)
    assert "fatal" not in result, result.get("traceback", result["fatal"])
    return result


def _stack_limit(result: dict, variant: str) -> float:
    floor = result["references"]["floor_autocast" if "autocast" in variant else "floor_bf16"]["worst"]
    return max(STACK_TOLERANCE, STACK_FLOOR_FACTOR * floor)


def _assert_stack_right(result: dict, variant: str) -> None:
    entry = result["variants"][variant]
    assert entry["status"] == "ok", entry
    compare = entry["compare"]
    limit = _stack_limit(result, variant)
    assert compare["worst"] <= limit and compare["out"] <= limit, (variant, compare, limit)
    assert compare["loss"] <= 0.01, (variant, compare)
    if "graphs" in entry:  # compiled: the cuDNN op pair was inside what dynamo handed the backend
        ops = {
            name: sum(graph.get(name, 0) for graph in entry["graphs"])
            for name in ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")
        }
        assert all(count > 0 for count in ops.values()), entry["graphs"]
    else:  # eager: 2 attention layers per step, each forward twice with checkpointing
        forward = 4 if "checkpointing" in variant else 2
        assert entry["kernel_calls"] == {
            "_scaled_dot_product_cudnn_attention": forward,
            "_scaled_dot_product_cudnn_attention_backward": 2,
        }, entry["kernel_calls"]
        assert entry["qkv_dtypes"] == ["bfloat16/bfloat16/bfloat16"], entry["qkv_dtypes"]


@pytest.mark.parametrize("variant", ["bf16 weights, eager", "bf16 weights, compiled", "bf16 weights, checkpointing"])
def test_training_stack_qwen_padded(stacks_result: dict, variant: str) -> None:
    """World size 1 over NCCL, diffusers' Ulysses attention and the cuDNN ops, the bool mask all-gathered and
    converted: forward + backward within tolerance of fp32, eager, inductor-compiled and with checkpointing."""
    _assert_stack_right(stacks_result, variant)


@pytest.mark.parametrize("variant", ["fp32 weights, autocast, eager", "fp32 weights, autocast, compiled"])
def test_training_stack_qwen_padded_autocast(stacks_result: dict, variant: str) -> None:
    """fp32 weights under torch.autocast(cuda, bf16): QwenImage's RMSNorm hands attention fp32 q/k beside bf16
    v, which the package casts to the autocast dtype as F.sdpa does; within tolerance of fp32."""
    _assert_stack_right(stacks_result, variant)


def test_training_stack_never_silently_wrong(stacks_result: dict) -> None:
    """Every variant but the control is within tolerance or refused with UnsafeAttentionError."""
    for variant, entry in stacks_result["variants"].items():
        if "control" in variant:
            continue
        if entry["status"] == "raised":
            assert entry["raised"] == "UnsafeAttentionError", (variant, entry)
        else:
            compare = entry["compare"]
            assert compare["worst"] <= _stack_limit(stacks_result, variant), (variant, compare)
    # Flux under autocast (recorded: CUDA's autocast runs torch.nn.RMSNorm, hence Flux's q/k, in fp32).
    for variant, entry in stacks_result["flux_autocast"].items():
        if entry["status"] == "raised":
            assert entry["raised"] == "UnsafeAttentionError", ("flux", variant, entry)
        else:
            assert entry["compare"]["worst"] <= STACK_TOLERANCE, ("flux", variant, entry["compare"])


def test_training_stack_control_is_far_off(stacks_result: dict) -> None:
    """The bool mask passed through (mask mode warn): far off on the real kernel, so these tests see the bug."""
    entry = stacks_result["variants"]["bf16 weights, eager, mask warn (control)"]
    assert entry["status"] == "ok", entry
    assert entry["compare"]["worst"] > STACK_MISREAD_MIN, entry["compare"]
    assert stacks_result["status_ok"] is True
