"""``diffusers-cudnn-fix verify`` on CPU over gloo, with real diffusers releases (docs/verify.md).

Each case starts ``python -m diffusers_cudnn_fix verify --nproc N ...`` with one release first on
``PYTHONPATH``, as a user would (the launcher starts its N ranks itself). ``_native_cudnn`` and
``_native_flash`` run on the tests' stand-in kernels, registered in each rank by verify's test-only
``--preload verify_seams`` (which also gives 0.42.x's ``enable_parallelism`` an accelerator count of 1 for
that one call); ``native`` needs none. The cases:

* PASS (exit 0) where training is right: 0.39.0 Ulysses and ring with the package (cuDNN), 0.37.0 Ulysses on
  the native-flash backend, 0.42.1 ring degree 3 with the package;
* FAIL (exit 1) where the release is silently wrong and the package is off: 0.39.0 ring degree 2 on cuDNN,
  0.42.1 ring degree 3 (``ring_grad_route``: 3 ranks, the cheapest that shows it);
* exit 2 with the reason where it cannot run: ``native`` ring on 0.39.0 (diffusers' own "does not support
  return_lse"), fp32 on cuDNN (the package's ``UnsafeAttentionError``), 0.42.1 on a CPU-only torch without
  the seam, a world of one;
* the launcher: a rank that exits or hangs, or a SIGTERM to the launcher, does not leave ranks waiting (exit 2,
  within the deadline); usage errors exit 64 before any rank starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from releases import ROOT, TESTS, release_dir, run_raw

pytestmark = pytest.mark.slow

SEAMS = ("--preload", "verify_seams")
TIMEOUT_S = 240


#: What a launcher of the test process's own would hand verify, and a user's shell would not.
NOT_A_USERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DIFFUSERS_CUDNN_FIX")


def verify(
    version: str | None, *args: str, env: dict[str, str] | None = None, timeout: float = TIMEOUT_S, stack: bool = False
):
    """(exit status, stdout, stderr, wall seconds) of ``diffusers-cudnn-fix verify ARGS`` (the command line's own
    ``main``), forked from the tests' interpreter that imported torch (``releases.run_raw(preloaded=True)``): what a
    fresh ``python -m diffusers_cudnn_fix verify`` does, less torch's import. ``stack``: with transformers,
    accelerate and peft on the path (``releases.USER_STACK``)."""
    site = release_dir(version) if version else None
    script = f"import sys\nfrom diffusers_cudnn_fix.__main__ import main\nsys.exit(main(['verify', *{list(args)!r}]))"
    unset: dict[str, str | None] = dict.fromkeys(NOT_A_USERS)
    started = time.monotonic()
    code, out, err = run_raw(site, script, env={**unset, **(env or {})}, timeout=timeout, preloaded=True, stack=stack)
    return code, out, err, time.monotonic() - started


def result(stdout: str) -> dict:
    """Rank 0's JSON object (the last line of stdout)."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON object in:\n{stdout}"
    return json.loads(lines[-1], parse_constant=refuse_non_standard_json)


def refuse_non_standard_json(word: str) -> float:
    """json.loads's hook for NaN / Infinity, which strict JSON parsers (jq, JavaScript) reject."""
    raise AssertionError(f"--json printed {word}, which is not JSON")


def passes(found: dict) -> bool:
    """A PASS, its verdict saying whether the run exercised every fix this diffusers needs (#49: a script reading one
    field tells a full PASS from one that reached none of them)."""
    return found["exit_status"] == 0 and found["verdict"] == ("pass-unexercised" if found["not_exercised"] else "pass")


def passed(version: str, *args: str) -> dict:
    code, out, err, _ = verify(version, "--json", *args)
    assert code == 0, f"exit {code}\n{out}\n{err}"
    found = result(out)
    assert passes(found) and all(row["ok"] for row in found["rows"])
    assert found["compared_params"] >= 60  # Flux: 62 parameters, every one compared
    assert found["setup"]["package"] == "on" and found["setup"]["package_ok"]
    return found


def failed(version: str, *args: str) -> dict:
    code, out, err, _ = verify(version, "--json", "--without-package", *args)
    assert code == 1, f"exit {code}\n{out}\n{err}"
    found = result(out)
    assert found["verdict"] == "mismatch" and found["setup"]["applied"] == []
    bad = [row for row in found["rows"] if not row["ok"]]
    assert bad and max(row["error"] for row in bad) > 0.5  # far off, not at the edge of the tolerance
    assert found["worst"][0]["error"] > found["worst"][0]["tolerance"]
    return found


