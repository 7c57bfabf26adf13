"""diffusers' context-parallel split hook calls ``logger.warning_once``, which its logger lacks without transformers.

Bug: ``ContextParallelSplitHook._prepare_cp_input`` warns through ``logger.warning_once`` where an input's dims are not
the plan's ``expected_dims`` (Wan's 1-D timestep); only transformers' import gives loggers that method, so without it
the forward raises AttributeError instead of skipping the split. Every release with context parallelism.
Detection: the method, run in one process on a tensor of the wrong dims with a logger lacking ``warning_once``: does
it reach for it? If so, and diffusers' logger has it here (transformers imported): ``ok``, by the environment. Else
``enable_parallelism``'s replacement lends that one logger a once-per-message ``warning_once``; ``revert()`` takes it.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import types
from typing import Any

import torch

from .. import _ledger
from .._detect import StandInModel, with_globals
from .._fix import Finding, Lookup, built_of
from . import ENABLE_PARALLELISM

#: The record's id (the module is named after it: the registry finds the check so), for the policy's mark.
FIX_ID = __name__.rpartition(".")[2]

#: diffusers' module of the plan's hooks; the split hook's class and the method that warns.
CONTEXT_PARALLEL = "diffusers.hooks.context_parallel"
SPLIT_HOOK = "ContextParallelSplitHook"
PREPARE = "_prepare_cp_input"
METHOD = "warning_once"

#: The loggers given a ``warning_once`` by :func:`lend`, with the function given (taken back by :func:`take_back`).
_lent: list[tuple[logging.Logger, Any]] = []
_lock = threading.Lock()


def _warning_once(logger: logging.Logger) -> Any:
    """A ``warning_once`` for ``logger``: each message (with its arguments) warned once, through ``logger``."""
    seen: set[Any] = set()

    def warning_once(msg: Any, *args: Any, **kwargs: Any) -> None:
        if _ledger.recording:  # the policy is exercised where diffusers reaches for the method it lacked
            _ledger.reached(FIX_ID)
        key = (str(msg), args)
        if key in seen:
            return
        seen.add(key)
        kwargs.setdefault("stacklevel", 2)
        logger.warning(msg, *args, **kwargs)

    return warning_once


def _split_hook_loggers(model: Any) -> list[logging.Logger]:
    """The loggers the split hooks diffusers put on ``model`` (its modules') warn through: the ``logger`` global of
    each hook's ``_prepare_cp_input``, where it is a logger lacking ``warning_once``."""
    found: list[logging.Logger] = []
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    for module in modules:
        hooks = getattr(getattr(module, "_diffusers_hook", None), "hooks", None)
        for hook in hooks.values() if isinstance(hooks, dict) else ():
            prepare = getattr(type(hook), PREPARE, None)
            logger = getattr(prepare, "__globals__", {}).get("logger")
            if isinstance(logger, logging.Logger) and not hasattr(logger, METHOD) and logger not in found:
                found.append(logger)
    return found


def lend(model: Any) -> None:
    """After diffusers applied a plan to ``model``: give the logger its split hooks warn through a ``warning_once``
    (once per message, through that logger: diffusers' own message is seen) where it lacks one. One module's logger
    object, nothing process-wide; a logger that has the method (transformers imported) is left alone."""
    loggers = _split_hook_loggers(model)
    if not loggers:
        return
    with _lock:
        for logger in loggers:
            if not hasattr(logger, METHOD):
                method = _warning_once(logger)
                setattr(logger, METHOD, method)
                _lent.append((logger, method))


def take_back() -> None:
    """Remove each ``warning_once`` :func:`lend` gave, where it is still the one given (``revert()``)."""
    with _lock:
        for logger, method in _lent:
            if logger.__dict__.get(METHOD) is method:
                delattr(logger, METHOD)
        _lent.clear()


class _Missing(Exception):
    """The method reached for a logger method diffusers' logger lacks."""


class _LoggerLike:
    """Stands in for diffusers' logger (``real``) as it is without transformers: what it has is recorded, not
    emitted; what it lacks, and ``warning_once`` (which only transformers' import gives it), is reported (as
    :class:`_Missing`)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.said: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name == METHOD or not hasattr(self.real, name):
            raise _Missing(name)
        return lambda *args, **kwargs: self.said.append(name)


class _StandInLogger(logging.Logger):
    """A logger that emits nothing, lacking ``warning_once`` as diffusers' does without transformers (a plain
    ``logging.Logger``, unless transformers patched the class): what it would say is kept in ``said``."""

    def __init__(self) -> None:
        super().__init__("diffusers_cudnn_fix.check", logging.WARNING)
        self.said: list[Any] = []

    def handle(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


def _reaches_missing(prepare: Any, logger: Any) -> bool | str:
    """Whether the split hook's ``prepare`` (``_prepare_cp_input``), run on a 1-D tensor for an input the plan expects
    2-D, with ``logger`` (a :class:`_LoggerLike` or :class:`_StandInLogger`) in place of its module's, reaches for a
    logger method the logger lacks; False where it warns and returns the tensor unsplit; a text where it cannot be
    run."""
    if not isinstance(prepare, types.FunctionType):
        return f"{PREPARE} is a {type(prepare).__name__}, not a function"
    x = torch.zeros(2)
    cp_input = types.SimpleNamespace(split_dim=1, expected_dims=2, split_output=False)
    hook = types.SimpleNamespace(parallel_config=None)
    try:
        out = with_globals(prepare, logger=logger)(hook, x, cp_input)
    except _Missing:
        return True
    except AttributeError as exc:
        if METHOD in str(exc):
            return True
        return f"AttributeError: {exc}"
    except Exception as exc:  # noqa: BLE001 - a build this check cannot run: said as unknown
        return f"{type(exc).__name__}: {exc}"
    return False if out is x else f"it returned {out!r} for an input it should leave unsplit"


def _lends(lookup: Lookup, prepare: Any, logger: Any) -> bool | str:
    """Whether the ``enable_parallelism`` a model gets (as ``lookup`` shows it), run in one process on a stand-in model
    whose split hook warns through ``logger`` (diffusers' own stood in by one that puts that hook on the model),
    leaves that hook warning instead of raising; a text where it cannot be run."""

    class _Hook:  # the split hook as diffusers registers it, its method warning through the stand-in logger
        pass

    setattr(_Hook, PREPARE, with_globals(prepare, logger=logger))
    model = StandInModel()

    def register(self: Any, *args: Any, **kwargs: Any) -> None:
        self._diffusers_hook = types.SimpleNamespace(hooks={"cp_input": _Hook()})

    run = built_of(lookup, ENABLE_PARALLELISM, register)
    if run is None:
        return "the replacement could not be built around a stand-in"
    config = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(ulysses_degree=2, ring_degree=1))
    try:
        run(model, config=config)
        return _reaches_missing(prepare, logger) is False
    except Exception as exc:  # noqa: BLE001 - a replacement this check cannot run: said as unknown
        return f"{type(exc).__name__}: {exc}"
    finally:
        with _lock:  # the stand-in is nothing revert() has to take back
            _lent[:] = [(lent, method) for lent, method in _lent if lent is not logger]


def check(lookup: Lookup) -> Finding:
    # Not a target's module (no hook of ours fires on it): enable_parallelism imports it the same way.
    module = sys.modules.get(CONTEXT_PARALLEL)
    if module is None and "diffusers" in sys.modules:
        try:
            module = importlib.import_module(CONTEXT_PARALLEL)
        except ImportError:
            module = None
    if module is None:
        return Finding("absent", "this diffusers has no context parallelism (no diffusers.hooks.context_parallel)")
    prepare = getattr(getattr(module, SPLIT_HOOK, None), PREPARE, None)
    real = getattr(module, "logger", None)
    reaches = _reaches_missing(prepare, _LoggerLike(real))
    if isinstance(reaches, str):
        return Finding("unknown", f"diffusers' {SPLIT_HOOK}.{PREPARE} could not be run in one process ({reaches})")
    if not reaches:
        return Finding("ok", f"{SPLIT_HOOK}.{PREPARE} warns and skips the split of an input of other dims than "
                       f"the plan's without logger.{METHOD}")  # fmt: skip
    if hasattr(real, METHOD):  # the code has the bug; this process does not (the record's environment)
        given = "transformers, imported, gives every logger one" if METHOD in vars(logging.Logger) else "given to it"
        return Finding("ok", f"here diffusers' logger has the logger.{METHOD} that {SPLIT_HOOK}.{PREPARE} calls "
                       f"({given}); where transformers is not imported, that call raises AttributeError",
                       by_environment=True)  # fmt: skip
    enable = lookup(ENABLE_PARALLELISM)
    broken = (f"{SPLIT_HOOK}.{PREPARE} calls logger.{METHOD}, which diffusers' logger lacks (transformers not "
              "imported): an input of other dims than the plan's raises AttributeError")  # fmt: skip
    if enable is None:  # diffusers' ModelMixin not imported yet: checked again once it is (the hook watches it)
        return Finding("broken", f"{broken}; ModelMixin.enable_parallelism is not imported yet")
    lends = _lends(lookup, prepare, _StandInLogger())
    if isinstance(lends, str):
        return Finding("unknown", f"ModelMixin.enable_parallelism could not be run in one process ({lends})")
    if lends:
        return Finding("ok", f"enable_parallelism gives the split hooks' logger a {METHOD}: such an input warns once "
                       "and is not split, as diffusers means")  # fmt: skip
    return Finding("broken", broken)
