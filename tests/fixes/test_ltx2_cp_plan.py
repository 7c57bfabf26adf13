"""``ltx2_cp_plan`` (fixes/ltx2_cp_plan.py): LTX2's context-parallel plan splits ``rope`` but not
``cross_attn_rope`` and never shards the audio stream (issue #42, item 4). The package hands diffusers the plan
completed; a plan of that shape on a model whose structure it does not know is refused.

* The check: broken on every release with LTX2 (0.37.0 on), the package's ``enable_parallelism`` passes it; absent
  on 0.35.2 and 0.36.0, which have no LTX2.
* The classifier: every plan shipped in 0.37.0 and 0.42.1 (each model built on the meta device): only LTX2's leaves
  modules of the class of one it splits the output of unsplit; the package completes it.
* The policy: ``enable_parallelism``'s replacement on stand-in models, in process (no process group).
* Two ranks on a tiny real LTX2 (with the package: output and every gradient as one process; without it, or with
  the fix skipped: the forward fails; a plan splitting ``cross_attn_rope`` alone trains wrong): tests/test_cp_models.py.
"""

from __future__ import annotations

import types

import pytest
from releases import RELEASES, WITH_OPS, fix_states, release_dir, run

FIX = "ltx2_cp_plan"
#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them).
# LTX2 (0.37.0 on): its plan splits rope but not cross_attn_rope and leaves the audio stream unsharded.
CARRIES = WITH_OPS - {"0.36.0"}
CORRECTION = True  # a correction: the package makes the result right (False: a guard)


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_the_check_finds_the_bug_on_every_release_with_ltx2(version: str) -> None:
    found = fix_states(version, models_first=True)[FIX]
    expected = ["broken", True, "fixed"] if version in CARRIES else ["absent", False, "not_applicable"]
    assert found == expected, version


