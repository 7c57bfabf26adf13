"""The key-padding plan once per mask per step under Ulysses (issue #40, item 3; ``_key_padding.plan_of``).

From 0.39.0 on, diffusers' Ulysses forward all-gathers a mask that holds the rank's own keys into a new tensor in
every layer. The plan for a key-padding mask (one host sync) was kept per tensor, so it ran in every layer. It is
now kept for the mask the model hands every layer, before the gather.

A fresh interpreter per release: ``TemplatedUlyssesAttention`` as the package installs it, Ulysses degree 2, a
thread per rank (``harness.ThreadedUlysses``), on the package's cuDNN ops with the tests' CPU stand-in kernels,
bf16. Each rank runs the layers of a model that hands every layer its own slice of one padded-prompt bool mask:

* ``plans``: the plans computed (``_key_padding.plan``, counted) over every layer of both ranks: one per rank.
  The control is the old keying (the plan kept for each gathered tensor alone): one per layer and rank.
* every layer's output and q/k/v gradients match attention over the whole sequence, within bf16 rounding.
* ``changed``: rank 1 changes its mask in place between two layers while rank 0 keeps its own. Rank 0's kept plan
  would be stale: the run is stopped by ``plan_of``'s device-side check (a ``RuntimeError`` naming the cause on the
  CPU), never trained on silently. With the check taken out (the control) rank 0's output is wrong.
* A property search (hypothesis) over degrees, batch, lengths, layers, bool and additive masks and a rank changing
  its slice: every layer a rank finishes is right, and a run stops only where a kept plan met changed values. Its
  control (the check taken out) finds a silently wrong layer.
* On a GPU (marked ``gpu``), the first two runs on the real cuDNN kernels: the changed mask ends in a device-side
  assert, surfacing as a CUDA error at the next synchronisation; the control is wrong and quiet.
"""

from __future__ import annotations

import pytest
from releases import keep, release_dir, run

#: The releases whose Ulysses forward all-gathers a sequence-local mask (0.39.0 on), the first and the newest.
RELEASES = ("0.39.0", "0.42.1")
LAYERS = 4

