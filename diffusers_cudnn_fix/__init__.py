"""Correct gradients for diffusers' context-parallel cuDNN / native-flash attention.

``import diffusers_cudnn_fix`` is all a user does: a post-import hook checks
``diffusers.models.attention_dispatch`` when it is imported (or at once, if it already is) and replaces
only the ops the check shows broken. The import itself loads neither torch nor diffusers, starts no
thread and never initialises CUDA. A GPU probe checks the ops once per CUDA device, at their first CUDA
call (or when asked: :func:`probe`, ``python -m diffusers_cudnn_fix``).

Public API: :func:`apply`, :func:`revert`, :func:`status` (a :class:`Report`), :func:`probe`,
:func:`is_patched`, :func:`get_original`, :func:`set_mask_mode`, :func:`set_probe_mode`, the warning
categories and :class:`UnsafeAttentionError`.

Switches (environment; values are case-insensitive; docs/behaviour.md has the whole contract):

- ``DIFFUSERS_CUDNN_FIX=0`` turns the package off (``1``, the default, leaves it on);
- ``DIFFUSERS_CUDNN_FIX_SKIP=id,...`` leaves named fixes alone (they are still checked and reported);
- ``DIFFUSERS_CUDNN_FIX_MASK=convert|warn|error`` (or :func:`set_mask_mode`): what happens to a bool or
  wrongly typed mask reaching the cuDNN context-parallel op; ``convert`` is the default;
- ``DIFFUSERS_CUDNN_FIX_PROBE=warn|strict|off`` (or :func:`set_probe_mode`): what a failed GPU probe does.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from . import _hook, _switches
from ._warnings import (
    DiffusersCudnnFixWarning,
    FixNotAppliedWarning,
    MaskConvertedWarning,
    MaskMisreadWarning,
    ProbeFailedWarning,
    ReleaseTableMismatchWarning,
    StaleReferenceWarning,
    SwitchValueWarning,
    UnsafeAttentionError,
)

if TYPE_CHECKING:
    from ._devices import ProbeResult
    from ._report import Report

__version__ = "0.1.0"

__all__ = [
    "DiffusersCudnnFixWarning",
    "FixNotAppliedWarning",
    "MaskConvertedWarning",
    "MaskMisreadWarning",
    "ProbeFailedWarning",
    "ReleaseTableMismatchWarning",
    "Report",
    "StaleReferenceWarning",
    "SwitchValueWarning",
    "UnsafeAttentionError",
    "__version__",
    "apply",
    "get_original",
    "is_patched",
    "probe",
    "revert",
    "set_mask_mode",
    "set_probe_mode",
    "status",
]


def __getattr__(name: str) -> Any:
    """``Report`` on first use (PEP 562): its module loads dataclasses, which the package's import avoids."""
    if name == "Report":
        from ._report import Report

        return Report
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def apply() -> Report:
    """Arm the hook, import diffusers' attention module if needed, check it and install the fixes it needs.

    Idempotent and thread-safe; after :func:`revert` it re-checks and re-installs. A no-op (returning the
    report) when the package is switched off. Raises ImportError only if diffusers is not installed.
    """
    import importlib

    from . import _registry

    _hook.arm()
    module = importlib.import_module(_switches.MODULE_NAME)  # a first import fires the hook
    _registry.apply_to(module)
    if _switches.enabled():
        _hook.install_prober()
    return _registry.status()


def revert() -> Report:
    """Put back the exact objects diffusers shipped (and any references we rebound), and disarm the hook so
    that a later import of diffusers patches nothing until :func:`apply`. Idempotent; works without torch."""
    from . import _registry

    _hook.disarm()
    return _registry.revert()


def status() -> Report:
    """Versions; per fix: expected by the release table, found by the check, applied, and why; GPU probes."""
    from . import _registry

    return _registry.status()


def probe(device: Any = None) -> ProbeResult:
    """Run the GPU gradient probe now on ``device`` (default: the current CUDA device); returns its result."""
    from . import _probe

    return _probe.probe(device)


def set_probe_mode(mode: str) -> None:
    """``"warn"`` (default), ``"strict"`` or ``"off"``, any case; wins over ``DIFFUSERS_CUDNN_FIX_PROBE``."""
    _switches.set_probe_mode(mode)


def set_mask_mode(mode: str) -> None:
    """What a bool or wrongly typed mask reaching the cuDNN context-parallel op does (#14342), any case:
    ``"convert"`` (default: to an additive mask in q's dtype), ``"warn"`` (pass it through as diffusers
    does, warn once) or ``"error"`` (raise :class:`UnsafeAttentionError`). Wins over
    ``DIFFUSERS_CUDNN_FIX_MASK``."""
    _switches.set_mask_mode(mode)


def is_patched(attr: str) -> bool:
    """Whether ``diffusers.models.attention_dispatch.<attr>`` is our replacement right now."""
    if "diffusers_cudnn_fix._registry" not in sys.modules:
        return False  # nothing was ever patched in this process
    from . import _registry

    return _registry.is_patched(attr)


def get_original(attr: str) -> Any:
    """The object diffusers shipped as ``diffusers.models.attention_dispatch.<attr>`` (None if absent)."""
    from . import _registry

    return _registry.original(attr)


_hook.arm()
