"""Every problem message the package raises or warns: cause, consequence and way out in at most three lines, the
last naming the command that prints the docs section where the long explanation lives (``_warnings.explain``:
``diffusers-cudnn-fix explain <page>#<section>``), a section the command prints.

Each message is triggered as the user meets it, or by calling the function that raises it (in-process, diffusers
0.39.0 with the stand-in kernels, as conftest sets up). A source scan holds that no other raise or report site
formats its own message; the sites whose owners convert them are listed, with why.
"""

from __future__ import annotations

import ast
import re
import types
import warnings
from collections.abc import Callable, Iterator

import pytest
from releases import ROOT

import diffusers_cudnn_fix
from diffusers_cudnn_fix import DiffusersCudnnFixWarning, UnsafeAttentionError, _explain

PACKAGE = ROOT / "diffusers_cudnn_fix"
#: The end of a message's third line: the command that prints its docs section (nothing after it, to be copied).
SEE = re.compile(r" Details: diffusers-cudnn-fix explain (?P<topic>[\w-]+\.md#[\w-]+)$")


def assert_explained(message: str, *, section: str | None = None, table: bool = False) -> None:
    """Three lines (cause, consequence, way out), the last naming the command that prints a docs section, one
    that it prints (``section`` if given); ``table``: an attached table may follow them."""
    lines = message.split("\n")
    assert table or len(lines) <= 3, f"{len(lines)} lines:\n{message}"
    assert len(lines) >= 3 and lines[0].startswith("diffusers_cudnn_fix: "), message
    assert all(line.strip() for line in lines[:3]), message
    see = SEE.search(lines[2])
    assert see is not None, f"the third line names no explain command:\n{message}"
    assert _explain.text_of(see["topic"]), f"diffusers-cudnn-fix explain {see['topic']} prints nothing"
    if section is not None:
        assert see["topic"] == section, message


