"""Import never breaks the host; switches; odd diffusers builds. Each case in a process of its own: a fresh
interpreter where the case is about torch, CUDA or import cost; otherwise forked from one that has imported
torch only (``releases.run(preloaded=True)``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from releases import ROOT, relabelled_copy, release_dir, run

from diffusers_cudnn_fix.fixes import ALL_FIXES

PREAMBLE = """
import json, logging, sys, warnings
warnings.simplefilter("always")
records = []
class _H(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
logging.getLogger("diffusers_cudnn_fix").addHandler(_H())
logging.getLogger("diffusers_cudnn_fix").setLevel(logging.INFO)
caught = warnings.catch_warnings(record=True)
seen = caught.__enter__()
def ours():
    return [(w.category.__name__, str(w.message)) for w in seen
            if w.category.__module__.startswith("diffusers_cudnn_fix")]
def done(**extra):
    import diffusers_cudnn_fix
    print(json.dumps({"status": diffusers_cudnn_fix.status().to_dict(), "warnings": ours(), "logs": records, **extra}))
"""


def script(body: str) -> str:
    return PREAMBLE + textwrap.dedent(body)


def test_import_without_diffusers_loads_nothing_heavy() -> None:
    result = run(
        None,
        script(
            """
            before = set(sys.modules)
            import wrapt
            with_wrapt = set(sys.modules)
            import diffusers_cudnn_fix
            added = sorted(m for m in set(sys.modules) - with_wrapt if not m.startswith("diffusers_cudnn_fix"))
            heavy = sorted(m for m in ("torch", "diffusers", "packaging", "numpy") if m in sys.modules)
            done(added=added, heavy=heavy)
            """
        ),
    )
    assert result["heavy"] == []
    # Nothing beyond what wrapt itself imports: `from __future__ import annotations` loads that tiny module, and
    # `typing` (with its stubs) is wrapt 2's own import but not wrapt 1.14's (the oldest the package declares).
    assert set(result["added"]) <= {"__future__", "typing", "_typing", "typing.io", "typing.re"}, result["added"]
    assert result["status"]["module_loaded"] is False and result["status"]["ok"] is True
    assert {f["detected"] for f in result["status"]["fixes"]} == {"pending"}
    assert result["warnings"] == []


CATEGORIES = {
    "DiffusersCudnnFixWarning": "RuntimeWarning",
    "FixNotAppliedWarning": "DiffusersCudnnFixWarning",
    "ReleaseTableMismatchWarning": "DiffusersCudnnFixWarning",
    "StaleReferenceWarning": "DiffusersCudnnFixWarning",
    "MaskConvertedWarning": "DiffusersCudnnFixWarning",
    "MaskMisreadWarning": "DiffusersCudnnFixWarning",
    "ProbeFailedWarning": "DiffusersCudnnFixWarning",
    "SwitchValueWarning": "DiffusersCudnnFixWarning",
    "UnsafeAttentionError": "RuntimeError",
}


def test_every_warning_category_is_exported_from_the_package_without_torch() -> None:
    """docs/behaviour.md: all in ``_warnings.py``, all exported; importing them loads no torch."""
    result = run(
        None,
        script(
            f"""
            import diffusers_cudnn_fix
            names = {sorted(CATEGORIES)!r}
            found = {{}}
            for name in names:
                cls = getattr(diffusers_cudnn_fix, name, None)
                found[name] = None if cls is None else {{
                    "module": cls.__module__,
                    "bases": [b.__name__ for b in cls.__mro__[1:]],
                    "exported": name in diffusers_cudnn_fix.__all__,
                }}
            done(found=found, heavy=sorted(m for m in ("torch", "diffusers") if m in sys.modules))
            """
        ),
    )
    assert result["heavy"] == []
    for name, base in CATEGORIES.items():
        cls = result["found"][name]
        assert cls is not None, f"diffusers_cudnn_fix.{name} is missing"
        assert cls["module"] == "diffusers_cudnn_fix._warnings", (name, cls)
        assert base in cls["bases"] and cls["exported"], (name, cls)


BARE_IMPORT = """
import json, sys, types
# A stand-in wrapt: what our own modules load, apart from whatever the installed wrapt loads (2.x loads
# logging and typing itself, 1.x neither).
stub = types.ModuleType("wrapt")
stub.register_post_import_hook = lambda hook, name: None
sys.modules["wrapt"] = stub
before = set(sys.modules)
import diffusers_cudnn_fix
print(json.dumps(sorted(m for m in set(sys.modules) - before if not m.startswith("diffusers_cudnn_fix"))))
"""


def test_our_own_modules_load_nothing_heavy_at_import() -> None:
    result = subprocess.run(
        [sys.executable, "-c", BARE_IMPORT],
        capture_output=True,
        text=True,
        check=True,
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    added = json.loads(result.stdout.splitlines()[-1])
    # logging and typing (which wrapt 2.x loads anyway) are allowed: the budget is `import wrapt` + 5 ms,
    # and simple code beats a lazy logger. Nothing that costs tens of ms or touches a GPU may load.
    heavy = {"torch", "diffusers", "packaging", "dataclasses", "inspect", "importlib.metadata", "numpy"}
    assert not heavy & set(added), sorted(heavy & set(added))


@pytest.mark.parametrize("order", ["package_first", "diffusers_first"])
def test_import_never_initialises_cuda(order: str) -> None:
    first, second = "import diffusers_cudnn_fix", "import diffusers.models.attention_dispatch"
    if order == "diffusers_first":
        first, second = second, first
    result = run(
        release_dir("0.39.0"),
        script(
            f"""
            {first}
            {second}
            import torch
            done(cuda_initialized=torch.cuda.is_initialized())
            """
        ),
    )
    assert result["cuda_initialized"] is False
    assert result["status"]["ok"] is True


def test_off_switch_leaves_diffusers_as_shipped() -> None:
    result = run(
        release_dir("0.39.0"),
        script(
            """
            import diffusers_cudnn_fix
            import diffusers.models.attention_dispatch as m
            shipped = m._cudnn_attention_backward_op
            report = diffusers_cudnn_fix.apply()  # explicit apply obeys the switch too
            done(untouched=m._cudnn_attention_backward_op is shipped, module=m._cudnn_attention_backward_op.__module__)
            """
        ),
        env={"DIFFUSERS_CUDNN_FIX": "0"},
        preloaded=True,
    )
    assert result["untouched"] is True
    assert result["module"] == "diffusers.models.attention_dispatch"
    assert result["status"]["enabled"] is False
    assert result["status"]["ok"] is False  # 0.39.0 carries the bugs, and nothing fixes them: not OK
    assert {f["detected"] for f in result["status"]["fixes"]} == {"disabled"}
    assert result["warnings"] == [] and result["logs"] == []


def test_skip_switch_checks_but_leaves_the_named_fix_and_says_so() -> None:
    result = run(
        release_dir("0.39.0"),
        script(
            """
            import diffusers_cudnn_fix
            import diffusers.models.attention_dispatch
            done()
            """
        ),
        env={"DIFFUSERS_CUDNN_FIX_SKIP": "flash_backward_kv"},
        preloaded=True,
    )
    fixes = {f["id"]: f for f in result["status"]["fixes"]}
    assert fixes["flash_backward_kv"]["applied"] is False
    assert fixes["flash_backward_kv"]["detected"] == "broken"
    assert "skipped" in fixes["flash_backward_kv"]["reason"]
    assert fixes["cudnn_backward_kv"]["applied"] is True
    assert result["status"]["ok"] is False  # skipping a broken fix is not "OK"
    assert any(c == "FixNotAppliedWarning" and "flash_backward_kv" in m for c, m in result["warnings"])


def test_skipping_the_lse_fix_turns_garbage_into_a_clear_error() -> None:
    """With only the K/V fix, the corrected backward refuses a missing log-sum-exp instead of computing garbage."""
    result = run(
        release_dir("0.39.0"),
        script(
            """
            import diffusers_cudnn_fix
            import subprocess_op_pair_grads
            module = subprocess_op_pair_grads.import_in_order("package_first")
            import standin_kernels
            standin_kernels.register()
            case = subprocess_op_pair_grads.CASES[0]
            done(
                without_lse=subprocess_op_pair_grads.run_case(module, "cudnn", case, False),
                with_lse=subprocess_op_pair_grads.run_case(module, "cudnn", case, True),
            )
            """
        ),
        env={"DIFFUSERS_CUDNN_FIX_SKIP": "cudnn_forward_lse"},
        preloaded=True,
    )
    assert result["without_lse"]["status"] == "raised"
    assert "cudnn_forward_lse" in result["without_lse"]["error"]
    assert "diffusers_cudnn_fix" in result["without_lse"]["error"]
    assert result["with_lse"]["status"] == "pass"


def test_warnings_as_errors_do_not_break_the_import() -> None:
    result = run(
        release_dir("0.39.0"),
        script(
            """
            import diffusers_cudnn_fix
            warnings.simplefilter("error", diffusers_cudnn_fix.DiffusersCudnnFixWarning)
            import diffusers_cudnn_fix._registry as registry
            registry.apply_to = lambda *a, **k: 1 / 0  # an internal failure inside the hook
            import diffusers.models.attention_dispatch as m
            done(untouched=m._cudnn_attention_backward_op.__module__ == "diffusers.models.attention_dispatch")
            """
        ),
    )
    assert result["untouched"] is True
    assert any("internal error" in line for line in result["logs"])


def test_internal_error_in_the_hook_warns_and_leaves_diffusers_as_shipped() -> None:
    result = run(
        release_dir("0.39.0"),
        script(
            """
            import diffusers_cudnn_fix._registry as registry
            real = registry.raw_set
            def half_then_fail(module, target, value):  # fails once the forward's replacement is in
                if target == "_cudnn_attention_backward_op" and registry._state.installed:
                    raise RuntimeError("boom")
                return real(module, target, value)
            registry.raw_set = half_then_fail
            import diffusers_cudnn_fix
            import diffusers.models.attention_dispatch as m
            names = ["_cudnn_attention_forward_op", "_cudnn_attention_backward_op",
                     "_native_flash_attention_backward_op"]
            done(untouched=[getattr(m, n).__module__ == "diffusers.models.attention_dispatch" for n in names])
            """
        ),
        preloaded=True,
    )
    # Nothing half-applied: the forward fix that went in before the failure was taken out again.
    assert result["untouched"] == [True, True, True]
    assert any(c == "FixNotAppliedWarning" and "internal error" in m for c, m in result["warnings"])


FAKE_INIT = '__version__ = "{version}"\n'
FAKE_DISPATCH_HEADER = "import torch\n"


def _fake_diffusers(tmp_path: Path, version: str, dispatch_body: str) -> Path:
    pkg = tmp_path / "diffusers"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_INIT.format(version=version))
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "attention_dispatch.py").write_text(FAKE_DISPATCH_HEADER + textwrap.dedent(dispatch_body))
    return tmp_path


ODD_BUILDS = {
    "renamed": """
        def _cudnn_attention_fwd(ctx, query, key, value):
            return query
        """,
    "other_signature": """
        def _cudnn_attention_forward_op(ctx, q, k, v, mask=None, dropout=0.0, causal=False, scale=None,
                                        gqa=False, lse=False, _save_ctx=True, _parallel_config=None):
            return q
        def _cudnn_attention_backward_op(ctx, grad_out, *args, **kwargs):
            return grad_out, grad_out, grad_out
        """,
    "raises_when_called": """
        def _cudnn_attention_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                        scale=None, enable_gqa=False, return_lse=False, _save_ctx=True,
                                        _parallel_config=None):
            raise RuntimeError("this build needs a GPU")
        def _cudnn_attention_backward_op(ctx, grad_out, *args, **kwargs):
            raise RuntimeError("this build needs a GPU")
        """,
    "not_functions": """
        _cudnn_attention_forward_op = None
        _cudnn_attention_backward_op = 42
        """,
}


@pytest.mark.parametrize("build", sorted(ODD_BUILDS))
@pytest.mark.parametrize("order", ["package_first", "diffusers_first"])
def test_odd_builds_never_raise_and_are_left_alone(tmp_path: Path, build: str, order: str) -> None:
    site = _fake_diffusers(tmp_path, "0.39.0", ODD_BUILDS[build])
    first, second = "import diffusers_cudnn_fix", "import diffusers.models.attention_dispatch as m"
    if order == "diffusers_first":
        first, second = second, first
    result = run(
        site,
        script(
            f"""
            {first}
            {second}
            import diffusers.models.attention_dispatch as m
            ops = ("_cudnn_attention_forward_op", "_cudnn_attention_backward_op")
            done(attrs={{n: repr(getattr(m, n, None))[:40] for n in ops}},
                 foreign=[n for n in dir(m)
                          if (getattr(getattr(m, n), "__module__", "") or "").startswith("diffusers_cudnn_fix")])
            """
        ),
        preloaded=True,
    )
    assert result["foreign"] == []  # nothing of ours went in
    fixes = {f["id"]: f for f in result["status"]["fixes"]}
    cudnn = {fixes["cudnn_forward_lse"]["detected"], fixes["cudnn_backward_kv"]["detected"]}
    if build in ("renamed", "not_functions"):
        assert cudnn <= {"absent", "unknown"}
    else:
        assert cudnn == {"unknown"}
        assert result["status"]["ok"] is False  # an affected version we cannot vouch for is not OK
        assert any(c == "FixNotAppliedWarning" for c, _ in result["warnings"])
    if build in ("renamed", "not_functions"):
        # The release table lists 0.39.0 as affected, but nothing is there to check: say so.
        assert any(c == "ReleaseTableMismatchWarning" for c, _ in result["warnings"])


def test_dev_build_with_the_old_code_is_fixed() -> None:
    """0.40.0.dev0 before upstream's fix: the table covers releases only, the check finds the bugs."""
    result = run(
        relabelled_copy("0.39.0", "0.40.0.dev0"),
        script("import diffusers_cudnn_fix, diffusers.models.attention_dispatch\ndone()\n"),
        preloaded=True,
    )
    assert result["status"]["diffusers_version"] == "0.40.0.dev0"
    fixes = {f["id"]: f for f in result["status"]["fixes"]}
    for fix_id in ("cudnn_forward_lse", "cudnn_backward_kv", "flash_backward_kv"):
        fix = fixes[fix_id]
        assert fix["expected"] is None and fix["detected"] == "broken" and fix["applied"] is True, fix
    assert result["status"]["ok"] is True


