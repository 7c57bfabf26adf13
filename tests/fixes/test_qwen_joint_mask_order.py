"""QwenImage's joint mask put into Ulysses' K/V order on 0.36.0 - 0.38.0 (``qwen_joint_mask_order``).

Three layers, cheapest first:

- the reorder itself (``rank_ordered_mask``) against a brute-force reference, position by position, over a
  small fixed hypothesis profile: Ulysses degree 2 and 4, text and image lengths, padding patterns, both mask
  shapes ([B, 1, 1, S] and [B, 1, S, S]), bool and additive masks;
- the installed Ulysses forward of 0.38.0 in one process (a fresh interpreter): the mask that reaches
  diffusers' own forward from a stand-in of QwenImage's attention processor inside the installed wrapper of it
  (which hands the text length on), per layout, eager and under ``torch.compile``; the layouts it cannot map are
  refused, naming the layout; the wrapper installed on 0.36.0 - 0.38.x only, the package imported before or
  after QwenImage, with the shipped signature, and reverted to the very function shipped;
- one training step of the tiny QwenImage with padded prompts of different lengths in one batch
  (``subprocess_cp_training``: ``QWEN_TEXT_MASK``), Ulysses degree 2 (2 gloo ranks; on 0.38.0 also with
  gradient checkpointing, and at degree 4 with 4 ranks), no switch set: the summed gradients within 3 % of
  one process on 0.37.0, 0.38.0 and 0.39.0; the control, the package with this fix skipped, far off (0.38.0)
  or refused by the stand-in kernel (0.37.0's 2-D mask). See docs/cp-training-tests.md, "QwenImage with padded prompts".
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from releases import release_dir, run
from test_cp_training import LOSS_TOLERANCE, MISREAD_MIN_REL_ERR, RING_TOLERANCE, _check_job, describe, modes, worst

from diffusers_cudnn_fix.fixes.qwen_joint_mask_order import rank_ordered_mask

#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them).
CARRIES = frozenset({"0.36.0", "0.37.0", "0.37.1", "0.38.0"})
CORRECTION = True  # a correction: the package makes the result right (False: a guard)


def brute_force(mask: torch.Tensor, text_len: int, image_len: int, degree: int) -> torch.Tensor:
    """The reference: position ``p`` of the rank order is rank ``p // local``'s local token ``p % local``, which
    is a text token of that rank's text shard or an image token of its image shard; copied one by one."""
    t, i = text_len // degree, image_len // degree
    local, length = t + i, text_len + image_len

    def source(p: int) -> int:
        rank, j = divmod(p, local)
        return rank * t + j if j < t else text_len + rank * i + (j - t)

    out = mask.clone()
    square = mask.shape[-2] == length
    for p in range(length):
        if square:
            for q in range(length):
                out[..., p, q] = mask[..., source(p), source(q)]
        else:
            out[..., p] = mask[..., source(p)]
    return out


@st.composite
def _cases(draw):
    degree = draw(st.sampled_from((2, 4)))
    text, image = draw(st.integers(0, 3)) * degree, draw(st.integers(1, 3)) * degree
    batch = draw(st.sampled_from((1, 2)))
    square = draw(st.booleans())
    length = text + image
    rows = length if square else 1
    pattern = draw(st.sampled_from(("right", "left", "random")))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, 1, rows, length, dtype=torch.bool)
    for b in range(batch):
        valid = int(torch.randint(0, text + 1, (1,), generator=gen)) if text else 0
        if pattern == "right":
            mask[b, ..., valid:text] = False
        elif pattern == "left":
            mask[b, ..., : text - valid] = False
        else:
            mask[b] = torch.rand(1, rows, length, generator=gen) > 0.3
    additive = draw(st.booleans())
    if additive:
        mask = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill_(~mask, float("-inf"))
    return mask, text, image, degree


@settings(max_examples=60, derandomize=True, deadline=None, database=None)
@given(_cases())
def test_rank_ordered_mask_matches_brute_force(case) -> None:
    mask, text, image, degree = case
    got = rank_ordered_mask(mask, text, image, degree)
    assert got.shape == mask.shape and got.dtype == mask.dtype
    assert torch.equal(got, brute_force(mask, text, image, degree))


