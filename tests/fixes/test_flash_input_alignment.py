"""``flash_input_alignment`` (fixes/flash_input_alignment.py): the native-flash CP forward hands the flash kernel
q/k/v off 16 bytes ("misaligned address" on a GPU, which ends the CUDA context). The package hands it dense copies.

* The check: broken on every release with the flash CP op (0.39.0 and 0.42.1 here; 0.36.0 has none), and the
  replacement passes it.
* The policy and the control: a view off 16 bytes, as shipped (misaligned) and guarded (the dense result).
* diffusers' own ``enable_gqa`` error still comes first.

In process on diffusers 0.39.0 (conftest).
"""

from __future__ import annotations

import types

import pytest
from releases import WITH_OPS, fix_states

import diffusers_cudnn_fix

FIX = "flash_input_alignment"
#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them).
CARRIES = WITH_OPS - {"0.36.0"}
CORRECTION = False  # a guard: the package refuses or converts the input (True: a correction)
FLASH_GQA = "`enable_gqa` is not yet supported for native flash attention."


@pytest.mark.slow
def test_the_check_finds_the_bug_and_passes_the_replacement() -> None:
    """Every release with the flash CP op carries it: broken as shipped, and the package's replacement passes the
    same check (``guarded``)."""
    for version in ("0.39.0", "0.42.1"):
        assert fix_states(version)[FIX] == ["broken", True, "guarded"], version
    assert fix_states("0.36.0")[FIX][0] == "absent"


def test_flash_inputs_off_16_bytes_are_copied_before_the_kernel(dispatch_module) -> None:
    """With one head the flash op's ``transpose(1, 2).contiguous()`` copies nothing, so a view one element
    into its buffer reached the flash kernel as it is: "misaligned address" on a GPU, which ends the CUDA
    context (the stand-in raises the same). The guard hands the op dense copies; the result is unchanged."""
    import torch

    shape = (2, 5, 1, 16)  # (B, S, H, D)
    gen = torch.Generator().manual_seed(0)
    buffers = [torch.randn(2 * 5 * 16 + 1, generator=gen).to(torch.bfloat16) for _ in range(3)]
    offset = [b[1:].view(shape) for b in buffers]  # off 16 bytes
    dense = [x.clone() for x in offset]

    def forward(q, k, v):
        ctx = types.SimpleNamespace(save_for_backward=lambda *t: None)
        return dispatch_module._native_flash_attention_forward_op(ctx, q, k, v, None, 0.0, False, None, False, False)

    diffusers_cudnn_fix.revert()
    with pytest.raises(RuntimeError, match="misaligned address"):
        forward(*offset)
    expected = forward(*dense)
    diffusers_cudnn_fix.apply()
    try:
        assert torch.equal(forward(*offset), expected)
    finally:
        diffusers_cudnn_fix.revert()


def test_the_flash_op_leaves_enable_gqa_to_diffusers(patched: types.ModuleType) -> None:
    """The flash forward's replacement also hands an enable_gqa call to diffusers' op untouched."""
    import torch

    assert diffusers_cudnn_fix.is_patched("_native_flash_attention_forward_op")
    q, k, v = (torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    ctx = types.SimpleNamespace(save_for_backward=lambda *t: None)
    with pytest.raises(ValueError, match=FLASH_GQA):
        patched._native_flash_attention_forward_op(ctx, q, k, v, None, 0.0, False, None, True, False)
