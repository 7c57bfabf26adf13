"""The record every fix module declares, what its behavioural check returns, and how its release table is read."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal

#: What a check can say about the installed code.
#: ``broken``: the bug is there; ``ok``: the installed code does the right thing; ``absent``: the functions
#: do not exist (release without the feature); ``unknown``: unexpected signature or behaviour, left alone.
State = Literal["broken", "ok", "absent", "unknown"]

#: Looks up an attribute of diffusers' attention module (or a candidate replacing it); None if missing.
Lookup = Callable[[str], Any]


class Record:
    """A small immutable record with ``__slots__``.

    Used instead of NamedTuple/dataclass for what the hook builds: those generate code with ``exec`` at
    class creation (about 0.3 ms each), and the hook has a 10 ms budget.
    """

    __slots__: ClassVar[tuple[str, ...]] = ()
    _defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not kwargs and len(args) == len(self.__slots__):  # every field given in order: the hook's case
            for name, value in zip(self.__slots__, args):
                object.__setattr__(self, name, value)
            return
        if len(args) > len(self.__slots__):
            raise TypeError(f"{type(self).__name__} takes {len(self.__slots__)} fields")
        values = dict(zip(self.__slots__, args))
        for name, value in kwargs.items():
            if name not in self.__slots__ or name in values:
                raise TypeError(f"{type(self).__name__}: unexpected or repeated field {name!r}")
            values[name] = value
        for name in self.__slots__:
            if name not in values:
                if name not in self._defaults:
                    raise TypeError(f"{type(self).__name__}: missing field {name!r}")
                values[name] = self._defaults[name]
            object.__setattr__(self, name, values[name])

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._fields() == self._fields()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, *self._fields()))

    def __repr__(self) -> str:
        body = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__name__}({body})"


class Finding(Record):
    """What a check says: a state and one sentence of evidence."""

    __slots__ = ("state", "detail")
    state: State
    detail: str


class Fix(Record):
    """One upstream bug and how this package handles it.

    Attributes:
        id: short stable name, used by ``DIFFUSERS_CUDNN_FIX_SKIP`` and in ``status()``.
        title: one line saying what goes wrong.
        upstream: where upstream tracks or fixed it.
        affected: PEP 440 specifier of the releases known to carry the bug (the release table); it sets
            expectations only, ``check`` decides. Pre-releases (dev builds) never match: their code can be
            either, which is what the check is for.
        targets: attributes of ``diffusers.models.attention_dispatch`` that ``build`` replaces.
        check: runs the installed code (through the lookup) and says whether the bug is there.
        build: returns the replacement objects for ``targets``, given the current ones through the lookup.
            Reverting puts the objects that were there before back, so no fix needs its own undo.
        kind: ``"correction"`` (makes wrong gradients right) or ``"guard"`` (stops, warns or converts where
            diffusers would compute wrong results and no correction is offered).
        note: optional; returns a few words on the fix's live settings for the report (a mode, say).
    """

    __slots__ = ("id", "title", "upstream", "affected", "targets", "check", "build", "kind", "note")
    _defaults = {"kind": "correction", "note": None}
    id: str
    title: str
    upstream: str
    affected: str
    targets: tuple[str, ...]
    check: Callable[[Lookup], Finding]
    build: Callable[[Lookup], Mapping[str, Any]]
    kind: Literal["correction", "guard"]
    note: Callable[[], str] | None


@functools.lru_cache(maxsize=256)
def release_table_lists(specifier: str, version: str) -> bool | None:
    """Whether the release-table ``specifier`` (:attr:`Fix.affected`) admits ``version``.

    None for a pre-release or dev build (``0.40.0.dev0``): the table lists releases, and such a build can
    carry either code, which is exactly what the behavioural check is for; None too for a string that is
    not PEP 440.

    The table's specifiers are PEP 440 (``>=0.36.0,<0.40.0``, ``>=0.36.0``), read here without packaging
    where that is exact: a final release (``0.42.1``) against clauses ``>=A`` / ``<B`` with final bounds is
    a comparison of integer tuples, zero-padded as PEP 440 compares release segments; other versions
    (``0.39.0.post1``, ``0.40.0+local``) are parsed by ``packaging.version`` and their release segment
    compared the same way; other forms of specifier (and epochs) go to ``SpecifierSet`` (importing ``packaging.specifiers`` costs about 7 ms, as much as the rest of
    the hook). ``tests/test_release_table.py`` holds these paths against ``SpecifierSet``. Answers are
    cached (a pure function of two strings, asked for every fix by each apply and status report).
    """
    plain = [_plain_clause(part.strip()) for part in specifier.split(",")]
    release = _final_release(version)
    if release is not None and all(plain):
        return all(_compare(release, *clause) for clause in plain)  # type: ignore[misc]
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return None
    if v.is_prerelease:
        return None
    if v.epoch == 0 and all(plain):
        # Post-releases and local versions: against final bounds, >= and < read the release segment alone.
        return all(_compare(v.release, *clause) for clause in plain)  # type: ignore[misc]
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(specifier).contains(v)


def _final_release(text: str) -> tuple[int, ...] | None:
    """``(0, 42, 1)`` for a plain final release ``0.42.1``; None for anything else (pre, post, dev, local)."""
    parts = text.strip().split(".")
    if not all(part.isdigit() and part.isascii() for part in parts):
        return None
    return tuple(int(part) for part in parts)


def _plain_clause(clause: str) -> tuple[str, tuple[int, ...]] | None:
    """``('>=', (0, 36, 0))`` / ``('<', (0, 40, 0))`` for a clause with a final-release bound, else None."""
    for op in (">=", "<"):
        if clause.startswith(op) and clause[len(op) : len(op) + 1] not in ("=", "<", ">", "~", "!"):
            bound = _final_release(clause[len(op) :])
            return None if bound is None else (op, bound)
    return None


def _compare(release: tuple[int, ...], op: str, bound: tuple[int, ...]) -> bool:
    width = max(len(release), len(bound))  # PEP 440: 0.40 == 0.40.0
    left, right = release + (0,) * (width - len(release)), bound + (0,) * (width - len(bound))
    return left >= right if op == ">=" else left < right
