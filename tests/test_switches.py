"""The one switch parser (docs/behaviour.md, "Switches"), the off switch's verdict, and life without torch.

Values are case-insensitive and stripped, in the environment and in the API; a bad value in the
environment gives one ``SwitchValueWarning`` per variable and value (naming the variable, the value, the
allowed values and what is used instead), a bad value given to the API raises ``ValueError``. Every case
that reads the environment runs in a fresh interpreter (``releases.run``), on diffusers 0.39.0 unless said.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from expected_fixes import FIX_IDS, not_on
from releases import ROOT, TESTS, release_dir, run

pytestmark = pytest.mark.slow

PREAMBLE = """
import contextlib, io, json, runpy, sys, warnings
warnings.simplefilter("always")
caught = warnings.catch_warnings(record=True)
seen = caught.__enter__()
BWD = "_cudnn_attention_backward_op"
MASK_CASE = ("b1_s64_h2", 1, 64, 64, 2, 64)


def is_ours(w):
    return w.category.__module__.startswith("diffusers_cudnn_fix")


def ours():
    return [(w.category.__name__, str(w.message)) for w in seen if is_ours(w)]


def lifecycle():
    '''Everything that may read a switch, some of it twice.'''
    import diffusers_cudnn_fix
    import diffusers.models.attention_dispatch
    diffusers_cudnn_fix.status()
    diffusers_cudnn_fix.apply()
    str(diffusers_cudnn_fix.status())
    diffusers_cudnn_fix.revert()
    diffusers_cudnn_fix.apply()
    return diffusers_cudnn_fix.status()


def bool_mask_case():
    import diffusers.models.attention_dispatch as module
    import subprocess_op_pair_grads, standin_kernels
    standin_kernels.register()
    before = len(seen)
    result = subprocess_op_pair_grads.run_case(module, "cudnn", MASK_CASE, False, mask="bool")
    return {"status": result["status"], "error": result.get("error", ""),
            "warnings": [w.category.__name__ for w in seen[before:] if is_ours(w)]}