def test_rank_ordered_mask_moves_padding_and_refuses_what_does_not_fit() -> None:
    """QwenImage's case of the training test, by hand: 4 text (last one padded) + 4 image tokens, degree 2. Rank
    1's text shard [t2, t3] comes after rank 0's image shard, so the padded token moves from 3 to 5."""
    mask = torch.tensor([True, True, True, False, True, True, True, True]).view(1, 1, 1, 8)
    assert rank_ordered_mask(mask, 4, 4, 2).flatten().tolist() == [True, True, True, True, True, False, True, True]
    assert torch.equal(rank_ordered_mask(mask, 0, 8, 2), mask)  # no text: the image order is the rank order
    for bad in ((mask, 3, 5, 2), (mask, 4, 4, 3), (mask, 2, 4, 2), (mask.view(1, 8), 4, 4, 2)):
        with pytest.raises(ValueError):
            rank_ordered_mask(*bad)
    with pytest.raises(ValueError):
        rank_ordered_mask(mask.expand(1, 2, 1, 8), 4, 4, 2)  # per head: not QwenImage's mask


# --- the installed Ulysses forward of 0.38.0, from a stand-in of QwenImage's attention processor --------------

ENTERING_SCRIPT = """
import json, types, torch, diffusers_cudnn_fix
import diffusers.models.attention_dispatch as module
import diffusers.models.transformers.transformer_qwenimage as qwen  # loaded, as in a QwenImage run
from diffusers_cudnn_fix import UnsafeAttentionError
from diffusers_cudnn_fix._fix import built_of
from diffusers_cudnn_fix._registry import live_objects
from diffusers_cudnn_fix.fixes import ALL_FIXES, qwen_joint_mask_order as fix
FIX_ID = "qwen_joint_mask_order"

installed = module.TemplatedUlyssesAttention.forward
shipped = diffusers_cudnn_fix.get_original(fix.ULYSSES_FORWARD).__func__

def stand_in(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
             attention_mask=None):  # QwenImage's processor, handing its joint mask to the attention (`attn`)
    return attn(attention_mask)

# QwenImage's processor as installed (the package's wrapper, built again around the stand-in, where it is one).
processor = built_of(live_objects(module), fix.QWEN_PROCESSOR, stand_in) or stand_in

class Reached(Exception):
    pass

def stop(*args, **kwargs):  # diffusers' own code asked for its process group: read the mask it got
    raise Reached

def entering(forward, mask, *, qwen=True, degree=2, local=4, text_local=2, fullgraph=None):
    config = types.SimpleNamespace(_ulysses_mesh=types.SimpleNamespace(get_group=stop), ulysses_degree=degree)
    parallel = types.SimpleNamespace(context_parallel_config=config)
    q = k = v = torch.zeros(2, local, 4, 8)
    this, text = types.SimpleNamespace(_parallel_config=parallel), torch.zeros(2, text_local, 8)

    def attn(m):
        return forward(types.SimpleNamespace(), q, k, v, m, 0.0, False, None, False, False, stop, None, parallel)

    def call(m):  # from QwenImage's processor, or from another model's
        if not qwen:
            return attn(m)
        return processor(this, attn, None, text, None, m)

    if fullgraph is not None:  # torch.compile'd, as a compiled transformer reaches it
        torch._dynamo.reset()
        call = torch.compile(call, backend="aot_eager", fullgraph=fullgraph)
    try:
        call(mask)
    except UnsafeAttentionError as exc:
        return {"refused": str(exc)}
    except Reached as exc:
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is shipped.__code__:
                got = tb.tb_frame.f_locals["attn_mask"]
                return {"mask": got.float().tolist(), "shape": list(got.shape), "same": got is mask}
            tb = tb.tb_next
        return {"error": "diffusers' own forward not reached"}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": "returned"}

gen = torch.Generator().manual_seed(0)
padded = torch.ones(2, 1, 1, 8, dtype=torch.bool)
padded[0, ..., 3] = False
padded[1, ..., 2:4] = False
additive = torch.zeros(2, 1, 1, 8).masked_fill_(~padded, float("-inf"))
square = torch.rand(2, 1, 8, 8, generator=gen) > 0.3
two_d = padded.view(2, 8)
per_head = padded.expand(2, 4, 1, 8)
unpadded_per_head = torch.ones(2, 4, 1, 8, dtype=torch.bool)
local = torch.ones(2, 1, 1, 4, dtype=torch.bool)
local[..., 1] = False
cached = entering(installed, padded), entering(installed, padded)
out = {
    "inputs": {name: t.float().tolist() for name, t in
               {"padded": padded, "additive": additive, "square": square, "two_d": two_d}.items()},
    "padded": entering(installed, padded),
    "additive": entering(installed, additive),
    "square": entering(installed, square),
    "two_d": entering(installed, two_d),
    "degree_4": entering(installed, padded, degree=4, local=2, text_local=1),
    "per_head": entering(installed, per_head),
    "unpadded_per_head": entering(installed, unpadded_per_head),
    "local_mask": entering(installed, local),
    "other_model": entering(installed, padded, qwen=False),
    "degree_1": entering(installed, padded, degree=1),
    "shipped": entering(shipped, padded),
    "compiled": entering(installed, padded, fullgraph=False),
    "compiled_other_model": entering(installed, padded, qwen=False, fullgraph=False),
    "compiled_fullgraph": entering(installed, padded, fullgraph=True),
}
# The same mask object twice: the reorder is kept (one object for every layer, which the conversion caches).
import diffusers_cudnn_fix.fixes.qwen_joint_mask_order as again
reorder = lambda: again.remembered(again._reorder, padded, (4, 4, 2))  # as in_kv_order calls it
out["reused"] = reorder() is reorder()
out["status"] = {f.id: [f.detected, f.applied, f.reason] for f in diffusers_cudnn_fix.status().fixes}[FIX_ID]
out["kind"] = {f.id: f.kind for f in ALL_FIXES}[FIX_ID]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def entering_038() -> dict:
    return run(release_dir("0.38.0"), ENTERING_SCRIPT, preloaded=True)


def _mask(result: dict) -> torch.Tensor:
    assert "mask" in result, result
    return torch.tensor(result["mask"])


def test_qwen_masks_reach_ulysses_in_the_kv_order_on_038(entering_038: dict) -> None:
    """0.38.0 with the package: QwenImage's joint mask reaches diffusers' Ulysses forward in the K/V's rank
    order (bool, additive, [B, 1, S, S], 0.37's 2-D (B, S) as [B, 1, 1, S], degree 4); another model's mask, degree
    1 and diffusers' own forward (the control) leave it as it came."""
    result, inputs = entering_038, {k: torch.tensor(v) for k, v in entering_038["inputs"].items()}
    assert result["kind"] == "correction"
    assert result["status"][:2] == ["broken", True], result["status"]
    for case, source in (("padded", "padded"), ("additive", "additive"), ("square", "square")):
        assert torch.equal(_mask(result[case]), brute_force(inputs[source], 4, 4, 2)), case
        assert not torch.equal(_mask(result[case]), inputs[source]), case  # the case sees a reorder
    assert torch.equal(_mask(result["two_d"]), brute_force(inputs["two_d"].view(2, 1, 1, 8), 4, 4, 2))
    assert torch.equal(_mask(result["degree_4"]), brute_force(inputs["padded"], 4, 4, 4))
    for case in ("other_model", "degree_1", "shipped", "unpadded_per_head", "compiled_other_model"):
        assert result[case].get("same") is True, (case, result[case])
    assert result["reused"] is True
    # Compiled: the call runs eagerly, where the mask is reordered; with fullgraph=True the error names the
    # cause and the ways out.
    assert torch.equal(_mask(result["compiled"]), brute_force(inputs["padded"], 4, 4, 2))
    refused = result["compiled_fullgraph"].get("error", "") + result["compiled_fullgraph"].get("refused", "")
    assert "torch.compile" in refused and "0.39.0" in refused, refused


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("per_head", "per head"),
        ("local_mask", "sequence-local mask"),
    ],
)
def test_layouts_that_cannot_be_mapped_are_refused_naming_them(entering_038: dict, case: str, named: str) -> None:
    refused = entering_038[case].get("refused", "")
    assert refused.startswith("diffusers_cudnn_fix: QwenImage's joint attention mask"), entering_038[case]
    assert named in refused and "0.39.0" in refused and "encoder_hidden_states_mask=None" in refused, refused