def test_039_ulysses_and_ring_pass_with_the_package() -> None:
    code, out, err, _ = verify("0.39.0", "--nproc", "2", "--backend", "_native_cudnn", *SEAMS)
    assert code == 0, f"{out}\n{err}"
    assert "verdict: PASS, NOT ALL EXERCISED (exit status 0)" in out and "MISMATCH" not in out
    assert "transformer_blocks.0.attn" in out  # a row per group of parameters
    for phase in ("[1/6]", "[5/6] context-parallel forward and backward: ulysses 2 x ring 1", "[6/6] comparing"):
        assert phase in err  # one line per phase on stderr, from rank 0 only
    assert err.count("[6/6]") == 1
    found = passed("0.39.0", "--nproc", "2", "--ring", "2", "--backend", "_native_cudnn", *SEAMS)
    assert "ring_grad_route" in found["setup"]["applied"]


def test_039_ring_without_the_package_fails() -> None:
    failed("0.39.0", "--nproc", "2", "--ring", "2", "--backend", "_native_cudnn", *SEAMS)


def test_039_native_ring_is_refused_with_the_reason_and_the_way_out() -> None:
    """diffusers' native backend raises "does not support return_lse" under ring; verify names why (ring merges
    through the log-sum-exp) and the way out, once, on the verdict line that ends the output."""
    code, out, err, _ = verify("0.39.0", "--nproc", "2", "--ring", "2", "--backend", "native")
    assert code == 2, f"{out}\n{err}"
    assert "COULD NOT RUN (exit status 2)" in out and "does not support return_lse" in out
    assert "cannot run ring attention" in out and "--ring 1" in out and "--backend _native_cudnn" in out, out
    assert (out + err).count("does not support return_lse") == 1, f"{out}\n{err}"
    assert out.rstrip().splitlines()[-1].startswith("verdict: COULD NOT RUN"), out


def test_039_fp32_on_cudnn_is_refused_by_the_package() -> None:
    code, out, err, _ = verify("0.39.0", "--nproc", "2", "--dtype", "fp32", "--backend", "_native_cudnn", *SEAMS)
    assert code == 2, f"{out}\n{err}"
    assert "COULD NOT RUN (exit status 2)" in out and "UnsafeAttentionError" in out and "bfloat16" in out
    # Both ranks meet it: said once, naming both, on the verdict line (it was said three times: rank 0, the
    # verdict, rank 1).
    assert "ranks 0, 1: context-parallel forward and backward: UnsafeAttentionError" in out, out
    assert (out + err).count("UnsafeAttentionError") == 1, f"{out}\n{err}"
    assert out.rstrip().splitlines()[-1].startswith("verdict: COULD NOT RUN"), out


def test_037_flash_ulysses_passes() -> None:
    found = passed("0.37.0", "--nproc", "2", "--backend", "_native_flash", *SEAMS)
    assert "flash_backward_kv" in found["setup"]["applied"]


def test_042_ring_degree_3_fails_without_the_package_and_passes_with_it() -> None:
    found = failed("0.42.1", "--nproc", "3", "--ring", "3", "--backend", "_native_cudnn", *SEAMS)
    assert any("attn" in worst["param"] for worst in found["worst"])
    found = passed("0.42.1", "--nproc", "3", "--ring", "3", "--backend", "_native_cudnn", *SEAMS)
    assert "ring_grad_route" in found["setup"]["applied"]


def test_042_on_a_cpu_only_torch_runs_with_the_package_and_says_why_not_without() -> None:
    """#51, item 2: 0.42.x's enable_parallelism divides by the accelerator count (0 on a CPU-only torch); with the
    package (cp_no_accelerator) verify runs there; without it verify says why it cannot, naming the fix."""
    found = result(verify("0.42.1", "--json", "--nproc", "2")[1])
    assert passes(found) and "cp_no_accelerator" in found["exercised"], found
    code, out, err, _ = verify("0.42.1", "--nproc", "2", "--without-package")
    assert code == 2, f"{out}\n{err}"
    assert "torch.accelerator.device_count()" in out and "ZeroDivisionError" in out and "cp_no_accelerator" in out


