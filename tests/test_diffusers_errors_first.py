"""Where diffusers raises its own error for an input, that error surfaces, not one of the package's guards
(issue #29, "Never silent", item 4): users' and frameworks' own tests of diffusers' errors keep passing.

Every guard that raises was audited for inputs diffusers itself rejects first (docs/behaviour.md, "diffusers'
own errors first"). The ones that ran first: the cuDNN forward op's dtype and mask guards, and the Ulysses
forward's mask guards, against the ops' own ``enable_gqa`` ``ValueError``. The package now reads off diffusers'
op, by running it, whether it refuses ``enable_gqa`` itself, and hands such a call to it untouched. The ring,
QwenImage and key-padding refusals come after diffusers' own checks by construction (tested elsewhere).

In process: diffusers 0.39.0 (conftest) with the fixes applied; the Ulysses class at degree 1 with stand-in
collectives. Fix ids: ``cudnn_input_dtypes``, ``cudnn_bool_mask``, ``ulysses_mask_grad`` (the flash forward's,
``flash_input_alignment``: tests/fixes/test_flash_input_alignment.py).
"""

from __future__ import annotations

import types
import warnings

import pytest
from harness import op_pair, pair_config, stand_in_collectives, ulysses_attention, ulysses_config

import diffusers_cudnn_fix

CUDNN_GQA = "`enable_gqa` is not yet supported for cuDNN attention."


@pytest.fixture()
def mask_mode():
    yield diffusers_cudnn_fix.set_mask_mode
    diffusers_cudnn_fix.set_mask_mode("convert")


def _inputs(case: str):
    """(q, k, v, mask) of ``case``: each an input one of the cuDNN op's guards refuses."""
    import torch

    gen = torch.Generator().manual_seed(0)
    dtypes = {"fp32 q/k/v": (torch.float32,) * 3, "mixed q/k/v": (torch.bfloat16, torch.float16, torch.float16)}
    q, k, v = (torch.randn(1, 8, 2, 16, generator=gen).to(d) for d in dtypes.get(case, (torch.bfloat16,) * 3))
    mask = None
    if case == "integer mask":
        mask = torch.ones(1, 1, 8, 8, dtype=torch.int64)
    elif case == "mask requiring grad":
        mask = torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16, requires_grad=True)
    elif case == "bool mask, error mode":
        mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    return q, k, v, mask


CASES = ("fp32 q/k/v", "mixed q/k/v", "integer mask", "mask requiring grad", "bool mask, error mode")


@pytest.mark.parametrize("case", CASES)
def test_the_cudnn_ops_own_enable_gqa_error_comes_before_the_guards(patched, mask_mode, case: str) -> None:
    """Before: the guards' UnsafeAttentionError (a RuntimeError) for each of these inputs; diffusers' op refuses
    enable_gqa=True first, whatever the inputs."""
    mask_mode("error" if "error mode" in case else "convert")
    q, k, v, mask = _inputs(case)
    pair = op_pair(patched._cudnn_attention_forward_op, patched._cudnn_attention_backward_op, enable_gqa=True,
                   parallel_config=pair_config())  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no notice of a conversion either: the call is diffusers' to refuse
        with pytest.raises(ValueError, match=CUDNN_GQA):
            pair.apply(q, k, v, mask)


def test_the_guards_still_refuse_those_inputs_without_enable_gqa(patched, mask_mode) -> None:
    """The control: the same inputs without enable_gqa are refused by the package as before."""
    for case in CASES:
        mask_mode("error" if "error mode" in case else "convert")
        q, k, v, mask = _inputs(case)
        pair = op_pair(patched._cudnn_attention_forward_op, patched._cudnn_attention_backward_op,
                       parallel_config=pair_config())  # fmt: skip
        with pytest.raises(diffusers_cudnn_fix.UnsafeAttentionError):
            pair.apply(q, k, v, mask)


@pytest.mark.parametrize("case", ["integer mask", "mask requiring grad", "bool mask, error mode"])
def test_ulysses_leaves_an_enable_gqa_call_to_diffusers_own_error(
    patched: types.ModuleType, monkeypatch, mask_mode, case: str
) -> None:
    """Before: the Ulysses forward's mask guards (``ulysses_mask_grad``, the mask policy) raised first."""
    mask_mode("error" if "error mode" in case else "convert")
    q, k, v, mask = _inputs(case)
    config = ulysses_config(stand_in_collectives(patched, monkeypatch), convert_to_fp32=False)
    with pytest.raises(ValueError, match=CUDNN_GQA):
        ulysses_attention(patched, q, k, v, mask, config=config, enable_gqa=True)
