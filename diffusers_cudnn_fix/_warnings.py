"""Every warning category and the error this package raises, and the one helper that reports a problem.

A problem met at import or hook time becomes a warning of one of these categories plus a ``logging``
record on the ``diffusers_cudnn_fix`` logger, never an exception in the host's import. A user sees it once:
the warning, filed at the user's own line (the first frame outside this package, diffusers, torch, wrapt
and the import machinery). The logger has a ``NullHandler``, so the record reaches the handlers a user
configures but is not printed a second time by ``logging``'s last-resort handler. Filter them like any
warning::

    warnings.simplefilter("error", diffusers_cudnn_fix.DiffusersCudnnFixWarning)
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from types import FrameType

logger = logging.getLogger("diffusers_cudnn_fix")
# Without a handler anywhere on its path, logging prints a WARNING record through its last-resort handler,
# which would repeat every warning below on stderr. The NullHandler counts as a handler; records still
# propagate to whatever the user configures (root handlers, basicConfig).
logger.addHandler(logging.NullHandler())

#: Top-level modules whose frames are never "the user's code": ours, the libraries we act through, and the
#: machinery that runs imports and ``python -m``.
_NOT_USER_CODE = {"diffusers_cudnn_fix", "diffusers", "torch", "wrapt", "importlib", "runpy", "contextlib", "functools"}


class DiffusersCudnnFixWarning(RuntimeWarning):
    """Base category of every warning this package emits."""


class FixNotAppliedWarning(DiffusersCudnnFixWarning):
    """A bug was found (or could not be ruled out) but its fix is not active: gradients may be wrong."""


class ReleaseTableMismatchWarning(DiffusersCudnnFixWarning):
    """The behavioural check disagrees with what the release table expects for this diffusers version."""


class StaleReferenceWarning(DiffusersCudnnFixWarning):
    """Some object still holds a shipped (buggy) function that the package could not rebind."""


class MaskConvertedWarning(DiffusersCudnnFixWarning):
    """A bool or wrongly typed mask reached the cuDNN context-parallel op and was converted (mode ``convert``)."""


class MaskMisreadWarning(DiffusersCudnnFixWarning):
    """A bool or wrongly typed mask reached the cuDNN context-parallel op and was passed through (mode ``warn``)."""


class ProbeFailedWarning(DiffusersCudnnFixWarning):
    """The GPU probe found wrong outputs or gradients from the attention ops diffusers will call."""


class SwitchValueWarning(DiffusersCudnnFixWarning):
    """An environment switch holds a value the package does not know; the warning says what is used instead."""


class UnsafeAttentionError(RuntimeError):
    """Raised on the attention path instead of letting diffusers compute wrong outputs or gradients.

    Its message names the cause and the way out (a switch, a backend, a dtype, or a diffusers release).
    """


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _is_user_frame(frame: FrameType) -> bool:
    if frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        return False  # ours, also where it runs as __main__ (``python -m diffusers_cudnn_fix``)
    name = frame.f_globals.get("__name__")
    # The frozen import machinery (``<frozen importlib._bootstrap>``) runs with __name__ "importlib._bootstrap".
    return not isinstance(name, str) or name.partition(".")[0] not in _NOT_USER_CODE


def report(message: str, category: type[DiffusersCudnnFixWarning], *, say_where: bool = False) -> None:
    """Log ``message`` at WARNING and emit it as a warning of ``category`` filed at the user's frame
    (``say_where``: the message also names that frame's file and line, for the log).

    Never raises, even when a filter turns the category into an error: the host's import must not break
    because of us (a user who wants a hard stop uses the strict switches, which raise on purpose).
    """
    # The innermost frame of the user's code; None on a stack of ours and the import machinery only
    # (``python -m diffusers_cudnn_fix``, or autograd's own thread).
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and not _is_user_frame(frame):
        frame = frame.f_back
    if say_where and frame is not None:
        message = f"{message} Called from {frame.f_code.co_filename}:{frame.f_lineno}."
    logger.warning(message)
    try:
        if frame is None:
            warnings.warn(message, category, stacklevel=2)
        else:
            # What warnings.warn does for a frame (its source line read by file name, as warn does).
            warnings.warn_explicit(
                message,
                category,
                frame.f_code.co_filename,
                frame.f_lineno,
                module=frame.f_globals.get("__name__"),
                registry=frame.f_globals.setdefault("__warningregistry__", {}),
            )
    except Warning:
        pass  # an "error" filter turned the warning into an exception; it is logged above
    except Exception:  # noqa: BLE001 - a broken warnings setup must not break the host's import
        try:
            warnings.warn(message, category, stacklevel=2)
        except Exception:  # noqa: BLE001, S110 - logged above
            pass
    finally:
        del frame  # no reference cycle through the caller's frames
