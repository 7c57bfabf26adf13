"""Every warning category and the error this package raises, and the one helper that reports a problem.

A problem met at import or hook time becomes a warning of one of these categories plus a ``logging``
record on the ``diffusers_cudnn_fix`` logger, never an exception in the host's import. Filter them like any
warning::

    warnings.simplefilter("error", diffusers_cudnn_fix.DiffusersCudnnFixWarning)
"""

from __future__ import annotations

import logging
import warnings

LOGGER_NAME = "diffusers_cudnn_fix"
logger = logging.getLogger(LOGGER_NAME)


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


def report(message: str, category: type[DiffusersCudnnFixWarning], *, stacklevel: int = 2) -> None:
    """Log ``message`` at WARNING and emit it as a warning of ``category``.

    Never raises, even when a filter turns the category into an error: the host's import must not break
    because of us (a user who wants a hard stop uses the strict switches, which raise on purpose).
    """
    logger.warning(message)
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    except Warning:
        pass  # an "error" filter turned the warning into an exception; it is logged above