def test_037_native_backend_says_diffusers_cannot_train_it_under_context_parallelism() -> None:
    """0.36.x - 0.37.x's native backward op recomputes attention with autograd off and raises: the check cannot
    run there on a CPU (native is its only CPU backend), and says why, instead of autograd's bare message."""
    code, out, err, _ = verify("0.37.0", "--nproc", "2")
    assert code == 2, f"{out}\n{err}"
    assert "_native_attention_backward_op" in out and "diffusers >= 0.38" in out


def test_a_world_of_one_is_refused_with_the_way_out() -> None:
    code, out, err, _ = verify("0.39.0")
    assert code == 2, f"{out}\n{err}"
    assert "needs at least 2 ranks" in out and "--nproc N" in out


@pytest.mark.parametrize("how", ["exit", "crash", "hang"])
def test_a_failed_rank_does_not_leave_the_others_waiting(how: str) -> None:
    args = ("--nproc", "2", "--timeout", "15", "--preload", "verify_rank_fails")
    code, out, err, wall = verify("0.39.0", *args, env={"VERIFY_TEST_FAIL": how}, timeout=120)
    assert code == 2, f"{out}\n{err}"
    assert "COULD NOT RUN" in out
    said = {
        "exit": "rank 1 ended with exit status 3",
        "crash": "rank 1 was killed by SIGSEGV (a crash inside the process, not a wrong result)",
        "hang": "timed out after 15 s",
    }[how]
    both = out + err
    assert said in both and "stopped rank(s) 0" in both, both
    assert both.count(said) == 1 and out.rstrip().splitlines()[-1].startswith("verdict: COULD NOT RUN"), both
    assert wall < 45  # the hang: the 15 s deadline; the exit: GRACE_S (10 s) after it


#: A launcher with a second thread running: it may not fork, and starts its ranks as fresh interpreters.
WITH_A_THREAD = (
    "import sys, threading, time; threading.Thread(target=time.sleep, args=(600,), daemon=True).start(); "
    "from diffusers_cudnn_fix.__main__ import main; sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.parametrize("ranks", ["forked", "fresh"])
def test_sigterm_to_the_launcher_ends_its_ranks(ranks: str) -> None:
    """The ranks run in sessions of their own (a signal to the launcher's group does not reach them): the
    launcher ends them itself, and waits for them, before it exits. Both ways of starting them: forked from the
    launcher (one thread) and, where it runs a thread, as fresh interpreters."""
    import select

    env = {**os.environ, "VERIFY_TEST_FAIL": "hang"}
    env["PYTHONPATH"] = os.pathsep.join([str(release_dir("0.39.0")), str(ROOT), str(TESTS)])
    start = ["-m", "diffusers_cudnn_fix"] if ranks == "forked" else ["-c", WITH_A_THREAD]
    cmd = [sys.executable, *start, "verify", "--nproc", "2", "--preload", "verify_rank_fails"]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
    assert proc.stderr is not None
    said = ""
    while "verify [1/6]" not in said and time.monotonic() - started < 60:  # rank 0 has started
        if select.select([proc.stderr], [], [], 1.0)[0]:
            said += proc.stderr.readline()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    err = said + err
    assert proc.returncode == 2, f"{out}\n{err}"
    assert "stopped by signal 15" in out + err and "stopped rank(s) 0, 1" in out + err
    assert time.monotonic() - started < 60


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--nproc", "2", "--mask", "padded"), "--model qwen"),
        (("--nproc", "2", "--ulysses", "3"), "world size is 2"),
        (("--nproc", "0"), "at least 2"),
        (("--nproc", "1"), "at least 2: context parallelism needs 2 or more ranks"),
        (("--backend",), "expected one argument"),
    ],
)
def test_usage_errors_exit_64_before_any_rank_starts(args: tuple[str, ...], says: str) -> None:
    code, out, err, _ = verify(None, *args, timeout=60)
    assert code == 64, f"{out}\n{err}"
    assert says in err and "verify [1/6]" not in err


def test_a_backend_diffusers_does_not_have_is_a_usage_error_naming_the_valid_ones_once() -> None:
    code, out, err, _ = verify("0.39.0", "--nproc", "2", "--backend", "_native_cudnnn", timeout=120)
    assert code == 64, f"{out}\n{err}"
    assert "'_native_cudnnn' is not an attention backend" in err and "verify [1/6]" not in err, err
    assert err.count("_native_cudnn,") == 1 and "native" in err, err  # the valid names, listed once


