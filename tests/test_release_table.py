"""The hook's fast reading of the release table agrees with packaging's SpecifierSet."""

from __future__ import annotations

import sys

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from diffusers_cudnn_fix._fix import release_table_lists as lists

VERSIONS = [
    "0.35.2", "0.36.0", "0.36.0.dev0", "0.37.1", "0.39.0", "0.39.0.post1", "0.39.1", "0.40.0.dev0", "0.40.0rc1",
    "0.40.0", "0.40.0+local", "0.42.1", "1.0.0", "0.36.0a1", "0.40", "0.39.0.0", "0.40.0.1", "1", "v0.39.0",
    "1!0.39.0", "0.40.0.post1", "0.39.0.post1+local",
]
# The table's own forms (integer path for final releases), their relatives, and forms only SpecifierSet reads.
SPECIFIERS = [
    ">=0.36.0,<0.40.0", ">=0.37.0,<0.40.0", ">=0.36.0", "<0.40.0", ">=0.36,<0.40", ">= 0.36.0, < 0.40.0",
    ">=0.36.0,<0.40.0.post1", ">=0.36.0,<=0.39.0", "~=0.39.0", "==0.39.*", "<0.40.0.dev0",
]


@pytest.mark.parametrize("spec", SPECIFIERS)
@pytest.mark.parametrize("version", VERSIONS)
def test_fast_path_matches_specifier_set(spec: str, version: str) -> None:
    if Version(version).is_prerelease:
        assert lists(spec, version) is None  # the table covers releases only
    else:
        assert lists(spec, version) == SpecifierSet(spec).contains(Version(version))


def test_not_a_version() -> None:
    assert lists(">=0.36.0", "not a version") is None


def test_final_releases_take_the_integer_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Unloaded for this test only (monkeypatch puts the module objects back): a final release must not
    # need packaging at all.
    for name in ("packaging.version", "packaging.specifiers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    lists.cache_clear()
    for version in ("0.35.2", "0.39.0", "0.40", "0.42.1"):
        lists(">=0.36.0,<0.40.0", version)
        lists(">=0.36.0", version)
    assert "packaging.version" not in sys.modules and "packaging.specifiers" not in sys.modules
    lists.cache_clear()


def test_the_tables_in_use_take_the_fast_path() -> None:
    from diffusers_cudnn_fix.fixes import ALL_FIXES

    sys.modules.pop("packaging.specifiers", None)
    for fix in ALL_FIXES:
        lists(fix.affected, "0.39.0")
    assert "packaging.specifiers" not in sys.modules
