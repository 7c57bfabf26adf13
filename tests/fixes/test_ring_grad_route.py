"""``ring_grad_route`` (fixes/ring_grad_route.py): ring / unified context parallelism's backward gives wrong K/V
gradients: on 0.36-0.39 every ring step reuses the first step's tensors; from 0.40.0 the gradients go the wrong
way round the ring from ring degree 3. The package installs its corrected ring for diffusers' cuDNN and flash ops
and refuses what it does not correct.

* The check: tells the shipped ring from the corrected one on 0.39.0; finds the route broken on 0.40.0.
* The policy: the corrected ring is right at every ring degree, with both ops, on 0.39.0 and on 0.42.1; with a
  mask (#43) each ring step gets the mask columns of its K/V chunk, whichever columns a rank holds (the whole key
  length, its own shard, its own rows), a chunk whose keys are all masked contributes nothing and a row that sees
  no key stays finite, and a mask that masks nothing is dropped (a hypothesis search too); it refuses other
  backends, a mask it cannot map, a mask with an op that takes none, dropout, causal attention, GQA, and a forward
  from before the correction.
* The control: diffusers' own ring with the same (corrected) ops is wrong, with a mask at ring degree 2 too.

In process on diffusers 0.39.0 (conftest), through ``threaded_ring`` (one thread per ring rank, so several ring
chunks run in this one process); 0.40.0 and 0.42.1 in fresh interpreters. Training steps at ring degree 2 and 4:
tests/test_cp_training.py.
"""

from __future__ import annotations

import types

import pytest
import threaded_ring
from releases import WITH_OPS, release_dir, run

import diffusers_cudnn_fix

#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them).
# 0.36.0-0.39.0: every ring step reuses the first step's tensors; 0.40.0 on: the K/V gradients go the wrong
# way round the ring from degree 3.
CARRIES = WITH_OPS
CORRECTION = True  # a correction: the package makes the result right (False: a guard)

RING_FORWARD, RING_BACKWARD = "TemplatedRingAttention.forward", "TemplatedRingAttention.backward"
#: The mask cases hand the cuDNN op bool masks: the package's notices of that (once per process) are expected here.
pytestmark = pytest.mark.filterwarnings(
    "ignore::diffusers_cudnn_fix.MaskConvertedWarning", "ignore::diffusers_cudnn_fix.MaskMisreadWarning"
)


def _shipped(target: str):
    return diffusers_cudnn_fix.get_original(target).__func__


# --- the check ------------------------------------------------------------------------------------------------


