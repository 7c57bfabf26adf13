"""Correct gradients for diffusers' context-parallel cuDNN / native-flash attention.

Importing the package is all a user does, once, at the top of the training entry point (the script every
rank runs), before or after diffusers::

    import diffusers_cudnn_fix  # noqa: F401
    import diffusers

A post-import hook checks ``diffusers.models.attention_dispatch`` when it is imported (or at once, if it
already is) and replaces only the ops the check shows broken. The import itself loads neither torch nor
diffusers, starts no thread and never initialises CUDA, so it is safe in torchrun ranks and forked
DataLoader workers. A GPU probe checks the ops once per CUDA device, at their first CUDA call (or when
asked: :func:`probe`, ``python -m diffusers_cudnn_fix``).

With torchrun (the import above in ``train.py``; every rank imports it)::

    torchrun --nproc-per-node 8 train.py

A training script that cannot be edited (diffusers' example scripts, a framework's entry point) runs
through the launcher instead, which makes every Python process of the command import the package first
(torchrun and accelerate workers included); its exit status and signals pass through::

    diffusers-cudnn-fix run -- torchrun --nproc-per-node 8 train_dreambooth_flux.py ...
    python -m diffusers_cudnn_fix run -- accelerate launch train.py ...

``diffusers-cudnn-fix`` alone (or ``python -m diffusers_cudnn_fix``) is the doctor: what to do next, each
fix's state, and on a GPU the ops' errors as shipped and corrected; ``--help`` lists its exit statuses.

Public API:

- :func:`apply` / :func:`revert`: install the fixes the check finds needed / put back the exact objects
  diffusers shipped (both idempotent and thread-safe; ``revert()`` before diffusers is imported disarms
  the hook, ``apply()`` re-arms it);
- :func:`status`: a :class:`Report` (plain immutable data: ``enabled``, ``diffusers_version``,
  ``torch_version``, ``module_loaded``, ``fixes`` (per fix: ``id``, ``title``, ``expected`` by the release
  table, ``detected`` by the check, ``applied``, ``reason``), ``stale_references``, ``probes``,
  ``problem``; ``.ok``, ``.to_dict()``, ``str()``). :class:`Report` is exported for type annotations;
- :func:`probe` ``(device=None)``: run the GPU probe now on ``device`` (default: the current CUDA device)
  and return its result (``device``, ``state`` ``"passed"`` / ``"failed"`` / ``"skipped"``, ``reason``,
  per-case errors); it never raises for a failing op;
- :func:`set_probe_mode` ``("warn" | "strict" | "off")`` and :func:`set_mask_mode`
  ``("convert" | "warn" | "error")``: the API twins of the switches below; they win over the environment
  and raise ``ValueError`` for a bad value;
- :func:`is_patched` ``(target)`` and :func:`get_original` ``(target)``: whether
  ``diffusers.models.attention_dispatch.<target>`` is our replacement now, and the object diffusers shipped;
  ``target`` is one of :data:`TARGETS` (bare or with the module's dotted name; a target of another module,
  QwenImage's attention processor, as ``module:Class.attr``), anything else raises ``ValueError``;
- ``__version__``: this package's version (also ``diffusers-cudnn-fix --version`` and the doctor's output);
- the warning categories (:class:`DiffusersCudnnFixWarning` and its subclasses, all ``RuntimeWarning``)
  and :class:`UnsafeAttentionError`, raised where a result would be wrong and cannot be corrected.

Switches: ``DIFFUSERS_CUDNN_FIX`` (``0`` turns the package off), ``DIFFUSERS_CUDNN_FIX_SKIP`` (fix ids to
leave alone), ``DIFFUSERS_CUDNN_FIX_MASK`` (:func:`set_mask_mode`) and ``DIFFUSERS_CUDNN_FIX_PROBE``
(:func:`set_probe_mode`); their values and defaults are documented once, in docs/behaviour.md, "Switches".
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from . import _hook, _switches, _target_names
from ._switches import set_mask_mode, set_probe_mode
from ._warnings import (
    DiffusersCudnnFixWarning,
    FixNotAppliedWarning,
    MaskConvertedWarning,
    MaskMisreadWarning,
    ProbeFailedWarning,
    ReleaseTableMismatchWarning,
    StaleReferenceWarning,
    SwitchValueWarning,
    UnsafeAttentionError,
)

if TYPE_CHECKING:
    from ._devices import ProbeResult
    from ._report import Report

__version__ = "0.5.0.dev0"

#: What :func:`is_patched` and :func:`get_original` take: the attributes of
#: ``diffusers.models.attention_dispatch`` the fixes may replace, bare or with that module's dotted name before them,
#: and those of another module as ``module:Class.attr``.
TARGETS = _target_names.TARGETS

__all__ = [
    "TARGETS",
    "DiffusersCudnnFixWarning",
    "FixNotAppliedWarning",
    "MaskConvertedWarning",
    "MaskMisreadWarning",
    "ProbeFailedWarning",
    "ReleaseTableMismatchWarning",
    "Report",
    "StaleReferenceWarning",
    "SwitchValueWarning",
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


def __getattr__(name: str) -> Any:
    """``Report`` on first use (PEP 562): its module loads dataclasses, which the package's import avoids."""
    if name == "Report":
        from ._report import Report

        return Report
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def apply() -> Report:
    """Arm the hook, import diffusers' attention module if needed, check it and install the fixes it needs.

    Idempotent and thread-safe; after :func:`revert` it re-checks and re-installs. A no-op (returning the
    report) when the package is switched off. Raises ImportError only if diffusers is not installed.
    """
    import importlib

    from . import _registry

    _hook.arm()
    _switches.check_environment()
    module = importlib.import_module(_switches.MODULE_NAME)  # a first import fires the hook
    _hook.import_first()
    _registry.apply_to(module)
    if _switches.enabled():
        _hook.install_prober()
    return _registry.status()


