"""``cp_gather_grads`` (fixes/cp_gather_grads.py): a context-parallel plan that gathers inside the model (Helios)
trains silently wrong (issue #42, item 1): the output is exact, the parameters run replicated between the plan's
split/gather pairs get wrong gradients. The package refuses such a model's backward under context parallelism;
its inference runs as shipped.

* The check: broken on every release with context parallelism (diffusers' all-gather backward keeps this rank's
  chunk), the package's ``enable_parallelism`` passes it; absent on 0.35.2.
* The classifier: every plan shipped in 0.36.0 - 0.42.1 as docs/fixes.md's table says (only Helios gathers inside).
* The policy: ``enable_parallelism``'s replacement on a stand-in model, in process (no process group): inference
  runs, training is refused, a plan gathering at its end and a single rank are left alone.
* The two-rank control and the refusal on a tiny real Helios: tests/test_cp_models.py.
"""

from __future__ import annotations

import types

import pytest
from releases import RELEASES, WITH_OPS, fix_states, release_dir, run

FIX = "cp_gather_grads"
#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them).
# diffusers' all-gather backward keeps this rank's chunk of a gradient it assumes equal on every rank (every
# release with context parallelism); a plan that gathers inside the model (Helios) trains wrong with it.
CARRIES = WITH_OPS
CORRECTION = False  # a guard: the package refuses or converts the input (True: a correction)


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_the_check_finds_the_bug_on_every_release_with_context_parallelism(version: str) -> None:
    """Broken as shipped and guarded by the package's ``enable_parallelism`` where the release has context
    parallelism; not applicable on 0.35.2, which has none."""
    found = fix_states(version, models_first=True)[FIX]
    expected = ["broken", True, "guarded"] if version in CARRIES else ["absent", False, "not_applicable"]
    assert found == expected, version


@pytest.mark.slow
def test_the_check_with_only_the_attention_module_imported() -> None:
    """``import diffusers.models.attention_dispatch`` alone (ModelMixin not imported yet): the same finding, no
    warning. Needs the hook to import ModelMixin's module first (``_target_names.IMPORTED_FIRST``)."""
    for version in ("0.36.0", "0.42.1"):
        assert fix_states(version)[FIX] == ["broken", True, "guarded"], version


def _plans_script() -> str:
    return r"""
import importlib, json, os, warnings
warnings.filterwarnings("ignore")
import diffusers
from diffusers_cudnn_fix.fixes.cp_gather_grads import gathers_inside
root = os.path.dirname(diffusers.models.__file__)
found = {}
for folder, _, files in os.walk(root):
    for name in sorted(files):
        path = os.path.join(folder, name)
        if not name.endswith(".py") or "_cp_plan" not in open(path).read():
            continue
        module = importlib.import_module("diffusers.models." + os.path.relpath(path, root)[:-3].replace(os.sep, "."))
        for cls in vars(module).values():
            if isinstance(cls, type) and cls.__module__ == module.__name__ and cls.__dict__.get("_cp_plan"):
                found[cls.__name__] = gathers_inside(cls._cp_plan)
print(json.dumps(found))
"""


#: docs/fixes.md's table: the plans that gather inside the model, by release; every other shipped plan gathers
#: once, at its end.
INSIDE = {
    "0.37.0": {"HeliosTransformer3DModel": ["blocks.*"]},
    "0.37.1": {"HeliosTransformer3DModel": ["blocks.*"]},
    **{
        v: {"HeliosTransformer3DModel": ["blocks.*.attn1", "blocks.*.attn2", "blocks.*.ffn"]}
        for v in ("0.38.0", "0.39.0", "0.40.0", "0.41.0", "0.42.0", "0.42.1")
    },
}
AT_THE_END = {"FluxTransformer2DModel", "Flux2Transformer2DModel", "QwenImageTransformer2DModel"}
AT_THE_END |= {"WanTransformer3DModel", "LTXVideoTransformer3DModel", "ChronoEditTransformer3DModel"}


@pytest.mark.slow
@pytest.mark.parametrize("version", [v for v in RELEASES if v != "0.35.2"])
def test_every_shipped_plan_is_classified_as_the_docs_table_says(version: str) -> None:
    found = run(release_dir(version), _plans_script(), preloaded=True)
    found.pop("_stderr")
    assert AT_THE_END <= found.keys(), sorted(found)
    assert {name: mods for name, mods in found.items() if mods} == INSIDE.get(version, {}), found


class _Split:
    def __init__(self, split_output: bool = False) -> None:
        self.split_dim, self.split_output = 1, split_output


class _Gather:
    gather_dim = 1


def test_the_classifier_reads_the_plans_structure() -> None:
    from diffusers_cudnn_fix.fixes.cp_gather_grads import gathers_inside

    pairs = {"blocks.*.attn": {"x": _Split()}, **{f"blocks.{i}.attn": _Gather() for i in range(3)}}
    assert gathers_inside(pairs) == ["blocks.*.attn"]
    at_the_end = {"": {"x": _Split()}, "rope": {0: _Split(split_output=True)}, "proj_out": _Gather()}
    assert gathers_inside(at_the_end) == []
    assert gathers_inside({"rope": {0: _Split(split_output=True)}, "rope.x": _Gather()}) == []
    assert gathers_inside({"blocks.*": {"t": _Split()}, "blocks.3": [_Gather(), _Gather()]}) == ["blocks.*"]
    assert gathers_inside({"blocks.*": {"t": _Split()}, "blocks.3.ffn": _Gather()}) == []  # another depth
    assert gathers_inside(None) == [] and gathers_inside({"": _Gather()}) == []


def _stand_in(plan: dict, *, degree: int = 2):
    """A linear model, the package's ``enable_parallelism`` around a stand-in of diffusers' own (which only
    records it was called), applied with ``plan`` at Ulysses ``degree``."""
    import torch

    from diffusers_cudnn_fix.targets.models import enable_parallelism

    calls: list = []
    model = torch.nn.Linear(2, 2)
    config = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(ulysses_degree=degree, ring_degree=1))
    enable_parallelism(lambda self, **kwargs: calls.append(kwargs))(model, config=config, cp_plan=plan)
    assert len(calls) == 1 and calls[0]["cp_plan"] is plan
    return model


def test_training_a_model_gathering_inside_is_refused_and_inference_runs() -> None:
    import torch

    from diffusers_cudnn_fix import UnsafeAttentionError

    model = _stand_in({"blocks.*.attn": {"x": _Split()}, "blocks.0.attn": _Gather()})
    with torch.no_grad():
        model(torch.ones(1, 2))
    with pytest.raises(UnsafeAttentionError, match=r"gathers the output of blocks\.\*\.attn inside the model"):
        model(torch.ones(1, 2)).sum().backward()
    assert model.weight.grad is None


@pytest.mark.parametrize("case", ["gathers_at_the_end", "one_rank"])
def test_other_plans_and_one_rank_train_as_shipped(case: str) -> None:
    import torch

    plan = {"": {"x": _Split()}, "proj_out": _Gather()} if case == "gathers_at_the_end" else None
    inside = {"blocks.*.attn": {"x": _Split()}, "blocks.0.attn": _Gather()}
    model = _stand_in(plan or inside, degree=2 if plan else 1)
    model(torch.ones(1, 2)).sum().backward()
    assert model.weight.grad is not None
