"""Environment switches, read when asked (not cached), so tests and launchers can flip them.

=================================  =======================================================================
``DIFFUSERS_CUDNN_FIX``            ``1`` (default) patch on import; ``0`` / ``off`` / ``false`` / ``no``:
                                   the package does nothing at all (no hook, ``apply()`` is a no-op).
``DIFFUSERS_CUDNN_FIX_SKIP``       comma-separated fix ids to leave alone, e.g. ``flash_backward_kv``.
=================================  =======================================================================
"""

from __future__ import annotations

import os

ENABLE_VAR = "DIFFUSERS_CUDNN_FIX"
SKIP_VAR = "DIFFUSERS_CUDNN_FIX_SKIP"

_FALSE = frozenset({"0", "off", "false", "no", "disable", "disabled"})


def enabled() -> bool:
    """Whether the package may patch anything (the master switch)."""
    return os.environ.get(ENABLE_VAR, "1").strip().lower() not in _FALSE


def skipped_fixes() -> frozenset[str]:
    """Fix ids the user asked us to leave alone."""
    raw = os.environ.get(SKIP_VAR, "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())
