"""The package's warning categories and the one helper that reports a problem.

Every problem the package meets at import or hook time becomes a warning of one of these categories
plus a ``logging`` record on the ``diffusers_cudnn_fix`` logger, never an exception in the host's
import. Filter them like any warning::

    warnings.simplefilter("error", diffusers_cudnn_fix.DiffusersCudnnFixWarning)
"""

from __future__ import annotations

import warnings

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see __getattr__ below)
if TYPE_CHECKING:
    import logging

    logger: logging.Logger

LOGGER_NAME = "diffusers_cudnn_fix"


def __getattr__(name: str) -> object:
    """``logger``, the package's ``logging`` logger, made on first use (PEP 562).

    ``import diffusers_cudnn_fix`` must cost next to nothing beyond ``import wrapt``, and wrapt 1.x loads
    no ``logging`` (several ms): the package's import never logs, so the logger waits for the hook, by
    which time torch and diffusers have loaded ``logging`` anyway.
    """
    if name == "logger":
        import logging

        return logging.getLogger(LOGGER_NAME)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class DiffusersCudnnFixWarning(RuntimeWarning):
    """Base category of every warning this package emits."""


class FixNotAppliedWarning(DiffusersCudnnFixWarning):
    """A bug was found (or could not be ruled out) but its fix is not active: gradients may be wrong."""


class ReleaseTableMismatchWarning(DiffusersCudnnFixWarning):
    """The behavioural check disagrees with what the release table expects for this diffusers version."""


class StaleReferenceWarning(DiffusersCudnnFixWarning):
    """Some object still holds a shipped (buggy) function that the package could not rebind."""


def report(message: str, category: type[DiffusersCudnnFixWarning], *, stacklevel: int = 2) -> None:
    """Log ``message`` at WARNING and emit it as a warning of ``category``.

    Never raises, even when a filter turns the category into an error: the host's import must not break
    because of us (a user who wants a hard stop uses the strict switches, which raise on purpose).
    """
    import logging

    logging.getLogger(LOGGER_NAME).warning(message)
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    except Warning:
        # "error" filters turn the warning into an exception; it is already logged above.
        pass


class UnsafeAttentionError(RuntimeError):
    """Raised on the attention path instead of letting diffusers compute wrong outputs or gradients.

    Its message names the cause and the way out (a switch, a backend, or a diffusers release).
    """