def doctor(*args):
    '''The doctor's text, run in this interpreter as `python -m diffusers_cudnn_fix` would.'''
    out = io.StringIO()
    saved, sys.argv = sys.argv, ["diffusers_cudnn_fix", *args]
    code = None
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module("diffusers_cudnn_fix", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = saved
    return {"code": code, "text": out.getvalue()}


def done(report, **extra):
    data = report.to_dict()
    print(json.dumps({"status": data, "text": str(report), "warnings": ours(), **extra}))
"""


def script(body: str) -> str:
    return PREAMBLE + textwrap.dedent(body)


def switch_warnings(result: dict) -> list[str]:
    return [message for category, message in result["warnings"] if category == "SwitchValueWarning"]


def fixes(result: dict) -> dict[str, dict]:
    return {f["id"]: f for f in result["status"]["fixes"]}


def mask_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "mask" in line.lower()]


# A line claiming masks are converted (what the convert mode does, and only it). What a line says about
# another mode ("in convert mode, ...", "DIFFUSERS_CUDNN_FIX_MASK=convert converts them") is no such claim.
CONVERT_CLAIM = re.compile(
    r"\b(are|is|gets?|get|were|was)\s+converted\b|\bconverted\s+(to|into)\b|\bconverts?\s+(bool\s+|the\s+)?(them|it|masks?)\b"
    r"|\bmasks? (become|becomes)\b|reach(es)? the (cuDNN )?kernels? as (an )?additive masks?",
    re.I,
)
OTHER_MODE = re.compile(r"\bin convert mode\b[^.;]*|\w*=convert\b[^.;]*", re.I)
PASS_THROUGH_CLAIM = re.compile(r"passed through|pass(es)? (them |it |masks? )?through|out of bounds", re.I)


def says_converting(text: str) -> bool:
    return any(CONVERT_CLAIM.search(OTHER_MODE.sub("", line)) for line in mask_lines(text))


def says_passing_through(text: str) -> bool:
    return any(PASS_THROUGH_CLAIM.search(line) for line in mask_lines(text))


def uses_instead(message: str, fallback: str) -> bool:
    """Whether the message says ``fallback`` is what is used instead (not merely lists it as allowed)."""
    verb = r"\bus(e|es|ed|ing)\b|\binstead\b|\bfall(s|ing)? back\b|\btreat(ed|s|ing)?\b|\bmeans\b"
    verb += r"|\bdefault(s|ing)? to\b|\bassum(e|es|ing)\b"
    pattern = rf"({verb})[^.;]{{0,40}}\b{fallback}\b|\b{fallback}\b[^.;]{{0,20}}\binstead\b"
    return bool(re.search(pattern, message, re.I))


# --------------------------------------------------------------------------------------------------
# Bad values in the environment
# --------------------------------------------------------------------------------------------------
BAD_VALUES = {
    # variable: (bad value, values the warning must list, what is used instead)
    "DIFFUSERS_CUDNN_FIX": ("maybe", ("1", "on", "0", "off"), "on"),
    "DIFFUSERS_CUDNN_FIX_PROBE": ("stict", ("warn", "strict", "off"), "strict"),
    "DIFFUSERS_CUDNN_FIX_MASK": ("bogus", ("convert", "warn", "error"), "convert"),
    "DIFFUSERS_CUDNN_FIX_SKIP": ("no_such_fix", FIX_IDS, None),  # unknown ids are ignored
}


@pytest.mark.parametrize("variable", sorted(BAD_VALUES))
def test_a_bad_environment_value_warns_once_and_says_what_is_used(variable: str) -> None:
    value, allowed, fallback = BAD_VALUES[variable]
    result = run(
        release_dir("0.39.0"),
        script(
            f"""
            report = lifecycle()
            mask = bool_mask_case() if {variable!r} == "DIFFUSERS_CUDNN_FIX_MASK" else None
            import diffusers_cudnn_fix
            diffusers_cudnn_fix.status()
            doc = doctor("--no-gpu") if {variable!r} == "DIFFUSERS_CUDNN_FIX_MASK" else None
            done(diffusers_cudnn_fix.status(), patched=diffusers_cudnn_fix.is_patched(BWD), mask=mask, doctor=doc)
            """
        ),
        env={variable: value},
        preloaded=True,
    )
    messages = switch_warnings(result)
    assert len(messages) == 1, result["warnings"]  # one per variable and value, however often it is read
    message = messages[0]
    assert variable in message and value in message, message
    missing = [a for a in allowed if not re.search(rf"\b{re.escape(a)}\b", message)]
    assert not missing, f"allowed values {missing} not named: {message}"
    if fallback is not None:
        assert uses_instead(message, fallback), f"does not say {fallback!r} is used instead: {message}"
    else:
        assert "ignor" in message.lower(), message
    status = result["status"]
    assert status["enabled"] is True  # "maybe" means on; no other switch turns the package off
    assert result["patched"] is True
    assert status["ok"] is True  # nothing was skipped: unknown ids are ignored
    # Not on this release: a 0.36.0-only bug, a 0.36-0.38 one, and a 0.40+ one.
    assert all(fixes(result)[i]["applied"] for i in FIX_IDS if i not in not_on("0.39.0"))
    if variable == "DIFFUSERS_CUDNN_FIX_MASK":
        # A bad mask mode means convert: the bool mask is converted, and the gradients are right.
        assert result["mask"]["status"] == "pass", result["mask"]
        assert result["mask"]["warnings"] == ["MaskConvertedWarning"], result["mask"]
        assert says_converting(result["doctor"]["text"]), result["doctor"]["text"]
        assert not says_passing_through(result["doctor"]["text"]), result["doctor"]["text"]


def test_values_are_case_insensitive_and_stripped_in_the_environment() -> None:
    """Upper case and spaces everywhere, and the old fix id: no warning, and each switch does what it says."""
    result = run(
        release_dir("0.39.0"),
        script(
            """
            report = lifecycle()
            mask = bool_mask_case()
            doc = doctor("--no-gpu")
            import diffusers_cudnn_fix
            from diffusers_cudnn_fix import _registry
            # The policies the installed backward op was built with (the masked-row guard's is there anyway).
            kv_corrected = "cudnn_backward_kv" in _registry._state.policies.get("_cudnn_attention_backward_op", ())
            done(diffusers_cudnn_fix.status(), kv_corrected=kv_corrected, mask=mask, doctor=doc)
            """
        ),
        env={
            "DIFFUSERS_CUDNN_FIX": " On ",
            "DIFFUSERS_CUDNN_FIX_MASK": " WARN ",
            "DIFFUSERS_CUDNN_FIX_PROBE": "Strict",
            # Upper case, spaces, and the old ids of cudnn_input_dtypes and ring_grad_route (merged into it).
            "DIFFUSERS_CUDNN_FIX_SKIP": " CUDNN_BACKWARD_KV , cudnn_fp32_inputs, ring_backward",
        },
        preloaded=True,
    )
    assert switch_warnings(result) == [], result["warnings"]
    status = result["status"]
    assert status["enabled"] is True
    by_id = fixes(result)
    assert set(by_id) == set(FIX_IDS)
    # Skipped: still checked, not applied, and status says so.
    for fix_id in ("cudnn_backward_kv", "cudnn_input_dtypes", "ring_grad_route"):
        assert by_id[fix_id]["applied"] is False, by_id[fix_id]
        assert by_id[fix_id]["detected"] == "broken", by_id[fix_id]
        assert "skip" in by_id[fix_id]["reason"].lower(), by_id[fix_id]
        assert by_id[fix_id]["reason_code"] == "skipped", by_id[fix_id]
        assert by_id[fix_id]["result"] == "NOT FIXED (skipped)", by_id[fix_id]
    assert result["kv_corrected"] is False
    assert by_id["cudnn_forward_lse"]["applied"] is True and by_id["cudnn_bool_mask"]["applied"] is True
    assert status["ok"] is False  # a skipped broken fix is not OK
    # " WARN ": the bool mask is passed through (wrong), with one MaskMisreadWarning; the doctor says so.
    assert result["mask"]["status"] != "pass", result["mask"]
    assert "MaskMisreadWarning" in result["mask"]["warnings"], result["mask"]
    text = result["doctor"]["text"]
    assert says_passing_through(text), text
    assert not says_converting(text), text


def test_the_api_takes_any_case_and_rejects_bad_values() -> None:
    result = run(
        release_dir("0.39.0"),
        script(
            """
            report = lifecycle()
            import diffusers_cudnn_fix as d
            modes = {}
            for mode in ("WARN", " Convert ", "ERROR"):
                d.set_mask_mode(mode)
                modes[mode] = bool_mask_case()
            rejected = {}
            for setter, bad in (("set_mask_mode", "maybe"), ("set_mask_mode", "warm"), ("set_mask_mode", ""),
                                ("set_probe_mode", "stict"), ("set_probe_mode", "on")):
                try:
                    getattr(d, setter)(bad)
                    rejected[f"{setter}({bad!r})"] = None
                except Exception as exc:
                    rejected[f"{setter}({bad!r})"] = type(exc).__name__
            accepted = {}
            for mode in ("STRICT", " off ", "Warn"):
                try:
                    d.set_probe_mode(mode)
                    accepted[mode] = True
                except Exception as exc:
                    accepted[mode] = f"{type(exc).__name__}: {exc}"
            done(d.status(), modes=modes, rejected=rejected, accepted=accepted)
            """
        ),
        preloaded=True,
    )
    modes = result["modes"]
    assert modes["WARN"]["status"] == "wrong" and "MaskMisreadWarning" in modes["WARN"]["warnings"], modes["WARN"]
    assert modes[" Convert "]["status"] == "pass", modes[" Convert "]
    assert modes["ERROR"]["status"] == "raised" and "UnsafeAttentionError" in modes["ERROR"]["error"], modes["ERROR"]
    assert result["rejected"] == {k: "ValueError" for k in result["rejected"]}, result["rejected"]
    assert result["accepted"] == {"STRICT": True, " off ": True, "Warn": True}
    assert switch_warnings(result) == []  # the API raises; it does not warn


# --------------------------------------------------------------------------------------------------
# Switched off
# --------------------------------------------------------------------------------------------------
def _doctor(version: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    paths = [str(release_dir(version)), str(ROOT), str(TESTS)]
    full_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.run(
        [sys.executable, "-m", "diffusers_cudnn_fix", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=str(ROOT),
        timeout=300,
    )


def test_switched_off_on_an_affected_release_is_not_safe() -> None:
    result = run(
        release_dir("0.39.0"),
        script(
            """
            report = lifecycle()
            import diffusers_cudnn_fix
            done(report, patched=diffusers_cudnn_fix.is_patched(BWD))
            """
        ),
        env={"DIFFUSERS_CUDNN_FIX": "0"},
        preloaded=True,
    )
    assert result["patched"] is False  # apply() obeys the switch too
    assert result["status"]["enabled"] is False
    assert result["status"]["ok"] is False
    text = result["text"]
    verdict = [line for line in text.splitlines() if "verdict" in line.lower()]
    assert verdict and "NOT SAFE" in verdict[-1], text
    assert "switched off" in text.lower(), text
    assert switch_warnings(result) == []


def test_the_doctor_exits_1_when_switched_off_on_an_affected_release() -> None:
    """...and quotes the switch as the user spelled it, not as "=0"."""
    proc = _doctor("0.39.0", {"DIFFUSERS_CUDNN_FIX": "OFF"}, "--no-gpu")
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "NOT SAFE" in proc.stdout and "switched off" in proc.stdout.lower(), proc.stdout
    assert "DIFFUSERS_CUDNN_FIX='OFF'" in proc.stdout and "DIFFUSERS_CUDNN_FIX=0" not in proc.stdout, proc.stdout


def test_the_readme_and_help_list_every_spelling_the_switch_takes() -> None:
    """Every spelling the master switch accepts is documented: in docs/behaviour.md's switch table (the one
    place the switches are documented, which the README points to) and the doctor's help."""
    from diffusers_cudnn_fix import _switches

    assert "docs/behaviour.md#switches" in (ROOT / "README.md").read_text()
    behaviour_row = next(
        line
        for line in (ROOT / "docs" / "behaviour.md").read_text().splitlines()
        if line.startswith("| `DIFFUSERS_CUDNN_FIX` |")
    )
    help_text = _doctor("0.35.2", {}, "--help").stdout
    # The help's entry for the switch: its line and the continuation lines under it.
    help_line = help_text[help_text.index("DIFFUSERS_CUDNN_FIX=") : help_text.index("DIFFUSERS_CUDNN_FIX_SKIP=")]
    for spelling in _switches._ON_OFF:
        for where, text in (("docs/behaviour.md", behaviour_row), ("--help", help_line)):
            assert re.search(rf"(?<![\w-]){re.escape(spelling)}(?![\w-])", text), f"{spelling!r} not in {where}: {text}"


