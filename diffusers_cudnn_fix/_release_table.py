"""Does a release-table specifier list a diffusers version?

The table's specifiers are PEP 440 (``>=0.36.0,<0.40.0``). The hook has a 10 ms budget and importing
``packaging.specifiers`` alone costs about 7 ms (it compiles a large regex), so the one form the table uses,
``>=A,<B``, is evaluated with ``packaging.version`` (which diffusers has already imported) under the same
rules as ``SpecifierSet.contains``: pre-releases never match. Any other form goes to ``SpecifierSet``.
"""

from __future__ import annotations


def lists(specifier: str, version: str) -> bool | None:
    """Whether ``specifier`` admits ``version``; None when the version string is not PEP 440."""
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return None
    parts = [p.strip() for p in specifier.split(",")]
    if len(parts) == 2 and parts[0].startswith(">=") and parts[1].startswith("<") and not parts[1].startswith("<="):
        try:
            low, high = Version(parts[0][2:]), Version(parts[1][1:])
        except InvalidVersion:
            pass
        else:
            if not low.is_prerelease and not high.is_prerelease:
                return not v.is_prerelease and low <= v < high
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(specifier).contains(v)
