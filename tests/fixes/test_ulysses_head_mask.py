"""``ulysses_head_mask`` (fixes/ulysses_head_mask.py): diffusers' Ulysses attention hands the attention op a
per-head mask (``[B, heads, S_q, S_kv]``: LTX and LTX2 repeat their text mask per head) with every head, where q
holds the rank's heads alone after the all-to-all: the forward raises (training and inference), on every release
with the class. The package cuts such a mask to the rank's heads where it meets the op.

* The check: broken as shipped on every release with the class (0.36.0, 0.39.0, 0.42.1 here); the replacement
  passes it.
* The policy and the control: ``TemplatedUlyssesAttention`` at Ulysses degree 2 and 4, a thread per rank
  (``harness.ulysses_against_reference``), masks that differ per head (so a wrong head order shows), each rank
  given its own keys of the mask (as a model's plan shards it; gathered by 0.39+) or every key, against attention
  over the whole sequence: right with the package, a broadcast error without it (in process on 0.39.0, the fix
  skipped; and on every release in a fresh interpreter, both import orders and without the package). A mask of
  one head is untouched (the same result as diffusers').
* Compiled whole (``fullgraph=True``, ``aot_eager``) the cut gives its eager result; ``verify``'s accounting counts
  it exercised only where a mask was cut.

Through a model (tiny LTX with its text mask, two gloo ranks): tests/test_cp_models.py.
"""

from __future__ import annotations

import pytest
from harness import ulysses_against_reference
from releases import RELEASES, WITH_OPS, fix_states, release_dir, run

import diffusers_cudnn_fix
from diffusers_cudnn_fix import FixNotAppliedWarning

FIX = "ulysses_head_mask"
#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them).
# diffusers' Ulysses class (0.36.0 on, the same code in its forward's head handling and its backward): a per-head
# mask reaches the op with every head (issue #42's LTX findings).
CARRIES = WITH_OPS
CORRECTION = True  # a correction: the package makes the result right (False: a guard)
WORLDS = (2, 4)
HEADS, SEQ = 4, 3
WITH_CLASS = tuple(v for v in RELEASES if v != "0.35.2")
#: Releases whose Ulysses forward all-gathers a mask holding the rank's own keys (0.39.0 on): only there can a mask
#: reach it so ("local").
GATHERS = ("0.39.0", "0.40.0", "0.41.0", "0.42.0", "0.42.1")


def _broadcast_error(result: dict) -> bool:
    """Whether the run raised the op's error for a mask of more heads than q (torch words it either way)."""
    error = result.get("error", "")
    return result["status"] == "raised" and ("must match the size" in error or "broadcast shape" in error)


@pytest.mark.slow
def test_the_check_finds_the_bug_and_passes_the_replacement() -> None:
    """Every release with the class carries it: broken as shipped, and the package's replacement passes the same
    check (``fixed``)."""
    for version in ("0.36.0", "0.39.0", "0.42.1"):
        assert fix_states(version)[FIX] == ["broken", True, "fixed"], version
    assert fix_states("0.35.2")[FIX][0] == "absent"


def _cases(module, layouts: tuple[str, ...], *, keep: bool = False) -> dict[str, dict]:
    """Per world and layout: a mask whose heads differ (``per_head``) and one of one head (``one_head``)."""
    import torch

    cases = {}
    for world in WORLDS:
        mask = torch.randn(2, HEADS, 1, SEQ * world, generator=torch.Generator().manual_seed(world))
        for layout in layouts:
            for kind, given in (("per_head", mask), ("one_head", mask[:, :1])):
                cases[f"{world}/{layout}/{kind}"] = ulysses_against_reference(
                    module, world, seq_q=SEQ, seq_kv=SEQ, mask=given, mask_layout=layout, heads=HEADS, keep=keep
                )
    return cases


