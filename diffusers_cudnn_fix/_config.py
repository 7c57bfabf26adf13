"""Environment switches, read when asked (not cached), so tests and launchers can flip them.

=================================  =======================================================================
``DIFFUSERS_CUDNN_FIX``            ``1`` (default) patch on import; ``0`` / ``off`` / ``false`` / ``no``:
                                   the package does nothing at all (no hook, ``apply()`` is a no-op).
``DIFFUSERS_CUDNN_FIX_SKIP``       comma-separated fix ids to leave alone, e.g. ``flash_backward_kv``.
``DIFFUSERS_CUDNN_FIX_MASK``       what to do when a bool / wrongly typed mask reaches the cuDNN CP op:
                                   ``warn`` (default, once), ``convert``, ``error``.
=================================  =======================================================================

Each switch has an API twin (``set_mask_mode()``, ...) that wins over the environment in this process.
"""

from __future__ import annotations

import os

#: The diffusers module every fix patches.
MODULE_NAME = "diffusers.models.attention_dispatch"

ENABLE_VAR = "DIFFUSERS_CUDNN_FIX"
SKIP_VAR = "DIFFUSERS_CUDNN_FIX_SKIP"
MASK_VAR = "DIFFUSERS_CUDNN_FIX_MASK"
MASK_MODES = ("warn", "convert", "error")

_mask_mode_override: str | None = None

_FALSE = frozenset({"0", "off", "false", "no", "disable", "disabled"})


def enabled() -> bool:
    """Whether the package may patch anything (the master switch)."""
    return os.environ.get(ENABLE_VAR, "1").strip().lower() not in _FALSE


def skipped_fixes() -> frozenset[str]:
    """Fix ids the user asked us to leave alone."""
    raw = os.environ.get(SKIP_VAR, "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def mask_mode() -> str:
    """The mask policy: the API's choice, else the environment's, else ``warn``; unknown values mean ``warn``."""
    if _mask_mode_override is not None:
        return _mask_mode_override
    mode = os.environ.get(MASK_VAR, "warn").strip().lower()
    if mode in MASK_MODES:
        return mode
    from ._warnings import DiffusersCudnnFixWarning, report

    report(f"diffusers_cudnn_fix: {MASK_VAR}={mode!r} is not one of {MASK_MODES}; using 'warn'.", DiffusersCudnnFixWarning)
    return "warn"


def set_mask_mode(mode: str) -> None:
    global _mask_mode_override
    if mode not in MASK_MODES:
        raise ValueError(f"mask mode must be one of {MASK_MODES}, not {mode!r}")
    _mask_mode_override = mode
