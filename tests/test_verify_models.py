"""``diffusers-cudnn-fix verify --model M``: every diffusers transformer that declares a context-parallel plan
(docs/verify.md, "Models"; issue #42).

* The table (``diffusers_cudnn_fix/_verify_models.py``) covers every class that declares ``_cp_plan`` in every
  installed release from 0.36.0 to 0.42.1, read from the release's source files (no import): a model a future
  release adds fails here until the table has it. Each row's ``since`` is the first release with its plan.
* ``--model list`` (quick: no rank, no import of diffusers) says on each release which models it has, which
  declare a plan, and what each takes (``--mask padded``, ``--ring``); a model the release lacks, or one without
  a plan (Cosmos3), is a usage error (64) before any rank starts, naming the releases that have it or saying why.
* Marker ``slow``: on 0.41.0, CPU, two gloo ranks, ``native``: every model with the package gives PASS, or the
  refusal that names the bug (Helios training: ``cp_gather_grads``); without the package Helios trains wrong
  (MISMATCH) and LTX's text mask fails in diffusers' forward (exit 2, diffusers' own error). The model fixes
  compiled and checkpointed; and each model on one of 0.38.0, 0.39.0, 0.40.0 and 0.42.1 in turn, every one of
  those releases run (``MODEL_MATRIX=all``: every model on each; ``benchmarks/models_by_release.py`` measures
  every release both ways).
"""

from __future__ import annotations

import functools
import json
import os
import re

import pytest
from releases import RELEASES, release_dir
from test_verify import passes, result, verify

from diffusers_cudnn_fix._verify_models import MODELS

#: The releases with context parallelism (0.35.2 has none).
CP_RELEASES = RELEASES[RELEASES.index("0.36.0") :]
RELEASE = "0.41.0"