@pytest.fixture()
def said() -> Iterator[list[warnings.WarningMessage]]:
    """The package's warnings while the test runs (every one, whatever the filters of the run)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield seen


def ours(seen: list[warnings.WarningMessage], category: type[Warning] = DiffusersCudnnFixWarning) -> list[str]:
    return [str(w.message) for w in seen if issubclass(w.category, category)]


def raised(call: Callable[[], object], error: type[BaseException] = UnsafeAttentionError) -> str:
    with pytest.raises(error) as err:
        call()
    return str(err.value)


# --- the guards' refusals and the mask notices ------------------------------------------------------------


def _qkv(dtype: str = "bfloat16", shape: tuple[int, ...] = (1, 8, 2, 16)) -> tuple:
    import torch

    return tuple(torch.zeros(shape, dtype=getattr(torch, dtype)) for _ in range(3))


def test_mask_messages(dispatch_module, monkeypatch, said) -> None:
    import torch

    from diffusers_cudnn_fix.fixes import cudnn_bool_mask

    q, k, v = _qkv()
    keep = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    section = "fixes.md#cudnn_bool_mask"
    grad = torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16, requires_grad=True)
    assert_explained(raised(lambda: cudnn_bool_mask.mask_policy(q, k, v, grad)), section=section)
    integer = keep.to(torch.int64)
    assert_explained(raised(lambda: cudnn_bool_mask.mask_policy(q, k, v, integer)), section=section)
    monkeypatch.setattr(cudnn_bool_mask, "_warned", set())  # the notices are said once per process
    try:
        diffusers_cudnn_fix.set_mask_mode("error")
        assert_explained(raised(lambda: cudnn_bool_mask.mask_policy(q, k, v, keep)), section=section)
        for mode, category in (("convert", "MaskConvertedWarning"), ("warn", "MaskMisreadWarning")):
            diffusers_cudnn_fix.set_mask_mode(mode)
            cudnn_bool_mask.mask_policy(q, k, v, keep)
            (message,) = ours(said, getattr(diffusers_cudnn_fix, category))
            assert_explained(message, section=section)
    finally:
        diffusers_cudnn_fix.set_mask_mode("convert")


def test_input_dtypes_refusal(dispatch_module) -> None:
    from diffusers_cudnn_fix.fixes import cudnn_input_dtypes

    q, k, v = _qkv("float32")
    message = raised(lambda: cudnn_input_dtypes.refuse_unsupported_dtypes(q, k, v, None))
    assert_explained(message, section="fixes.md#cudnn_input_dtypes")
    assert "torch.float32/torch.float32/torch.float32" in message


def test_ulysses_mask_grad_refusal(dispatch_module) -> None:
    import torch

    from diffusers_cudnn_fix.fixes import ulysses_mask_grad

    mask = torch.zeros(1, 1, 4, 4, requires_grad=True)
    assert_explained(raised(lambda: ulysses_mask_grad.refuse_mask_grad(mask)), section="fixes.md#ulysses_mask_grad")


def test_flash_cp_ignored_refusal(dispatch_module) -> None:
    from diffusers_cudnn_fix.fixes import flash_cp_ignored

    cp = types.SimpleNamespace(ulysses_degree=2, ring_degree=1)
    config = types.SimpleNamespace(context_parallel_config=cp)
    message = raised(lambda: flash_cp_ignored.refuse_context_parallel(config))
    assert_explained(message, section="fixes.md#flash_cp_ignored")


def test_no_kernel_message(dispatch_module) -> None:
    import torch

    from diffusers_cudnn_fix.fixes import cudnn_forward_lse

    message = cudnn_forward_lse.no_kernel_message(torch.device("cpu"))
    assert_explained(message, section="behaviour.md#tensors-off-the-gpu")
    assert "cpu" in message and '"native" attention backend' in message


def test_layout_refusals(dispatch_module, monkeypatch) -> None:
    import torch

    from diffusers_cudnn_fix import _layout

    q, _, _ = _qkv(shape=(1, 8, 1, 16))  # one head a rank
    per_step = raised(lambda: _layout.reject_per_step_tensors({"lse": q}, "cudnn_backward_kv"), NotImplementedError)
    assert_explained(per_step, section="fixes.md#cudnn_backward_kv")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    compiled = raised(lambda: _layout.entering(q))
    assert_explained(compiled, section="behaviour.md#under-torchcompile")
    assert "(1, 8, 1, 16)" in compiled


# --- the GPU probe, the switches ----------------------------------------------------------------------------


def test_probe_failure(dispatch_module, said) -> None:
    import torch

    from diffusers_cudnn_fix import _devices, _probe

    errors = {t: 1.0 for t in _probe.TENSORS}
    case = _devices.CaseResult("cudnn", "heads_eq_seq", "as installed", errors, errors, errors, False, None)
    failed = _devices.ProbeResult("cuda:0", "failed", "cudnn/heads_eq_seq outside the pass rule", (case,))
    _probe._announce(failed)
    (warned,) = ours(said, diffusers_cudnn_fix.ProbeFailedWarning)
    _devices.record(failed)
    try:
        diffusers_cudnn_fix.set_probe_mode("strict")
        strict = raised(lambda: _probe.maybe_probe(torch.device("cuda", 0)))
    finally:
        diffusers_cudnn_fix.set_probe_mode("warn")
        _devices._results.pop("cuda:0", None)
    for message in (warned, strict):
        assert_explained(message, section="doctor.md#the-gpu-probe", table=True)
        assert "heads_eq_seq" in message.split("\n", 3)[3]  # the table follows the three lines
    assert "DIFFUSERS_CUDNN_FIX_PROBE=strict" in strict


@pytest.mark.parametrize("variable", sorted(diffusers_cudnn_fix._switches.SWITCHES))
def test_bad_switch_values(monkeypatch, said, variable: str) -> None:
    from diffusers_cudnn_fix import _switches

    monkeypatch.setattr(_switches, "_reported", set())
    monkeypatch.setattr(_switches, "_overrides", {})  # the API's choice would win over the environment
    monkeypatch.setenv(variable, "banana")
    _switches.check_environment()
    _switches.skipped_fixes({"cudnn_backward_kv": "cudnn_backward_kv"})
    (message,) = ours(said, diffusers_cudnn_fix.SwitchValueWarning)
    assert_explained(message, section="behaviour.md#switches")
    assert f"{variable}='banana'" in message


# --- what the check and the hook say at diffusers' import --------------------------------------------------


@pytest.fixture()
def reapplied(dispatch_module) -> Iterator[Callable[[], None]]:
    """apply() from scratch (the check runs again); reverted afterwards."""
    diffusers_cudnn_fix.revert()
    yield diffusers_cudnn_fix.apply
    diffusers_cudnn_fix.revert()


def test_fix_skipped(reapplied, monkeypatch, said) -> None:
    monkeypatch.setenv("DIFFUSERS_CUDNN_FIX_SKIP", "cudnn_backward_kv")
    reapplied()
    (message,) = ours(said, diffusers_cudnn_fix.FixNotAppliedWarning)
    assert_explained(message, section="fixes.md#cudnn_backward_kv")


@pytest.mark.parametrize("state", ["broken", "unknown", "ok"])
def test_fix_not_applied_and_table_mismatch(reapplied, monkeypatch, said, state: str) -> None:
    """A check that finds the shipped code and the replacement broken (not applied), one that cannot tell, and
    one that finds it right on a release the table lists as carrying the bug (a mismatch notice)."""
    from diffusers_cudnn_fix import _fix
    from diffusers_cudnn_fix.fixes import cudnn_input_dtypes

    monkeypatch.setattr(cudnn_input_dtypes, "check", lambda lookup: _fix.Finding(state, "a stand-in check"))
    reapplied()
    category = (
        diffusers_cudnn_fix.ReleaseTableMismatchWarning if state == "ok" else diffusers_cudnn_fix.FixNotAppliedWarning
    )
    messages = [m for m in ours(said, category) if "cudnn_input_dtypes" in m]
    assert messages, ours(said)
    for message in messages:
        assert_explained(message, section="fixes.md#cudnn_input_dtypes")


class _ReadOnly(dict):
    def __setitem__(self, key: object, value: object) -> None:
        raise TypeError("read-only namespace")


class _Holder:
    """A module stand-in whose namespace refuses to be written."""


def test_stale_reference(reapplied, dispatch_module, monkeypatch, said) -> None:
    holder = _Holder()
    holder.__dict__ = _ReadOnly(op=dispatch_module._cudnn_attention_forward_op)  # a copy of the shipped op
    monkeypatch.setitem(__import__("sys").modules, "user_code_holding_a_copy", holder)
    reapplied()
    (message,) = ours(said, diffusers_cudnn_fix.StaleReferenceWarning)
    assert_explained(message, section="api.md#what-importing-it-does")


def test_hook_failures(dispatch_module, monkeypatch, said) -> None:
    import wrapt

    from diffusers_cudnn_fix import _hook, _registry

    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("stand-in failure")

    monkeypatch.setattr(_hook, "_late", None)
    monkeypatch.setattr(wrapt, "register_post_import_hook", fails)
    _hook.arm()
    monkeypatch.setattr(_registry, "apply_to", fails)
    try:
        _hook.on_import(dispatch_module)
    finally:
        diffusers_cudnn_fix.revert()
    messages = ours(said, diffusers_cudnn_fix.FixNotAppliedWarning)
    assert len(messages) == 2 and all("stand-in failure" in m for m in messages), messages
    for message in messages:
        assert_explained(message, section="api.md#what-importing-it-does")


def test_ring_messages() -> None:
    """The ring's refusals: an op it cannot drive (0.36 - 0.39's bug, and 0.40 on's from ring degree 3), inputs
    the corrected backward cannot take, a forward that ran before the ring was corrected. The first two are built
    here; the last is raised by the backward on a context the corrected forward never saw."""
    from diffusers_cudnn_fix.fixes import ring_grad_route
    from diffusers_cudnn_fix.targets import ring

    for first_step in (True, False):
        message = ring_grad_route.unsupported_backend_message(print, 3, first_step=first_step)
        assert_explained(message, section="fixes.md#ring_grad_route")
    refused = ring.RingRecord(out=None, lse=None, refusal="an attention mask")  # type: ignore[arg-type]
    ctx = types.SimpleNamespace(**{ring.RECORD: refused})
    assert_explained(raised(lambda: ring._recorded(ctx)), section="fixes.md#ring_grad_route")
    assert_explained(raised(lambda: ring._recorded(types.SimpleNamespace())), section="fixes.md#ring_grad_route")


def test_qwen_messages() -> None:
    """QwenImage's joint mask that cannot be put in the K/V's order (inside the processor: its text length set),
    plain and through ulysses_anything, and the traced call handed back to eager execution."""
    import torch

    from diffusers_cudnn_fix.fixes import qwen_joint_mask_order as qwen

    config = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(ulysses_degree=2))
    q = k = torch.zeros(1, 4, 2, 8)
    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)  # not the joint length (8): cannot be mapped
    mask[..., 0] = False
    token = qwen.TEXT_LEN.set(2)
    try:
        for anything in (False, True):
            message = raised(lambda anything=anything: qwen.in_kv_order(mask, q, k, config, anything=anything))
            assert_explained(message, section="fixes.md#qwen_joint_mask_order")
    finally:
        qwen.TEXT_LEN.reset(token)
    assert_explained(qwen.compile_message(2), section="fixes.md#qwen_joint_mask_order")


# --- no site formats its own message ------------------------------------------------------------------------

#: Sites not converted here, with why: their owners convert them (or they are no problem message).
KNOWN_EXCEPTIONS = {
    "_verify.py": "the verify report, not a problem message",
    "__main__.py": "the doctor's output, a report, not a problem message",
}
#: The calls that say a problem, by the name called.
SITES = {"UnsafeAttentionError", "report", "NotImplementedError"}


def _formatted_here(arg: ast.expr) -> bool:
    """Whether ``arg`` formats the message text in place (a literal, an f-string, a concatenation or a
    ``.format``) instead of taking it from ``explain``."""
    if isinstance(arg, (ast.Constant, ast.JoinedStr, ast.BinOp)):
        return True
    return isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr == "format"


def test_no_site_formats_its_own_message() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name in KNOWN_EXCEPTIONS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called in SITES and _formatted_here(node.args[0]):
                offenders.append(f"{name}:{node.lineno}: {called}(...)")
    assert not offenders, "messages formatted without _warnings.explain:\n" + "\n".join(offenders)


def test_the_exceptions_still_exist() -> None:
    missing = [name for name in KNOWN_EXCEPTIONS if not (PACKAGE / name).is_file()]
    assert not missing, f"listed as exceptions but gone (drop them from KNOWN_EXCEPTIONS): {missing}"
