"""The one test-side table of fix ids: which releases carry each bug, written out by hand from
docs/kernel-facts.md and upstream's release notes (the package's own table, ``fixes/__init__.py``, is checked
against it, never read to build it). A new fix adds one line here (docs/adding-a-fix.md)."""

from __future__ import annotations

from releases import RELEASES

_WITH_OPS = frozenset(RELEASES) - {"0.35.2"}

#: fix id -> the releases that carry the bug (and so get the fix applied).
CARRIES: dict[str, frozenset[str]] = {
    # Gradient corrections (the package's reason to exist).
    "cudnn_forward_lse": frozenset({"0.36.0", "0.37.0", "0.37.1", "0.38.0", "0.39.0"}),
    "cudnn_backward_kv": frozenset({"0.36.0", "0.37.0", "0.37.1", "0.38.0", "0.39.0"}),
    "flash_backward_kv": frozenset({"0.37.0", "0.37.1", "0.38.0", "0.39.0"}),
    "ulysses_grad_count": frozenset({"0.36.0"}),
    # 0.36.0-0.39.0: every ring step reuses the first step's tensors; 0.40.0 on: the K/V gradients go the wrong
    # way round the ring from degree 3.
    "ring_grad_route": _WITH_OPS,
    "qwen_joint_mask_order": frozenset({"0.36.0", "0.37.0", "0.37.1", "0.38.0"}),
    # Guards.
    "cudnn_bool_mask": _WITH_OPS,
    "cudnn_input_dtypes": _WITH_OPS,
    "cudnn_masked_row_grads": _WITH_OPS,
    "ulysses_mask_grad": _WITH_OPS,
    "flash_input_alignment": _WITH_OPS - {"0.36.0"},
    # 0.36.0's _native_flash backend takes _parallel_config and never reads it (0.37.0 routes it through the
    # templated context-parallel path; 0.35.2 has no context parallelism).
    "flash_cp_ignored": frozenset({"0.36.0"}),
    # diffusers' Ulysses class (0.36.0 on, the same code in its forward's head handling and its backward): a per-head
    # mask reaches the op with every head; dK / dV are reshaped with the queries' length (issue #42's LTX findings).
    "ulysses_head_mask": _WITH_OPS,
    "ulysses_kv_length": _WITH_OPS,
    # diffusers' all-gather backward keeps this rank's chunk of a gradient it assumes equal on every rank (every
    # release with context parallelism); a plan that gathers inside the model (Helios) trains wrong with it.
    "cp_gather_grads": _WITH_OPS,
    # LTX2 (0.37.0 on): its plan splits rope but not cross_attn_rope and leaves the audio stream unsharded.
    "ltx2_cp_plan": _WITH_OPS - {"0.36.0"},
    # diffusers' split hook calls logger.warning_once (every release with context parallelism), which its logger has
    # only once transformers is imported (not installed in the test environment).
    "cp_split_warning_once": _WITH_OPS,
}
CORRECTIONS = ("cudnn_forward_lse", "cudnn_backward_kv", "flash_backward_kv", "ulysses_grad_count")
CORRECTIONS += ("ring_grad_route", "qwen_joint_mask_order", "ulysses_head_mask", "ulysses_kv_length")
CORRECTIONS += ("ltx2_cp_plan", "cp_split_warning_once")
GUARDS = tuple(i for i in CARRIES if i not in CORRECTIONS)
FIX_IDS = tuple(CARRIES)


def applied(version: str) -> list[str]:
    """The fixes the package applies on ``version``, sorted."""
    return sorted(i for i, releases in CARRIES.items() if version in releases)


def not_on(version: str) -> tuple[str, ...]:
    """The fixes ``version`` does not carry."""
    return tuple(i for i, releases in CARRIES.items() if version not in releases)