def test_ring_check_tells_the_shipped_ring_from_the_corrected_one(patched: types.ModuleType) -> None:
    """0.39.0: the shipped ring's steps reuse the first step's tensors; the package's own ring sees each step's
    K/V and routes each chunk's gradient to its owner. 0.40.0 and later (the route broken): the next test, in a
    fresh interpreter."""
    import diffusers_cudnn_fix
    from diffusers_cudnn_fix._registry import Objects, live_objects
    from diffusers_cudnn_fix.fixes import ring_grad_route

    cls = patched.TemplatedRingAttention
    shipped = {t: diffusers_cudnn_fix.get_original(t).__func__ for t in (RING_FORWARD, RING_BACKWARD)}
    globals_before = dict(shipped[RING_BACKWARD].__globals__)

    def lookup(objects: dict) -> object:  # diffusers' own functions, as a plain lookup shows them
        return lambda name: cls if name == "TemplatedRingAttention" else objects.get(name)

    found = ring_grad_route.check(lookup(shipped))
    assert found.state == "broken" and "each step's K/V" in found.detail, found
    assert ring_grad_route.reuses_first_step(lookup(shipped))
    installed = live_objects(patched)  # the package's ring, built again with the check's stand-ins
    found = ring_grad_route.check(installed)
    assert found.state == "ok" and "reaches its owner" in found.detail, found
    # The corrected backward after diffusers' own forward (which keeps nothing for it) refuses to run: the check
    # cannot call that pair right, and says so.
    backward_only = {RING_BACKWARD: installed.candidates[RING_BACKWARD]}
    mixed = Objects(patched, backward_only, installed.broken, facts=installed.facts)
    assert ring_grad_route.check(mixed).state == "unknown"
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
    """Dropout, causal attention, GQA. The forward op is a stand-in where the stand-in kernels would refuse first
    (dropout) or diffusers' op raises (GQA)."""
    cases = {
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


# --- masks (#43): each ring step gets the mask columns of the K/V chunk it attends to -------------------------

MASK_CASES = [
    pytest.param(kind, layout, id=f"{kind}-{layout}")
    for kind, layouts in threaded_ring.MASK_KINDS.items()
    for layout in layouts
]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(("kind", "layout"), MASK_CASES)
def test_ring_masks_are_right_at_every_degree(patched: types.ModuleType, kind: str, layout: str, world: int) -> None:
    """0.39.0 (the package's corrected ops, driven from their saved context): every mask kind, in every layout a
    rank may hold it, against fp32 attention over the whole sequence; a mask that masks nothing reaches no op,
    any other reaches every ring step's."""
    mask = threaded_ring.make_mask(kind, world, seed=world)
    result = threaded_ring.run(patched, "cudnn", world, mask=mask, mask_layout=layout)
    assert result["status"] == "pass", result
    assert result["op_calls"] == world * world, result
    assert result["masked_calls"] == (0 if kind in threaded_ring.MASKS_NOTHING else world * world), result


@pytest.mark.parametrize("kernel", ["stand-in", "naive"])
def test_ring_mask_rows_without_keys_stay_finite(patched: types.ModuleType, kernel: str, monkeypatch) -> None:
    """A query row that sees no key at all, and a sample whose keys of one ring chunk are all masked: the merge of
    the log-sum-exps stays finite (no NaN: -inf - -inf), such rows get output 0 and no gradient, the rest is
    right; also with the merge in fp32 (``convert_to_fp32``). ``naive``: kernels computing exp(score - lse) as it
    stands, which give NaN in a row without keys (forward: -inf - -inf; backward: the merged log-sum-exp -inf),
    where the stand-ins give 0 as cuDNN is measured to: the ring keeps such values out of every merge and step."""
    import standin_kernels
    import torch

    if kernel == "naive":
        monkeypatch.setattr(standin_kernels, "_probabilities", lambda scores, lse: torch.exp(scores - lse[..., None]))
    world, per_rank = 3, threaded_ring.SEQ_PER_RANK
    mask = threaded_ring.make_mask("bool", world, seed=1)
    mask[0, :, 0, :] = False  # the first query sees no key
    mask[1, :, :, per_rank : 2 * per_rank] = False  # sample 1: ring chunk 1 all masked for every query
    mask[1, :, :, 0] = True  # ... while each of its rows sees a key elsewhere
    for fp32 in (False, True):
        result = threaded_ring.run(patched, "cudnn", world, mask=mask, mask_layout="global", convert_to_fp32=fp32)
        assert result["status"] == "pass", (fp32, result)


def test_ring_masks_nothing_in_warn_mode_still_reaches_the_op(patched: types.ModuleType, monkeypatch) -> None:
    """The all-true bool mask is dropped only in convert mode: in warn mode it reaches every step's op as diffusers
    hands it (a uniform bias there, which changes no softmax), in error mode the op refuses it."""
    from diffusers_cudnn_fix import _switches

    monkeypatch.setattr(_switches, "_overrides", {})
    mask = threaded_ring.make_mask("all_true", 2)
    diffusers_cudnn_fix.set_mask_mode("warn")
    result = threaded_ring.run(patched, "cudnn", 2, mask=mask, mask_layout="local")
    assert result["status"] == "pass" and result["masked_calls"] == 4, result
    diffusers_cudnn_fix.set_mask_mode("error")
    result = threaded_ring.run(patched, "cudnn", 2, mask=mask, mask_layout="local")
    assert result["status"] == "raised" and "error mode" in result["error"], result


def test_ring_mask_property_search(patched: types.ModuleType) -> None:
    """Hypothesis: ring degree 2 - 4, batch 1 - 2, 2 - 5 tokens per rank, 1 - 3 heads, every mask kind and layout
    (``threaded_ring.search``): right, and a mask that masks nothing reaches no op. 0.40.0+: the next section."""
    assert threaded_ring.search(patched, max_examples=100) == []


def test_ring_refuses_masks_it_cannot_map(patched: types.ModuleType) -> None:
    """A mask whose key dimension is neither the whole key length, nor the rank's shard, nor 1; a rank's shard of
    the keys with a row per query (the other ranks' rows are not there); a mask that requires grad (refused by
    the op, as without ring attention); a mask with the flash op, whose backward takes none. Each refusal names
    the cause and the way out."""
    import torch

    per_rank, world = threaded_ring.SEQ_PER_RANK, 2
    odd = torch.ones(threaded_ring.BATCH, 1, 1, per_rank + 1, dtype=torch.bool)
    odd[..., 0] = False
    shard_rows = threaded_ring.make_mask("bool", world)
    for kwargs, words in (
        ({"attn_mask": odd}, ("key dimension of 5", "ulysses_degree")),
        ({"mask": shard_rows, "mask_layout": "local"}, ("a row per query", "attn_mask=None")),
    ):
        result = threaded_ring.run(patched, "cudnn", world, **kwargs)
        assert result["status"] == "raised" and result["raised"] == "UnsafeAttentionError", result
        for word in (*words, "ring_grad_route"):
            assert word in result["error"], (word, result["error"])
    # A mask that requires grad reaches the op as it came, which refuses it (it would get no gradient).
    trained = threaded_ring.make_mask("all_zero", world).float().requires_grad_()
    result = threaded_ring.run(patched, "cudnn", world, mask=trained, mask_layout="local")
    assert result["status"] == "raised" and "requires grad" in result["error"], result
    padded = threaded_ring.make_mask("key_padding", world)
    result = threaded_ring.run(patched, "flash", world, mask=padded, mask_layout="local")
    assert result["status"] == "raised" and result["raised"] == "UnsafeAttentionError", result
    assert "_native_cudnn" in result["error"] and "flash" in result["error"], result["error"]


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
# Refused: a backward op of another backend from ring degree 3.
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
        ("other/3", ("ring_degree 3", "other_backward_op", "_native_cudnn", "ring_degree=2", "Ulysses")),
    ):
        refused = result[case]
        assert refused["status"] == "raised" and refused["raised"] == "UnsafeAttentionError", (case, refused)
        for word in words:
            assert word in refused["error"], (case, word, refused["error"])
    # Another backend at ring degree 2: diffusers' own route is right there, and so is the package's.
    assert result["other/2"]["status"] == "pass", result["other/2"]


