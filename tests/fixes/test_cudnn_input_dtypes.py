"""``cudnn_input_dtypes`` (fixes/cudnn_input_dtypes.py): the raw cuDNN op checks no dtype, so fp32 or mixed-dtype
q/k/v reach the kernel and give garbage. The package refuses them naming the three dtypes, and casts them as
``F.scaled_dot_product_attention`` does under ``torch.autocast``.

* The check: broken on every release with the op (0.39.0 and 0.42.1 here); the replacement passes it.
* The policy: fp32, unsupported and mixed q/k/v raise ``UnsafeAttentionError``; under autocast they are cast.
* The control: the fix skipped (``DIFFUSERS_CUDNN_FIX_SKIP``), fp32 q/k/v come out wrong, silently.

In process on diffusers 0.39.0 (conftest). The contract: docs/behaviour.md, "q / k / v".
"""

from __future__ import annotations

import re

import pytest
import subprocess_op_pair_grads
from harness import op_pair, pair_config
from releases import WITH_OPS, fix_states

import diffusers_cudnn_fix
from diffusers_cudnn_fix import FixNotAppliedWarning, UnsafeAttentionError

FIX = "cudnn_input_dtypes"
#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them).
CARRIES = WITH_OPS
CORRECTION = False  # a guard: the package refuses or converts the input (True: a correction)


def _forward(module, *, dtypes=("bfloat16", "bfloat16", "bfloat16")):
    """diffusers' cuDNN CP forward op on (2, 16, 16, 32) q/k/v of ``dtypes``, driven as in subprocess_op_pair_grads."""
    import torch

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, 16, 32, generator=gen).to(getattr(torch, dt)) for dt in dtypes)
    pair = op_pair(
        module._cudnn_attention_forward_op, module._cudnn_attention_backward_op, parallel_config=pair_config()
    )
    return pair.apply(q, k, v, None)


@pytest.mark.slow
def test_the_check_finds_the_bug_and_passes_the_replacement() -> None:
    """Every release with the op carries it: broken as shipped, and the package's replacement passes the same
    check (``guarded``)."""
    for version in ("0.39.0", "0.42.1"):
        assert fix_states(version)[FIX] == ["broken", True, "guarded"], version


def test_fp32_inputs_raise_instead_of_garbage(patched) -> None:
    result = subprocess_op_pair_grads.run_case(
        patched, "cudnn", subprocess_op_pair_grads.CASES[0], False, dtype="float32"
    )
    assert result["status"] == "raised"
    assert "UnsafeAttentionError" in result["error"] and "bfloat16" in result["error"]


@pytest.mark.parametrize(
    "dtypes",
    [
        ("bfloat16", "float16", "bfloat16"),
        ("float16", "bfloat16", "bfloat16"),
        ("bfloat16", "bfloat16", "float32"),
        ("float32", "float32", "float32"),
        ("float64", "float64", "float64"),
    ],
    ids="-".join,
)
def test_unsupported_or_mixed_qkv_dtypes_raise_naming_the_three(patched, dtypes) -> None:
    with pytest.raises(UnsafeAttentionError) as err:
        _forward(patched, dtypes=dtypes)
    message = str(err.value)
    for dtype in set(dtypes):
        # "float16" inside "bfloat16" does not count.
        assert re.search(rf"(?<![a-z]){dtype}", message), (dtype, message)


def test_without_the_guard_fp32_inputs_give_garbage(dispatch_module, monkeypatch) -> None:
    """The control: every other fix applied, this one skipped: the same fp32 case runs and comes out wrong."""
    diffusers_cudnn_fix.revert()
    monkeypatch.setenv("DIFFUSERS_CUDNN_FIX_SKIP", FIX)
    with pytest.warns(FixNotAppliedWarning, match=FIX):
        diffusers_cudnn_fix.apply()
    try:
        result = subprocess_op_pair_grads.run_case(
            dispatch_module, "cudnn", subprocess_op_pair_grads.CASES[0], False, dtype="float32"
        )
    finally:
        diffusers_cudnn_fix.revert()
    assert result["status"] == "wrong", result


# --- torch.autocast: q/k/v cast as F.scaled_dot_product_attention's autocast rule casts them ------------------


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_autocast_casts_q_k_v_as_sdpa_does(patched, compiled: bool) -> None:
    """Under ``torch.autocast(bf16)`` with fp32 weights a model's norms hand attention fp32 q/k beside bf16 v
    (QwenImage's RMSNorm under CUDA autocast). ``F.scaled_dot_product_attention`` casts them to the autocast
    dtype; the raw cuDNN op has no autocast rule, and the dtype guard refused them. The package now casts them,
    so the result is the bf16 one (up to bf16 rounding: autocast reaches the stand-in kernel's own arithmetic
    on the CPU), with or without ``torch.compile``; without autocast they are still refused."""
    import subprocess_compile_matrix
    import torch

    one = subprocess_compile_matrix.attention_fn(patched, "pair", None)
    fn = torch.compile(one, backend="aot_eager", fullgraph=True) if compiled else one
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 32, 4, 32, generator=gen) for _ in range(4))
    keep = torch.ones(2, 1, 1, 32, dtype=torch.bool)
    keep[1, ..., -8:] = False

    def run(inputs: list, autocast: bool) -> list:
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn(*leaves, keep)
        out.backward(grad.to(out.dtype))
        return [out.detach(), *(x.grad for x in leaves)]

    want = run([x.to(torch.bfloat16) for x in (q, k, v)], autocast=False)
    got = run([q, k, v.to(torch.bfloat16)], autocast=True)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32  # autograd casts q's grad back
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2, msg=name)
    # Compiled with fullgraph=True, a refusal reaches the caller as dynamo's error carrying the package's message.
    with pytest.raises((UnsafeAttentionError, torch._dynamo.exc.Unsupported), match=r"q/k/v of dtypes torch\.float32"):
        run([q, k, v.to(torch.bfloat16)], autocast=False)
