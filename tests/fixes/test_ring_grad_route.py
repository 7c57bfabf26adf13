"""``ring_grad_route`` (fixes/ring_grad_route.py): ring / unified context parallelism's backward gives wrong K/V
gradients: on 0.36-0.39 every ring step reuses the first step's tensors; from 0.40.0 the gradients go the wrong
way round the ring from ring degree 3. The package installs its corrected ring for diffusers' cuDNN and flash ops
and refuses what it does not correct.

* The check: tells the shipped ring from the corrected one on 0.39.0; finds the route broken on 0.40.0.
* The policy: the corrected ring is right at every ring degree, with both ops, on 0.39.0 and on 0.42.1; it
  refuses other backends, masks, dropout, causal attention, GQA, and a forward from before the correction.
* The control: diffusers' own ring with the same (corrected) ops is wrong.

In process on diffusers 0.39.0 (conftest), through ``threaded_ring`` (one thread per ring rank, so several ring
chunks run in this one process); 0.40.0 and 0.42.1 in fresh interpreters. Training steps at ring degree 2 and 4:
tests/test_cp_training.py.
"""

from __future__ import annotations

import types

import pytest
import threaded_ring
from releases import release_dir, run

import diffusers_cudnn_fix

RING_FORWARD, RING_BACKWARD = "TemplatedRingAttention.forward", "TemplatedRingAttention.backward"


def _shipped(target: str):
    return diffusers_cudnn_fix.get_original(target).__func__


# --- the check ------------------------------------------------------------------------------------------------


def test_ring_check_tells_the_shipped_ring_from_the_corrected_one(patched: types.ModuleType) -> None:
    """0.39.0: the shipped ring's steps reuse the first step's tensors; the package's own ring sees each step's
    K/V and routes each chunk's gradient to its owner. 0.40.0 and later (the route broken): the next test, in a
    fresh interpreter."""
    import diffusers_cudnn_fix
    from diffusers_cudnn_fix.fixes import ring_grad_route

    cls = patched.TemplatedRingAttention
    shipped = {t: diffusers_cudnn_fix.get_original(t).__func__ for t in (RING_FORWARD, RING_BACKWARD)}
    installed = {RING_FORWARD: cls.forward, RING_BACKWARD: cls.backward}
    globals_before = dict(shipped[RING_BACKWARD].__globals__)

    def lookup(objects: dict) -> object:
        return lambda name: cls if name == "TemplatedRingAttention" else objects.get(name)

    found = ring_grad_route.check(lookup(shipped))
    assert found.state == "broken" and "each step's K/V" in found.detail, found
    assert ring_grad_route.reuses_first_step(lookup(shipped))
    found = ring_grad_route.check(lookup(installed))
    assert found.state == "ok" and "reaches its owner" in found.detail, found
    # The corrected backward after diffusers' own forward (which keeps nothing for it) refuses to run: the check
    # cannot call that pair right, and says so.
    mixed = {**installed, RING_FORWARD: shipped[RING_FORWARD]}
    assert ring_grad_route.check(lookup(mixed)).state == "unknown"
    # The stand-in collectives reached copies only.
    assert dict(shipped[RING_BACKWARD].__globals__) == globals_before


def test_ring_steps_are_found_right_on_040() -> None:
    """0.40.0+ per-step backward: the check sees each step's K/V (the route is what it finds wrong); Ulysses never
    guarded."""
    result = run(
        release_dir("0.40.0"),
        "import json, diffusers_cudnn_fix, diffusers.models.attention_dispatch\n"
        "print(json.dumps({f.id: [f.detected, f.applied, f.reason] for f in diffusers_cudnn_fix.status().fixes}))\n",
        preloaded=True,
    )
    assert result["ring_grad_route"][:2] == ["broken", True]
    assert "each ring step's backward sees its K/V and the merged output" in result["ring_grad_route"][2]
    assert "K gradient sums the chunks" in result["ring_grad_route"][2]
    assert result["ulysses_grad_count"][:2] == ["ok", False]


