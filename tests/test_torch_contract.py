"""The ATen attention ops of the running torch, and what the package does when they are not the ones it knows.

* On every torch the suite runs on (the pinned one, and the oldest and newest in .ci/run's torch legs) the four
  ops have exactly the signatures the corrected ops call by keyword (``_detect.ATEN_SIGNATURES``) and the
  cuDNN forward's meta kernel returns a log-sum-exp of the rank the package expects.
* A changed op (an argument added, renamed or retyped, or a log-sum-exp of another rank) gives "unknown" for
  every correction calling it: not applied, a FixNotAppliedWarning, ``status()`` not ok and the doctor's
  NOT SAFE naming the op. Shown in process with a changed signature handed to the check, and end to end in
  a fresh interpreter where ``torch.ops.aten._scaled_dot_product_cudnn_attention`` is a test-only op of a
  changed schema (one more keyword argument) that diffusers and the package both reach.
"""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version
from releases import release_dir, run

from diffusers_cudnn_fix import _detect

ALL_OPS = (
    _detect.CUDNN_FORWARD_KERNEL,
    _detect.CUDNN_BACKWARD_KERNEL,
    _detect.FLASH_FORWARD_KERNEL,
    _detect.FLASH_BACKWARD_KERNEL,
)


def test_the_running_torch_has_the_known_ops() -> None:
    for name, known in _detect.ATEN_SIGNATURES.items():
        assert _detect.aten_signature(name) == known, (torch.__version__, name)
    assert _detect.aten_contract_problem(*ALL_OPS) is None


def test_the_lse_rank_rule_matches_this_torchs_meta_kernel() -> None:
    expected = 4 if Version(torch.__version__).release[:2] >= (2, 9) else 3
    assert _detect._meta_lse_ndim() == _detect.cudnn_lse_ndim() == expected


def _changed(name: str, arguments: str) -> object:
    real = _detect.aten_signature

    def signature(op: str) -> tuple[str, str] | None:
        found = real(op)
        return (arguments, found[1]) if op == name and found is not None else found

    return signature


@pytest.mark.parametrize(
    "arguments",
    [
        # An added keyword argument (as a softcap or a new mask mode might come).
        _detect.ATEN_SIGNATURES["_scaled_dot_product_cudnn_attention"][0] + ", float? softcap=None",
        # attn_bias renamed.
        _detect.ATEN_SIGNATURES["_scaled_dot_product_cudnn_attention"][0].replace("attn_bias", "attn_mask"),
    ],
    ids=["added", "renamed"],
)
def test_a_changed_cudnn_forward_schema_is_unknown(dispatch_module, monkeypatch, arguments: str) -> None:
    monkeypatch.setattr(_detect, "aten_signature", _changed("_scaled_dot_product_cudnn_attention", arguments))
    from diffusers_cudnn_fix._registry import callable_of, check_of, original
    from diffusers_cudnn_fix.fixes import ALL_FIXES

    fixes = {fix.id: check_of(fix) for fix in ALL_FIXES}

    lookup = lambda name: callable_of(original(name))  # noqa: E731  (diffusers' code as shipped)
    for fix_id in ("cudnn_forward_lse", "cudnn_backward_kv"):
        finding = fixes[fix_id](lookup)
        assert finding.state == "unknown", (fix_id, finding)
        assert "aten::_scaled_dot_product_cudnn_attention " in finding.detail, finding.detail
        assert "softcap" in finding.detail or "attn_mask" in finding.detail, finding.detail
    # The flash pair does not call the changed op: its check runs as before (broken on 0.39.0, in process).
    assert fixes["flash_backward_kv"](lookup).state == "broken"


def test_a_log_sum_exp_of_another_rank_is_unknown(dispatch_module, monkeypatch) -> None:
    monkeypatch.setattr(_detect, "cudnn_lse_ndim", lambda: 7 - _detect._meta_lse_ndim())  # 4 <-> 3
    finding = _detect.check_forward_lse(
        dispatch_module._cudnn_attention_forward_op, forward_op=_detect.CUDNN_FORWARD_KERNEL
    )
    assert finding.state == "unknown" and "log-sum-exp" in finding.detail, finding


# A fresh interpreter: aten's cuDNN forward replaced by a test-only op whose schema has one more keyword argument
# (its CPU kernel is the stand-in's), bound where every caller looks it up, before diffusers and the package.
CHANGED_OP = """
import contextlib, io, json, warnings
import torch, standin_kernels
standin_kernels.register()
NAME = "_scaled_dot_product_cudnn_attention"
real = getattr(torch.ops.aten, NAME).default
arguments = str(real._schema).partition("(")[2].partition(") -> ")[0]
lib = torch.library.Library("dcf_changed", "DEF")
returns = "Tensor, Tensor, Tensor, Tensor, SymInt, SymInt, Tensor, Tensor, Tensor"
lib.define(f"{NAME}({arguments}, float? softcap=None) -> ({returns})")
lib.impl(NAME, lambda *args, softcap=None, **kwargs: real(*args, **kwargs), "CPU")
setattr(torch.ops.aten, NAME, getattr(torch.ops.dcf_changed, NAME))
assert "softcap" in str(torch.ops.aten._scaled_dot_product_cudnn_attention.default._schema)

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import diffusers_cudnn_fix
    import diffusers.models.attention_dispatch
    report = diffusers_cudnn_fix.status()
from diffusers_cudnn_fix import __main__ as doctor
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = doctor.main(["--no-gpu"])
print(json.dumps({
    "fixes": {f.id: [f.detected, f.applied, f.reason] for f in report.fixes},
    "ok": report.ok,
    "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    "doctor_code": code,
    "doctor": out.getvalue(),
}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.38.0", "0.42.1"])  # 0.42.1 skipped on torch < 2.6 (conftest.py)
def test_a_changed_op_is_refused_clearly_in_status_and_doctor(version: str) -> None:
    result = run(release_dir(version), CHANGED_OP, preloaded=True)
    fixes = result["fixes"]
    for fix_id in ("cudnn_forward_lse", "cudnn_backward_kv"):
        detected, applied, reason = fixes[fix_id]
        assert (detected, applied) == ("unknown", False), (fix_id, fixes[fix_id])
        assert "aten::_scaled_dot_product_cudnn_attention" in reason and "softcap" in reason, reason
    assert result["ok"] is False
    assert any(
        w.startswith("FixNotAppliedWarning") and "cudnn_forward_lse" in w and "softcap" in w for w in result["warnings"]
    ), result["warnings"]
    text = " ".join(result["doctor"].split())
    assert result["doctor_code"] == 1 and text.startswith("NOT SAFE"), result["doctor"]
    assert "aten::_scaled_dot_product_cudnn_attention" in text, result["doctor"]
    # The flash pair's ops are unchanged: its correction is decided by its own check, as before.
    assert fixes["flash_backward_kv"][1] is (version == "0.38.0"), fixes["flash_backward_kv"]
