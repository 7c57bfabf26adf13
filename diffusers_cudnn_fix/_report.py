"""What ``status()`` returns: plain immutable data, printable, and ``to_dict()`` for ``--json``."""

from __future__ import annotations

from typing import Any, NamedTuple

from . import _config

MODULE_NAME = _config.MODULE_NAME


class FixStatus(NamedTuple):
    """One fix's state.

    Attributes:
        expected: whether the release table lists the installed diffusers version as affected (None when
            the version is unknown).
        detected: what the behavioural check found on the shipped code: broken / ok / absent / unknown /
            disabled (package switched off) / pending (module not imported yet). A fix named in
            ``DIFFUSERS_CUDNN_FIX_SKIP`` is still checked; its reason says it was skipped.
        applied: whether our replacement is installed right now (read off the live module).
        reason: one sentence on why.
    """

    id: str
    title: str
    upstream: str
    affected: str
    expected: bool | None
    detected: str
    applied: bool
    reason: str

    @property
    def needs_attention(self) -> bool:
        """The bug is (or may be) there and is not fixed."""
        return self.detected in ("broken", "unknown") and not self.applied


class Report(NamedTuple):
    """What ``status()`` returns."""

    enabled: bool
    diffusers_version: str | None
    torch_version: str | None
    module_loaded: bool
    fixes: tuple[FixStatus, ...]
    stale_references: tuple[str, ...] = ()
    probes: tuple[Any, ...] = ()  # probe.ProbeResult per CUDA device probed in this process

    @property
    def ok(self) -> bool:
        """Every bug the checks found is fixed and no GPU probe failed (vacuously true before import)."""
        return not any(f.needs_attention for f in self.fixes) and not any(p.state == "failed" for p in self.probes)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json`` and logs."""
        data = self._asdict()
        data["fixes"] = [f._asdict() | {"needs_attention": f.needs_attention} for f in self.fixes]
        data["stale_references"] = list(self.stale_references)
        data["probes"] = [p.as_dict() for p in self.probes]
        data["ok"] = self.ok
        return data

    def __str__(self) -> str:
        lines = [
            f"diffusers_cudnn_fix: {'enabled' if self.enabled else 'DISABLED by ' + _config.ENABLE_VAR}",
            f"  diffusers {self.diffusers_version or '(not installed)'}, torch {self.torch_version or '(not loaded)'}",
        ]
        if not self.module_loaded:
            lines.append(f"  {MODULE_NAME} not imported yet: fixes apply when it is")
        for f in self.fixes:
            expected = {True: "affected", False: "not affected", None: "unknown"}[f.expected]
            lines.append(
                f"  {f.id:<20} table: {expected:<12} check: {f.detected:<8} "
                f"applied: {'yes' if f.applied else 'no':<3}  {f.reason}"
            )
        for ref in self.stale_references:
            lines.append(f"  still holds a shipped function: {ref}")
        for p in self.probes:
            lines.append(f"  GPU probe {p.device}: {p.state} ({p.reason})")
        lines.append(f"  verdict: {'OK' if self.ok else 'NOT SAFE: see the lines above'}")
        return "\n".join(lines)