@functools.cache
def classes_with_a_plan(version: str) -> dict[str, str]:
    """class -> module file stem, for every class in diffusers ``version``'s models that declares ``_cp_plan``
    (a class-level ``_cp_plan = ...`` other than ``None``), read from the source text."""
    found: dict[str, str] = {}
    for path in sorted((release_dir(version) / "diffusers" / "models").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        classes = [(m.start(), m.group(1)) for m in re.finditer(r"^class (\w+)\(", text, re.M)]
        for plan in re.finditer(r"^    _cp_plan = (?!None\b)", text, re.M):
            owners = [name for start, name in classes if start < plan.start()]
            assert owners, f"{path}: a _cp_plan outside any class"
            found[owners[-1]] = path.stem
    return found


def has_class(version: str, entry) -> bool:
    path = release_dir(version) / "diffusers" / "models" / "transformers" / f"{entry.source}.py"
    return path.exists() and re.search(rf"^class {entry.cls}\(", path.read_text(encoding="utf-8"), re.M) is not None


@pytest.mark.parametrize("version", CP_RELEASES)
def test_the_table_covers_every_class_with_a_plan(version: str) -> None:
    declared = classes_with_a_plan(version)
    assert declared, f"no _cp_plan found in diffusers {version}: the grep is broken"
    rows = {entry.cls: entry for entry in MODELS.values()}
    missing = sorted(set(declared) - {cls for cls, entry in rows.items() if entry.plan})
    assert not missing, (
        f"diffusers {version} declares _cp_plan in {missing}: add each to diffusers_cudnn_fix/_verify_models.py "
        "(a tiny config and valid inputs) and measure it (docs/verify.md, 'Models')"
    )
    for cls, stem in declared.items():
        assert rows[cls].source == stem, (cls, stem)


@pytest.mark.parametrize("name", list(MODELS))
def test_each_row_names_the_first_release_that_has_it(name: str) -> None:
    """``since`` (named by verify when a release lacks the model): the first release whose class declares the plan;
    for a row without a plan (Cosmos3), the first release with the class, and no release declares one for it."""
    entry = MODELS[name]
    if entry.plan:
        having = [v for v in CP_RELEASES if entry.cls in classes_with_a_plan(v)]
    else:
        having = [v for v in CP_RELEASES if has_class(v, entry)]
        assert not [v for v in having if entry.cls in classes_with_a_plan(v)], f"{entry.cls} declares a plan now"
    assert having, f"{entry.cls}: in no installed release"
    assert entry.since == having[0], (name, having)
    assert having == list(CP_RELEASES[CP_RELEASES.index(having[0]) :]), f"{name}: missing from some later release"
    assert (entry.build is not None) == entry.plan


@pytest.mark.parametrize("version", ["0.36.0", "0.39.0", "0.41.0", "0.42.1"])
def test_model_list_says_what_each_release_has(version: str) -> None:
    code, out, err, _ = verify(version, "--model", "list", "--json", timeout=60)
    assert code == 0, f"{out}\n{err}"
    found = json.loads(out)
    assert found["diffusers"] == version
    declared = classes_with_a_plan(version)
    rows = {row["model"]: row for row in found["models"]}
    assert list(rows) == list(MODELS)
    for name, row in rows.items():
        entry = MODELS[name]
        if entry.cls in declared:
            assert row["here"] == "yes" and row["runs"], row
        elif has_class(version, entry):
            assert row["here"] == "no context-parallel plan" and not row["runs"], row
        else:
            assert row["here"] == f"not in this diffusers (diffusers {entry.since} and later)", row
    assert rows["qwen"]["mask"] == "encoder_hidden_states_mask" and rows["ltx"]["mask"] == "encoder_attention_mask"
    assert rows["flux"]["mask"] is None and rows["helios"]["mask"] is None
    # Ring, by backend (#49: it said "yes" for every model on a backend that cannot run ring).
    assert "_native_cudnn" in rows["flux"]["ring"] and "not native" in rows["flux"]["ring"], rows["flux"]
    code, out, err, _ = verify(version, "--model", "list", "--json", "--backend", "native", timeout=60)
    by_native = {row["model"]: row["ring"] for row in json.loads(out)["models"]}
    assert by_native["flux"].startswith("no: native returns no log-sum-exp"), by_native
    code, text, err, _ = verify(version, "--model", "list", timeout=60)
    assert code == 0 and text.count("\n") >= len(MODELS), f"{text}\n{err}"
    assert "helios: 40 blocks" in text and ("no context-parallel plan" in text) == (version != "0.36.0"), text


@pytest.mark.parametrize(
    ("version", "model", "says"),
    [
        ("0.39.0", "minimax_h3", "diffusers 0.39.0 has no MiniMaxH3Transformer3DModel (not in this diffusers; "
         "diffusers 0.40.0 and later have it)"),
        ("0.36.0", "helios", "diffusers 0.37.0 and later have it"),
        ("0.41.0", "cosmos3", "Cosmos3OmniTransformer declares no context-parallel plan (_cp_plan)"),
        ("0.41.0", "flux", "--model ltx"),  # --mask padded on a model without a text mask
    ],
)  # fmt: skip
def test_a_model_verify_cannot_run_is_a_usage_error_before_any_rank_starts(version: str, model: str, says: str) -> None:
    extra = ("--mask", "padded") if model == "flux" else ()
    code, out, err, _ = verify(version, "--nproc", "2", "--model", model, *extra, timeout=60)
    assert code == 64, f"{out}\n{err}"
    assert says in " ".join(err.split()) and "verify [1/6]" not in err, err


# ------------------------------------------------------------------------------------------------------------
# Every model on 0.41.0, two ranks (marker slow)
# ------------------------------------------------------------------------------------------------------------
#: model and options -> what verify gives with the package on 0.41.0 (docs/verify.md, "Models": measured).
WITH_THE_PACKAGE = {
    "flux": "pass",
    "flux2": "pass",
    "qwen --mask padded": "pass",
    "wan": "pass",
    "chronoedit": "pass",
    "minimax_h3": "pass",
    "helios": "pass",  # its plan gathers inside the model: the package corrects its gradients (#51)
    "ltx --mask padded": "pass",
    "ltx2 --mask padded": "pass",
}
#: Without the package: model and options -> (exit status, what the verdict names). LTX and LTX2 repeat the text
#: mask per head, and diffusers' Ulysses hands the rank's 8 heads the mask of all 16 (issue #42's "doesn't match
#: the broadcast shape" is the same bug with one head a rank, where the op adds the mask in place).
WITHOUT_THE_PACKAGE = {
    "helios": (1, "scale_shift_table"),
    "ltx --mask padded": (2, "RuntimeError: The size of tensor a (8) must match the size of tensor b (16) at"),
    "ltx2 --mask padded": (2, "RuntimeError: The size of tensor a (8) must match the size of tensor b (16) at"),
}


def test_every_model_of_the_table_is_measured() -> None:
    runnable = {name for name, entry in MODELS.items() if entry.plan}
    assert {case.split()[0] for case in WITH_THE_PACKAGE} == runnable


@pytest.mark.slow
@pytest.mark.parametrize("case", list(WITH_THE_PACKAGE))
def test_every_model_passes_or_is_refused_naming_the_bug_with_the_package(case: str) -> None:
    model, *options = case.split()
    code, out, err, _ = verify(RELEASE, "--json", "--nproc", "2", "--model", model, *options)
    found = result(out)
    expected = WITH_THE_PACKAGE[case]
    if expected == "pass":
        assert code == 0 and passes(found), f"{out}\n{err}"
        assert found["setup"]["model"] == model and found["setup"]["package"] == "on", found
        assert found["compared_params"] >= 20, found
    else:
        assert code == 2 and found["verdict"] == "could not run", f"{out}\n{err}"
        assert "UnsafeAttentionError" in found["reason"] and f"fixes.md#{expected}" in found["reason"], found


@pytest.mark.slow
@pytest.mark.parametrize("case", list(WITHOUT_THE_PACKAGE))
def test_without_the_package_helios_trains_wrong_and_ltx_masks_fail_in_diffusers(case: str) -> None:
    model, *options = case.split()
    code, out, err, _ = verify(RELEASE, "--nproc", "2", "--model", model, *options, "--without-package")
    status, names = WITHOUT_THE_PACKAGE[case]
    verdict = out.rstrip().splitlines()[-1]
    assert code == status, f"{out}\n{err}"
    assert verdict.startswith("verdict: MISMATCH" if status == 1 else "verdict: COULD NOT RUN"), verdict
    assert names in verdict, verdict
    if status == 2:  # diffusers' own failure is the bug the package corrects there: the verdict names the fix (#49)
        said = " ".join(verdict.split())
        assert "the bug the package corrects as ulysses_head_mask" in said, said
        assert "met in diffusers' TemplatedUlyssesAttention.forward" in said, said


@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "ring"), [(2, 2), (4, 2)], ids=["ring-2", "unified-2x2"])
def test_helios_under_ring_and_unified_attention(ranks: int, ring: int) -> None:
    """#51 where the backend runs ring (``_native_cudnn`` on the stand-in kernels, bf16; Helios' cross-attention,
    outside context parallelism, on the math kernel, ``verify_seams``): with the package its gradients are one
    process's within the bf16 noise (measured 3.0 %); without it far off (118 % and 350 %)."""
    options = ("--json", "--nproc", str(ranks), "--ring", str(ring), "--backend", "_native_cudnn", "--model", "helios")
    code, out, err, _ = verify(RELEASE, *options, "--preload", "verify_seams", timeout=300)
    found = result(out)
    assert code == 0 and passes(found) and "cp_gather_grads" in found["exercised"], f"{out}\n{err}"
    code, out, err, _ = verify(RELEASE, *options, "--preload", "verify_seams", "--without-package", timeout=300)
    found = result(out)
    assert code == 1 and found["verdict"] == "mismatch", f"{out}\n{err}"
    assert max(row["error"] for row in found["rows"]) > 0.5, found["rows"]