# --- the wrapper of QwenImage's attention processor: only where the fix applies, reverted exactly --------------

INSTALL_SCRIPT = """
import inspect, json
if {package_first!r}:
    import diffusers_cudnn_fix
import diffusers.models.transformers.transformer_qwenimage as qwen
import diffusers_cudnn_fix
from diffusers_cudnn_fix.fixes import qwen_joint_mask_order as fix
cls = qwen.QwenDoubleStreamAttnProcessor2_0
original = diffusers_cudnn_fix.get_original(fix.QWEN_PROCESSOR)
out = {{
    "patched": diffusers_cudnn_fix.is_patched(fix.QWEN_PROCESSOR),
    "shipped": original.__code__.co_filename == qwen.__file__ and original.__name__ == "__call__",
    "live_is_shipped": cls.__dict__["__call__"] is original,
    "signature": str(inspect.signature(cls.__call__)) == str(inspect.signature(original)),  # Attention reads it
}}
diffusers_cudnn_fix.revert()
out["reverted"] = cls.__dict__["__call__"] is original and not diffusers_cudnn_fix.is_patched(fix.QWEN_PROCESSOR)
diffusers_cudnn_fix.apply()
out["reapplied"] = diffusers_cudnn_fix.is_patched(fix.QWEN_PROCESSOR)
print(json.dumps(out))
"""