def test_fixed_code_labelled_as_an_affected_release_is_left_alone() -> None:
    result = run(
        relabelled_copy("0.40.0", "0.39.0"),
        script("import diffusers_cudnn_fix, diffusers.models.attention_dispatch\ndone()\n"),
        preloaded=True,
    )
    fixes = {f["id"]: f for f in result["status"]["fixes"]}
    fixed_in_040 = ("cudnn_forward_lse", "cudnn_backward_kv", "flash_backward_kv")
    for fix_id in fixed_in_040:
        fix = fixes[fix_id]
        assert fix["expected"] is True and fix["detected"] == "ok" and fix["applied"] is False, fix
    assert fixes["cudnn_bool_mask"]["applied"] is True  # still open upstream
    # 0.40.0's ring backward routes the K/V gradients wrong from ring degree 3 (0.39.0's reuses the first step's
    # tensors: the table lists both): corrected.
    route = fixes["ring_grad_route"]
    assert route["expected"] is True and route["detected"] == "broken" and route["applied"] is True, route
    mismatches = [m for c, m in result["warnings"] if c == "ReleaseTableMismatchWarning"]
    assert sorted(m.split("'")[1] for m in mismatches) == sorted(fixed_in_040)


def test_double_import_and_reload_apply_once_and_log_once() -> None:
    result = run(
        release_dir("0.39.0"),
        script(
            """
            import importlib
            import diffusers_cudnn_fix
            import diffusers.models.attention_dispatch as m
            first = m._cudnn_attention_backward_op
            import diffusers_cudnn_fix as again
            importlib.reload(diffusers_cudnn_fix)
            diffusers_cudnn_fix.apply()
            done(same=m._cudnn_attention_backward_op is first)
            """
        ),
        preloaded=True,
    )
    assert result["same"] is True
    applied_lines = [line for line in result["logs"] if "applied" in line]
    assert len(applied_lines) == 1, result["logs"]