# ------------------------------------------------------------------------------------------------------------
# What the run exercised (#39): by the code that ran, never by what was installed
# ------------------------------------------------------------------------------------------------------------
NEEDED_039 = [
    "cudnn_forward_lse", "cudnn_backward_kv", "flash_backward_kv", "ulysses_mask_grad", "cudnn_bool_mask",
    "cudnn_input_dtypes", "cudnn_masked_row_grads", "flash_input_alignment", "ring_grad_route", "ulysses_head_mask",
    "ulysses_kv_length", "cp_gather_grads", "ltx2_cp_plan", "cp_split_warning_once",
]  # fmt: skip


@pytest.mark.parametrize("package", [True, False], ids=["package", "without-package"])
def test_039_default_cpu_run_says_it_exercised_none_of_what_the_release_needs(package: bool) -> None:
    """0.39.0 on a CPU: the default backend, ``native``, runs none of the code 0.39.0 ships broken. The PASS says
    so on its verdict line and names runs that reach it; ``--without-package`` names diffusers' functions called."""
    extra = () if package else ("--without-package",)
    code, out, err, _ = verify("0.39.0", "--nproc", "2", *extra)
    assert code == 0, f"{out}\n{err}"
    verdict = out.rstrip().splitlines()[-1]
    assert verdict.startswith("verdict: PASS") and "NOT exercised by this run: cudnn_forward_lse" in verdict, verdict
    assert "verify --backend _native_cudnn (on GPUs)" in verdict, verdict
    found = result(verify("0.39.0", "--json", "--nproc", "2", *extra)[1])
    assert found["needed"] == NEEDED_039 and found["exercised"] == [], found
    assert found["verdict"] == "pass-unexercised", found
    assert found["not_exercised"] == NEEDED_039, found
    if package:
        assert found["functions_reached"] is None and "cudnn_backward_kv" in found["setup"]["applied"], found
    else:
        # The native Ulysses path calls diffusers' Ulysses forward and backward (where the mask-grad and key-length
        # bugs live), with no mask and keys as long as the queries: neither bug is met.
        assert sorted(found["functions_reached"]) == sorted(
            [
                "TemplatedUlyssesAttention.forward",
                "TemplatedUlyssesAttention.backward",
                "diffusers.hooks.context_parallel:AllGatherFunction.backward",  # Flux gathers its output: met no bug
                # Every context-parallel run: the plan applied (Flux's is complete) and each input split (none of
                # other dims than the plan's): neither bug is met.
                "diffusers.models.modeling_utils:ModelMixin.enable_parallelism",
                "diffusers.hooks.context_parallel:ContextParallelSplitHook._prepare_cp_input",
            ]
        ), found
        assert "_cudnn_attention_backward_op" in found["functions_not_reached"], found
        assert "ulysses_mask_grad" in found["cannot_tell"], found


def test_039_cudnn_run_exercises_the_op_fixes_it_ran_and_not_the_ones_merely_applied() -> None:
    """On the stand-in kernels with ``_native_cudnn``: the cuDNN op pair's policies ran; the flash fix is applied
    too but its code never ran, and a fix skipped by the switch is needed and not exercised. Eager and compiled
    (the marks are made while dynamo traces a policy into the graph)."""
    args = ("--nproc", "2", "--backend", "_native_cudnn", *SEAMS)
    found = result(verify("0.39.0", "--json", *args)[1])
    ops = ["cudnn_forward_lse", "cudnn_backward_kv", "cudnn_input_dtypes"]
    assert found["exit_status"] == 0 and found["exercised"] == ops, found
    assert "flash_backward_kv" in found["setup"]["applied"] and "flash_backward_kv" in found["not_exercised"]
    compiled = result(verify("0.39.0", "--json", *args, "--compile")[1])
    assert compiled["exit_status"] == 0 and compiled["exercised"] == ops, compiled
    skipped = result(verify("0.39.0", "--json", *args, env={"DIFFUSERS_CUDNN_FIX_SKIP": "cudnn_input_dtypes"})[1])
    assert skipped["exit_status"] == 0 and skipped["exercised"] == ops[:2], skipped
    assert "cudnn_input_dtypes" in skipped["needed"] and "cudnn_input_dtypes" in skipped["not_exercised"], skipped