@pytest.mark.parametrize("version", ["0.40.0", "0.42.1"])
def test_ring_masks_on_040_and_later(version: str) -> None:
    """0.40.0+ (diffusers' own cuDNN ops, driven through their keywords, each ring step's mask as ``ctx.attn_mask``):
    every mask kind and layout at ring degrees 2 - 4, and the hypothesis search; the control: diffusers' own ring
    at ring degree 2 (its route right there), the mask converted by the package, is wrong with a mask that pads
    some keys, as each ring step applies the rank's own mask columns to another rank's K/V."""
    result = run(
        release_dir(version),
        """
import json, diffusers_cudnn_fix, threaded_ring, standin_kernels
import diffusers.models.attention_dispatch as module
standin_kernels.register()
result = {}
for kind, layouts in threaded_ring.MASK_KINDS.items():
    for layout in layouts:
        for world in (2, 3, 4):
            mask = threaded_ring.make_mask(kind, world, seed=world)
            found = threaded_ring.run(module, "cudnn", world, mask=mask, mask_layout=layout)
            result[f"{kind}/{layout}/{world}"] = found
shipped = {n: diffusers_cudnn_fix.get_original(f"TemplatedRingAttention.{n}").__func__ for n in ("forward", "backward")}
padded = threaded_ring.make_mask("key_padding", 2, seed=2)
control = {f"ring_{name}": function for name, function in shipped.items()}
result["shipped"] = threaded_ring.run(module, "cudnn", 2, mask=padded, mask_layout="local", **control)
result["search"] = threaded_ring.search(module, max_examples=100)
print(json.dumps(result))
""",
        preloaded=True,
    )
    result.pop("_stderr", None)
    assert result.pop("search") == []
    shipped = result.pop("shipped")
    assert shipped["status"] == "wrong", shipped
    for case, found in result.items():
        kind, _, world = case.split("/")
        assert found["status"] == "pass", (case, found)
        expected = 0 if kind in threaded_ring.MASKS_NOTHING else int(world) ** 2
        assert found["masked_calls"] == expected, (case, found)
