"""Every warning category and the error this package raises, and the one helper that reports a problem.

A problem becomes a warning of one of these categories plus a ``logging`` record on the
``diffusers_cudnn_fix`` logger. A user sees it once: the warning, filed at the user's own line (the first
frame outside this package, diffusers, torch, wrapt and the import machinery). The logger has a
``NullHandler``, so the record reaches the handlers a user configures but is not printed a second time by
``logging``'s last-resort handler. Filter them like any warning::

    warnings.simplefilter("error", diffusers_cudnn_fix.DiffusersCudnnFixWarning)  # or python -W error
    warnings.filterwarnings("ignore", category=diffusers_cudnn_fix.MaskConvertedWarning)

An error filter never makes a warning vanish: met on the user's own call (an attention op) it raises there;
met inside an import (the package's, or the hook inside diffusers' import), which must not break, it is
written to stderr instead. Notices (the run is right) are shown by rank 0 only; problems by every rank.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from types import FrameType

from ._explain import command_for

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


def explain(cause: str, consequence: str, way_out: str, section: str) -> str:
    """A problem as the package says it: the cause, the consequence and the way out, one line each, the last
    naming once the command that prints the long explanation, ``section`` of the docs (``"fixes.md#<fix id>"``
    for a fix's: docs/fixes.md has a section per fix). The command reads the docs installed with the package,
    so it works from a wheel, where a path into the source tree would not; it ends the line, to be copied as
    it is. Each part is one sentence or a few, with no line break of its own."""
    return f"diffusers_cudnn_fix: {cause}\n{consequence}\n{way_out} Details: {command_for(section)}"


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

#: Notices: the run is right, the message only says what the package did. Under torchrun every rank meets
#: them at once, so only rank 0 shows them (the other ranks log them at INFO), as distributed training tools
#: do; every other category says that a run may be wrong or was refused, and every rank that meets it says it.
NOTICES: tuple[type[DiffusersCudnnFixWarning], ...] = (MaskConvertedWarning, ReleaseTableMismatchWarning)


def _is_user_frame(frame: FrameType) -> bool:
    if frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        return False  # ours, also where it runs as __main__ (``python -m diffusers_cudnn_fix``)
    name = frame.f_globals.get("__name__")
    # The frozen import machinery (``<frozen importlib._bootstrap>``) runs with __name__ "importlib._bootstrap".
    return not isinstance(name, str) or name.partition(".")[0] not in _NOT_USER_CODE


def process_rank() -> int:
    """This process's global rank: the initialised default process group's, else ``RANK`` (torchrun,
    accelerate), else 0. Imports nothing (this runs on autograd's threads too)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001, S110 - a half-initialised group: fall back to the environment
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _filter_action(message: str, category: type[Warning], module: str, lineno: int) -> str:
    """The action the warning filters pick for this warning (``warnings``' own matching rule), without
    emitting it."""
    for action, text, cat, mod, line in warnings.filters:
        if (
            (text is None or text.match(message))
            and issubclass(category, cat)
            and (mod is None or mod.match(module))
            and (line == 0 or line == lineno)
        ):
            return str(action)
    return str(getattr(warnings, "defaultaction", "default"))


def report(
    message: str, category: type[DiffusersCudnnFixWarning], *, say_where: bool = False, may_raise: bool = False
) -> None:
    """Log ``message`` at WARNING and emit it as a warning of ``category`` filed at the user's frame.

    ``say_where``: the log record also names that frame's file and line (the warning's own header does).
    Under an "error" filter (``python -W error``, pytest's ``filterwarnings = error``) the warning is raised
    where the caller may raise (``may_raise``: the user's own call, an attention op), and otherwise (inside an
    import or the hook, which must not break) written to stderr in the warning's own format. An "ignore"
    filter silences it. A notice (:data:`NOTICES`) is shown by rank 0 only. The log record is written whatever
    the filters say: logging is configured on its own.
    """
    # The innermost frame of the user's code; None on a stack of ours and the import machinery only
    # (``python -m diffusers_cudnn_fix``, or autograd's own thread).
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and not _is_user_frame(frame):
        frame = frame.f_back
    at = frame if frame is not None else sys._getframe(1)
    filename, lineno, module = at.f_code.co_filename, at.f_lineno, at.f_globals.get("__name__")
    registry = at.f_globals.setdefault("__warningregistry__", {})
    del frame, at  # no reference cycle through the caller's frames
    where = f" Called from {filename}:{lineno}." if say_where else ""
    if issubclass(category, NOTICES) and process_rank() != 0:
        # Rank 0 shows it; here only an error filter (every rank raises alike) or the log has it.
        filter_module = module if isinstance(module, str) else filename.removesuffix(".py")
        try:
            action = _filter_action(message, category, filter_module, lineno)
        except Exception:  # noqa: BLE001 - filters we cannot read: show it, as rank 0 does
            action = "default"
        if action != "error":
            logger.info("%s%s", message, where)
            return
    logger.warning("%s%s", message, where)
    try:
        warnings.warn_explicit(message, category, filename, lineno, module=module, registry=registry)
    except Warning:
        if may_raise:
            raise
        # Raising here would break the host's import: the user still sees it, in the warning's own format.
        try:
            text = warnings.formatwarning(message, category, filename, lineno).rstrip()
            sys.stderr.write(f"{text}\n  (an error filter matches it; not raised: it was met inside an import)\n")
        except Exception:  # noqa: BLE001, S110 - no stderr to write to (pythonw): the log record above stays
            pass
    except Exception:  # noqa: BLE001, S110 - a broken warnings setup must not break the host's import
        pass