def test_in_the_environment_users_have_ltx2_passes_and_nothing_is_warned() -> None:
    """transformers, accelerate and peft installed (#49): LTX2 (whose inputs meet the split hook's warning_once)
    passes; ``cp_split_warning_once`` is not needed there (transformers gives diffusers' logger the method), so it
    is neither needed nor exercised; no warning of the package's on any rank."""
    code, out, err, _ = verify("0.39.0", "--json", "--nproc", "2", "--model", "ltx2", stack=True)
    found = result(out)
    assert code == 0 and passes(found), f"{out}\n{err}"
    assert "cp_split_warning_once" not in found["needed"] and "ltx2_cp_plan" in found["exercised"], found
    assert "Warning:" not in err, err


@pytest.mark.parametrize("package", [True, False], ids=["package", "without-package"])
def test_038_padded_prompts_on_a_cpu_reach_the_qwen_mask_order(package: bool) -> None:
    """The CPU run that shows a bug on <= 0.38: QwenImage with padded prompts. With the package its mask policies
    ran (PASS); without, the run reached diffusers' Ulysses forward with the mask (MISMATCH: the bug)."""
    extra = () if package else ("--without-package",)
    code, out, err, _ = verify("0.38.0", "--json", "--nproc", "2", "--model", "qwen", "--mask", "padded", *extra)
    found = result(out)
    assert code == (0 if package else 1), f"{out}\n{err}"
    assert "qwen_joint_mask_order" in found["exercised"], found
    if package:
        assert found["exercised"] == ["ulysses_mask_grad", "qwen_joint_mask_order"], found
    else:
        assert "TemplatedUlyssesAttention.forward" in found["functions_reached"], found
        assert "cudnn_bool_mask" not in found["exercised"], found  # the cuDNN op, where that bug is, never ran


@pytest.mark.parametrize("floor_too", [True, False], ids=["floor-run-also-nan", "floor-run-finite"])
def test_a_nan_gradient_is_a_mismatch_whatever_the_floor_run_gave(floor_too: bool) -> None:
    """A NaN in the context-parallel run's gradients is never within tolerance, also when the one-process
    low-precision run (the noise floor) went NaN too: an infinite floor must not make every error acceptable."""
    import torch

    from diffusers_cudnn_fix import _verify

    def run(value: float) -> dict[str, object]:
        grads = {"transformer_blocks.0.attn.to_q.weight": torch.full((4,), value)}
        return {"out": torch.full((4,), value), "grads": grads, "loss": value, "backend": "native"}

    reference, broken = run(1.0), run(float("nan"))
    result = _verify.compare(torch, broken, reference, broken if floor_too else run(1.001), "bfloat16")
    assert result["verdict"] == "mismatch"
    assert not any(row["ok"] for row in result["rows"])
    # A right run beside a broken floor run is judged against the least tolerance, not waved through or failed.
    assert _verify.compare(torch, run(1.0), reference, broken, "bfloat16")["verdict"] == "pass"


@pytest.mark.parametrize("stray", [0.0, 1e-3], ids=["zero", "non-zero"])
def test_a_parameter_the_reference_does_not_reach_must_get_exactly_zero(stray: float) -> None:
    """Its true gradient is 0 (the loss does not depend on it): a context-parallel run that gives it any other
    gradient is wrong, and must not pass because the reference has nothing to compare with."""
    import torch

    from diffusers_cudnn_fix import _verify

    def run(tail: float | None) -> dict[str, object]:
        grads = {"transformer_blocks.0.attn.to_q.weight": torch.ones(4)}
        if tail is not None:  # the text stream's tail of QwenImage's last block: the output never reaches it
            grads["transformer_blocks.1.txt_mlp.weight"] = torch.full((4,), tail)
        return {"out": torch.ones(4), "grads": grads, "loss": 1.0, "backend": "native"}

    result = _verify.compare(torch, run(stray), run(None), run(stray), "bfloat16")
    assert result["unreached"] == ["transformer_blocks.1.txt_mlp.weight"]
    assert result["verdict"] == ("pass" if stray == 0 else "mismatch")
    row = result["rows"][-1]
    assert (row["group"], row["params"], row["ok"]) == (_verify.UNREACHED, 1, stray == 0)