SCRIPT = r"""
import json, os, threading, types, warnings
import torch
import torch.nn.functional as F
import diffusers.models.attention_dispatch as m
import standin_kernels
import diffusers_cudnn_fix
from diffusers_cudnn_fix import _key_padding
from harness import ThreadedUlysses, seeing

DEVICE = {device!r}
if DEVICE == "cpu":  # on a GPU: the real cuDNN kernels
    standin_kernels.register()
warnings.simplefilter("ignore")
CONTROL, LAYERS, WORLD = {control!r}, {layers}, 2
B, S, H, D = 2, 6, 4, 16  # S: keys a rank
plans = []
real_plan = _key_padding.plan
def counted(mask, dtype):
    plans.append(threading.get_ident())
    return real_plan(mask, dtype)
_key_padding.plan = counted
if CONTROL == "per_tensor":  # the old keying: each gathered tensor planned on its own
    _key_padding.plan_of = lambda given, dtype, source, config: _key_padding.remembered(_key_padding.plan, given, dtype)
if CONTROL == "unchecked":  # the kept plan without the check that every layer's gather is the same
    real_assert = torch._assert_async
    torch._assert_async = lambda *args: None

gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(B, S * WORLD, H, D, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(3))
grad_out = torch.randn(q.shape, generator=gen).to(DEVICE, torch.bfloat16)
keep = torch.ones(B, 1, 1, S * WORLD, dtype=torch.bool, device=DEVICE)
keep[0, ..., -3:] = False  # element 0's prompt padded, in rank 1's keys
keep[1, ..., S - 2 : S] = False  # element 1's, in rank 0's keys
changed_keep = keep.clone()
changed_keep[1, ..., -1] = False  # what rank 1 changes its mask to in the "changed" run

def reference(mask):
    full = [x.float().clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in full), attn_mask=mask).transpose(1, 2)
    out.backward(grad_out.float())
    return [out.detach(), *(x.grad for x in full)]

golden = reference(keep)
collectives = ThreadedUlysses(WORLD)
forward, backward = (seeing(m, f"TemplatedUlyssesAttention.{{name}}", collectives.overrides,
                            all_to_all=collectives.all_to_all_single) for name in ("forward", "backward"))
forward_op, backward_op = m._cudnn_attention_forward_op, m._cudnn_attention_backward_op

def run(change_on_rank_1):
    results, layers = [None] * WORLD, {{}}
    def rank_main(rank):
        cp = types.SimpleNamespace(_ulysses_mesh=collectives.mesh(rank), _ulysses_local_rank=rank,
                                   ulysses_degree=WORLD, ring_degree=1, _world_size=WORLD, ulysses_anything=False,
                                   convert_to_fp32=False)
        config = types.SimpleNamespace(context_parallel_config=cp)
        mine = slice(rank * S, (rank + 1) * S)
        mask = keep[..., mine].clone()  # the model's mask: made once, handed to every layer
        got = []
        try:
            for layer in range(LAYERS):
                if change_on_rank_1 and rank == 1 and layer == 2:
                    mask.copy_(changed_keep[..., mine])
                ctx = types.SimpleNamespace(needs_input_grad=(True,) * 12)
                ctx.save_for_backward = lambda *t, ctx=ctx: setattr(ctx, "saved_tensors", t)
                with torch.no_grad():
                    out = forward(ctx, q[:, mine], k[:, mine], v[:, mine], mask, 0.0, False, None, False, False,
                                  forward_op, backward_op, config)
                    grads = backward(ctx, grad_out[:, mine])
                got.append([out, *grads[:3]])
            results[rank] = got
        except BaseException as exc:
            results[rank] = exc
            collectives.barrier.abort()
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results

def errors(results):
    worst = 0.0
    for layer in range(LAYERS):
        for i, ref in enumerate(golden):
            got = torch.cat([results[r][layer][i].float() for r in range(WORLD)], dim=1)
            worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
    return worst

diffusers_cudnn_fix.apply()
steady = run(False)
failed = [r for r in steady if isinstance(r, BaseException)]
report = {{"plans": len(plans), "ranks_planning": len(set(plans)),
           "error": None if failed else errors(steady), "raised": repr(failed[0]) if failed else None}}
plans.clear()
changed = run(True)
report["changed_raised"] = [repr(r) if isinstance(r, BaseException) else None for r in changed]
if DEVICE == "cuda":  # a device-side assert surfaces at the next synchronisation, wherever that is
    try:
        torch.cuda.synchronize()
    except RuntimeError as exc:
        report["sync_error"] = repr(exc)
if not any(isinstance(r, BaseException) for r in changed) and "sync_error" not in report:
    # rank 0's layers 2 and 3: as good as the first two?
    ref_changed = reference(torch.cat([keep[..., :S], changed_keep[..., S:]], dim=-1))
    worst = 0.0
    for layer in (2, 3):
        got = torch.cat([changed[r][layer][0].float() for r in range(WORLD)], dim=1)
        worst = max(worst, ((got - ref_changed[0]).abs().max() / ref_changed[0].abs().max()).item())
    report["changed_error"] = worst
print(json.dumps(report), flush=True)
if DEVICE == "cuda":
    os._exit(0)  # after a device-side assert the CUDA context is unusable: no teardown through it
"""

#: What the package's stop says (``_key_padding.plan_of``).
STOPPED = "changed between layers"
#: bf16 q/k/v and grad_out against fp32 attention: rounding, not a wrong key (a wrong key is off by tens of percent).
TOLERANCE = 3e-2


def _run(version: str, control: str | None = None, device: str = "cpu") -> dict:
    script = SCRIPT.format(control=control, layers=LAYERS, device=device)
    result = run(release_dir(version), script, preloaded=device == "cpu")
    stderr = result.pop("_stderr")
    if device == "cuda":  # what the user would see of a device-side assert: the kernel's own lines
        result["stderr_assert_lines"] = [line for line in stderr.splitlines() if "Assertion" in line][:5]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_one_plan_per_rank_over_every_layer(version: str) -> None:
    """Every layer hands the model's mask: one plan per rank, every layer right; the old keying planned in every
    layer (the control)."""
    found = _run(version)
    assert found["raised"] is None, found
    assert (found["plans"], found["ranks_planning"]) == (2, 2), found
    assert found["error"] <= TOLERANCE, found
    control = _run(version, "per_tensor")
    assert control["plans"] == 2 * LAYERS, control
    assert control["error"] <= TOLERANCE, control


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_a_mask_changed_on_one_rank_stops_the_run(version: str) -> None:
    """Rank 1 changes its mask between layers, rank 0 keeps its own: rank 0's kept plan no longer fits what
    diffusers gathered. The device-side check stops rank 0 with a message naming the cause; without the check
    (the control), rank 0 trains on the stale plan and its output is wrong."""
    found = _run(version)
    assert STOPPED in (found["changed_raised"][0] or ""), found
    control = _run(version, "unchecked")
    assert control["changed_raised"] == [None, None], control
    assert control["changed_error"] > 10 * TOLERANCE, control


