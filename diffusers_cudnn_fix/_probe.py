"""One-shot gradient probe: the attention ops diffusers will call, checked on the CUDA device in use.

Users cannot see gradients go wrong, so the package checks its own work once per device per process, on
the user's GPU, torch and cuDNN build:

* When: at the first call of a corrected op on a CUDA tensor, or at patch time if CUDA is already
  initialised. Never at import if that would initialise CUDA; never while ``torch.compile`` traces or a CUDA
  graph is captured (it waits for the next call). On demand: :func:`probe`.
* What: diffusers' live cuDNN (and native-flash, where present) forward/backward op pair, driven as
  ``TemplatedUlyssesAttention`` drives it in training (inside an ``autograd.Function``, fresh tensors,
  ``return_lse=False``), on bf16 B=2 S=16 H=16 D=64 (num_heads == seq_len, where no shape check helps)
  and B=1 S_q=96 S_kv=64 H=8 D=64; out, dQ, dK, dV compared by max-abs error with an fp32 eager reference.
* Pass rule (PyTorch's fused-attention tests): each error is at most 5x the error of the same attention
  computed eagerly in bf16, plus 1e-3; any NaN/Inf fails.
* Freed memory of the caching allocator is poisoned with NaN first, so that memory reused from an earlier
  correct run cannot make garbage look right.
* Where our corrected cuDNN forward is installed, the cases run twice: with the dense copies the shipped op
  makes, then with zero-copy strided views. Only if the views pass too does the corrected op use them
  (``_layout.zero_copy``).
* Modes (``DIFFUSERS_CUDNN_FIX_PROBE`` or :func:`set_mode`): ``off``, ``warn`` (default: a warning with the
  error table when it fails), ``strict`` (raise :class:`UnsafeAttentionError`).

Cost: a few milliseconds once cuDNN is loaded (``benchmarks/bench_gpu.py``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
from typing import Any

import torch

from . import _config, _detect, _layout
from ._fix import Record
from ._warnings import DiffusersCudnnFixWarning, UnsafeAttentionError, logger, report

MODULE_NAME = _config.MODULE_NAME
MODE_VAR = "DIFFUSERS_CUDNN_FIX_PROBE"
MODES = ("off", "warn", "strict")

#: (name, B, S_q, S_kv, H, D)
CASES = (("heads_eq_seq", 2, 16, 16, 16, 64), ("heads_ne_seq_sq_ne_skv", 1, 96, 64, 8, 64))
BACKENDS = {
    "cudnn": ("_cudnn_attention_forward_op", "_cudnn_attention_backward_op"),
    "flash": ("_native_flash_attention_forward_op", "_native_flash_attention_backward_op"),
}
TENSORS = ("out", "dq", "dk", "dv")
REFERENCE_FACTOR = 5.0
ABSOLUTE_SLACK = 1e-3


class ProbeFailedWarning(DiffusersCudnnFixWarning):
    """The GPU probe found wrong outputs or gradients from the attention ops diffusers will call."""


class CaseResult(Record):
    """One backend / shape / layout: max-abs errors against fp32, the bf16 reference's own errors."""

    __slots__ = ("backend", "case", "layout", "errors", "ref_errors", "magnitudes", "passed", "error")
    backend: str
    case: str
    layout: str  # "as installed" or "zero-copy views"
    errors: dict[str, float]
    ref_errors: dict[str, float]
    magnitudes: dict[str, float]
    passed: bool
    error: str | None

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