def test_json_of_a_nan_mismatch_is_strict_json() -> None:
    """--json on a run whose gradients are NaN: every parser reads it, and the errors say "inf"."""
    import torch

    from diffusers_cudnn_fix import _report, _verify

    def run(value: float) -> dict[str, object]:
        grads = {"transformer_blocks.0.attn.to_q.weight": torch.full((4,), value)}
        return {"out": torch.full((4,), value), "grads": grads, "loss": value, "backend": "native"}

    found = _verify.compare(torch, run(float("nan")), run(1.0), run(1.0), "bfloat16")
    parsed = json.loads(_report.json_text(found), parse_constant=refuse_non_standard_json)
    assert parsed["verdict"] == "mismatch"
    assert [row["error"] for row in parsed["rows"]] == ["inf", "inf"]
    assert parsed["loss"]["cp"] == "nan"


def test_compare_search_no_nan_inf_or_stray_gradient_passes_and_an_exact_run_always_does() -> None:
    """A hypothesis search over compare()'s inputs: gradient groups, parameters the reference does not reach,
    the checked dtype, and non-finite values in the run, the floor run or both. An exact copy of the reference
    passes whatever the floor run holds; a NaN or infinity in the run, or a non-zero gradient where the
    reference has none, never passes."""
    import math

    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from diffusers_cudnn_fix import _verify

    values = st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=1, max_size=5)
    special = st.sampled_from([math.nan, math.inf, -math.inf])

    @settings(derandomize=True, max_examples=300, deadline=None, database=None)
    @given(data=st.data())
    def search(data: st.DataObject) -> None:
        count = data.draw(st.integers(1, 5), label="parameters")
        names = [f"transformer_blocks.{data.draw(st.integers(0, 2))}.attn.p{i}" for i in range(count)]
        unreached = {n for n in names if data.draw(st.booleans(), label=f"{n} unreached")}
        ref_grads = {n: torch.tensor(data.draw(values, label=n)) for n in names if n not in unreached}
        out = torch.tensor(data.draw(values, label="out"))
        ref = {"out": out, "grads": ref_grads, "loss": 1.0, "backend": "_native_math"}
        exact = {n: ref_grads.get(n, torch.zeros(3)).clone() for n in names}
        got = {"out": out.clone(), "grads": exact, "loss": 1.0}
        # The run: exact, or one value made non-finite, or a stray gradient where the reference has none.
        change = data.draw(st.sampled_from(["exact", "non-finite", "stray"]), label="run")
        if change == "stray" and not unreached:
            change = "exact"
        if change == "non-finite":
            target = data.draw(st.sampled_from(["out", *names]), label="where")
            tensor = got["out"] if target == "out" else got["grads"][target]
            tensor[data.draw(st.integers(0, tensor.numel() - 1))] = data.draw(special)
        elif change == "stray":
            target = data.draw(st.sampled_from(sorted(unreached)), label="where")
            got["grads"][target][0] = data.draw(st.floats(1e-30, 1e3) | st.floats(-1e3, -1e-30))
        floor_kind = data.draw(st.sampled_from(["same", "noisy", "non-finite"]), label="floor run")
        floor = {"out": out.clone(), "grads": {n: g.clone() for n, g in exact.items()}, "loss": 1.0}
        if floor_kind != "same":
            for tensor in [floor["out"], *floor["grads"].values()]:
                tensor[0] = data.draw(special) if floor_kind == "non-finite" else tensor[0] * 1.5 + 1
        dtype = data.draw(st.sampled_from(["bfloat16", "float16", "float32"]))
        found = _verify.compare(torch, got, ref, None if dtype == "float32" else floor, dtype)
        assert found["verdict"] == ("pass" if change == "exact" else "mismatch"), found["rows"]
        assert sorted(found["unreached"]) == sorted(unreached)

    search()


@pytest.mark.parametrize("ring", [2, 4])
def test_042_qwen_padded_prompts_under_ring_pass_with_the_package_and_fail_without(ring: int) -> None:
    """#43: tiny QwenImage with padded prompts under ring attention on the stand-in kernels: the package hands each
    ring step its K/V chunk's mask columns (PASS, the ring's correction exercised); diffusers hands every step the
    rank's own mask (MISMATCH)."""
    args = ("--nproc", str(ring), "--ring", str(ring), "--model", "qwen", "--mask", "padded")
    found = passed("0.42.1", *args, "--backend", "_native_cudnn", *SEAMS)
    assert "ring_grad_route" in found["exercised"] and "cudnn_bool_mask" in found["exercised"], found
    failed("0.42.1", *args, "--backend", "_native_cudnn", *SEAMS)