def test_reloading_diffusers_module_is_noticed_and_reapplied() -> None:
    result = run(
        release_dir("0.39.0"),
        script(
            """
            import importlib
            import diffusers_cudnn_fix
            import diffusers.models.attention_dispatch as m
            before = sorted(f.id for f in diffusers_cudnn_fix.status().fixes if f.applied)
            importlib.reload(m)
            after_reload = diffusers_cudnn_fix.status().to_dict()
            diffusers_cudnn_fix.apply()
            done(after_reload=after_reload, before=before)
            """
        ),
        preloaded=True,
    )
    assert result["after_reload"]["ok"] is False
    # The reload replaces the attention module's objects; diffusers' ModelMixin, whose enable_parallelism the
    # model-level fixes replace, stays (and so do they).
    elsewhere = {fix.id for fix in ALL_FIXES if all(":" in target for target in fix.targets)}
    assert elsewhere == {"cp_gather_grads", "ltx2_cp_plan", "cp_split_warning_once", "cp_no_accelerator"}, elsewhere
    assert all(not f["applied"] for f in result["after_reload"]["fixes"] if f["id"] not in elsewhere)
    assert result["status"]["ok"] is True
    assert sorted(f["id"] for f in result["status"]["fixes"] if f["applied"]) == result["before"]


