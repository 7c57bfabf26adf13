"""The post-import hook on ``diffusers.models.attention_dispatch``.

wrapt fires the hook right after the module is first imported, or at once if it already was, so the
import order of diffusers and this package does not matter. Nothing raised in here reaches the host's
import: a failure becomes a warning, and diffusers is left as shipped.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType

from . import _config
from ._warnings import FixNotAppliedWarning, report

MODULE_NAME = _config.MODULE_NAME

_armed = False
_arm_lock = threading.Lock()
# Whether diffusers' module was imported before us. Only then can other modules already hold the shipped
# ops (``from ... import``), so only then is the reference scan worth its millisecond or two.
_late = False


def arm() -> None:
    """Register the hook once per process, unless the package is switched off. Never raises."""
    global _armed, _late
    if not _config.enabled():
        return
    with _arm_lock:
        if _armed:
            return
        _armed = True
        _late = MODULE_NAME in sys.modules
    try:
        import wrapt

        wrapt.register_post_import_hook(on_import, MODULE_NAME)
    except Exception as exc:  # noqa: BLE001 - the host's import must survive anything
        report(
            f"diffusers_cudnn_fix: could not register the import hook ({type(exc).__name__}: {exc}); "
            "call diffusers_cudnn_fix.apply() after importing diffusers.",
            FixNotAppliedWarning,
        )


def on_import(module: ModuleType) -> None:
    """Check and patch ``module``. Never raises."""
    try:
        from ._registry import apply_to

        apply_to(module, scan_references=_late)
        # The GPU probe runs now only if CUDA is up already; else at a corrected op's first CUDA call.
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            from ._probe import after_patch

            after_patch()
    except Exception as exc:  # noqa: BLE001 - leave diffusers as shipped and say so
        try:
            from ._registry import revert

            revert()
        except Exception:  # noqa: BLE001
            pass
        report(
            f"diffusers_cudnn_fix: internal error while checking diffusers ({type(exc).__name__}: {exc}); "
            "diffusers is left as shipped, so context-parallel cuDNN training may give wrong gradients.",
            FixNotAppliedWarning,
        )
