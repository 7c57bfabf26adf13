"""The four switches: one parser for the environment and the API.

Read when asked, not cached, so tests and launchers can flip them. Values are stripped and
case-insensitive. A bad value in the environment is reported once per process (a :class:`SwitchValueWarning`
naming the variable, the value, the allowed values and what is used instead), when the package first acts
(diffusers' attention module imported, or :func:`check_environment`), not when the package is merely
imported: the launcher's own process, which only imports it, reports nothing. A bad value given to the API
raises ``ValueError``. What each value does: ``docs/behaviour.md``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping

from ._warnings import SwitchValueWarning, explain, report

#: The diffusers module every fix patches.
MODULE_NAME = "diffusers.models.attention_dispatch"

ENABLE_VAR = "DIFFUSERS_CUDNN_FIX"
SKIP_VAR = "DIFFUSERS_CUDNN_FIX_SKIP"
MASK_VAR = "DIFFUSERS_CUDNN_FIX_MASK"
PROBE_VAR = "DIFFUSERS_CUDNN_FIX_PROBE"

_ON_OFF = {
    **dict.fromkeys(("1", "on", "true", "yes", "enable", "enabled"), "on"),
    **dict.fromkeys(("0", "off", "false", "no", "disable", "disabled"), "off"),
}

#: Every switch, the one source of the CLI's help on them: variable -> (spelling -> value, the default first;
#: value used for a bad spelling; what it does). The skip switch takes fix ids, not spellings.
SWITCHES: dict[str, tuple[Mapping[str, str], str, str]] = {
    ENABLE_VAR: (_ON_OFF, "on", "the package on or off"),  # a typo must not switch the fixes off
    SKIP_VAR: ({}, "", "fixes to leave alone (still checked and reported)"),
    MASK_VAR: ({m: m for m in ("convert", "warn", "error")}, "convert", "what a bool or wrongly typed mask does"),
    # Someone who typed "stict" wanted strict; the safe reading of a typo is the stricter one.
    PROBE_VAR: ({m: m for m in ("warn", "strict", "off")}, "strict", "what a failed GPU probe does"),
}

SECTION = "behaviour.md#switches"  # where the switches are documented

_overrides: dict[str, str] = {}  # variable -> value chosen through the API in this process
_reported: set[tuple[str, str]] = set()


def _bad_value(var: str, raw: str, known: str, instead: str) -> None:
    if (var, raw) not in _reported:
        _reported.add((var, raw))
        way_out = f"Set {var} to known values only ({known}), or unset it."
        report(explain(f"{var}={raw!r} is not understood.", instead, way_out, SECTION), SwitchValueWarning)


def _choice(var: str, *, quiet: bool = False) -> str:
    if var in _overrides:
        return _overrides[var]
    spellings, fallback, _ = SWITCHES[var]
    raw = os.environ.get(var, "")
    spelling = raw.strip().lower()
    if spelling and spelling not in spellings and not quiet:
        _bad_value(var, raw, ", ".join(spellings), f"Using {fallback!r} instead.")
    return spellings.get(spelling, fallback) if spelling else next(iter(spellings.values()))


def _set(var: str, value: str) -> None:
    chosen = SWITCHES[var][0].get(str(value).strip().lower())
    if chosen is None:
        raise ValueError(f"{var} (and its API twin) takes one of {', '.join(SWITCHES[var][0])}, not {value!r}")
    _overrides[var] = chosen


def enabled(*, quiet: bool = False) -> bool:
    """Whether the package may patch anything (the master switch). ``quiet``: do not report a bad value
    (the package's import reads it so; the report comes when the package acts)."""
    return _choice(ENABLE_VAR, quiet=quiet) == "on"


def raw_enable_value() -> str:
    """The master switch as the user set it (for messages that quote it), or ``""``."""
    return os.environ.get(ENABLE_VAR, "").strip()


def check_environment() -> None:
    """Report a bad value of the master, mask and probe switches now (once per variable and value)."""
    for var in (ENABLE_VAR, MASK_VAR, PROBE_VAR):
        _choice(var)


#: ``mask_mode()``: ``convert``, ``warn`` or ``error``: the API's choice, else the environment's, else ``convert``.
#: Read by the mask policies at every call: a partial, so that reading it costs no frame of its own.
mask_mode: Callable[[], str] = functools.partial(_choice, MASK_VAR)


def set_mask_mode(mode: str) -> None:
    """What a bool or wrongly typed mask reaching the cuDNN context-parallel op does (#14342), any case:
    ``"convert"`` (default: to an additive mask in q's dtype), ``"warn"`` (pass it through as diffusers
    does, warn once) or ``"error"`` (raise :class:`UnsafeAttentionError`). Wins over
    ``DIFFUSERS_CUDNN_FIX_MASK``; a bad value raises ``ValueError``."""
    _set(MASK_VAR, mode)


def probe_mode() -> str:
    """``warn``, ``strict`` or ``off``: the API's choice, else the environment's, else ``warn``."""
    return _choice(PROBE_VAR)


def set_probe_mode(mode: str) -> None:
    """``"warn"`` (default), ``"strict"`` or ``"off"``, any case; wins over ``DIFFUSERS_CUDNN_FIX_PROBE``; a bad
    value raises ``ValueError``."""
    _set(PROBE_VAR, mode)


def skipped_fixes(known: Mapping[str, str]) -> frozenset[str]:
    """Fix ids named in ``DIFFUSERS_CUDNN_FIX_SKIP``. ``known`` maps every accepted spelling (ids and old
    ids, lower case) to a fix id; unknown names are reported once and ignored."""
    raw = os.environ.get(SKIP_VAR, "")
    names = [part.strip() for part in raw.split(",") if part.strip()]
    unknown = [name for name in names if name.lower() not in known]
    if unknown:
        _bad_value(SKIP_VAR, raw, ", ".join(sorted(set(known.values()))), f"Ignoring {', '.join(unknown)}: no fix id.")
    return frozenset(known[name.lower()] for name in names if name.lower() in known)