@pytest.mark.gpu
@pytest.mark.parametrize("version", RELEASES)
def test_on_a_gpu_one_plan_per_rank_and_a_changed_mask_stops(version: str) -> None:
    """The same two runs on the real cuDNN kernels: one plan per rank, every layer right; and where rank 1 changes
    its mask between layers, a device-side assert (the CUDA error at the next synchronisation, in whichever
    thread meets it) instead of a silently stale plan. The control, the check taken out, is wrong and quiet."""
    found = _run(version, device="cuda")
    keep(f"gpu-key-padding-ulysses-{version}.json", found)
    assert found["raised"] is None, found
    assert (found["plans"], found["ranks_planning"]) == (2, 2), found
    assert found["error"] <= TOLERANCE, found
    met = [raised for raised in (*found["changed_raised"], found.get("sync_error")) if raised]
    assert any("device-side assert" in raised for raised in met), found
    # The kernel's assertion line, on the process's stderr, carries the package's message: the cause and the way out.
    assert any(STOPPED in line for line in found["stderr_assert_lines"]), found
    control = _run(version, "unchecked", device="cuda")
    keep(f"gpu-key-padding-ulysses-{version}-unchecked.json", control)
    assert control["changed_raised"] == [None, None] and "sync_error" not in control, control
    assert control["changed_error"] > 10 * TOLERANCE, control


