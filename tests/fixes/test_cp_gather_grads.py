"""``cp_gather_grads`` (fixes/cp_gather_grads.py): a context-parallel plan that gathers inside the model (Helios)
trains silently wrong (issue #42, item 1): the output is exact, the parameters run replicated between the plan's
split/gather pairs get wrong gradients. The package corrects it (#51): for such a plan alone, each gather's
backward sums the gradient over the ranks before diffusers keeps this rank's chunk (a reduce-scatter), and the
gradient entering the model's outputs is divided by the world size.

* The check: broken on every release with context parallelism (diffusers' all-gather backward keeps this rank's
  chunk), the package's ``enable_parallelism`` passes it; absent on 0.35.2.
* The classifier: every plan shipped in 0.36.0 - 0.42.1 as docs/fixes.md's table says (only Helios gathers inside).
* The policy: ``enable_parallelism``'s replacement on a stand-in model, in process, with a stand-in sum over the
  ranks: the gathered gradient summed over the hook's group, the output's divided by the world size; inference
  unchanged; a plan gathering at its end and a single rank left alone (their gathers and outputs untouched).
* Two ranks on a tiny real Helios (with the package: every gradient as one process; without: the control):
  tests/test_cp_models.py; under ring and unified attention, compiled and checkpointed: tests/test_verify_models.py.
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
CORRECTION = True  # a correction: the package makes the result right (False: a guard)


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_the_check_finds_the_bug_on_every_release_with_context_parallelism(version: str) -> None:
    """Broken as shipped and corrected by the package's ``enable_parallelism`` where the release has context
    parallelism; not applicable on 0.35.2, which has none."""
    found = fix_states(version, models_first=True)[FIX]
    expected = ["broken", True, "fixed"] if version in CARRIES else ["absent", False, "not_applicable"]
    assert found == expected, version


@pytest.mark.slow
def test_the_check_with_only_the_attention_module_imported() -> None:
    """``import diffusers.models.attention_dispatch`` alone (ModelMixin not imported yet): the same finding, no
    warning. Needs the hook to import ModelMixin's module first (``_target_names.IMPORTED_FIRST``)."""
    for version in ("0.36.0", "0.42.1"):
        assert fix_states(version)[FIX] == ["broken", True, "fixed"], version


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


class _Gathering:
    """A stand-in model of two linear maps whose first one's output goes through the gather hook's post-forward (an
    identity: one process), as diffusers' hook registry calls it; the stand-in of diffusers' ``enable_parallelism``
    puts that hook on it."""

    def __init__(self) -> None:
        import torch

        class Net(torch.nn.Sequential):
            def forward(self, x):  # the first layer's output through the hook's post-forward, as diffusers' registry
                hook = next(iter(self[0]._diffusers_hook.hooks.values()))
                return self[1](hook.fn_ref.post_forward(self[0], self[0](x)))

        self.module = Net(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False))
        with torch.no_grad():
            self.module[0].weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
            self.module[1].weight.copy_(torch.tensor([[0.5, -1.0], [2.0, 1.5]]))
        self.group = object()
        self.summed: list = []

    def register(self, module, **kwargs) -> None:
        mesh = types.SimpleNamespace(get_group=lambda: self.group)
        hook = types.SimpleNamespace(
            metadata=[_Gather()], fn_ref=types.SimpleNamespace(post_forward=lambda m, out: out),
            parallel_config=types.SimpleNamespace(_flattened_mesh=mesh),
        )  # fmt: skip
        module[0]._diffusers_hook = types.SimpleNamespace(hooks={"cp_output---blocks.0.attn": hook})
        self.hook = hook

    def all_reduce(self, tensor, group):
        self.summed.append(group)
        return tensor * 2  # two equal ranks

    def run(self, x, enable: bool, plan: dict, degree: int = 2):
        from diffusers_cudnn_fix.targets.models import enable_parallelism

        if enable:
            config = types.SimpleNamespace(
                context_parallel_config=types.SimpleNamespace(ulysses_degree=degree, ring_degree=1)
            )
            steps = frozenset({FIX})
            enable_parallelism(self.register, steps, self.all_reduce)(self.module, config=config, cp_plan=plan)
        elif not hasattr(self, "hook"):
            self.register(self.module)
        return self.module(x)


PLAN_INSIDE = {"blocks.*.attn": {"x": _Split()}, "blocks.0.attn": _Gather()}


def _grads(model: _Gathering) -> list:
    return [p.grad.clone() for p in model.module.parameters()]


def test_a_model_gathering_inside_gets_its_gradients_summed_and_its_output_divided() -> None:
    """As one of two equal ranks: the gathered gradient summed over the hook's group (doubled), the output's halved:
    the layer before the gather gets one process's gradient, the one after it half (its share of the sum)."""
    import torch

    x = torch.tensor([[1.0, -2.0]])
    corrected, shipped = _Gathering(), _Gathering()
    corrected.run(x, True, PLAN_INSIDE).square().sum().backward()
    shipped.run(x, False, PLAN_INSIDE).square().sum().backward()
    (before, after), (before_ref, after_ref) = _grads(corrected), _grads(shipped)
    assert corrected.summed == [corrected.group]
    assert torch.equal(before, before_ref) and torch.equal(after * 2, after_ref)
    with torch.no_grad():  # inference: exactly the shipped output, nothing summed
        assert torch.equal(corrected.run(x, False, PLAN_INSIDE), shipped.run(x, False, PLAN_INSIDE))
    assert corrected.summed == [corrected.group]


@pytest.mark.parametrize("case", ["gathers_at_the_end", "one_rank"])
def test_other_plans_and_one_rank_train_as_shipped(case: str) -> None:
    """A plan that gathers only where it stops splitting (Flux, QwenImage, Wan, LTX), and a single rank: nothing
    summed, nothing divided: the gradients diffusers gives, bit for bit."""
    import torch

    plan = {"": {"x": _Split()}, "proj_out": _Gather()} if case == "gathers_at_the_end" else PLAN_INSIDE
    x = torch.tensor([[1.0, -2.0]])
    corrected, shipped = _Gathering(), _Gathering()
    corrected.run(x, True, plan, degree=2 if case == "gathers_at_the_end" else 1).square().sum().backward()
    shipped.run(x, False, plan).square().sum().backward()
    assert corrected.summed == []
    assert all(torch.equal(a, b) for a, b in zip(_grads(corrected), _grads(shipped), strict=True))