@pytest.mark.parametrize("version", ["0.35.2", "0.36.0", "0.39.0", "0.40.0", "0.42.1"])
def test_one_advice_in_the_log_the_doctor_text_and_its_json(version: str) -> None:
    """The import-time INFO line, the doctor's first paragraph and its ``--json`` give one computed advice
    (``apply`` / ``keep`` / ``remove``), in the same words. Before, on 0.42.1 the log said the package "can be
    removed" for the gradient corrections while the doctor said it still guards padded prompts (#14342), and
    ``--json`` said ``no_gradient_correction_needed``; on 0.40+ the ring route's correction was left out."""
    result = run(
        release_dir(version),
        script(
            """
            import contextlib, io
            import diffusers_cudnn_fix, diffusers.models.attention_dispatch
            from diffusers_cudnn_fix import __main__ as doctor
            outputs = {}
            for args in (["--no-gpu"], ["--no-gpu", "--json"]):
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    doctor.main(args)
                outputs[" ".join(args)] = out.getvalue()
            done(text=outputs["--no-gpu"], json=json.loads(outputs["--no-gpu --json"]))
            """
        ),
        preloaded=True,
    )
    data = result["json"]
    expected = {"0.35.2": "remove", "0.36.0": "apply", "0.39.0": "apply", "0.40.0": "keep", "0.42.1": "keep"}
    assert data["advice"] == expected[version], data
    # The word itself, as --json says it, before the sentence in the log and the doctor's text (#49: the JSON said
    # "apply" and the text "keep it imported").
    said = f"advice {data['advice']}: {data['advice_text']}"
    advice_lines = [line for line in result["logs"] if said in line]
    assert len(advice_lines) == 1, (said, result["logs"])
    first_paragraph = " ".join(result["text"].strip().split("\n\n")[0].split())
    assert first_paragraph.startswith(said), first_paragraph
    others = {"apply", "keep", "remove"} - {data["advice"]}
    assert not any(f"{word} it" in data["advice_text"] for word in others), data["advice_text"]
    if data["advice"] != "remove":
        assert not any("can be removed" in line for line in result["logs"]), result["logs"]
    # The fixes applied are exactly those the advice names as needed (no skip switch is set).
    applied = sorted(f["id"] for f in result["status"]["fixes"] if f["applied"])
    needs = data["needs"]
    assert sorted([*needs["corrections"], *needs["only_for"], *needs["guards"]]) == applied, (needs, applied)
    assert result["warnings"] == []
