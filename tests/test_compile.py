"""The cuDNN context-parallel path under ``torch.compile``: every mask kind, the op pair and Ulysses, on CPU.

Each release runs ``subprocess_compile_matrix`` in a fresh interpreter (stand-in kernels, one-process gloo group): the
same forward and backward not compiled, through ``aot_eager`` and through inductor (both ``fullgraph=True``), with no
mask, bool, additive bf16 (q's dtype) and additive fp32 masks, each as a key-padding [B, 1, 1, S] and a [B, 1, S, S]
mask, through the op pair and through diffusers' own ``TemplatedUlyssesAttention`` (which all-gathers a
sequence-local mask from 0.39.0), and through the op pair with one head and q/k/v one element off 16 bytes (a
view diffusers' ``.contiguous()`` hands on as it is, which the stand-in misreads as cuDNN does). Every case must
pass the fp32 rule, and a compiled case must equal the eager one.

Releases: ``aot_eager`` on every release whose op code differs (0.36.0 without Ulysses' mask gather, 0.37.0,
0.38.0, 0.39.0, 0.40.0 with the upstream fixes, 0.42.1; 0.37.1, 0.41.0 and 0.42.0 ship the same attention code
as their neighbours). Inductor (it compiles C++, the costliest part of the suite per case) where it proves what
``aot_eager`` cannot: its code generation for the package's handling of a mask that diffusers all-gathers (the
torch fault below), i.e. through Ulysses with every mask kind, on 0.39.0: the first release that gathers the
mask, and the one where every fix of the package is inside the graph (0.42.1's Ulysses code is 0.39.0's; its
op pair carries upstream's fixes and runs under ``aot_eager``). Through the op pair, inductor generates code
for the same conversions without the gather (right on the H200 on 0.36.0, 0.39.0 and 0.42.1,
``tests/test_gpu_compile.py``). ``COMPILE_MATRIX=all`` adds inductor on every path on 0.39.0 and 0.42.1.
Inductor compiles in the test's process (``TORCHINDUCTOR_COMPILE_THREADS=1``: a pool of compile workers,
each importing torch, costs more than it saves on a few small graphs). Import orders alternate.

``test_inductor_mistypes_gathered_bool_tensors`` keeps the torch fault the package works around in view: if
a torch release fixes it, the test fails and docs/kernel-facts.md needs its update.
"""

from __future__ import annotations

import os

import pytest
from releases import release_dir, run

pytestmark = pytest.mark.slow

ONE_HEAD = "pair-odd-offset-h1"
FULLGRAPH = ("aot_eager", "inductor")

#: (release, import order, compiler settings).
MATRIX = (
    ("0.36.0", "package_first", ("eager", "aot_eager")),
    ("0.37.0", "diffusers_first", ("eager", "aot_eager")),
    ("0.38.0", "package_first", ("eager", "aot_eager")),
    ("0.39.0", "diffusers_first", ("eager", "aot_eager", "inductor:ulysses", "aot_eager-graph-breaks-allowed")),
    ("0.40.0", "diffusers_first", ("eager", "aot_eager")),
    ("0.42.1", "package_first", ("eager", "aot_eager")),
)
if os.environ.get("COMPILE_MATRIX", "").strip().lower() == "all":
    MATRIX = tuple(
        (v, o, (*(b for b in backends if not b.startswith("inductor")), "inductor"))
        if v in ("0.39.0", "0.42.1")
        else (v, o, backends)
        for v, o, backends in MATRIX
    )
#: Inductor in the test's own process (see the module's docstring); the cache in the releases' folder.
INDUCTOR_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
#: Cases per path (``subprocess_compile_matrix``): every mask through the op pair and Ulysses; no mask and the bool
#: key-padding mask through the one-head view off 16 bytes.
CASES_PER_PATH = {"pair": 7, "ulysses": 7, ONE_HEAD: 2}


def expected_cases(backends: tuple[str, ...]) -> int:
    """How many cases ``backends`` run (a setting ``name:path,path`` runs those paths only)."""
    total = 0
    for backend in backends:
        only = backend.partition(":")[2]
        total += sum(n for path, n in CASES_PER_PATH.items() if not only or path in only.split(","))
    return total


@pytest.mark.parametrize(("version", "order", "backends"), MATRIX, ids=[f"{v}-{o}" for v, o, _ in MATRIX])
def test_compiled_masked_attention_matches_eager(version: str, order: str, backends: tuple[str, ...]) -> None:
    result = run(
        release_dir(version),
        f"import subprocess_compile_matrix; subprocess_compile_matrix.main({order!r}, {backends!r})",
        env={**INDUCTOR_ENV, "TORCHINDUCTOR_CACHE_DIR": str(release_dir(version).parent / "inductor")},
        timeout=600,
        preloaded=True,
    )
    assert result["version"] == version and result["package"]
    cases = result["cases"]
    assert len(cases) == expected_cases(backends), sorted(cases)
    # One head (or one query position) per rank inside a compiled graph gave wrong gradients on the H200, so the
    # package refuses it while tracing: with fullgraph=True that is an error naming the cause; otherwise dynamo
    # runs the call eagerly, and it is right.
    refused = {name for name in cases if ONE_HEAD in name and name.split("/")[0] in FULLGRAPH}
    for name in refused:
        assert cases[name]["status"] == "raised" and "inside a torch.compile graph" in cases[name]["error"], cases[name]
    bad = {name: case for name, case in cases.items() if case["status"] != "pass" and name not in refused}
    assert not bad, bad
    # Compiled code must give the eager answer: the stand-ins and the conversions are the same arithmetic.
    drift = {name: case["from_eager"] for name, case in cases.items() if case.get("from_eager", 0.0) > 1e-3}
    assert not drift, drift


GATHER_BOOL = """
import json, tempfile, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mkstemp()[1], rank=0, world_size=1)
def gather(mask):
    parts = [torch.empty_like(mask)]
    dist.all_gather(parts, mask)
    return torch.cat(parts, dim=-1)
mask = torch.rand(2, 8) > 0.3
compiled = torch.compile(gather, backend="inductor", fullgraph=True)(mask)
print(json.dumps({"torch": torch.__version__, "eager": str(gather(mask).dtype), "compiled": str(compiled.dtype)}))
import os; os._exit(0)
"""


def test_inductor_mistypes_gathered_bool_tensors(tmp_path) -> None:
    """The smallest reproducer of the torch fault (docs/kernel-facts.md): inductor lowers ``all_gather`` of a
    bool tensor into an int64 buffer that the graph still types as bool."""
    result = run(
        None, GATHER_BOOL, env={**INDUCTOR_ENV, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}, timeout=300, preloaded=True
    )
    assert result["eager"] == "torch.bool"
    assert result["compiled"] == "torch.int64", (
        f"torch {result['torch']} gathers a bool tensor as {result['compiled']} under inductor: the fault "
        "the Ulysses mask conversion works around may be fixed; update docs/kernel-facts.md"
    )