def test_per_head_masks_reach_each_rank_cut_to_its_heads(dispatch_module, monkeypatch) -> None:
    """Without the fix (skipped), every per-head mask raises a broadcast error, and a mask of one head is right;
    with it every case matches one process, and the one-head mask gives diffusers' own result bit for bit."""
    import torch

    layouts = ("local", "global")
    diffusers_cudnn_fix.revert()
    monkeypatch.setenv("DIFFUSERS_CUDNN_FIX_SKIP", FIX)
    with pytest.warns(FixNotAppliedWarning, match=FIX):
        diffusers_cudnn_fix.apply()
    try:
        shipped = _cases(dispatch_module, layouts, keep=True)
    finally:
        diffusers_cudnn_fix.revert()
    for case, result in shipped.items():
        if case.endswith("per_head"):
            assert _broadcast_error(result), (case, result)
        else:
            assert result["status"] == "pass", (case, result)

    monkeypatch.delenv("DIFFUSERS_CUDNN_FIX_SKIP")
    diffusers_cudnn_fix.apply()
    try:
        fixed = _cases(dispatch_module, layouts, keep=True)
    finally:
        diffusers_cudnn_fix.revert()
    assert {case: r["status"] for case, r in fixed.items()} == dict.fromkeys(fixed, "pass"), fixed
    for case in (c for c in fixed if c.endswith("one_head")):
        assert all(torch.equal(a, b) for a, b in zip(shipped[case]["got"], fixed[case]["got"], strict=True)), case


SCRIPT = """
import json
{imports}
import torch
from harness import ulysses_against_reference
cases = {{}}
for world in {worlds}:
    mask = torch.randn(2, {heads}, 1, {seq} * world, generator=torch.Generator().manual_seed(world))
    for layout in {layouts}:
        for kind, given in (("per_head", mask), ("one_head", mask[:, :1])):
            cases[f"{{world}}/{{layout}}/{{kind}}"] = ulysses_against_reference(
                m, world, seq_q={seq}, seq_kv={seq}, mask=given, mask_layout=layout, heads={heads}
            )
print(json.dumps(cases))
"""
IMPORTS = {
    "package_first": "import diffusers_cudnn_fix\nimport diffusers.models.attention_dispatch as m",
    "diffusers_first": "import diffusers.models.attention_dispatch as m\nimport diffusers_cudnn_fix",
    "none": "import diffusers.models.attention_dispatch as m",
}


@pytest.mark.slow
@pytest.mark.parametrize("order", list(IMPORTS))
@pytest.mark.parametrize("version", WITH_CLASS)
def test_every_release(version: str, order: str) -> None:
    """Each release in a fresh interpreter: with the package (imported before or after diffusers) every case is
    right; without it every per-head mask raises, a mask of one head is right. The keys of the mask reach each
    rank whole, and also as its own where the release gathers them (0.39.0 on)."""
    layouts = ("global", "local") if version in GATHERS else ("global",)
    script = SCRIPT.format(imports=IMPORTS[order], worlds=WORLDS, heads=HEADS, seq=SEQ, layouts=layouts)
    result = run(release_dir(version), script, preloaded=True)
    result.pop("_stderr")
    for case, found in result.items():
        if order == "none" and case.endswith("per_head"):
            assert _broadcast_error(found), (case, found)
        else:
            assert found["status"] == "pass", (case, found)


def test_the_cut_compiles_whole(patched, monkeypatch) -> None:
    """Under ``torch.compile(fullgraph=True)`` (``aot_eager``) the cut traces into the graph, with no break, and
    gives what it gives eagerly: a per-head mask at Ulysses degree 2 (the collectives stood in: each all-to-all
    returns its input), the cuDNN ops on the CPU stand-in kernels."""
    import torch
    from harness import stand_in_collectives, ulysses_attention, ulysses_config

    config = ulysses_config(stand_in_collectives(patched, monkeypatch), ulysses_degree=2, _ulysses_local_rank=1)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, 4, HEADS, 8, generator=gen).to(torch.bfloat16) for _ in range(3)]
    mask = torch.randn(1, HEADS, 1, 4, generator=gen).to(torch.bfloat16)

    def step(q, k, v):
        return ulysses_attention(patched, q, k, v, mask, config=config)

    results = []
    for run_step in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        q, k, v = (x.clone().requires_grad_() for x in inputs)
        out = run_step(q, k, v)
        out.float().sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad])
    torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_verify_counts_it_exercised_only_where_it_cut(patched) -> None:
    """``verify`` names the fixes whose code a run reached (``_ledger``): only a call whose mask was cut counts, not
    one with a mask of one head (QwenImage's)."""
    import torch

    from diffusers_cudnn_fix import _ledger

    mask = torch.randn(2, HEADS, 1, SEQ * 2, generator=torch.Generator().manual_seed(0))
    marked = {}
    for kind, given in (("one_head", mask[:, :1]), ("per_head", mask)):
        _ledger.start()
        try:
            result = ulysses_against_reference(patched, 2, seq_q=SEQ, seq_kv=SEQ, mask=given, heads=HEADS)
            assert result["status"] == "pass", result
        finally:
            marked[kind] = _ledger.stop()
    assert FIX not in marked["one_head"] and FIX in marked["per_head"], marked