@pytest.mark.slow
@pytest.mark.parametrize("package", [True, False], ids=["package", "without-package"])
def test_ltx_text_mask_under_unified_attention(package: bool) -> None:
    """Ulysses 2 x ring 2 (4 ranks) on the cuDNN stand-ins: LTX's per-head text mask reaches the ring with every
    head while q holds this rank's heads. The package's ring cuts each step's mask to them (after gathering it
    along the keys); without it the step's op cannot broadcast the mask (found by this table's first runs)."""
    options = ("--nproc", "4", "--ring", "2", "--backend", "_native_cudnn", "--preload", "verify_seams")
    flag = () if package else ("--without-package",)
    code, out, err, _ = verify(RELEASE, *options, "--model", "ltx", "--mask", "padded", *flag, timeout=180)
    verdict = out.rstrip().splitlines()[-1]
    if package:
        assert code == 0 and verdict.startswith("verdict: PASS"), f"{out}\n{err}"
        assert "ring_grad_route" in out and "ulysses_head_mask" in out.split("exercised by this run")[1], out
    else:
        assert code == 2 and "does not broadcast" in verdict, f"{out}\n{err}"


#: The model-level fixes in the stacks users train in (0.41.0, two ranks, ``native``): torch.compile (inductor) of
#: the parallelised transformer, and gradient checkpointing. LTX2's completed plan and LTX's mask fixes must pass
#: there as eagerly; Helios' training must be refused there too (its plan gathers inside the model).
STACKS = {
    "ltx2 --mask padded --compile": "pass",
    "ltx2 --mask padded --checkpointing": "pass",
    "ltx --mask padded --compile": "pass",
    "ltx --mask padded --checkpointing": "pass",
    "helios --compile": "pass",
    "helios --checkpointing": "pass",
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(STACKS))
def test_model_fixes_hold_compiled_and_checkpointed(case: str) -> None:
    model, *options = case.split()
    code, out, err, _ = verify(RELEASE, "--json", "--nproc", "2", "--model", model, *options, timeout=400)
    found = result(out)
    if STACKS[case] == "pass":
        assert code == 0 and passes(found), f"{out}\n{err}"
        assert found["compared_params"] >= 20, found
    else:
        assert code == 2 and "UnsafeAttentionError" in found["reason"], f"{out}\n{err}"
        assert f"fixes.md#{STACKS[case]}" in found["reason"], found


