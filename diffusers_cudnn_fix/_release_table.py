"""Does a release-table specifier list a diffusers version?

The table's specifiers are PEP 440 (``>=0.36.0,<0.40.0``, ``>=0.36.0``). The hook has a 10 ms budget and
importing ``packaging.specifiers`` alone costs about 7 ms (it compiles a large regex), so the forms the table
uses, clauses ``>=A`` and ``<B``, are evaluated with ``packaging.version`` (which diffusers has already
imported); any other form goes to ``SpecifierSet``. ``tests/test_release_table.py`` holds the two side by side.

A pre-release or dev build (``0.40.0.dev0``) gets no answer: the table lists releases, and such a build can
carry either code, which is exactly what the behavioural check is for.
"""

from __future__ import annotations


def lists(specifier: str, version: str) -> bool | None:
    """Whether ``specifier`` admits ``version``; None for a pre-release or a string that is not PEP 440."""
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return None
    if v.is_prerelease:
        return None
    bounds = [_simple_clause(part.strip()) for part in specifier.split(",")]
    if bounds and all(b is not None for b in bounds):
        return all((v >= bound) if op == ">=" else (v < bound) for op, bound in bounds)  # type: ignore[misc]
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(specifier).contains(v)


def _simple_clause(clause: str) -> tuple[str, object] | None:
    """``('>=', Version)`` or ``('<', Version)`` for a final-release bound, else None (take the slow path)."""
    from packaging.version import InvalidVersion, Version

    for op in (">=", "<"):
        rest = clause[len(op) :]
        if clause.startswith(op) and rest[:1] not in ("=", "<", ">", "~", "!"):
            try:
                bound = Version(rest.strip())
            except InvalidVersion:
                return None
            if bound.is_prerelease or bound.is_postrelease or bound.local or "*" in rest:
                return None
            return op, bound
    return None