@pytest.mark.parametrize(
    ("version", "package_first"),
    [("0.35.2", True), ("0.36.0", True), ("0.38.0", True), ("0.38.0", False), ("0.39.0", True), ("0.42.1", False)],
)
def test_processor_wrapped_only_where_the_fix_applies(version: str, package_first: bool) -> None:
    """QwenImage's processor is the package's wrapper (which hands the text length on) on 0.36.0 - 0.38.x only,
    the package imported before or after QwenImage's module, with the shipped signature (diffusers' Attention
    drops the keywords it does not name); revert() puts back the very function shipped."""
    result = run(release_dir(version), INSTALL_SCRIPT.format(package_first=package_first), preloaded=True)
    applies = version in ("0.36.0", "0.38.0")
    assert result["shipped"] is True, result
    assert result == {**result, "patched": applies, "live_is_shipped": not applies, "reapplied": applies}, result
    assert result["reverted"] is True and result["signature"] is True, result


#: A tiny QwenImage with a padded prompt, no context parallelism: its output and gradients through the package's
#: processor wrapper, eager and compiled, against the processor diffusers shipped (after revert()).
COMPILED_SCRIPT = """
import json
import diffusers_cudnn_fix
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

torch.manual_seed(0)
model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(4, 6, 6))
mask = torch.ones(2, 6, dtype=torch.bool)
mask[0, -2:] = False
inputs = dict(hidden_states=torch.randn(2, 16, 16), encoder_hidden_states=torch.randn(2, 6, 16),
    encoder_hidden_states_mask=mask, timestep=torch.tensor([0.5, 0.5]), img_shapes=[(1, 4, 4)] * 2,
    txt_seq_lens=[6, 6], return_dict=False)

def step(run):
    model.zero_grad()
    out = run(**inputs)[0]
    out.square().mean().backward()
    return [out.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

wrapped = diffusers_cudnn_fix.is_patched({target!r})
eager, compiled = step(model), step(torch.compile(model))
diffusers_cudnn_fix.revert()
shipped = step(model)
diff = lambda a, b: max(float((x - y).abs().max()) for x, y in zip(a, b))
print(json.dumps({{"wrapped": wrapped, "eager": diff(eager, shipped), "compiled": diff(compiled, shipped),
    "tensors": len(shipped)}}))
"""


@pytest.mark.slow
def test_wrapped_processor_matches_the_shipped_one_eager_and_compiled() -> None:
    """The wrapper changes nothing a processor computes: every keyword reaches diffusers' processor (its
    ``Attention`` drops those the signature does not name: a generic wrapper lost ``image_rotary_emb``), and
    under ``torch.compile`` (inductor) it traces without a refusal where there is no context parallelism."""
    from diffusers_cudnn_fix._target_names import QWEN_PROCESSOR

    result = run(release_dir("0.38.0"), COMPILED_SCRIPT.format(target=QWEN_PROCESSOR))
    assert result["wrapped"] is True and result["tensors"] > 10, result
    assert result["eager"] <= 1e-6 and result["compiled"] <= 1e-5, result


# --- training: tiny QwenImage, padded prompts, Ulysses degree 2 (and 4), gloo ----------------------------------

