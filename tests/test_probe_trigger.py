"""The GPU probe's automatic trigger, on CPU: never waits for a lock, runs once per device, respects modes.

The trigger is reached from the corrected ops (on autograd's threads too). Here it is driven with an object
whose device says ``cuda:0``; on this CPU-only machine the probe then records "skipped: no CUDA device",
which is enough to see when and how often it runs.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch

from diffusers_cudnn_fix import _devices, _hook, _probe, _switches

CUDA_INPUT = types.SimpleNamespace(device=torch.device("cuda", 0))


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(_devices, "_results", {})
    monkeypatch.setattr(_switches, "_overrides", {})
    monkeypatch.delenv(_switches.PROBE_VAR, raising=False)
    _hook.install_prober()
    yield
    _devices.set_prober(None)


def test_first_cuda_call_probes_once() -> None:
    _devices.on_cuda_call(CUDA_INPUT)
    _devices.on_cuda_call(CUDA_INPUT)
    (found,) = _devices.results()
    assert found.device == "cuda:0" and found.runs == 1 and found.trigger == "first CUDA call"
    assert found.state == "skipped"  # no CUDA here


def test_cpu_tensors_never_probe() -> None:
    _devices.on_cuda_call(torch.zeros(1))
    assert _devices.results() == ()


def test_off_mode_never_probes() -> None:
    _switches.set_probe_mode("OFF")
    _devices.on_cuda_call(CUDA_INPUT)
    assert _devices.results() == ()


def test_a_running_probe_is_not_waited_for() -> None:
    # Another thread (the main thread's probe, say, whose backward runs on autograd's thread) holds the lock.
    done = threading.Event()
    with _probe._lock:
        worker = threading.Thread(target=lambda: (_devices.on_cuda_call(CUDA_INPUT), done.set()), daemon=True)
        worker.start()
        assert done.wait(timeout=10), "the trigger waited for the probe's lock"
    assert _devices.results() == ()  # it went on without probing; the next call will


def test_strict_mode_raises_at_every_call_after_a_failed_probe() -> None:
    _devices.record(_devices.ProbeResult("cuda:0", "failed", "cudnn/heads_eq_seq outside the pass rule"))
    _switches.set_probe_mode("strict")
    for _ in range(2):
        with pytest.raises(_probe.UnsafeAttentionError, match="GPU probe on cuda:0 found wrong results"):
            _devices.on_cuda_call(CUDA_INPUT)
    _switches.set_probe_mode("warn")
    _devices.on_cuda_call(CUDA_INPUT)  # warn mode: the failure was reported once, training goes on


def test_views_only_where_verified_and_unit_stride() -> None:
    from diffusers_cudnn_fix._layout import kernel_layout

    # On CPU the corrected ops always copy; the rule itself is read off _devices.
    _devices.record(_devices.ProbeResult("cuda:0", "passed", "", zero_copy=True))
    assert _devices.zero_copy_allowed(torch.device("cuda", 0))
    assert not _devices.zero_copy_allowed(torch.device("cuda", 1))
    with _devices.trying_views():
        assert _devices.zero_copy_allowed(torch.device("cuda", 1))
    x = torch.zeros(2, 5, 3, 8)
    assert kernel_layout(x)[0].is_contiguous()


@pytest.mark.slow
def test_what_the_trigger_calls_is_loaded_before_any_op_runs() -> None:
    """The trigger may run on autograd's thread, where a first import can deadlock: what the probe calls (the
    registry's ``status()`` included, which decides whether the zero-copy views are tried) imports nothing that
    the hook has not loaded already, before any attention op runs. On the code before the fix, ``_report``."""
    from releases import release_dir, run

    script = (
        "import json, sys, diffusers_cudnn_fix, diffusers.models.attention_dispatch\n"
        "before = set(sys.modules)\n"
        "from diffusers_cudnn_fix import _probe, _registry\n"
        "_registry.status()\n"
        "print(json.dumps({'new': sorted(m for m in set(sys.modules) - before if 'diffusers_cudnn_fix' in m)}))\n"
    )
    assert run(release_dir("0.39.0"), script)["new"] == []


@pytest.mark.parametrize(
    ("error", "reference_error", "passes"),
    [
        (0.01, 0.01, True),  # within 5x the bf16 reference's error
        (0.2, 0.01, False),  # beyond it
        (float("nan"), 0.01, False),  # the kernel's result is NaN
        (0.01, float("inf"), False),  # the reference overflowed: no allowance to judge by
        (0.01, float("nan"), False),
    ],
)
def test_the_probe_rule_fails_nan_and_a_reference_that_is_not_finite(
    error: float, reference_error: float, passes: bool
) -> None:
    assert _probe.within_rule(error, reference_error) is passes
