"""One-shot gradient probe: the attention ops diffusers will call, checked on the CUDA device in use.

Users cannot see gradients go wrong, so the package checks its own work once per device per process, on
the user's GPU, torch and cuDNN build:

* When: at the first call of a corrected or guarded op on a CUDA tensor (``_devices.on_cuda_call``, which
  the hook points here), or on demand (:func:`probe`, the doctor). Never inside an import, never while
  ``torch.compile`` traces or a CUDA graph is captured (it waits for the next call). The automatic trigger
  may run on autograd's thread: everything it needs is imported with this module (by the hook), and it
  never waits for a lock (a probe already running, on this thread or another, is not waited for).
* What: diffusers' live cuDNN (and native-flash, where present) forward/backward op pair, driven as
  ``TemplatedUlyssesAttention`` drives it in training (inside an ``autograd.Function``, fresh tensors,
  ``return_lse=False``), on bf16 B=2 S=16 H=16 D=64 (num_heads == seq_len, where no shape check helps)
  and B=1 S_q=96 S_kv=64 H=8 D=64; out, dQ, dK, dV compared by max-abs error with an fp32 eager reference;
  with autocast off, grad mode on and inference mode off, whatever the caller had.
* Pass rule (PyTorch's fused-attention tests): each error is at most 5x the error of the same attention
  computed eagerly in bf16, plus 1e-3; any NaN/Inf fails.
* Freed memory of the caching allocator is poisoned with NaN first, so that memory reused from an earlier
  correct run cannot make garbage look right.
* Where our corrected cuDNN forward is installed, the cases run twice: with the dense copies the shipped op
  makes, then with zero-copy strided views. Only if the views pass too may the corrected op use them on
  that device (``_devices.zero_copy_allowed``).
* Modes (``DIFFUSERS_CUDNN_FIX_PROBE`` or ``set_probe_mode()``): ``off``, ``warn`` (default: a warning with
  the error table when it fails), ``strict`` (raise :class:`UnsafeAttentionError` at every call of a
  corrected op on that device).
"""

from __future__ import annotations

import math
import sys
import threading
import time
import types
from typing import Any

import torch
import torch.backends.cuda
import torch.backends.cudnn

# _report too: _registry.status() imports it inside, and this module's trigger may run on autograd's thread.
from . import _detect, _devices, _registry, _report, _switches  # noqa: F401
from ._devices import CaseResult, ProbeResult
from ._warnings import ProbeFailedWarning, UnsafeAttentionError, explain, logger, report
from .fixes import CUDNN_BACKWARD, CUDNN_FORWARD, FLASH_BACKWARD, FLASH_FORWARD, cudnn_forward_lse

#: (name, B, S_q, S_kv, H, D)
CASES = (("heads_eq_seq", 2, 16, 16, 16, 64), ("heads_ne_seq_sq_ne_skv", 1, 96, 64, 8, 64))
BACKENDS = {"cudnn": (CUDNN_FORWARD, CUDNN_BACKWARD), "flash": (FLASH_FORWARD, FLASH_BACKWARD)}
TENSORS = ("out", "dq", "dk", "dv")
REFERENCE_FACTOR = 5.0
ABSOLUTE_SLACK = 1e-3
PASSED = f"every error within {REFERENCE_FACTOR:g}x the bf16 eager reference's (+{ABSOLUTE_SLACK:g}), no NaN"

_lock = threading.Lock()  # one probe at a time; the automatic trigger never waits for it


def within_rule(error: float, reference_error: float) -> bool:
    """The pass rule for one tensor: at most 5x the bf16 eager reference's error, plus 1e-3. NaN fails, and so
    does any error where the reference's own is not finite (an infinite allowance would pass anything)."""
    return math.isfinite(reference_error) and error <= REFERENCE_FACTOR * reference_error + ABSOLUTE_SLACK


def table(result: ProbeResult) -> str:
    """The errors as the upstream report showed them: one row per case, out / dQ / dK / dV."""
    lines = [f"{'backend':<6} {'case':<24} {'layout':<15} " + " ".join(f"{t:>9}" for t in TENSORS) + "  verdict"]
    for c in result.cases:
        found = f"raised {c.error}"
        if c.error is None:
            found = " ".join(f"{c.errors[t]:>9.4f}" for t in TENSORS) + ("  pass" if c.passed else "  FAIL")
        lines.append(f"{c.backend:<6} {c.case:<24} {c.layout:<15} {found}")
    if result.cases and result.cases[0].magnitudes:
        mags = " ".join(f"{result.cases[0].magnitudes[t]:>9.3f}" for t in TENSORS)
        lines.append(f"{'':<6} {'reference magnitudes':<24} {'':<15} {mags}")
    return "\n".join(lines)


