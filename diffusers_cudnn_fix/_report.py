"""What ``status()`` returns: plain immutable data, printable, and ``to_dict()`` for ``--json``."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Literal, NamedTuple

from ._switches import ENABLE_VAR, MODULE_NAME, raw_enable_value

#: The fix table's "table" column: what the release table says of the installed release (``FixStatus.expected``).
TABLE_SAYS = {True: "affected", False: "not affected", None: "unknown"}


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
    result: str


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
            "fixes": [f._asdict() for f in self.fixes],
            "stale_references": list(self.stale_references),
            "probes": [asdict(p) for p in self.probes],
            "ok": self.ok,
        }

    def __str__(self) -> str:
        state = "enabled" if self.enabled else f"SWITCHED OFF by {ENABLE_VAR}"
        diffusers, torch = self.diffusers_version or "(not installed)", self.torch_version or "(not loaded)"
        lines = [f"diffusers_cudnn_fix: {state}", f"  diffusers {diffusers}, torch {torch}"]
        lines += [f"  {self.problem}"] if self.problem else []
        if not self.module_loaded and self.fixes:
            lines.append(f"  {MODULE_NAME} not imported yet: fixes apply when it is")
        rows = [(f.id, TABLE_SAYS[f.expected], f.detected, "yes" if f.applied else "no", f.reason) for f in self.fixes]
        # Columns as wide as their longest entry, so that they line up whatever the ids and states.
        id_w, table_w, check_w = (max((len(r[i]) for r in rows), default=0) for i in range(3))
        lines += [
            f"  {i:<{id_w}}  table: {table:<{table_w}}  check: {check:<{check_w}}  applied: {applied:<3}  {reason}"
            for i, table, check, applied, reason in rows
        ]
        lines += [f"  still holds a shipped function: {ref}" for ref in self.stale_references]
        lines += [f"  GPU probe {p.device}: {p.state} ({p.reason})" for p in self.probes]
        verdict = "OK" if self.ok else "NOT SAFE: see the lines above"
        if not self.ok and not self.enabled:
            verdict = f"NOT SAFE: the package is switched off ({switched_off_by()}) on a release that needs its fixes"
        return "\n".join([*lines, f"  verdict: {verdict}"])
