"""apply / revert / status in one process, on diffusers 0.39.0 (every bug present)."""

from __future__ import annotations

import sys
import threading
import types

import pytest
from expected_fixes import CORRECTIONS, GUARDS, not_on
from harness import op_pair

import diffusers_cudnn_fix
from diffusers_cudnn_fix import _registry
from diffusers_cudnn_fix._target_names import QWEN_PROCESSOR

# What 0.39.0 needs: everything but the 0.36.0-only Ulysses fix.
TARGETS = (
    "_cudnn_attention_forward_op",
    "_cudnn_attention_backward_op",
    "_native_flash_attention_backward_op",
    "TemplatedRingAttention.backward",
)


def _raw_get(module: types.ModuleType, target: str) -> object:
    """The object stored at ``target``: a class's own ``__dict__`` entry for ``Class.attr`` (a staticmethod
    stays one), else the module attribute."""
    holder_name, _, name = target.rpartition(".")
    if holder_name:
        return getattr(module, holder_name).__dict__.get(name)
    return getattr(module, name, None)


def _live(module: types.ModuleType) -> dict[str, object]:
    return {name: _raw_get(module, name) for name in TARGETS}


def _shipped(module: types.ModuleType) -> dict[str, object]:
    diffusers_cudnn_fix.revert()
    return _live(module)


def test_apply_replaces_and_revert_restores_the_exact_objects(dispatch_module: types.ModuleType) -> None:
    shipped = _shipped(dispatch_module)
    report = diffusers_cudnn_fix.apply()
    assert report.ok
    for name in TARGETS:
        assert _raw_get(dispatch_module, name) is not shipped[name]
        assert diffusers_cudnn_fix.is_patched(name)
        assert diffusers_cudnn_fix.get_original(name) is shipped[name]
    installed = _live(dispatch_module)
    diffusers_cudnn_fix.apply()  # idempotent: nothing is replaced twice
    assert _live(dispatch_module) == installed
    report = diffusers_cudnn_fix.revert()
    for name in TARGETS:
        assert _raw_get(dispatch_module, name) is shipped[name]
        assert not diffusers_cudnn_fix.is_patched(name)
    assert not report.ok  # the bugs are back, and the report says so
    diffusers_cudnn_fix.revert()  # idempotent
    assert _live(dispatch_module) == shipped
    diffusers_cudnn_fix.apply()  # and apply again after revert
    assert all(diffusers_cudnn_fix.is_patched(name) for name in TARGETS)


def test_a_target_of_another_module_is_left_as_shipped_where_not_needed(dispatch_module: types.ModuleType) -> None:
    """QwenImage's attention processor (a target of another module, imported after apply(): the hook checks
    again) is wrapped on 0.36.0 - 0.38.x only (tests/fixes/test_qwen_joint_mask_order.py); 0.39.0 keeps its own."""
    diffusers_cudnn_fix.apply()
    import diffusers.models.transformers.transformer_qwenimage as qwen

    shipped = qwen.QwenDoubleStreamAttnProcessor2_0.__dict__["__call__"]
    assert QWEN_PROCESSOR in diffusers_cudnn_fix.TARGETS
    assert not diffusers_cudnn_fix.is_patched(QWEN_PROCESSOR)
    assert diffusers_cudnn_fix.get_original(QWEN_PROCESSOR) is shipped
    diffusers_cudnn_fix.revert()
    assert qwen.QwenDoubleStreamAttnProcessor2_0.__dict__["__call__"] is shipped


def test_status_reports_each_fix(patched: types.ModuleType) -> None:
    report = diffusers_cudnn_fix.status()
    assert report.enabled and report.module_loaded and report.ok
    assert report.diffusers_version == "0.39.0"
    by_id = {f.id: f for f in report.fixes}
    assert list(by_id) == [*CORRECTIONS, *GUARDS] or set(by_id) == {*CORRECTIONS, *GUARDS}, list(by_id)
    for fix_id, fix in by_id.items():
        # A 0.36.0-only bug; a 0.36-0.38 one (0.39's Ulysses gathers the mask); a 0.40+ one, which the
        # package's own corrected ring does not have; a 0.42 one, in a method 0.39.0 has not.
        if fix_id in not_on("0.39.0"):
            assert fix.expected is False and fix.detected in ("ok", "absent") and not fix.applied, fix
            continue
        assert fix.expected is True and fix.detected == "broken" and fix.applied, fix
        assert fix.reason.startswith("fixed:" if fix_id in CORRECTIONS else "guarded:"), fix
        assert fix.reason_code == ("fixed" if fix_id in CORRECTIONS else "guarded"), fix
        assert fix.result == ("corrected" if fix_id in CORRECTIONS else "guarded") and not fix.needs_attention, fix
    # The mask guard's line names the mode in force: convert, the default.
    assert "convert" in by_id["cudnn_bool_mask"].reason, by_id["cudnn_bool_mask"]
    data = report.to_dict()
    assert data["ok"] is True and len(data["fixes"]) == len(CORRECTIONS) + len(GUARDS)
    text = str(report)
    assert "verdict: OK" in text and "cudnn_backward_kv" in text