#: The launcher: ``subprocess_cp_training``'s own jobs, one after the other in one interpreter, with a Ulysses
#: degree 4 case added (4 ranks: each holds 1 text + 1 image token and 1 of the 4 heads), the one-process
#: reference's backend set per release, and ``DIFFUSERS_CUDNN_FIX_SKIP`` per job (the control).
TRAIN_SCRIPT = """
import json, os, sys
import subprocess_cp_training as s
s.CASES["qwen_ulysses4"] = ("qwen", "ulysses4")
s.DEGREES["ulysses4"] = {{"ulysses_degree": 4}}
s.REFERENCE_BACKEND = {reference!r}
results = []
for job, skip in {jobs!r}:
    os.environ.pop("DIFFUSERS_CUDNN_FIX_SKIP", None)
    if skip:
        os.environ["DIFFUSERS_CUDNN_FIX_SKIP"] = skip
    s._check_job(job)
    results.append(s._run_job(job))
print(json.dumps({{"jobs": results}}))
sys.stdout.flush()
os._exit(0)
"""
QWEN, QWEN4, QWEN_CKPT = "qwen_ulysses", "qwen_ulysses4", "qwen_ulysses_ckpt"
#: 0.37.x build the joint mask 2-D, (B, S): only diffusers' ``native`` backend reads it (as [B, 1, 1, S]);
#: ``_native_math`` hands it to F.sdpa, which broadcasts it as (S_q, S_kv) and raises at batch 2.
REFERENCE = {"0.37.0": "native", "0.38.0": "_native_math", "0.39.0": "_native_math"}
#: Per release: Ulysses degree 2; on 0.38.0 also with gradient checkpointing (each block's forward, the reorder
#: included, re-run inside the backward) and at degree 4; on 0.37.0 and 0.38.0 the control (this fix skipped).
DEGREE_4 = ("0.38.0",)
CONTROL = ("0.37.0", "0.38.0")


def _train_jobs(version: str) -> list:
    jobs = [({"package": True, "modes": (QWEN, QWEN_CKPT) if version in DEGREE_4 else (QWEN,)}, None)]
    if version in CONTROL:
        jobs.append(({"package": True, "modes": (QWEN,)}, "qwen_joint_mask_order"))
    if version in DEGREE_4:
        jobs.append(({"package": True, "modes": (QWEN4,), "world_size": 4}, None))
    return jobs


def _assert_trained_right(result: dict, mode: str, world: int, record_property) -> None:
    entries = modes(result, mode)
    assert len(entries) == world
    forward_calls = 4 if mode == QWEN_CKPT else 2  # checkpointing runs each block's forward twice
    for entry in entries:
        assert entry["status"] == "ok", describe(entry)
        assert entry["cp"]["ulysses_degree"] == world, entry["cp"]
        for calls in entry["kernel_calls"]:  # both blocks through the cuDNN ops, forward and backward
            assert calls.get("_scaled_dot_product_cudnn_attention") == forward_calls, calls
            assert calls.get("_scaled_dot_product_cudnn_attention_backward") == 2, calls
    rank0 = entries[0]
    record_property(f"worst_rel_err_{mode}", worst(rank0))
    assert worst(rank0) <= RING_TOLERANCE, describe(rank0)
    assert rank0["local_worst"] > RING_TOLERANCE, rank0["local_worst"]  # the all-reduce is needed
    assert rank0["loss_rel_err"] <= LOSS_TOLERANCE, describe(rank0)
    for rank in result["ranks"]:
        assert rank["status_ok"] is True and rank["status_ok_end"] is True, rank
        assert rank["mask_env"] is None  # no switch set


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.37.0", "0.38.0", "0.39.0"])
def test_padded_qwen_trains_right_under_ulysses(version: str, record_property) -> None:
    """With the package and no switch: within 3 % of one process (0.37.0 - 0.38.0 through this fix; 0.39.0
    through upstream's gather, unchanged). The control, this fix skipped: 0.38.0 runs and is far off (the mask
    in the global order), 0.37.0's 2-D mask is refused by the stand-in kernel."""
    jobs = _train_jobs(version)
    script = TRAIN_SCRIPT.format(reference=REFERENCE[version], jobs=jobs)
    out = run(release_dir(version), script, timeout=300 * len(jobs), preloaded=True)
    results = dict(zip(((job.get("world_size", 2), skip) for job, skip in jobs), out["jobs"], strict=True))
    for result in results.values():
        result["_stderr"] = out["_stderr"]
        _check_job(version, True, None, result)
    _assert_trained_right(results[(2, None)], QWEN, 2, record_property)
    if version in DEGREE_4:
        _assert_trained_right(results[(2, None)], QWEN_CKPT, 2, record_property)
        _assert_trained_right(results[(4, None)], QWEN4, 4, record_property)
    if version in CONTROL:
        rank0 = modes(results[(2, "qwen_joint_mask_order")], QWEN)[0]
        record_property("control", describe(rank0))
        if version == "0.38.0":
            assert rank0["status"] == "ok" and worst(rank0) > MISREAD_MIN_REL_ERR, describe(rank0)
        else:
            assert rank0["status"] == "raised" and "does not broadcast" in rank0["error"], describe(rank0)