_PLANS = r"""
import importlib, json, os, warnings
warnings.filterwarnings("ignore")
import torch, diffusers
from diffusers_cudnn_fix.fixes.ltx2_cp_plan import plan_for, unsplit_siblings
root = os.path.dirname(diffusers.models.__file__)
found, completed = {}, None
for folder, _, files in os.walk(root):
    for name in sorted(files):
        path = os.path.join(folder, name)
        if not name.endswith(".py") or "_cp_plan" not in open(path).read():
            continue
        module = importlib.import_module("diffusers.models." + os.path.relpath(path, root)[:-3].replace(os.sep, "."))
        for cls in vars(module).values():
            if isinstance(cls, type) and cls.__module__ == module.__name__ and cls.__dict__.get("_cp_plan"):
                with torch.device("meta"):
                    model = cls()
                found[cls.__name__] = unsplit_siblings(model, cls._cp_plan)[1]
                if found[cls.__name__]:
                    config = type("C", (), {"context_parallel_config": type("P", (), {"ulysses_degree": 2,
                                                                                      "ring_degree": 1})})
                    plan = plan_for(model, config, cls._cp_plan)
                    completed = {k: sorted(map(str, v)) if isinstance(v, dict) else type(v).__name__
                                 for k, v in plan.items()}
print(json.dumps({"found": found, "completed": completed}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.37.0", "0.42.1"])
def test_only_ltx2s_shipped_plan_leaves_a_sibling_unsplit_and_the_package_completes_it(version: str) -> None:
    result = run(release_dir(version), _PLANS, preloaded=True)
    incomplete = {name: unsplit for name, unsplit in result["found"].items() if unsplit}
    assert incomplete == {"LTX2VideoTransformer3DModel": ["audio_rope", "cross_attn_rope", "cross_attn_audio_rope"]}
    assert {"FluxTransformer2DModel", "WanTransformer3DModel", "LTXVideoTransformer3DModel"} <= result["found"].keys()
    completed = result["completed"]
    assert completed[""] == sorted(
        ["hidden_states", "encoder_hidden_states", "audio_hidden_states", "audio_encoder_hidden_states",
         "encoder_attention_mask", "audio_encoder_attention_mask", "timestep"]
    )  # fmt: skip
    for rope in ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope"):
        assert completed[rope] == ["0", "1"], completed
    assert completed["proj_out"] == completed["audio_proj_out"] == "ContextParallelOutput"


class _In:
    def __init__(self, split_dim: int = 1, expected_dims: int | None = None, split_output: bool = False) -> None:
        self.split_dim, self.expected_dims, self.split_output = split_dim, expected_dims, split_output


class _Out:
    def __init__(self, gather_dim: int = 1, expected_dims: int | None = None) -> None:
        self.gather_dim, self.expected_dims = gather_dim, expected_dims


def _shipped_plan() -> dict:
    """LTX2's own plan's structure."""
    rope = {0: _In(1, 3, True), 1: _In(1, 3, True)}
    entry = {"hidden_states": _In(1, 3), "encoder_hidden_states": _In(1, 3), "encoder_attention_mask": _In(1, 2)}
    return {"": entry, "rope": rope, "proj_out": _Out(1, 3)}


def _ltx2_like(rope_type: str = "interleaved"):
    import torch

    from diffusers_cudnn_fix.fixes.ltx2_cp_plan import _StandInModel

    model = _StandInModel()
    for name in ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope"):
        model.get_submodule(name).rope_type = rope_type
    assert isinstance(model, torch.nn.Module)
    return model


def _enable(model, plan, *, degree: int = 2) -> list:
    """The package's ``enable_parallelism`` around a stand-in of diffusers' own (which records the plan handed)."""
    from diffusers_cudnn_fix.targets.models import enable_parallelism

    handed: list = []
    config = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(ulysses_degree=degree, ring_degree=1))
    enable_parallelism(lambda self, **kwargs: handed.append(kwargs["cp_plan"]))(model, config=config, cp_plan=plan)
    return handed


@pytest.mark.parametrize("rope_type", ["interleaved", "split"])
def test_ltx2s_plan_is_completed(rope_type: str) -> None:
    plan = _shipped_plan()
    (handed,) = _enable(_ltx2_like(rope_type), plan)
    assert handed is not plan and plan.keys() == {"", "rope", "proj_out"}  # the plan given is left as it was
    assert handed[""]["hidden_states"] is plan[""]["hidden_states"] or handed[""]["hidden_states"].split_dim == 1
    for name in ("audio_hidden_states", "audio_encoder_hidden_states"):
        assert (handed[""][name].split_dim, handed[""][name].expected_dims) == (1, 3)
    for name in ("audio_encoder_attention_mask", "timestep"):
        assert (handed[""][name].split_dim, handed[""][name].expected_dims) == (1, 2)
    layout = (2, 4) if rope_type == "split" else (1, 3)
    for rope in ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope"):
        entry = handed[rope]
        assert sorted(entry) == [0, 1] and all(isinstance(item, _In) and item.split_output for item in entry.values())
        assert {(item.split_dim, item.expected_dims) for item in entry.values()} == {layout}
    assert isinstance(handed["audio_proj_out"], _Out) and handed["audio_proj_out"].gather_dim == 1


def test_a_complete_plan_and_one_rank_are_left_alone() -> None:
    plan = _shipped_plan()
    for name in ("audio_rope", "cross_attn_rope", "cross_attn_audio_rope"):
        plan[name] = plan["rope"]
    assert _enable(_ltx2_like(), plan)[0] is plan
    shipped = _shipped_plan()
    assert _enable(_ltx2_like(), shipped, degree=1)[0] is shipped


def test_an_unknown_structure_is_refused() -> None:
    """A plan leaving a module of the class of one it splits unsplit, on a model that is not LTX2's structure."""
    import torch

    from diffusers_cudnn_fix import UnsafeAttentionError

    class Rope(torch.nn.Module):
        pass

    model = torch.nn.Module()
    model.rope, model.other_rope = Rope(), Rope()
    plan = {"": {"x": _In(1, 3)}, "rope": {0: _In(1, 3, True)}, "proj_out": _Out()}
    with pytest.raises(UnsafeAttentionError, match=r"splits the output of rope but not of other_rope") as info:
        _enable(model, plan)
    assert "enable_parallelism(cp_plan=...)" in str(info.value)
    assert "explain fixes.md#ltx2_cp_plan" in str(info.value)


def test_the_check_tells_diffusers_own_from_the_package() -> None:
    """The control in process: diffusers' own ``enable_parallelism`` (a stand-in: it applies the plan as given)
    hands the plan unchanged, so the check says broken; the package's, built around it, passes."""
    from diffusers_cudnn_fix.fixes.ltx2_cp_plan import _plan_handed, _StandInModel, unsplit_siblings
    from diffusers_cudnn_fix.targets.models import enable_parallelism

    def shipped(self, **kwargs):
        return None

    class Package:  # a lookup showing the package's replacement, built again around the check's stand-in
        def __call__(self, name: str) -> object:
            return enable_parallelism(shipped, frozenset({FIX}))

        def built(self, name: str, around: object, **seams: object) -> object:
            return enable_parallelism(around, frozenset({FIX}))

    plan = _plan_handed(lambda name: shipped)
    assert unsplit_siblings(_StandInModel(), plan)[1] == ["audio_rope", "cross_attn_rope", "cross_attn_audio_rope"]
    ours = _plan_handed(Package())
    assert unsplit_siblings(_StandInModel(), ours)[1] == [] and "audio_hidden_states" in ours[""]