class ProbeResult(Record):
    """What the probe found on one device."""

    __slots__ = ("device", "state", "reason", "cases", "zero_copy", "ms")
    device: str
    state: str  # "passed", "failed" or "skipped"
    reason: str
    cases: tuple[CaseResult, ...]
    zero_copy: bool  # whether the corrected cuDNN forward now uses strided views on this device
    ms: float

    def as_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in self.__slots__}
        data["cases"] = [c.as_dict() for c in self.cases]
        return data

    def table(self) -> str:
        """The errors as the upstream report showed them: one row per case, out / dQ / dK / dV."""
        lines = [f"{'backend':<6} {'case':<24} {'layout':<15} " + " ".join(f"{t:>9}" for t in TENSORS) + "  verdict"]
        for c in self.cases:
            if c.error is not None:
                lines.append(f"{c.backend:<6} {c.case:<24} {c.layout:<15} raised {c.error[:80]}")
                continue
            errs = " ".join(f"{c.errors[t]:>9.4f}" for t in TENSORS)
            lines.append(f"{c.backend:<6} {c.case:<24} {c.layout:<15} {errs}  {'pass' if c.passed else 'FAIL'}")
        if self.cases and self.cases[0].magnitudes:
            mags = " ".join(f"{self.cases[0].magnitudes[t]:>9.3f}" for t in TENSORS)
            lines.append(f"{'':<6} {'reference magnitudes':<24} {'':<15} {mags}")
        return "\n".join(lines)


_mode_override: str | None = None
_results: dict[str, ProbeResult] = {}
_busy: set[str] = set()
_lock = threading.RLock()


def mode() -> str:
    if _mode_override is not None:
        return _mode_override
    value = os.environ.get(MODE_VAR, "warn").strip().lower()
    return value if value in MODES else "warn"


def set_mode(value: str) -> None:
    """``off``, ``warn`` or ``strict`` for this process (wins over ``DIFFUSERS_CUDNN_FIX_PROBE``)."""
    global _mode_override
    if value not in MODES:
        raise ValueError(f"probe mode must be one of {MODES}, not {value!r}")
    _mode_override = value


def results() -> tuple[ProbeResult, ...]:
    with _lock:
        return tuple(_results.values())


def maybe_probe(tensor: torch.Tensor) -> None:
    """The automatic trigger, reached from the corrected ops through ``_layout.maybe_probe`` (which has
    already returned for CPU tensors and while compiling): one dict lookup after the first call on a device.

    In strict mode a failed probe raises here, at every call, so training stops instead of going on wrong.
    """
    key = str(tensor.device)
    done = _results.get(key)
    if done is not None:
        if done.state == "failed" and mode() == "strict":
            raise UnsafeAttentionError(_failure_message(done) + f"\n(raised because {MODE_VAR}=strict)")
        return
    if key in _busy or mode() == "off" or torch.cuda.is_current_stream_capturing():
        return  # a capture: wait for the next call outside it
    _announce(probe(tensor.device))
    maybe_probe(tensor)  # strict mode raises now if it failed


def after_patch() -> None:
    """At patch time: probe the current device, only if CUDA is initialised already (never initialise it).

    Runs inside the import hook, so it never raises: a failure is warned about here, and strict mode raises at
    the first call of a corrected op.
    """
    if mode() == "off" or not torch.cuda.is_initialized() or torch.cuda.is_current_stream_capturing():
        return
    _announce(probe(torch.device("cuda", torch.cuda.current_device())))


def _failure_message(result: ProbeResult) -> str:
    return (
        f"diffusers_cudnn_fix: the GPU probe on {result.device} found wrong results from the attention ops "
        f"diffusers will call ({result.reason}):\n{result.table()}"
    )


def _announce(result: ProbeResult) -> None:
    if result.state == "passed":
        logger.info(
            "diffusers_cudnn_fix: GPU probe passed on %s (%.1f ms)%s",
            result.device, result.ms, "; zero-copy layout on" if result.zero_copy else "",
        )
    elif result.state == "failed":
        report(_failure_message(result), ProbeFailedWarning)


