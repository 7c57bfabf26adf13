"""The release table's reader: which releases each fix's table entry lists, and what it will not judge."""

from __future__ import annotations

import pytest
from expected_fixes import CARRIES
from releases import RELEASES

from diffusers_cudnn_fix._fix import release_table_lists as lists
from diffusers_cudnn_fix.fixes import ALL_FIXES


@pytest.mark.parametrize("fix", ALL_FIXES, ids=lambda f: f.id)
def test_each_entry_lists_exactly_the_releases_that_carry_the_bug(fix) -> None:
    assert {v for v in RELEASES if lists(fix.affected, v)} == CARRIES[fix.id]


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.39.0.post1", True),  # a post-release of an affected release
        ("0.39.0+local", True),  # a local build of one
        ("0.39", True),
        ("0.40.0.post1", False),
        ("0.40", False),
        ("1!0.39.0", False),  # another epoch sorts after every 0.x
        ("0.36.0.dev0", None),  # pre-releases and dev builds carry either code: the check decides
        ("0.40.0.dev0", None),
        ("0.40.0rc1", None),
        ("not a version", None),
    ],
)
def test_other_versions(version: str, expected: bool | None) -> None:
    assert lists(">=0.36.0,<0.40.0", version) is expected