def maybe_probe(device: torch.device) -> None:
    """The automatic trigger (installed by the hook as ``_devices``' prober): one dict lookup after the first
    call on a device. In strict mode a failed probe raises here, at every call, so training stops instead
    of going on wrong."""
    found = _devices.result(str(device))
    if found is None:
        # Never while a CUDA graph is captured on the current stream: the probe waits for the next call.
        if _switches.probe_mode() == "off" or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return
        if not _lock.acquire(blocking=False):
            return  # a probe is running (this very one, re-entered, or on another thread): never wait
        try:
            found = _devices.result(str(device)) or _probe_locked(device, "first CUDA call")
        finally:
            _lock.release()
        _announce(found)
    if found.state == "failed" and _switches.probe_mode() == "strict":
        raise UnsafeAttentionError(_failure_message(found, f"; raised at every call ({_switches.PROBE_VAR}=strict)"))


def _failure_message(result: ProbeResult, strict: str = f"; {_switches.PROBE_VAR}=strict stops training") -> str:
    """The three lines, then the error table."""
    cause = f"the GPU probe on {result.device} found wrong results from the attention ops diffusers will call."
    consequence = f"Training there may give wrong outputs or gradients ({result.reason}{strict})."
    way_out = "Use another attention backend on this device, or another torch / cuDNN; the errors are below."
    return f"{explain(cause, consequence, way_out, 'doctor.md#the-gpu-probe')}\n{table(result)}"


def _announce(result: ProbeResult) -> None:
    if result.state == "passed":
        views = "; zero-copy layout on" if result.zero_copy else ""
        logger.info("diffusers_cudnn_fix: GPU probe passed on %s (%.1f ms)%s", result.device, result.ms, views)
    elif result.state == "failed":
        report(_failure_message(result), ProbeFailedWarning, may_raise=True)


def probe(device: torch.device | str | int | None = None) -> ProbeResult:
    """Run the probe now on ``device`` (default: the current CUDA device) and record the result.

    Never raises for a failing op: failures are in the result. Initialises CUDA if it is not yet.
    """
    skip = _skip_reason(device)
    if skip is not None:
        return ProbeResult(str(device) if device is not None else "cuda", "skipped", skip, trigger="probe()")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        return _probe_locked(dev, "probe()")


def _probe_locked(device: torch.device, trigger: str) -> ProbeResult:
    start = time.perf_counter()
    key = str(device)
    runs = getattr(_devices.result(key), "runs", 0) + 1
    skip = _skip_reason(device)
    if skip is not None:
        result = ProbeResult(key, "skipped", skip, runs=runs, trigger=trigger)
    else:
        # Whatever the caller runs under (autocast, no_grad, inference_mode), the probe needs plain fp32/bf16
        # eager math with autograd.
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cuda", enabled=False):
            cases, zero_copy = _run_all(sys.modules.get(_switches.MODULE_NAME), device)
        torch.cuda.synchronize(device)
        failed = [c for c in cases if not c.passed and c.layout == "as installed"]
        if not cases:
            state, reason = "skipped", "diffusers' cuDNN / flash context-parallel ops are not there to probe"
        elif failed:
            state, reason = "failed", ", ".join(f"{c.backend}/{c.case}" for c in failed) + " outside the pass rule"
        else:
            state, reason = "passed", PASSED
        ms = (time.perf_counter() - start) * 1e3
        result = ProbeResult(key, state, reason, tuple(cases), zero_copy, ms, runs, trigger)
    _devices.record(result)
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
    q = torch.empty(2, 16, 16, 64, device=dev, dtype=torch.bfloat16)
    params = torch.backends.cuda.SDPAParams(q, q, q, None, 0.0, False, False)
    if not torch.backends.cuda.can_use_cudnn_attention(params, False):
        return "torch says cuDNN attention cannot run here (can_use_cudnn_attention)"
    return None