def revert() -> Report:
    """Put back the exact objects diffusers shipped (and any references we rebound), and disarm the hook so
    that a later import of diffusers patches nothing until :func:`apply`. Idempotent; works without torch."""
    from . import _registry

    _hook.disarm()
    return _registry.revert()


def status() -> Report:
    """Versions; per fix: expected by the release table, found by the check, applied, and why; GPU probes."""
    from . import _registry

    return _registry.status()


def probe(device: Any = None) -> ProbeResult:
    """Run the GPU gradient probe now on ``device`` (default: the current CUDA device); returns its result.

    ``device``: None, a CUDA device index, ``"cuda"`` / ``"cuda:N"`` or a CUDA ``torch.device``; anything else
    raises ``ValueError``. On a machine without a usable GPU the result is ``"skipped"`` with the reason.
    """
    from . import _probe

    is_index = isinstance(device, int) and not isinstance(device, bool)
    if is_index and device < 0:
        raise ValueError(f"probe() takes a CUDA device (an index, 'cuda', 'cuda:N'), not {device!r}")
    if device is not None and not is_index:
        import torch

        try:
            parsed = torch.device(device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ValueError(f"probe() takes a CUDA device (an index, 'cuda', 'cuda:N'), not {device!r}") from exc
        if parsed.type != "cuda":
            raise ValueError(f"probe() checks CUDA kernels; {device!r} is a {parsed.type} device")
    return _probe.probe(device)


def _target(target: object) -> str:
    """``target`` as one of :data:`TARGETS`, or ``ValueError`` naming them."""
    if isinstance(target, str):
        name = target.strip().removeprefix(_switches.MODULE_NAME + ".")
        if name in TARGETS:
            return name
    raise ValueError(
        f"{target!r} is not an attribute the package may patch; use one of {', '.join(TARGETS)} "
        f"(optionally prefixed with {_switches.MODULE_NAME}.)"
    )


def is_patched(target: str) -> bool:
    """Whether ``diffusers.models.attention_dispatch.<target>`` is our replacement right now.

    ``target``: one of :data:`TARGETS` (``"_cudnn_attention_backward_op"``,
    ``"TemplatedRingAttention.backward"``, ...), bare or as ``"diffusers.models.attention_dispatch.<target>"``;
    anything else raises ``ValueError`` naming the known targets.
    """
    name = _target(target)
    if "diffusers_cudnn_fix._registry" not in sys.modules:
        return False  # nothing was ever patched in this process
    from . import _registry

    return _registry.is_patched(name)


def get_original(target: str) -> Any:
    """The object diffusers shipped as ``diffusers.models.attention_dispatch.<target>`` (None if diffusers'
    module is not imported or lacks it). ``target`` as for :func:`is_patched`; anything else raises
    ``ValueError``."""
    name = _target(target)
    from . import _registry

    return _registry.original(name)


_hook.arm()