def test_threads_applying_at_once_install_each_fix_once(dispatch_module: types.ModuleType) -> None:
    shipped = _shipped(dispatch_module)
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            diffusers_cudnn_fix.apply()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for name in TARGETS:
        assert diffusers_cudnn_fix.get_original(name) is shipped[name]
    # Racing revert and apply: whatever interleaving, the end state is one of the two, never a mix.
    threads = [
        threading.Thread(target=diffusers_cudnn_fix.revert if i % 2 else diffusers_cudnn_fix.apply) for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    patched_now = {diffusers_cudnn_fix.is_patched(name) for name in TARGETS}
    assert len(patched_now) == 1
    diffusers_cudnn_fix.revert()
    assert _live(dispatch_module) == shipped


def test_a_build_that_raises_leaves_diffusers_as_shipped_and_says_so(
    dispatch_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replacement's builder that raises (an unknown diffusers, a bug of ours) must not break apply() or the
    import: diffusers stays as shipped, every fix found broken is "failed" with the builder's error, a
    FixNotAppliedWarning says so for each, and the report is not OK."""
    import diffusers_cudnn_fix.targets

    shipped = _shipped(dispatch_module)

    def build(shipped: object, broken: frozenset[str], **collaborators: object) -> dict[str, object]:
        raise RuntimeError("a builder's bug")

    monkeypatch.setattr(diffusers_cudnn_fix.targets, "build", build)
    try:
        with pytest.warns(diffusers_cudnn_fix.FixNotAppliedWarning, match="a builder's bug"):
            report = diffusers_cudnn_fix.apply()
        assert _live(dispatch_module) == shipped
        failed = {f.id for f in report.fixes if f.reason_code == "failed"}
        assert failed == {f.id for f in report.fixes if f.detected == "broken"} and failed, report
        assert all("a builder's bug" in f.reason for f in report.fixes if f.id in failed)
        assert not report.ok
    finally:
        monkeypatch.undo()
        diffusers_cudnn_fix.revert()
    assert diffusers_cudnn_fix.apply().ok  # the real builder again
    diffusers_cudnn_fix.revert()


def test_modules_holding_a_shipped_op_are_rebound_and_restored(dispatch_module: types.ModuleType) -> None:
    shipped = _shipped(dispatch_module)
    # The scan skips third-party packages whole, by sorted name ranges: names right beside a skipped one
    # ("torch") and a submodule of a user package must still be found.
    holders = [types.ModuleType(n) for n in ("user_training_code", "torch_user_code", "user_pkg", "user_pkg.sub")]
    for user in holders:
        user.backward_op = dispatch_module._cudnn_attention_backward_op  # as `from ... import ... as backward_op`
        sys.modules[user.__name__] = user
    try:
        diffusers_cudnn_fix.apply()
        for user in holders:
            assert user.backward_op is dispatch_module._cudnn_attention_backward_op, user.__name__
            assert user.backward_op is not shipped["_cudnn_attention_backward_op"]
        diffusers_cudnn_fix.revert()
        for user in holders:
            assert user.backward_op is shipped["_cudnn_attention_backward_op"]
    finally:
        for user in holders:
            del sys.modules[user.__name__]


def test_third_party_packages_are_not_scanned(dispatch_module: types.ModuleType) -> None:
    shipped = _shipped(dispatch_module)
    vendor = types.ModuleType("some_vendor_pkg")
    vendor.__file__ = "/usr/lib/python3/site-packages/some_vendor_pkg/__init__.py"
    vendor.backward_op = shipped["_cudnn_attention_backward_op"]
    sys.modules[vendor.__name__] = vendor
    try:
        diffusers_cudnn_fix.apply()
        assert vendor.backward_op is shipped["_cudnn_attention_backward_op"]  # left alone, by design
    finally:
        diffusers_cudnn_fix.revert()
        del sys.modules[vendor.__name__]


def test_a_replaced_module_object_is_rechecked(dispatch_module: types.ModuleType) -> None:
    """If the module's attributes change under us (reload, another patcher), status says so and apply redoes it."""
    shipped = _shipped(dispatch_module)
    diffusers_cudnn_fix.apply()
    ours = dispatch_module._cudnn_attention_backward_op
    try:
        dispatch_module._cudnn_attention_backward_op = shipped["_cudnn_attention_backward_op"]  # as a reload would
        report = diffusers_cudnn_fix.status()
        kv = next(f for f in report.fixes if f.id == "cudnn_backward_kv")
        assert not kv.applied and "reloaded" in kv.reason and kv.reason_code == "lost" and not report.ok
        assert kv.needs_attention and kv.result == "NOT FIXED", kv
        diffusers_cudnn_fix.apply()
        assert diffusers_cudnn_fix.is_patched("_cudnn_attention_backward_op")
        assert (
            diffusers_cudnn_fix.get_original("_cudnn_attention_backward_op") is shipped["_cudnn_attention_backward_op"]
        )
    finally:
        diffusers_cudnn_fix.revert()
        assert dispatch_module._cudnn_attention_backward_op is shipped["_cudnn_attention_backward_op"]
        del ours


def test_second_apply_rechecks_nothing(patched: types.ModuleType) -> None:
    """A second apply() finds everything installed and re-runs no check (the registry keeps its records)."""
    calls = []
    original = _registry.check_of
    _registry.check_of = lambda fix: calls.append(fix.id) or original(fix)  # type: ignore[assignment]
    try:
        diffusers_cudnn_fix.apply()
    finally:
        _registry.check_of = original  # type: ignore[assignment]
    assert calls == []


def test_apply_drives_the_shipped_ring_once(dispatch_module: types.ModuleType, monkeypatch) -> None:
    """The ring's check on the shipped code reads whether the ring reuses the first step, and the builders take it
    from that finding (``Finding.read``) instead of driving diffusers' ring again: one drive of the shipped ring
    and one of the replacement per apply() (three before)."""
    from diffusers_cudnn_fix.fixes import ring_grad_route

    drives: list[int] = []
    real = ring_grad_route._drive
    monkeypatch.setattr(ring_grad_route, "_drive", lambda *a, **k: drives.append(1) or real(*a, **k))
    diffusers_cudnn_fix.revert()
    try:
        diffusers_cudnn_fix.apply()
    finally:
        diffusers_cudnn_fix.revert()
    assert len(drives) == 2, drives


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_replacements_trace_under_torch_compile_fullgraph(dispatch_module: types.ModuleType, backend: str) -> None:
    """The corrected ops compile with fullgraph=True wherever the shipped ones do, and compute the same."""
    import torch

    names = {
        "cudnn": ("_cudnn_attention_forward_op", "_cudnn_attention_backward_op"),
        "flash": ("_native_flash_attention_forward_op", "_native_flash_attention_backward_op"),
    }[backend]

    def make_step():
        # return_lse=True: the shipped cuDNN forward then computes the log-sum-exp too, so the shipped pair runs
        # (wrongly) rather than failing for that other bug.
        pair = op_pair(getattr(dispatch_module, names[0]), getattr(dispatch_module, names[1]), return_lse=True)

        def step(q, k, v):
            return pair.apply(q, k, v, None)

        return step

    gen = torch.Generator().manual_seed(0)
    # num_heads == seq_len (16): the shipped backward traces too (no shape error), just computes garbage.
    q, k, v, g = (torch.randn(2, 16, 16, 32, generator=gen).to(torch.bfloat16) for _ in range(4))
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))

    def run(step) -> tuple[torch.Tensor, ...]:
        out = step(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), g))

    def compiles() -> tuple[bool, object]:
        # AOTAutograd traces the autograd.Function's backward together with its forward.
        torch._dynamo.reset()
        try:
            return True, run(torch.compile(make_step(), fullgraph=True, backend="aot_eager"))
        except Exception as exc:
            return False, exc

    diffusers_cudnn_fix.revert()
    shipped_ok, shipped_result = compiles()
    diffusers_cudnn_fix.apply()
    try:
        if not shipped_ok:
            pytest.skip(f"the shipped ops do not compile with fullgraph=True on this torch: {shipped_result}")
        ours_ok, compiled = compiles()
        assert ours_ok, compiled
        eager = run(make_step())
        for a, b in zip(compiled, eager):
            assert torch.equal(a, b)
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------------------
# What the queries take
# ------------------------------------------------------------------------------------------------------------
def test_queries_take_the_readmes_forms_and_refuse_anything_else(patched: types.ModuleType) -> None:
    for name in TARGETS:
        dotted = f"diffusers.models.attention_dispatch.{name}"
        assert diffusers_cudnn_fix.is_patched(dotted) is True
        assert diffusers_cudnn_fix.get_original(dotted) is diffusers_cudnn_fix.get_original(name)
    assert diffusers_cudnn_fix.get_original("_cudnn_attention_backward_op") is not None
    shipped_function = diffusers_cudnn_fix.get_original("_cudnn_attention_backward_op")
    for bad in (
        "_cudnn_attention_backwards_op",  # a typo
        "cudnn_backward_kv",  # a fix id, not a target
        "diffusers.models.attention_dispatch.banana",
        "attention_dispatch._cudnn_attention_backward_op",  # half a dotted name
        shipped_function,  # the function object itself
        None,
    ):
        for query in (diffusers_cudnn_fix.is_patched, diffusers_cudnn_fix.get_original):
            with pytest.raises(ValueError, match=r"_cudnn_attention_backward_op.*TemplatedRingAttention\.backward"):
                query(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["banana", "cpu", "meta", "cuda:banana", 1.5])
def test_probe_refuses_what_is_no_cuda_device(device: object) -> None:
    with pytest.raises(ValueError, match="CUDA"):
        diffusers_cudnn_fix.probe(device)


def test_probe_on_a_machine_without_cuda_says_why() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: tests/test_gpu.py probes it")
    for device in (None, "cuda", "cuda:0", 0, torch.device("cuda", 0)):
        result = diffusers_cudnn_fix.probe(device)
        assert result.state == "skipped" and "CUDA" in result.reason, (device, result)
