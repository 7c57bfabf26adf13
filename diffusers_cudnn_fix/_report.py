"""What ``status()`` returns: plain immutable data, ``to_dict()`` for ``--json``, and the one renderer of its rows:
the doctor's text and ``str(status())`` both say each fix's state with :func:`render`."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any, Literal, NamedTuple

from ._switches import ENABLE_VAR, raw_enable_value
from .fixes import ALL_FIXES

#: The fix table's "table" column: what the release table says of the installed release (``FixStatus.expected``).
TABLE_SAYS = {True: "affected", False: "not affected", None: "unknown"}

#: The result of a fix not applied, by the check's state ("disabled", which a reload's "lost" hides) or the reason
#: code: (where it needs attention, where not). Any other: "NOT FIXED", or the check's state in words.
_RESULTS = {"disabled": ("NOT ACTIVE (package off)", "package off"), "skipped": ("NOT FIXED (skipped)", "skipped")}
_QUIET = {"ok": "not needed", "absent": "no such code"}
_CHECK_SAYS = "what the check found in the shipped code"

#: Why a fix is in its state (``FixStatus.reason_code``), for programs; ``reason`` says it in words.
ReasonCode = Literal[
    "fixed", "guarded", "skipped", "failed", "not_needed", "not_applicable", "unknown", "disabled", "pending",
    "unchecked", "reverted", "lost",
]  # fmt: skip


def json_text(data: Any) -> str:
    """``data`` as strict JSON for the command line's ``--json``: a float that is not finite (an error that is
    NaN or infinite, as a mismatch can give) becomes the string "nan", "inf" or "-inf". ``json.dumps`` alone
    writes the bare words NaN and Infinity, which strict parsers (jq, JavaScript) reject."""
    import json  # the command line's only: the package's import does not load it
    import math

    def strict(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, dict):
            return {key: strict(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [strict(item) for item in value]
        return value

    return json.dumps(strict(data), default=str, allow_nan=False)


def switched_off_by() -> str:
    """The master switch as the user spelled it (``DIFFUSERS_CUDNN_FIX='OFF'``), for messages that quote it."""
    return f"{ENABLE_VAR}={raw_enable_value()!r}"


class FixStatus(NamedTuple):
    """One fix's state.

    Attributes:
        expected: whether the release table lists the installed diffusers version as affected (None when
            the version is unknown or a pre-release).
        detected: what the behavioural check found on the shipped code: broken / ok / absent / unknown /
            disabled (package switched off) / pending (module not imported yet) / unchecked (imported while
            the package was reverted). A fix named in ``DIFFUSERS_CUDNN_FIX_SKIP`` is still checked; its
            ``reason_code`` is ``skipped``.
        applied: whether our replacement is installed right now (read off the live module).
        reason: one sentence on why.
        reason_code: the reason as a code: fixed / guarded (applied), skipped (named in
            ``DIFFUSERS_CUDNN_FIX_SKIP``), failed (its replacement did not pass its check), not_needed (check: ok),
            not_applicable (absent), unknown, disabled, pending, unchecked (as ``detected``), reverted (by
            ``revert()``), lost (applied, but the module no longer holds the replacement).
        needs_attention: the bug is (or may be) there and is not fixed; or the package is switched off on a
            release the table lists as carrying it.
        result: the doctor's result, in a word or three: corrected, guarded, not needed, no such code, skipped,
            package off, NOT FIXED, NOT FIXED (skipped), NOT ACTIVE (package off), or else the check's state.
    """

    id: str
    title: str
    upstream: str
    affected: str
    expected: bool | None
    detected: str
    applied: bool
    reason: str
    reason_code: ReasonCode
    needs_attention: bool

    @property
    def result(self) -> str:
        if self.applied:  # only a fix found broken and fixed or guarded is applied
            return "corrected" if self.reason_code == "fixed" else "guarded"
        quiet = ("NOT FIXED", _QUIET.get(self.detected, self.detected))
        return (_RESULTS.get(self.detected) or _RESULTS.get(self.reason_code, quiet))[0 if self.needs_attention else 1]


class Report(NamedTuple):
    """What ``status()`` returns."""

    enabled: bool
    diffusers_version: str | None
    torch_version: str | None
    module_loaded: bool
    fixes: tuple[FixStatus, ...]
    stale_references: tuple[str, ...] = ()
    probes: tuple[Any, ...] = ()  # a ProbeResult per CUDA device probed in this process
    problem: str | None = None  # why nothing could be checked (torch missing)

    @property
    def ok(self) -> bool:
        """Every bug found is fixed, the package is not switched off where the release needs it, and no GPU
        probe failed (vacuously true before diffusers' module is imported)."""
        return not any(f.needs_attention for f in self.fixes) and not any(p.state == "failed" for p in self.probes)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json`` and logs."""
        return self._asdict() | {
            "fixes": [f._asdict() | {"result": f.result} for f in self.fixes],
            "stale_references": list(self.stale_references),
            "probes": [asdict(p) for p in self.probes],
            "ok": self.ok,
        }

    def __str__(self) -> str:
        data = self.to_dict()
        diffusers, torch = self.diffusers_version or "(not installed)", self.torch_version or "(not loaded)"
        lines = [f"diffusers_cudnn_fix: diffusers {diffusers}, torch {torch}", *render(data)]
        lines += ["", *map(probe_line, data["probes"])] if self.probes else []
        verdict = "OK" if self.ok else "NOT SAFE: see the lines above"
        if not self.ok and not self.enabled:
            verdict = f"NOT SAFE: the package is switched off ({switched_off_by()}) on a release that needs its fixes"
        return "\n".join([*lines, "", f"verdict: {verdict}"])


# ------------------------------------------------------------------------------------------------------------
# The renderer: the doctor's text and str(status())
# ------------------------------------------------------------------------------------------------------------
def wrap(text: str, indent: str = "") -> str:
    """The whole of ``text``, wrapped: nothing the doctor prints is cut."""
    return textwrap.fill(
        text, width=100, initial_indent=indent, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    )


def columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows as aligned columns, each as wide as its widest cell, indented by two spaces."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def upstream_reports(checks: Mapping[str, str]) -> dict[str, dict[str, str | None]]:
    """Per fix found broken (``checks``: fix id -> the check's state) that has an upstream report, shipped in the
    package (``explain`` prints it): the doctor's ``--json`` ``upstream``, and a line under the fix's row."""
    return {
        fix.id: {"issue": fix.upstream_folder, "command": fix.upstream_command, "holds": fix.upstream_issue}
        for fix in ALL_FIXES
        if fix.upstream_folder is not None and checks.get(fix.id) == "broken"
    }


def probe_line(probe: Mapping[str, Any]) -> str:
    return f"GPU probe: {probe['state']} on {probe['device']} ({probe['reason']})"


def render(status: Mapping[str, Any], checks: Mapping[str, str] | None = None, verbose: bool = False) -> list[str]:
    """The package's state and the fix table, as the doctor's text and ``str(status())`` say them. ``status``: a
    :class:`Report`'s ``to_dict()``; ``checks``: the "check" column by fix id (default: each fix's ``detected``).
    Under each row: the fix's title, an applied fix's note, why where the result does not say it (always with
    ``verbose``: the check's evidence), and where its bug is open upstream the command that prints the report."""
    fixes = status["fixes"]
    lines = [] if status["enabled"] else [f"diffusers_cudnn_fix is SWITCHED OFF by {switched_off_by()}"]
    lines += [status["problem"]] if status["problem"] else []
    if not fixes:
        return lines
    checks = checks or {f["id"]: f["detected"] for f in fixes}
    notes, upstream, yes = {fix.id: fix.note for fix in ALL_FIXES}, upstream_reports(checks), {True: "yes", False: "no"}
    rows = [(f["id"], TABLE_SAYS[f["expected"]], checks[f["id"]], yes[f["applied"]], f["result"]) for f in fixes]
    header, *cells = columns([("fix", "table", "check", "applied", "result"), *rows])
    lines += ["", f"fixes (table: the release table lists this release; check: {_CHECK_SAYS}):", header]
    for f, row in zip(fixes, cells, strict=True):
        lines += [row, wrap(f["title"], "      ")]
        if f["applied"] and (note := notes.get(f["id"])) is not None:
            lines.append(wrap(note(), "      "))
        # The result does not say why, or the table lists the release and the check finds the bug not here (a bug
        # the environment spares this process, Fix.environment): the reason says why.
        disagrees = f["expected"] is True and f["detected"] == "ok"
        if verbose or disagrees or f["result"] in ("NOT FIXED", f["detected"]):
            lines.append(wrap(f"why: {f['reason']}", "      "))
        if (report := upstream.get(f["id"])) is not None:  # the bug is open: where to fix it upstream
            lines.append(wrap(f"upstream: {report['command']} prints the report ({report['holds']})", "      "))
    return lines + [wrap(f"still holds a shipped function: {ref}", "  ") for ref in status["stale_references"]]
