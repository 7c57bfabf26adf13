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
"""

from __future__ import annotations

import pytest
from releases import release_dir, run

#: The releases whose Ulysses forward all-gathers a sequence-local mask (0.39.0 on), the first and the newest.
RELEASES = ("0.39.0", "0.42.1")
LAYERS = 4

SCRIPT = r"""
import json, threading, types, warnings
import torch
import torch.nn.functional as F
import diffusers.models.attention_dispatch as m
import standin_kernels
import diffusers_cudnn_fix
from diffusers_cudnn_fix import _key_padding
from harness import ThreadedUlysses, seeing

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
q, k, v = (torch.randn(B, S * WORLD, H, D, generator=gen).to(torch.bfloat16) for _ in range(3))
grad_out = torch.randn(q.shape, generator=gen).to(torch.bfloat16)
keep = torch.ones(B, 1, 1, S * WORLD, dtype=torch.bool)
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
if not any(isinstance(r, BaseException) for r in changed):  # rank 0's layers 2 and 3: as good as the first two?
    ref_changed = reference(torch.cat([keep[..., :S], changed_keep[..., S:]], dim=-1))
    worst = 0.0
    for layer in (2, 3):
        got = torch.cat([changed[r][layer][0].float() for r in range(WORLD)], dim=1)
        worst = max(worst, ((got - ref_changed[0]).abs().max() / ref_changed[0].abs().max()).item())
    report["changed_error"] = worst
print(json.dumps(report))
"""

#: bf16 q/k/v and grad_out against fp32 attention: rounding, not a wrong key (a wrong key is off by tens of percent).
TOLERANCE = 3e-2


def _run(version: str, control: str | None = None) -> dict:
    result = run(release_dir(version), SCRIPT.format(control=control, layers=LAYERS), preloaded=True)
    result.pop("_stderr")
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
    assert "changed between layers" in (found["changed_raised"][0] or ""), found
    control = _run(version, "unchecked")
    assert control["changed_raised"] == [None, None], control
    assert control["changed_error"] > 10 * TOLERANCE, control