def test_switched_off_where_there_is_nothing_to_fix_is_ok() -> None:
    """0.35.2 has none of the ops: switched off (upper case, spaces: the same parser) is still OK."""
    result = run(
        release_dir("0.35.2"), script("done(lifecycle())\n"), env={"DIFFUSERS_CUDNN_FIX": " OFF "}, preloaded=True
    )
    assert result["status"]["enabled"] is False
    assert result["status"]["ok"] is True
    assert "NOT SAFE" not in result["text"]
    assert switch_warnings(result) == []


# --------------------------------------------------------------------------------------------------
# Without torch
# --------------------------------------------------------------------------------------------------
NO_TORCH = """
import importlib.util, json, sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as seen:
    assert importlib.util.find_spec("torch") is None, "torch is importable here"
    import diffusers_cudnn_fix as d
    out = {}
    for name, call in (
        ("status", lambda: d.status()),
        ("revert", lambda: d.revert()),
        ("is_patched", lambda: d.is_patched("_cudnn_attention_backward_op")),
        ("get_original", lambda: d.get_original("_cudnn_attention_backward_op")),
        ("is_patched_class_attr", lambda: d.is_patched("TemplatedRingAttention.backward")),
        ("is_patched_dotted", lambda: d.is_patched("diffusers.models.attention_dispatch._cudnn_attention_backward_op")),
        ("is_patched_typo", lambda: d.is_patched("_cudnn_attention_backwards_op")),
        ("get_original_typo", lambda: d.get_original("banana")),
    ):
        try:
            value = call()
            out[name] = {"ok": True, "value": value}
        except BaseException as exc:
            out[name] = {"ok": False, "value": f"{type(exc).__name__}: {exc}"}
    from diffusers_cudnn_fix.fixes import ALL_FIXES  # the fix table: plain data
    from diffusers_cudnn_fix.__main__ import main
    out["table"] = {"ok": True, "value": [fix.id for fix in ALL_FIXES]}
    import contextlib, io
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["--no-gpu"])
    out["doctor"] = {"ok": code == 2, "value": printed.getvalue()}
    report = out["status"]["value"]
    if out["status"]["ok"]:
        out["status"]["value"] = {"dict": report.to_dict(), "text": str(report), "ok": report.ok}
    if out["revert"]["ok"]:
        out["revert"]["value"] = str(out["revert"]["value"])
    out["get_original"]["value"] = repr(out["get_original"]["value"])
print(json.dumps({"calls": out, "torch_loaded": "torch" in sys.modules,
                  "warnings": [f"{w.category.__name__}: {w.message}" for w in seen]}))
"""