# --- the policy and its control on 0.39.0 ---------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_ring_is_corrected_for_every_ring_degree(patched: types.ModuleType, backend: str, world: int) -> None:
    assert diffusers_cudnn_fix.is_patched(RING_FORWARD) and diffusers_cudnn_fix.is_patched(RING_BACKWARD)
    result = threaded_ring.run(patched, backend, world)
    assert result["status"] == "pass", result
    fp32 = threaded_ring.run(patched, backend, world, convert_to_fp32=True)
    assert fp32["status"] == "pass", fp32


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_ring_as_shipped_is_wrong_with_the_corrected_ops(patched: types.ModuleType, backend: str) -> None:
    """The control: the corrected cuDNN / flash ops under diffusers' own ring forward and backward."""
    result = threaded_ring.run(
        patched, backend, 2, ring_forward=_shipped(RING_FORWARD), ring_backward=_shipped(RING_BACKWARD)
    )
    assert result["status"] == "wrong", result


def _ring_refusal(module: types.ModuleType, backend: str = "cudnn", **kwargs) -> str:
    result = threaded_ring.run(module, backend, 2, **kwargs)
    assert result["status"] == "raised" and result["raised"] == "UnsafeAttentionError", result
    return result["error"]


def _zeros_forward_op(ctx, query, *args, **kwargs):
    """A forward op returning (out, lse) of the right shapes, for cases that must be refused before any
    backward op runs."""
    import torch

    return torch.zeros_like(query), torch.zeros(query.shape[:3])


def test_ring_refuses_other_backends(patched: types.ModuleType) -> None:
    """Another backend's backward op (here diffusers' native one; its forward op cannot return a log-sum-exp,
    so a stand-in runs the forward): the backward refuses, naming the backends that work and the way out."""
    message = _ring_refusal(patched, "native", forward_op=_zeros_forward_op)
    assert "_native_cudnn" in message and "_native_flash" in message, message
    assert "_native_attention_backward_op" in message and "Ulysses" in message and "0.40" in message, message


def test_ring_refuses_the_shipped_cudnn_backward_op(patched: types.ModuleType) -> None:
    """With DIFFUSERS_CUDNN_FIX_SKIP=cudnn_backward_kv the shipped op is what the ring gets: refused, as it is
    not one of the ops the corrected ring drives (identity, not name)."""
    patched._cudnn_attention_backward_op = diffusers_cudnn_fix.get_original("_cudnn_attention_backward_op")
    try:
        message = _ring_refusal(patched)
    finally:
        diffusers_cudnn_fix.apply()  # puts the corrected op back
    assert "cudnn_backward_kv" in message, message


def test_ring_refuses_what_it_does_not_correct(patched: types.ModuleType) -> None:
    """A mask (diffusers applies the local mask to every ring step), dropout, causal attention, GQA. The forward
    op is a stand-in where the stand-in kernels would refuse first (dropout) or diffusers' op raises (GQA)."""
    import torch

    mask = torch.zeros(threaded_ring.BATCH, 1, threaded_ring.SEQ_PER_RANK, threaded_ring.SEQ_PER_RANK)
    cases = {
        "mask": {"attn_mask": mask.to(torch.bfloat16)},
        "dropout": {"dropout_p": 0.1, "forward_op": _zeros_forward_op},
        "is_causal": {"is_causal": True},
        "enable_gqa": {"enable_gqa": True, "forward_op": _zeros_forward_op},
    }
    for word, kwargs in cases.items():
        message = _ring_refusal(patched, **kwargs)
        assert word in message and "Ulysses" in message and "ring_grad_route" in message, (word, message)


def test_ring_refuses_a_forward_from_before_the_correction(patched: types.ModuleType) -> None:
    """A forward run by the shipped class (before apply()) kept nothing the corrected backward needs."""
    message = _ring_refusal(patched, ring_forward=_shipped(RING_FORWARD))
    assert "before the package corrected" in message, message


# --- 0.40.0 and later: diffusers' own ring backward routes the K/V gradients wrong from ring degree 3; the package
# installs its corrected ring there (diffusers' own ops)


