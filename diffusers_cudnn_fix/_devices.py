"""What the GPU probe found, per CUDA device: the one place that state lives, and its one reader API.

The corrected ops read it on the training hot path (may they hand the kernel views instead of copies?) and
call :func:`on_cuda_call`, which hands the device to the prober the hook installed (``_probe.maybe_probe``)
without importing anything: this module sits below the fixes, the probe above them, and the corrected ops
run on autograd's threads, where an import can deadlock against an import lock held elsewhere.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CaseResult:
    """One backend / shape / layout of the probe: max-abs errors against fp32, the bf16 reference's own."""

    backend: str
    case: str
    layout: str  # "as installed" or "zero-copy views"
    errors: dict[str, float]
    ref_errors: dict[str, float]
    magnitudes: dict[str, float]
    passed: bool
    error: str | None


@dataclass(frozen=True)
class ProbeResult:
    """What the probe found on one device."""

    device: str
    state: str  # "passed", "failed" or "skipped"
    reason: str
    cases: tuple[CaseResult, ...] = ()
    zero_copy: bool = False  # whether the corrected cuDNN forward may hand the kernel views on this device
    ms: float = 0.0
    runs: int = 1  # how often the probe ran on this device in this process
    trigger: str = ""  # what started it: "first CUDA call" or "probe()"


_results: dict[str, ProbeResult] = {}
_prober: Callable[[torch.device], None] | None = None
_local = threading.local()  # .views: this thread is the probe, trying views


def result(device: str) -> ProbeResult | None:
    return _results.get(device)


def results() -> tuple[ProbeResult, ...]:
    return tuple(_results.values())


def record(found: ProbeResult) -> None:
    """Store the probe's verdict for ``found.device`` (the probe is the only writer)."""
    _results[found.device] = found


def zero_copy_allowed(device: torch.device) -> bool:
    """Whether the probe verified views on ``device`` (or is trying them on this thread right now)."""
    return getattr(_local, "views", False) or getattr(_results.get(str(device)), "zero_copy", False)


@contextmanager
def trying_views() -> Iterator[None]:
    """Within this block, on this thread only, the corrected forward hands the kernel views (the probe's trial)."""
    _local.views = True
    try:
        yield
    finally:
        _local.views = False


def set_prober(prober: Callable[[torch.device], None] | None) -> None:
    """Install the callable the corrected ops hand a CUDA device to (the hook installs the GPU probe)."""
    global _prober
    _prober = prober


def on_cuda_call(tensor: torch.Tensor) -> None:
    """Called by the corrected ops with an input: hands a CUDA device to the prober, outside compilation."""
    prober = _prober
    if prober is not None and tensor.device.type == "cuda" and not torch.compiler.is_compiling():
        prober(tensor.device)
