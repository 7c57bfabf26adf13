"""Correct gradients for diffusers' context-parallel cuDNN / native-flash attention.

``import diffusers_cudnn_fix`` is all a user does: a post-import hook checks
``diffusers.models.attention_dispatch`` when it is imported (or at once, if it already is) and replaces
only the ops the check shows broken. The import itself loads nothing heavy (no torch, no diffusers) and
never initialises CUDA.

Public API: :func:`apply`, :func:`revert`, :func:`status`, :func:`is_patched`, :func:`get_original`, the
warning categories, and ``python -m diffusers_cudnn_fix`` (prints :func:`status`).
Switches: ``DIFFUSERS_CUDNN_FIX=0`` turns the package off; ``DIFFUSERS_CUDNN_FIX_SKIP=id,...`` leaves
named fixes alone; ``DIFFUSERS_CUDNN_FIX_MASK=warn|convert|error`` (or :func:`set_mask_mode`) says what
happens to bool masks.
"""

from __future__ import annotations

from . import _config, _hook
from ._warnings import (
    DiffusersCudnnFixWarning,
    FixNotAppliedWarning,
    ReleaseTableMismatchWarning,
    StaleReferenceWarning,
    UnsafeAttentionError,
)

__version__ = "0.1.0"

# typing.TYPE_CHECKING without importing typing: wrapt 1.x does not load it, and this import must cost next
# to nothing beyond wrapt's (the annotations are strings, from __future__).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ._report import Report

__all__ = [
    "DiffusersCudnnFixWarning",
    "FixNotAppliedWarning",
    "ReleaseTableMismatchWarning",
    "StaleReferenceWarning",
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


def apply() -> Report:
    """Import diffusers' attention module if needed, check it and install the fixes it needs.

    Idempotent and thread-safe; after :func:`revert` it re-checks and re-installs. A no-op (returning the
    report) when the package is switched off. Raises ImportError only if diffusers is not installed.
    """
    import importlib

    from . import _registry

    module = importlib.import_module(_registry.MODULE_NAME)
    _registry.apply_to(module)
    return _registry.status()


def revert() -> Report:
    """Put back the exact objects diffusers shipped (and any references we rebound). Idempotent."""
    from . import _registry

    return _registry.revert()


def status() -> Report:
    """Versions; per fix: expected by the release table, found by the check, applied, and why; GPU probes."""
    import sys

    from . import _registry

    report = _registry.status()
    probe_module = sys.modules.get("diffusers_cudnn_fix._probe")  # never imported just to say "none"
    return report._replace(probes=probe_module.results()) if probe_module is not None else report


def probe(device: Any = None) -> Any:
    """Run the GPU gradient probe now (see ``diffusers_cudnn_fix._probe``); returns its ProbeResult."""
    from . import _probe as probe_module

    return probe_module.probe(device)


def set_probe_mode(mode: str) -> None:
    """``"off"``, ``"warn"`` (default) or ``"strict"``; wins over ``DIFFUSERS_CUDNN_FIX_PROBE``."""
    from . import _probe as probe_module

    probe_module.set_mode(mode)


def is_patched(attr: str) -> bool:
    """Whether ``diffusers.models.attention_dispatch.<attr>`` is our replacement right now."""
    from . import _registry

    return _registry.is_patched(attr)


def get_original(attr: str) -> Any:
    """The object diffusers shipped as ``diffusers.models.attention_dispatch.<attr>``."""
    from . import _registry

    return _registry.original(attr)


def set_mask_mode(mode: str) -> None:
    """What to do when a bool or wrongly typed mask reaches the cuDNN context-parallel op (#14342).

    ``"warn"`` (default: pass it through, warn once), ``"convert"`` (to an additive mask in q's dtype) or
    ``"error"`` (raise :class:`UnsafeAttentionError`). Wins over ``DIFFUSERS_CUDNN_FIX_MASK``.
    """
    import sys

    _config.set_mask_mode(mode)
    live = sys.modules.get("diffusers_cudnn_fix.fixes.cudnn_bool_mask")
    if live is not None:
        live._mode = mode


_hook.arm()