def probe(device: torch.device | str | int | None = None) -> ProbeResult:
    """Run the probe now on ``device`` (default: the current CUDA device) and record the result.

    Never raises for a failing op: failures are in the result. Initialises CUDA if it is not yet.
    """
    start = time.perf_counter()
    skip = _skip_reason(device)
    if skip is not None:
        result = ProbeResult(str(device) if device is not None else "cuda", "skipped", skip, (), False, 0.0)
        with _lock:
            _results[result.device] = result
        return result
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = str(dev)
    module = sys.modules.get(MODULE_NAME)
    with _lock:
        _busy.add(key)
        try:
            cases, zero_copy = _run_all(module, dev)
        finally:
            _busy.discard(key)
        failed = [c for c in cases if not c.passed and c.layout == "as installed"]
        if not cases:
            state, reason = "skipped", "diffusers' cuDNN / flash context-parallel ops are not there to probe"
        elif failed:
            state = "failed"
            reason = ", ".join(f"{c.backend}/{c.case}" for c in failed) + " outside the pass rule"
        else:
            state = "passed"
            reason = f"every error within {REFERENCE_FACTOR:g}x the bf16 eager reference's (+{ABSOLUTE_SLACK:g}), no NaN"
        torch.cuda.synchronize(dev)
        result = ProbeResult(key, state, reason, tuple(cases), zero_copy, (time.perf_counter() - start) * 1e3)
        _results[key] = result
        return result


def _skip_reason(device: Any) -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        return f"{dev} is not a CUDA device"
    if torch.cuda.get_device_capability(dev) < (8, 0):
        return f"compute capability {torch.cuda.get_device_capability(dev)} < (8, 0): no cuDNN SDPA"
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available in this torch build"
    can_use = getattr(torch.backends.cuda, "can_use_cudnn_attention", None)
    params_cls = getattr(torch.backends.cuda, "SDPAParams", None)
    if can_use is not None and params_cls is not None:
        q = torch.empty(2, 16, 16, 64, device=dev, dtype=torch.bfloat16)
        try:
            params = params_cls(q, q, q, None, 0.0, False, False)
        except TypeError:  # older signature without enable_gqa
            params = params_cls(q, q, q, None, 0.0, False)
        if not can_use(params, False):
            return "torch says cuDNN attention cannot run here (can_use_cudnn_attention)"
    return None


def _run_all(module: types.ModuleType | None, device: torch.device) -> tuple[list[CaseResult], bool]:
    if module is None:
        return [], False
    cases: list[CaseResult] = []
    for backend, (fwd_name, bwd_name) in BACKENDS.items():
        if getattr(module, fwd_name, None) is None or getattr(module, bwd_name, None) is None:
            continue
        for case in CASES:
            cases.append(_run_case(module, backend, case, device, "as installed"))
    # Zero-copy views: only our corrected cuDNN forward reads the switch.
    from . import _registry

    zero_copy = False
    if _registry.is_patched("_cudnn_attention_forward_op") and _corrected_forward_installed(module):
        saved = _layout.zero_copy
        _layout.zero_copy = True
        try:
            views = [_run_case(module, "cudnn", case, device, "zero-copy views") for case in CASES]
        finally:
            _layout.zero_copy = saved
        cases.extend(views)
        copies_ok = all(c.passed for c in cases if c.backend == "cudnn" and c.layout == "as installed")
        zero_copy = copies_ok and all(c.passed for c in views)
        _layout.zero_copy = zero_copy and all(r.zero_copy for r in _results.values() if r.state == "passed")
    return cases, zero_copy


def _corrected_forward_installed(module: types.ModuleType) -> bool:
    from .fixes.cudnn_forward_lse import cudnn_attention_forward_op

    fn = getattr(module, "_cudnn_attention_forward_op", None)
    while fn is not None:
        if fn is cudnn_attention_forward_op:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


_harness: Any = None


def _harness_class() -> Any:
    """The ``autograd.Function`` that drives an op pair as diffusers' TemplatedUlyssesAttention does in
    training. Made on first use: creating it costs the import hook time it never needs."""
    global _harness
    if _harness is None:

        class _Harness(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ops: tuple) -> torch.Tensor:
                forward_op, backward_op = ops
                ctx._dcf_backward_op = backward_op
                query, key, value = (x.clone() for x in (query, key, value))  # fresh, as after the all-to-all
                return forward_op(
                    ctx, query, key, value, None, 0.0, False, None, False, False,
                    _save_ctx=True, _parallel_config=_TRAINING_CP,
                )

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor):
                dq, dk, dv = ctx._dcf_backward_op(ctx, grad)[:3]
                return dq, dk, dv, None

        _harness = _Harness
    return _harness