#: Every model on the other releases a CPU can train under context parallelism with ``native`` (0.36.0 - 0.37.1
#: cannot: diffusers' own backward op there; verify says so), with the package: what
#: benchmarks/models_by_release.py measured (docs/verify.md, "Every release"). On 0.38.0 LTX's and LTX2's masks
#: fail in diffusers' forward (it gathers no key-sharded mask for Ulysses before 0.39.0): a loud error the package
#: leaves as it is.
OTHER_RELEASES = ("0.38.0", "0.39.0", "0.40.0", "0.42.1")


def _by_release() -> list[tuple[str, str, str]]:
    """By default each model on one of the other releases, taken in turn, so that every model and every one of
    those releases is run (each case starts two ranks; the whole matrix is what the benchmark measures);
    ``MODEL_MATRIX=all``: every model on every one of them."""
    every = os.environ.get("MODEL_MATRIX", "").strip().lower() == "all"
    cases = []
    for turn, (case, expected) in enumerate(WITH_THE_PACKAGE.items()):
        model = case.split()[0]
        having = [version for version in OTHER_RELEASES if has_class(version, MODELS[model])]
        rotated = having[turn % len(having) :] + having[: turn % len(having)]
        for version in having if every else rotated[:1]:
            cases.append((version, case, "diffusers" if version == "0.38.0" and model in ("ltx", "ltx2") else expected))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize(("version", "case", "expected"), _by_release())
def test_every_model_on_every_release_a_cpu_can_train(version: str, case: str, expected: str) -> None:
    model, *options = case.split()
    seams = ("--preload", "verify_seams")  # 0.42.x on a CPU-only torch
    code, out, err, _ = verify(version, "--json", "--nproc", "2", "--model", model, *options, *seams)
    found = result(out)
    if expected == "pass":
        assert code == 0 and passes(found), f"{out}\n{err}"
    elif expected == "diffusers":
        assert code == 2 and "must match the size of tensor" in found["reason"], found
        assert "UnsafeAttentionError" not in found["reason"], found
    else:
        assert code == 2 and "UnsafeAttentionError" in found["reason"] and f"fixes.md#{expected}" in found["reason"]
