"""``ulysses_mask_grad`` (fixes/ulysses_mask_grad.py): diffusers' Ulysses context parallelism gives a mask that
requires grad no gradient, silently (0.39+ all-gathers the mask into a fresh tensor, so the op-level guard cannot
see that it requires grad). The package's Ulysses forward refuses such a mask, naming the way out (detach it).

* The check: broken on every release with Ulysses (0.39.0 and 0.42.1 here); the replacement passes it.
* The policy and the control: below, the guard left out (the mask's gradient silently None) and in (refused).

In process on diffusers 0.39.0 (conftest). diffusers' ``ulysses_anything`` class needs no guard (its backward
raises on every release): tests/fixes/test_cudnn_bool_mask.py shows it. diffusers' own ``enable_gqa`` error first:
tests/test_diffusers_errors_first.py.
"""

from __future__ import annotations

import pytest
from harness import stand_in_collectives, ulysses_attention, ulysses_config
from releases import WITH_OPS, fix_states

import diffusers_cudnn_fix
from diffusers_cudnn_fix import FixNotAppliedWarning, UnsafeAttentionError

FIX = "ulysses_mask_grad"
#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them).
CARRIES = WITH_OPS
CORRECTION = False  # a guard: the package refuses or converts the input (True: a correction)


@pytest.mark.slow
def test_the_check_finds_the_bug_and_passes_the_replacement() -> None:
    """Every release with Ulysses carries it: broken as shipped, and the package's replacement passes the same
    check (``guarded``)."""
    for version in ("0.39.0", "0.42.1"):
        assert fix_states(version)[FIX] == ["broken", True, "guarded"], version


def _ulysses(module, monkeypatch, mask, *, grad: bool = True):
    """diffusers' own ``TemplatedUlyssesAttention`` at Ulysses degree 1 (collectives stood in), cuDNN ops."""
    import torch

    config = ulysses_config(stand_in_collectives(module, monkeypatch), convert_to_fp32=False)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=gen).to(torch.bfloat16).requires_grad_(True) for _ in range(3))
    with torch.set_grad_enabled(grad):
        out = ulysses_attention(module, q, k, v, mask, config=config)
        if grad:
            out.float().sum().backward()
    return out


def test_a_mask_needing_grad_is_refused_by_ulysses_attention(dispatch_module, monkeypatch) -> None:
    """0.39+'s Ulysses forward all-gathers the mask into a fresh tensor, so the op-level guard cannot see that
    it requires grad; its backward gives it none. As shipped the mask's gradient silently stays None; with
    the package the forward refuses it (under no_grad too: inside the forward the two cannot be told apart),
    and the detached mask runs as shipped."""
    import torch

    def mask():
        return torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16).requires_grad_(True)

    # Every other fix in (the shipped 0.39.0 backward needs them), this guard left out.
    diffusers_cudnn_fix.revert()
    monkeypatch.setenv("DIFFUSERS_CUDNN_FIX_SKIP", "ulysses_mask_grad")
    with pytest.warns(FixNotAppliedWarning, match="ulysses_mask_grad"):
        diffusers_cudnn_fix.apply()
    try:
        shipped_mask = mask()
        _ulysses(dispatch_module, monkeypatch, shipped_mask)
        assert shipped_mask.grad is None  # the bug: no gradient, no error
        shipped_eval = _ulysses(dispatch_module, monkeypatch, mask(), grad=False)
    finally:
        diffusers_cudnn_fix.revert()

    monkeypatch.delenv("DIFFUSERS_CUDNN_FIX_SKIP")
    diffusers_cudnn_fix.apply()
    try:
        with pytest.raises(UnsafeAttentionError, match=r"requires grad.*no gradient.*detach"):
            _ulysses(dispatch_module, monkeypatch, mask())
        with pytest.raises(UnsafeAttentionError, match=r"detach"):
            _ulysses(dispatch_module, monkeypatch, mask(), grad=False)
        assert torch.equal(_ulysses(dispatch_module, monkeypatch, mask().detach(), grad=False), shipped_eval)
        _ulysses(dispatch_module, monkeypatch, mask().detach())
    finally:
        diffusers_cudnn_fix.revert()
