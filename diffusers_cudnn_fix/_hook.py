"""The post-import hook on ``diffusers.models.attention_dispatch``.

wrapt fires the hook right after the module is first imported, or at once if it already was, so the
import order of diffusers and this package does not matter. The hook checks and patches on the importing
thread and does no GPU work; it also imports the GPU probe and points the corrected ops at it, so that
nothing they call later (on autograd's threads too) has a module left to import. Nothing raised in here
reaches the host's import: a failure becomes a warning, and diffusers is left as shipped. A target in another
module (``module:Class.attr``, :mod:`._target_names`) is installed by a hook on that module, which checks and
patches again once it is imported (diffusers imports it after the attention module).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from types import ModuleType

from . import _switches
from ._target_names import IMPORTED_FIRST, TARGETS
from ._warnings import FixNotAppliedWarning, explain, report

_lock = threading.Lock()
_active = False  # revert() before diffusers' import disarms the hook; apply() re-arms it
# None until the hook is registered; then whether diffusers' module was imported before us. Only then can
# other modules already hold the shipped ops (``from ... import``), so only then is the reference scan needed.
_late: bool | None = None


def arm() -> None:
    """Register the hook once per process (unless the package is switched off) and let it patch. Never raises."""
    global _active, _late
    # Quiet: a process that only imports the package (the launcher's own) reports nothing; a bad value is
    # reported once the package acts (on_import), in the process that trains.
    if not _switches.enabled(quiet=True):
        return
    with _lock:
        _active = True
        if _late is not None:
            return
        _late = _switches.MODULE_NAME in sys.modules
    try:
        import wrapt

        for name in (_switches.MODULE_NAME, *{t.partition(":")[0] for t in TARGETS if ":" in t}):
            wrapt.register_post_import_hook(on_import, name)
    except Exception as exc:  # noqa: BLE001 - the host's import must survive anything
        report(explain(f"could not register the import hook ({type(exc).__name__}: {exc}).", "Importing diffusers "
                       "will not check or fix it.", "Call diffusers_cudnn_fix.apply() after importing diffusers.",
                       "api.md#what-importing-it-does"), FixNotAppliedWarning)  # fmt: skip


def disarm() -> None:
    """A later import of diffusers' module patches nothing (until :func:`arm`)."""
    global _active
    _active = False


def install_prober() -> None:
    """Point the corrected ops at the GPU probe (importing it here, on the patching thread)."""
    from . import _devices, _probe

    _devices.set_prober(_probe.maybe_probe)


def import_first() -> None:
    """Import the target modules the checks need loaded (``IMPORTED_FIRST``) where they are not yet. Imported here,
    such a module's own hook checks and patches at once, and the caller's apply then finds it done. One that cannot be
    imported (a build without it, a broken dependency of it) must not cost the attention fixes: the checks then say
    what is missing."""
    for name in IMPORTED_FIRST:
        if name not in sys.modules:
            with contextlib.suppress(Exception):
                importlib.import_module(name)


def on_import(_: ModuleType) -> None:
    """Check and patch diffusers' attention module (where imported), once it or a module of a target is. Never
    raises."""
    module = sys.modules.get(_switches.MODULE_NAME)
    if not _active or module is None:
        return
    try:
        # Bad switch values are reported here, at the user's import of diffusers (not first use, which may
        # never come on a CPU).
        _switches.check_environment()
        from ._registry import apply_to

        import_first()

        apply_to(module, scan_references=bool(_late))
        install_prober()
    except Exception as exc:  # noqa: BLE001 - leave diffusers as shipped and say so
        try:
            from ._registry import revert

            revert()
        except Exception:  # noqa: BLE001, S110 - already reporting the first failure
            pass
        report(explain(f"internal error while checking diffusers ({type(exc).__name__}: {exc}).", "diffusers is left "
                       "as shipped, so context-parallel cuDNN training may give wrong gradients.", "Please report it, "
                       "with your diffusers and torch versions.", "api.md#what-importing-it-does"),
               FixNotAppliedWarning)  # fmt: skip
