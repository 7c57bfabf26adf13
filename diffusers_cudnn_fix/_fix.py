"""The record every fix module declares, what its behavioural check returns, and the release table's reader."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: What a check can say about the installed code.
#: ``broken``: the bug is there; ``ok``: the installed code does the right thing; ``absent``: the functions
#: do not exist (release without the feature); ``unknown``: unexpected signature or behaviour, left alone.
State = Literal["broken", "ok", "absent", "unknown"]

#: Looks up an attribute of diffusers' attention module (or a candidate replacing it); None if missing.
Lookup = Callable[[str], Any]


@dataclass(frozen=True)
class Finding:
    """What a check says: a state and one sentence of evidence."""

    state: State
    detail: str


@dataclass(frozen=True)
class Fix:
    """One upstream bug and how this package handles it.

    Attributes:
        id: short stable name, used by ``DIFFUSERS_CUDNN_FIX_SKIP`` and in ``status()``.
        title: one line saying what goes wrong.
        upstream: where upstream tracks or fixed it.
        affected: PEP 440 specifier of the releases known to carry the bug (the release table); it sets
            expectations only, ``check`` decides.
        targets: attributes of ``diffusers.models.attention_dispatch`` that ``build`` replaces.
        check: runs the installed code (through the lookup) and says whether the bug is there.
        build: returns the replacement objects for ``targets``, given the current ones through the lookup.
            Reverting puts the objects that were there before back, so no fix needs its own undo.
        kind: ``"correction"`` (makes wrong gradients right) or ``"guard"`` (stops, warns or converts where
            diffusers would compute wrong results and no correction is offered).
        note: optional; a few words on the fix's live settings for the report (a mode, say).
        only_for: for a correction that matters only to some context-parallel runs, those runs in a few
            words (``"ring_degree >= 3"``): where it is the only correction needed, the doctor and the log
            still say the package can be removed, for every other run.
        old_ids: ids this fix had in earlier versions, still accepted by ``DIFFUSERS_CUDNN_FIX_SKIP``.
    """

    id: str
    title: str
    upstream: str
    affected: str
    targets: tuple[str, ...]
    check: Callable[[Lookup], Finding]
    build: Callable[[Lookup], Mapping[str, Any]]
    kind: Literal["correction", "guard"] = "correction"
    note: Callable[[], str] | None = None
    only_for: str = ""
    old_ids: tuple[str, ...] = ()


def release_table_lists(specifier: str, version: str) -> bool | None:
    """Whether the release-table ``specifier`` (:attr:`Fix.affected`) admits ``version``.

    None for a pre-release or dev build (``0.40.0.dev0``): the table lists releases, and such a build can
    carry either code, which is exactly what the behavioural check is for; None too for a string that is
    not PEP 440.
    """
    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    if parsed.is_prerelease:
        return None
    return SpecifierSet(specifier).contains(parsed)