def test_ring_gradients_right_at_every_degree_on_040_and_later() -> None:
    """0.42.x's ``enable_parallelism`` fails on a CPU-only torch, so its ring runs here in one process, a
    thread per ring rank (``threaded_ring``), on diffusers' own cuDNN and flash ops as installed (0.42.0's
    ring is 0.42.1's; 0.40.0 and 0.41.0 train at ring degree 4 in tests/test_cp_training.py)."""
    result = run(
        release_dir("0.42.1"),
        """
import json, functools, torch, diffusers_cudnn_fix, threaded_ring, standin_kernels
import diffusers.models.attention_dispatch as module
standin_kernels.register()
shipped = {n: diffusers_cudnn_fix.get_original(f"TemplatedRingAttention.{n}").__func__ for n in ("forward", "backward")}
result = {f"{b}/{w}": threaded_ring.run(module, b, w) for b in ("cudnn", "flash") for w in (2, 3, 4)}
# The control: diffusers' own ring with the same ops.
for w in (2, 3, 4):
    result[f"shipped/{w}"] = threaded_ring.run(
        module, "cudnn", w, ring_forward=shipped["forward"], ring_backward=shipped["backward"]
    )
result["unified-shape/2"] = threaded_ring.run(module, "cudnn", 2, convert_to_fp32=True)
# Refused: a mask at ring degree > 1 (dropout too: the stand-in kernels have none); a backward op of another
# backend from ring degree 3.
key_mask = torch.zeros(threaded_ring.BATCH, 1, 1, threaded_ring.SEQ_PER_RANK, dtype=torch.bfloat16)
result["mask/2"] = threaded_ring.run(module, "cudnn", 2, attn_mask=key_mask)
installed = module._cudnn_attention_backward_op
def other_backward_op(ctx, grad_out, *args, **kwargs):  # not one of diffusers' cuDNN / flash ops
    return installed(ctx, grad_out, *args, **kwargs)
module._cudnn_attention_backward_op = other_backward_op
result["other/2"] = threaded_ring.run(module, "cudnn", 2)
result["other/3"] = threaded_ring.run(module, "cudnn", 3)
module._cudnn_attention_backward_op = installed
fixes = diffusers_cudnn_fix.status().fixes
result["status"] = {f.id: [f.detected, f.applied, f.reason.split(":")[0]] for f in fixes if f.id.startswith("ring")}
result["patched"] = [diffusers_cudnn_fix.is_patched(f"TemplatedRingAttention.{n}") for n in ("forward", "backward")]
print(json.dumps(result))
""",
        preloaded=True,
    )
    tolerance = threaded_ring.TOLERANCE
    assert result["status"] == {"ring_grad_route": ["broken", True, "fixed"]}, result["status"]
    assert result["patched"] == [True, True]
    # As shipped: degree 2 right; from degree 3 wrong K/V gradients, the output and the query gradient right.
    assert result["shipped/2"]["status"] == "pass", result["shipped/2"]
    for world in (3, 4):
        shipped = result[f"shipped/{world}"]
        assert shipped["status"] == "wrong", shipped
        assert shipped["errors"]["out"] <= tolerance and shipped["errors"]["dq"] <= tolerance, shipped
        assert max(shipped["errors"]["dk"], shipped["errors"]["dv"]) > 10 * tolerance, shipped
    # With the package: right at every degree, with both backends.
    for backend in ("cudnn", "flash"):
        for world in (2, 3, 4):
            case = result[f"{backend}/{world}"]
            assert case["status"] == "pass", (backend, world, case)
    assert result["unified-shape/2"]["status"] == "pass", result["unified-shape/2"]
    for case, words in (
        ("mask/2", ("an attention mask", "Ulysses", "DIFFUSERS_CUDNN_FIX_SKIP=ring_grad_route")),
        ("other/3", ("ring_degree 3", "other_backward_op", "_native_cudnn", "ring_degree=2", "Ulysses")),
    ):
        refused = result[case]
        assert refused["status"] == "raised" and refused["raised"] == "UnsafeAttentionError", (case, refused)
        for word in words:
            assert word in refused["error"], (case, word, refused["error"])
    # Another backend at ring degree 2: diffusers' own route is right there, and so is the package's.
    assert result["other/2"]["status"] == "pass", result["other/2"]