_TRAINING_CP = _detect.training_parallel_config()  # what diffusers' ops read in a 2-rank training run


def run_pair(
    forward_op: Any, backward_op: Any, case: tuple, device: torch.device
) -> dict[str, torch.Tensor]:
    """out, dq, dk, dv of an op pair on the case's inputs (model layout), as fp32 tensors."""
    q, k, v, grad = _inputs(case, device)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    with torch.enable_grad():
        out = _harness_class().apply(*leaves, (forward_op, backward_op))
        out.backward(grad)
    return {"out": out.detach().float(), **{n: x.grad.float() for n, x in zip(("dq", "dk", "dv"), leaves)}}


def _inputs(case: tuple, device: torch.device) -> tuple[torch.Tensor, ...]:
    _, batch, seq_q, seq_kv, heads, dim = case
    gen = torch.Generator(device=device).manual_seed(1234)
    shapes = ((batch, seq_q, heads, dim), (batch, seq_kv, heads, dim), (batch, seq_kv, heads, dim), (batch, seq_q, heads, dim))
    return tuple(torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) for s in shapes)


def reference(case: tuple, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Eager attention in ``dtype`` (fp32: the golden values; bf16: the low-precision yardstick)."""
    q, k, v, grad = _inputs(case, device)
    leaves = [x.to(dtype).transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v)]
    with torch.enable_grad():
        scores = (leaves[0] @ leaves[1].transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        out = torch.softmax(scores, dim=-1) @ leaves[2]
        out.backward(grad.to(dtype).transpose(1, 2))
    tensors = (out.detach(), *(x.grad for x in leaves))
    return {n: t.transpose(1, 2).float() for n, t in zip(TENSORS, tensors)}


def _poison(case: tuple, device: torch.device) -> None:
    """Fill blocks of the sizes the run will allocate with NaN and free them (the allocator reuses them)."""
    _, batch, seq_q, seq_kv, heads, dim = case
    blocks = []
    for numel in (batch * seq_q * heads * dim, batch * seq_kv * heads * dim):
        for dtype in (torch.bfloat16, torch.float32):
            blocks += [torch.full((numel,), float("nan"), dtype=dtype, device=device) for _ in range(4)]
    blocks.append(torch.full((batch * heads * seq_q,), float("nan"), dtype=torch.float32, device=device))
    del blocks


def _run_case(module: types.ModuleType, backend: str, case: tuple, device: torch.device, layout: str) -> CaseResult:
    fwd_name, bwd_name = BACKENDS[backend]
    golden = reference(case, device, torch.float32)
    low = reference(case, device, torch.bfloat16)
    ref_errors = {n: (low[n] - golden[n]).abs().max().item() for n in TENSORS}
    magnitudes = {n: golden[n].abs().max().item() for n in TENSORS}
    _poison(case, device)
    try:
        got = run_pair(getattr(module, fwd_name), getattr(module, bwd_name), case, device)
    except Exception as exc:  # noqa: BLE001 - a raising op is a finding
        return CaseResult(backend, case[0], layout, {}, ref_errors, magnitudes, False, f"{type(exc).__name__}: {exc}")
    errors = {}
    for n in TENSORS:
        diff = (got[n] - golden[n]).abs()
        errors[n] = float("inf") if not torch.isfinite(got[n]).all() else diff.max().item()
    passed = all(errors[n] <= REFERENCE_FACTOR * ref_errors[n] + ABSOLUTE_SLACK for n in TENSORS)
    return CaseResult(backend, case[0], layout, errors, ref_errors, magnitudes, passed, None)