def _run_all(module: types.ModuleType | None, device: torch.device) -> tuple[list[CaseResult], bool]:
    if module is None:
        return [], False
    cases = [
        _run_case(module, backend, case, device, "as installed")
        for backend, names in BACKENDS.items()
        if all(getattr(module, name, None) is not None for name in names)
        for case in CASES
    ]
    if not any(fix.id == cudnn_forward_lse.FIX_ID and fix.applied for fix in _registry.status().fixes):
        return cases, False  # only the corrected cuDNN forward (cudnn_forward_lse's) hands the kernel views
    with _devices.trying_views():
        cases += [_run_case(module, "cudnn", case, device, "zero-copy views") for case in CASES]
    return cases, all(c.passed for c in cases if c.backend == "cudnn")  # the copies and the views


class _Harness(torch.autograd.Function):
    """Drives an op pair as diffusers' TemplatedUlyssesAttention does in training."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ops: tuple[Any, Any]) -> Any:
        forward_op, ctx.probe_backward_op = ops
        query, key, value = (x.clone() for x in (query, key, value))  # fresh, as after the all-to-all
        return forward_op(
            ctx, query, key, value, None, 0.0, False, None, False, False,
            _save_ctx=True, _parallel_config=_TRAINING_CP,
        )  # fmt: skip

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        dq, dk, dv = ctx.probe_backward_op(ctx, grad)[:3]
        return dq, dk, dv, None


_TRAINING_CP = _detect.training_parallel_config()  # what diffusers' ops read in a 2-rank training run


def run_pair(forward_op: Any, backward_op: Any, case: tuple[Any, ...], device: torch.device) -> dict[str, torch.Tensor]:
    """out, dq, dk, dv of an op pair on the case's inputs (model layout), as fp32 tensors."""
    q, k, v, grad = _inputs(case, device)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    with torch.enable_grad():
        out = _Harness.apply(*leaves, (forward_op, backward_op))
        out.backward(grad)
    got = {"out": out.detach().float()}
    for name, leaf in zip(("dq", "dk", "dv"), leaves, strict=True):
        if leaf.grad is None:
            raise RuntimeError(f"the op pair returned no gradient for {name[1]}")
        got[name] = leaf.grad.float()
    return got


def _inputs(case: tuple[Any, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    _, batch, seq_q, seq_kv, heads, dim = case
    gen = torch.Generator(device=device).manual_seed(1234)
    q_shape, kv_shape = (batch, seq_q, heads, dim), (batch, seq_kv, heads, dim)
    shapes = (q_shape, kv_shape, kv_shape, q_shape)  # q, k, v, grad_out
    return tuple(torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) for s in shapes)


def reference(case: tuple[Any, ...], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Eager attention in ``dtype`` (fp32: the golden values; bf16: the low-precision yardstick)."""
    q, k, v, grad = _inputs(case, device)
    leaves = [x.to(dtype).transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v)]
    with torch.enable_grad():
        scores = (leaves[0] @ leaves[1].transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        out = torch.softmax(scores, dim=-1) @ leaves[2]
        out.backward(grad.to(dtype).transpose(1, 2))
    tensors = [out.detach()] + [x.grad for x in leaves if x.grad is not None]
    return {n: t.transpose(1, 2).float() for n, t in zip(TENSORS, tensors, strict=True)}


def _poison(case: tuple[Any, ...], device: torch.device) -> None:
    """Fill blocks of the sizes the run will allocate with NaN and free them (the allocator reuses them)."""
    _, batch, seq_q, seq_kv, heads, dim = case
    blocks = []
    for numel in (batch * seq_q * heads * dim, batch * seq_kv * heads * dim):
        for dtype in (torch.bfloat16, torch.float32):
            blocks += [torch.full((numel,), float("nan"), dtype=dtype, device=device) for _ in range(4)]
    blocks.append(torch.full((batch * heads * seq_q,), float("nan"), dtype=torch.float32, device=device))
    del blocks


def _run_case(
    module: types.ModuleType, backend: str, case: tuple[Any, ...], device: torch.device, layout: str
) -> CaseResult:
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
    errors = {
        n: (got[n] - golden[n]).abs().max().item() if torch.isfinite(got[n]).all() else float("inf") for n in TENSORS
    }
    passed = all(within_rule(errors[n], ref_errors[n]) for n in TENSORS)
    return CaseResult(backend, case[0], layout, errors, ref_errors, magnitudes, passed, None)