SEARCH = r"""
import json, threading, types, warnings
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st
import diffusers.models.attention_dispatch as m
import standin_kernels
import diffusers_cudnn_fix
from harness import ThreadedUlysses, seeing

standin_kernels.register()
warnings.simplefilter("ignore")
diffusers_cudnn_fix.apply()
if {unchecked!r}:  # the control: the kept plan without its check
    torch._assert_async = lambda *args: None
forward_op, backward_op = m._cudnn_attention_forward_op, m._cudnn_attention_backward_op
STALE = "changed between layers"
TOLERANCE = {tolerance!r}
seen = {{"examples": 0, "changed": 0, "stopped": 0}}

def attention(q, k, v, grad_out, keep):
    full = [x.float().clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in full), attn_mask=keep).transpose(1, 2)
    out.backward(grad_out.float())
    return [out.detach(), *(x.grad for x in full)]

@st.composite
def examples(draw):
    world, batch, seq = draw(st.sampled_from([2, 3])), draw(st.integers(1, 2)), draw(st.integers(2, 4))
    layers = draw(st.integers(1, 3))
    flags = st.lists(st.booleans(), min_size=world * seq, max_size=world * seq)
    keep = [draw(flags.filter(any)) for _ in range(batch)]  # every element attends to some key
    change = None
    if layers > 1 and draw(st.booleans()):
        rank = draw(st.integers(0, world - 1))
        new = [list(row) for row in keep]
        for b in range(batch):
            new[b][rank * seq : (rank + 1) * seq] = draw(st.lists(st.booleans(), min_size=seq, max_size=seq))
        if all(any(row) for row in new):
            change = {{"rank": rank, "layer": draw(st.integers(1, layers - 1)), "keep": new}}
    kind = draw(st.sampled_from(["bool", "additive"]))
    return {{"world": world, "batch": batch, "seq": seq, "layers": layers, "keep": keep, "change": change,
            "kind": kind, "seed": draw(st.integers(0, 2**16))}}

def as_mask(keep, kind):
    mask = torch.tensor(keep, dtype=torch.bool)[:, None, None, :]
    return mask if kind == "bool" else torch.zeros(mask.shape).masked_fill(~mask, float("-inf")).to(torch.bfloat16)

@settings(max_examples={examples}, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(examples())
def test(ex):
    seen["examples"] += 1
    world, seq, heads = ex["world"], ex["seq"], ex["world"]
    gen = torch.Generator().manual_seed(ex["seed"])
    q, k, v, grad_out = (torch.randn(ex["batch"], seq * world, heads, 8, generator=gen).to(torch.bfloat16)
                         for _ in range(4))
    masks = [as_mask(ex["keep"], ex["kind"])]
    if ex["change"]:
        masks.append(as_mask(ex["change"]["keep"], ex["kind"]))
        seen["changed"] += 1
    collectives = ThreadedUlysses(world)
    forward, backward = (seeing(m, f"TemplatedUlyssesAttention.{{name}}", collectives.overrides,
                                all_to_all=collectives.all_to_all_single) for name in ("forward", "backward"))
    results = [None] * world
    def rank_main(rank):
        cp = types.SimpleNamespace(_ulysses_mesh=collectives.mesh(rank), _ulysses_local_rank=rank,
                                   ulysses_degree=world, ring_degree=1, _world_size=world, ulysses_anything=False,
                                   convert_to_fp32=False)
        config = types.SimpleNamespace(context_parallel_config=cp)
        mine = slice(rank * seq, (rank + 1) * seq)
        mask, got = masks[0][..., mine].clone(), []
        try:
            for layer in range(ex["layers"]):
                change = ex["change"]
                if change and layer == change["layer"] and rank == change["rank"]:
                    mask.copy_(masks[1][..., mine])
                ctx = types.SimpleNamespace(needs_input_grad=(True,) * 12)
                ctx.save_for_backward = lambda *t, ctx=ctx: setattr(ctx, "saved_tensors", t)
                with torch.no_grad():
                    out = forward(ctx, q[:, mine], k[:, mine], v[:, mine], mask, 0.0, False, None, False, False,
                                  forward_op, backward_op, config)
                    got.append([out, *backward(ctx, grad_out[:, mine])[:3]])
        except BaseException as exc:
            got.append(exc)
            collectives.barrier.abort()
        results[rank] = got
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stale = [r[-1] for r in results if r and isinstance(r[-1], RuntimeError) and STALE in str(r[-1])]
    others = [r[-1] for r in results if r and isinstance(r[-1], BaseException)
              and not isinstance(r[-1], threading.BrokenBarrierError) and r[-1] not in stale]
    assert not others, others
    changed = ex["change"] is not None and not torch.equal(masks[0], masks[1])
    # Stopped only where another rank's mask changed its values under a kept plan.
    assert not stale or changed, (ex, stale)
    seen["stopped"] += bool(stale)
    # Every layer a rank finished is right for the mask in force then.
    for layer in range(ex["layers"]):
        if not all(len(r) > layer and not isinstance(r[layer], BaseException) for r in results):
            assert stale, (ex, layer)
            break
        in_force = masks[1] if ex["change"] and layer >= ex["change"]["layer"] else masks[0]
        golden = attention(q, k, v, grad_out, in_force if in_force.dtype == torch.bool else in_force.float())
        for i, ref in enumerate(golden):
            got = torch.cat([r[layer][i].float() for r in results], dim=1)
            # One valid key gives dq = 0 exactly: relative to at least 1e-2, not to 0.
            error = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-2)).item()
            assert error <= TOLERANCE, ("silently wrong", ex, layer, i, error)

test()
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_search_a_kept_plan_is_right_or_stops() -> None:
    """Property search (hypothesis) on 0.42.1: Ulysses degree 2 or 3 as threads, 1 – 3 layers, a random key-padding
    mask (bool or additive, batch 1 or 2, every element attending somewhere), and sometimes one rank changing its
    slice in place between layers. Every layer each rank finishes is right for the mask in force then; a run stops
    only with the package's message, and only where a rank's kept plan met a gather whose values changed."""
    script = SEARCH.format(examples=40, tolerance=TOLERANCE, unchecked=False)
    result = run(release_dir("0.42.1"), script, preloaded=True, timeout=600)
    result.pop("_stderr")
    assert result["examples"] >= 40 and result["changed"] > 0 and result["stopped"] > 0, result


@pytest.mark.slow
def test_the_search_catches_a_kept_plan_without_its_check() -> None:
    """The control: with the device-side check taken out, the same search finds a layer that is silently wrong."""
    script = SEARCH.format(examples=40, tolerance=TOLERANCE, unchecked=True)
    with pytest.raises(AssertionError, match=r"AssertionError: \('silently wrong'"):
        run(release_dir("0.42.1"), script, preloaded=True, timeout=600)