def test_status_revert_and_queries_work_without_torch(tmp_path: Path) -> None:
    """An interpreter without site-packages (``-S``) and only wrapt and packaging: torch is not installed."""
    site = tmp_path / "site"
    site.mkdir()
    for name in ("wrapt", "packaging"):
        module = __import__(name)
        (site / name).symlink_to(Path(module.__file__).parent, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site)])
    proc = subprocess.run(
        [sys.executable, "-S", "-c", NO_TORCH], capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    calls = result["calls"]
    # A target the package does not know is refused (no torch needed to say so), naming the known ones.
    for name in ("is_patched_typo", "get_original_typo"):
        refused = calls.pop(name)
        assert not refused["ok"] and refused["value"].startswith("ValueError"), refused
        assert "_cudnn_attention_backward_op" in refused["value"], refused
    failed = {k: v["value"] for k, v in calls.items() if not v["ok"]}
    assert not failed, failed
    assert calls["is_patched"]["value"] is False and calls["is_patched_class_attr"]["value"] is False
    assert calls["is_patched_dotted"]["value"] is False
    assert calls["get_original"]["value"] == "None"
    status = calls["status"]["value"]
    assert status["dict"]["fixes"] == []  # lists no fix
    # The fix table and the doctor's release table need no torch.
    assert sorted(calls["table"]["value"]) == sorted(FIX_IDS)
    doctor = calls["doctor"]["value"]
    assert "release table" in doctor and all(f"{i} " in doctor for i in FIX_IDS), doctor
    assert ">=0.36.0,<0.40.0" in doctor, doctor
    missing = r"torch\W[^\n]*(missing|not installed|cannot be imported|not found|unavailable)"
    assert re.search(missing, status["text"], re.I), status["text"]
    assert result["torch_loaded"] is False


# --------------------------------------------------------------------------------------------------
# Said once, at the user's line
# --------------------------------------------------------------------------------------------------
# A user's training script: the package first, then diffusers (line 6). With a handler of the user's own on
# the root logger when asked: it still receives the package's records.
USER_SCRIPT = """\
import logging, sys
records = []
if "--handler" in sys.argv:
    logging.getLogger().addHandler(type("Keep", (logging.Handler,), {"emit": lambda self, r: records.append(r)})())
import diffusers_cudnn_fix
import diffusers.models.attention_dispatch
print("records", len(records))
"""
USER_LINE = 6
ONE_MESSAGE_ENV = {"DIFFUSERS_CUDNN_FIX_MASK": "banana", "DIFFUSERS_CUDNN_FIX_SKIP": "cudnn_backward_kv"}
EVENTS = {"SwitchValueWarning": "DIFFUSERS_CUDNN_FIX_MASK='banana'", "FixNotAppliedWarning": "'cudnn_backward_kv'"}


def _said(stderr: str, needle: str) -> list[str]:
    return [line for line in stderr.splitlines() if needle in line]


@pytest.mark.parametrize("how", ["script", "script with a logging handler", "launcher", "doctor"])
def test_each_problem_is_said_once_at_the_users_line(how: str, tmp_path: Path) -> None:
    """A bad switch value and a skipped broken fix: one line on stderr each, per process, filed at the line of
    the user's script that imported diffusers (not the package's own code); through the launcher too (its
    own interpreter says nothing); the doctor, which is the user's code there, says each once as its own."""
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    command = {
        "script": [sys.executable, str(script)],
        "script with a logging handler": [sys.executable, str(script), "--handler"],
        "launcher": [sys.executable, "-m", "diffusers_cudnn_fix", "run", "--", sys.executable, str(script)],
        "doctor": [sys.executable, "-m", "diffusers_cudnn_fix", "--no-gpu"],
    }[how]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "DIFFUSERS_CUDNN_FIX"))}
    env.update(ONE_MESSAGE_ENV, PYTHONPATH=os.pathsep.join([str(release_dir("0.39.0")), str(ROOT)]))
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert proc.returncode in (0, 1), (proc.returncode, proc.stderr)
    for category, needle in EVENTS.items():
        lines = _said(proc.stderr, needle)
        assert len(lines) == 1, f"{category} said {len(lines)} times:\n{proc.stderr}"
        if how == "doctor":
            assert lines[0].startswith(f"diffusers-cudnn-fix: {category}: "), lines[0]
        else:
            assert lines[0].startswith(f"{script}:{USER_LINE}: {category}: "), lines[0]
    assert "diffusers_cudnn_fix/" not in proc.stderr, proc.stderr  # no line of ours is shown
    if how == "script with a logging handler":
        assert "records 2" in proc.stdout, proc.stdout  # the user's handler got both records
