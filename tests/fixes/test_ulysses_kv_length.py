"""``ulysses_kv_length`` (fixes/ulysses_kv_length.py): diffusers' Ulysses backward reshapes dK/dV with the queries'
local length, so cross-attention to keys of another length (LTX's text) raises in the backward, on every release
with the class. The package's Ulysses backward is its own, routing each gradient back with its own length.

* The check: broken as shipped on every release with the class (0.36.0, 0.39.0, 0.42.1 here); the replacement
  passes it.
* The policy and the control: ``TemplatedUlyssesAttention`` at Ulysses degree 2 and 4, a thread per rank
  (``harness.ulysses_against_reference``), keys longer and shorter than the queries, against attention over the
  whole sequence: right with the package, diffusers' "is invalid for input of size" without it (in process on
  0.39.0, the fix skipped; and on every release in a fresh interpreter, both import orders and without the
  package). At equal lengths the package's backward gives diffusers' own gradients bit for bit.
* Compiled whole (``fullgraph=True``, ``aot_eager``) it gives its eager result; ``verify``'s accounting counts it
  exercised only where the lengths differ.

Through a model (tiny LTX with its text mask, two gloo ranks): tests/test_cp_models.py.
"""

from __future__ import annotations

import pytest
from harness import ulysses_against_reference
from releases import RELEASES, WITH_OPS, fix_states, release_dir, run

import diffusers_cudnn_fix
from diffusers_cudnn_fix import FixNotAppliedWarning

FIX = "ulysses_kv_length"
#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them).
# diffusers' Ulysses class (0.36.0 on, the same code in its backward): dK / dV are reshaped with the queries'
# length (issue #42's LTX findings).
CARRIES = WITH_OPS
CORRECTION = True  # a correction: the package makes the result right (False: a guard)
#: diffusers' own error: dK/dV reshaped with the queries' length.
SHIPPED_ERROR = "is invalid for input of size"
#: (tokens of q, tokens of k and v) a rank: keys longer, keys shorter, equal lengths.
LENGTHS = ((3, 5), (5, 3), (4, 4))
WORLDS = (2, 4)
WITH_CLASS = tuple(v for v in RELEASES if v != "0.35.2")


@pytest.mark.slow
def test_the_check_finds_the_bug_and_passes_the_replacement() -> None:
    """Every release with the class carries it: broken as shipped, and the package's replacement passes the same
    check (``fixed``)."""
    for version in ("0.36.0", "0.39.0", "0.42.1"):
        assert fix_states(version)[FIX] == ["broken", True, "fixed"], version
    assert fix_states("0.35.2")[FIX][0] == "absent"


def _cases(module) -> dict[str, dict]:
    return {
        f"{world}/{seq_q}/{seq_kv}": ulysses_against_reference(module, world, seq_q=seq_q, seq_kv=seq_kv)
        for world in WORLDS
        for seq_q, seq_kv in LENGTHS
    }


def test_keys_of_another_length_get_right_gradients(dispatch_module, monkeypatch) -> None:
    """Without the fix (skipped), diffusers' backward raises wherever the lengths differ and is right where they
    are equal; with it every case matches one process, and at equal lengths gives diffusers' own bit for bit."""
    import torch

    def equal_lengths() -> list[dict]:
        return [ulysses_against_reference(dispatch_module, w, seq_q=4, seq_kv=4, keep=True) for w in WORLDS]

    diffusers_cudnn_fix.revert()
    monkeypatch.setenv("DIFFUSERS_CUDNN_FIX_SKIP", FIX)
    with pytest.warns(FixNotAppliedWarning, match=FIX):
        diffusers_cudnn_fix.apply()
    try:
        assert not diffusers_cudnn_fix.is_patched("TemplatedUlyssesAttention.backward")
        shipped = _cases(dispatch_module)
        theirs = equal_lengths()
    finally:
        diffusers_cudnn_fix.revert()
    for case, result in shipped.items():
        _, seq_q, seq_kv = case.split("/")
        if seq_q == seq_kv:
            assert result["status"] == "pass", (case, result)
        else:
            assert result["status"] == "raised" and SHIPPED_ERROR in result["error"], (case, result)

    monkeypatch.delenv("DIFFUSERS_CUDNN_FIX_SKIP")
    diffusers_cudnn_fix.apply()
    try:
        assert diffusers_cudnn_fix.is_patched("TemplatedUlyssesAttention.backward")
        fixed = _cases(dispatch_module)
        ours = equal_lengths()
    finally:
        diffusers_cudnn_fix.revert()
    assert {case: r["status"] for case, r in fixed.items()} == dict.fromkeys(fixed, "pass"), fixed
    for shipped_run, our_run in zip(theirs, ours, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(shipped_run["got"], our_run["got"], strict=True))


SCRIPT = """
import json
{imports}
from harness import ulysses_against_reference
cases = {{
    f"{{world}}/{{seq_q}}/{{seq_kv}}": ulysses_against_reference(m, world, seq_q=seq_q, seq_kv=seq_kv)
    for world in {worlds} for seq_q, seq_kv in {lengths}
}}
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
    right; without it the cases with keys of another length raise diffusers' error, the others are right."""
    script = SCRIPT.format(imports=IMPORTS[order], worlds=WORLDS, lengths=LENGTHS)
    result = run(release_dir(version), script, preloaded=True)
    result.pop("_stderr")
    for case, found in result.items():
        _, seq_q, seq_kv = case.split("/")
        if order != "none" or seq_q == seq_kv:
            assert found["status"] == "pass", (case, found)
        else:
            assert found["status"] == "raised" and SHIPPED_ERROR in found["error"], (case, found)


@pytest.mark.parametrize("degree", [1, 2])
def test_the_own_backward_compiles_whole(patched, monkeypatch, degree: int) -> None:
    """Under ``torch.compile(fullgraph=True)`` (``aot_eager``) the package's backward traces into the graph, with no
    break, and gives what it gives eagerly: keys shorter than the queries, Ulysses degree 1 and 2 (the collectives
    stood in: each all-to-all returns its input), the cuDNN ops on the CPU stand-in kernels."""
    import torch
    from harness import stand_in_collectives, ulysses_attention, ulysses_config

    config = ulysses_config(stand_in_collectives(patched, monkeypatch), ulysses_degree=degree, _ulysses_local_rank=0)

    def step(q, k, v):
        return ulysses_attention(patched, q, k, v, config=config)

    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, seq, 4, 8, generator=gen).to(torch.bfloat16) for seq in (6, 4, 4)]
    results = []
    for run_step in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        q, k, v = (x.clone().requires_grad_() for x in inputs)
        out = run_step(q, k, v)
        out.float().sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad])
    torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_verify_counts_it_exercised_only_where_the_lengths_differ(patched) -> None:
    """``verify`` names the fixes whose code a run reached (``_ledger``): the package's backward runs for every
    Ulysses call, but it counts as exercised only where the keys' length differs from the queries' (there diffusers'
    own raises); Flux's and QwenImage's joint attention, of one length, must not claim it."""
    from diffusers_cudnn_fix import _ledger

    marked = {}
    for seq_kv in (3, 5):
        _ledger.start()
        try:
            assert ulysses_against_reference(patched, 2, seq_q=3, seq_kv=seq_kv)["status"] == "pass"
        finally:
            marked[seq_kv] = _ledger.stop()
    assert FIX not in marked[3] and FIX in marked[5], marked
