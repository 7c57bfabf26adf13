"""Two-rank context-parallel training of tiny real Flux and QwenImage transformers on CPU, through diffusers' CP code.

Run in a fresh interpreter whose ``PYTHONPATH`` starts with one diffusers release (``releases.run`` does it)::

    python -c "import subprocess_cp_training as s; s.launch(package=True)"
    python -c "import subprocess_cp_training as s; s.launch(package=True, modes=('qwen_ulysses',), mask_switch='warn')"
    python -c "import subprocess_cp_training as s; s.launch_many([{'package': True}, {'package': False}])"

``launch`` imports torch and ``torch._dynamo`` (nothing else: no diffusers, no package, no thread, no process
group), forks the rank processes (two, or four for unified attention) and waits for them under a deadline.
Forking after torch saves each rank torch's import, most of its CPU time; diffusers and the package are
imported in each rank, in that rank's order. ``launch_many`` runs several such jobs one after the other
from the one launcher (the test runs all the jobs of a release so). Each rank runs on one torch thread and:

1. imports ``diffusers_cudnn_fix`` first when ``package`` is true (never otherwise), then diffusers;
2. joins a 2-rank gloo group (``file://`` rendezvous in a temporary folder: no network at all); rank 0,
   *before* the CPU stand-in kernels exist, computes the single-process references of each model the cases
   use, with no parallel config and diffusers' ``_native_math`` backend (``F.scaled_dot_product_attention``
   restricted to the math kernel), in fp32 (the golden reference) and in bf16 (the noise floor). Nothing on
   that path can reach the cuDNN / flash ATen ops: they have no CPU kernel yet, so touching them would raise.
   A reference that raises is recorded, and rank 0 broadcasts which did, so both ranks skip that model's
   cases (one rank alone would wait in a collective until the group's timeout);
3. registers the stand-in kernels (``standin_kernels.register()``);
4. for each case (``CASES``: ``ulysses`` and ``ring`` train the tiny Flux under
   ``ContextParallelConfig(ulysses_degree=2)`` / ``(ring_degree=2)``; ``qwen_ulysses`` trains the tiny
   QwenImage with padded prompts under ``ulysses_degree=2``, so that diffusers builds a bool joint attention
   mask that reaches the cuDNN op, #14342): copies the pristine bf16 model, sets the ``_native_cudnn``
   backend with ``model.set_attention_backend``, calls ``model.enable_parallelism(config=...)`` (diffusers
   builds the mesh, shards the inputs with its ``_cp_plan`` hooks and gathers ``proj_out``), runs a training
   step (forward on the full inputs, MSE loss on the gathered output, backward), sums the parameter
   gradients over the ranks (diffusers has no gradient sync of its own: each rank's gradients are partial
   sums over its sequence shard), takes an SGD step with them and runs a second forward/backward;
5. writes one JSON file; the launcher prints both ranks' files as one JSON line.

The QwenImage ring cases (#43) train it with padded prompts under ring degree 2, 3 and 4 and unified 2 x 2
(``qwen_ring``, ``qwen_ring3``, ``qwen_ring4``, ``qwen_unified``: jobs of 2, 3 and 4 ranks, the inputs shaped so
that each stream splits into as many shards as ranks, ``QWEN_SHAPES``), and with unpadded prompts (an all-true
joint mask, which masks nothing) at ring degree 2 (``qwen_ones_ring``, model ``qwen_ones``). Where the math
backend refuses the model's inputs in one process (0.37.x's 2-D QwenImage mask), the reference runs on diffusers'
``native`` backend, which reads that mask as key padding (``_reference``).

The training-stack cases (``STACK_CASES``) run a case again with gradient checkpointing on, or with
the parallelised transformer compiled (``torch.compile``, ``aot_eager`` recording the ops in its graphs).

``mask_switch`` is the value of ``DIFFUSERS_CUDNN_FIX_MASK`` the ranks see: ``None`` (the default) removes the
variable from the launcher's environment before the ranks start, so they run on the package's default.

Seam on 0.42.x: ``ModelMixin._resolve_parallel_config`` computes ``rank % torch.accelerator.device_count()``,
which is 0 on a CPU-only torch (ZeroDivisionError). Only when that exact error comes out of
``enable_parallelism`` is it called again, on a fresh copy, with ``torch.accelerator.device_count`` returning
1 for the duration of that one call. Everything else (mesh, config setup, hooks, templated ring / Ulysses
attention, the attention ops) is diffusers' own code; the result records whether the seam was used.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

WORLD_SIZE = 2
#: Case name -> (model, context-parallel mode). The Flux cases keep their historical names. ``unified``
#: (Ulysses degree 2 x ring degree 2) needs 4 ranks: it runs in jobs of its own (``launch(world_size=4)``).
CASES = {
    "ulysses": ("flux", "ulysses"),
    "ring": ("flux", "ring"),
    "qwen_ulysses": ("qwen", "ulysses"),
    "unified": ("flux", "unified"),
    # Ring degree 4 (4 ranks, jobs of its own): diffusers 0.40+'s own ring backward routes K/V gradients wrong
    # from degree 3 (ring_grad_route).
    "ring4": ("flux", "ring4"),
    # QwenImage with padded prompts under ring attention (#43): its joint mask reaches every ring step, which
    # must see the mask columns of the K/V chunk it attends to. Ring degree 2 rides in the 2-rank jobs, degree 4
    # and unified in the 4-rank ones, degree 3 in 3-rank jobs of its own (``QWEN_SHAPES``).
    "qwen_ring": ("qwen", "ring"),
    # The same prompts unpadded: QwenImage hands its all-true joint mask to every attention call, a mask that masks
    # nothing (ring attention drops it).
    "qwen_ones_ring": ("qwen_ones", "ring"),
    "qwen_ring3": ("qwen", "ring3"),
    "qwen_ring4": ("qwen", "ring4"),
    "qwen_unified": ("qwen", "unified"),
}
MODES = ("ulysses", "ring", "qwen_ulysses")
#: The degrees of each context-parallel mode (their product is the world size the mode needs).
DEGREES = {
    "ulysses": {"ulysses_degree": 2},
    "ring": {"ring_degree": 2},
    "unified": {"ulysses_degree": 2, "ring_degree": 2},
    "ring4": {"ring_degree": 4},
    "ring3": {"ring_degree": 3},
}
#: Training stacks (#19): a Ulysses case again, with gradient checkpointing on
#: (``model.enable_gradient_checkpointing()``: each block's forward re-runs inside the backward, collectives and
#: cuDNN forward included) or with the whole parallelised transformer compiled (``torch.compile(model,
#: backend=COMPILE_BACKEND)``; the parameters, their names and the optimizer stay on ``model``).
#: Case name -> (model, context-parallel mode, stack).
STACK_CASES = {
    "ulysses_ckpt": ("flux", "ulysses", "checkpointing"),
    "ulysses_compile": ("flux", "ulysses", "compile"),
    "qwen_ulysses_ckpt": ("qwen", "ulysses", "checkpointing"),
    "qwen_ulysses_compile": ("qwen", "ulysses", "compile"),
    "ring_ckpt": ("flux", "ring", "checkpointing"),
    "qwen_ring_ckpt": ("qwen", "ring", "checkpointing"),
    "qwen_ring_compile": ("qwen", "ring", "compile"),
}
CASES.update({case: (model, cp_mode) for case, (model, cp_mode, _) in STACK_CASES.items()})
#: aot_eager: dynamo's graph capture and AOTAutograd's joint forward/backward graph, run with eager ATen ops (so
#: the stand-in kernels run); inductor would generate code (see the compile matrix's tests for that).
COMPILE_BACKEND = "aot_eager"
#: With the package, even ranks import it before diffusers and odd ranks after: both import orders in one
#: job. Each rank patches on its own, and one wrongly patched rank spoils the all-reduced gradients.
IMPORT_ORDERS = ("package_first", "diffusers_first")
MASK_VAR = "DIFFUSERS_CUDNN_FIX_MASK"
BACKEND = "_native_cudnn"
REFERENCE_BACKEND = "_native_math"
#: Where the math backend refuses the model's inputs (``_reference``): diffusers' default backend.
FALLBACK_REFERENCE_BACKEND = "native"

#: Tiny Flux: inner dim 4 heads x 8 = 32, one double-stream and one single-stream block.
FLUX_CONFIG = dict(
    patch_size=1,
    in_channels=4,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=8,
    pooled_projection_dim=8,
    guidance_embeds=False,
    axes_dims_rope=(2, 2, 4),
)
#: 4 image + 4 text tokens: each rank holds 2 + 2 = 4 = num_attention_heads tokens under ring CP, the case
#: in which K/V handed over as (B, S, H, D) instead of (B, H, S, D) still fit every shape check and give
#: garbage silently (as on a GPU). Under Ulysses each rank holds 4 / 2 = 2 heads of the full 8 tokens.
BATCH, IMG_TOKENS, TXT_TOKENS = 2, 4, 4

#: Tiny QwenImage: inner dim 4 heads x 8 = 32, two double-stream blocks (each one joint attention).
QWEN_CONFIG = dict(
    patch_size=1,
    in_channels=4,
    out_channels=4,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=8,
    axes_dims_rope=(2, 2, 4),
)
#: One 1 x 2 x 2 latent frame (4 image tokens) per sample and 4 text tokens, of which the last 1 (sample 0) and
#: 2 (sample 1) are padding: ``encoder_hidden_states_mask`` as a tokenizer gives it (int64 1/0). diffusers
#: (0.38.0+) turns it into a bool joint mask ``[text mask, ones for the image]`` that the templated Ulysses
#: attention hands to the cuDNN op as ``attn_bias``. Under Ulysses each rank holds 2 text + 2 image tokens
#: and 2 of the 4 heads; the padding sits entirely in rank 1's text shard.
QWEN_IMG_SHAPE = (1, 2, 2)
QWEN_TEXT_MASK = ((1, 1, 1, 0), (1, 1, 0, 0))
#: World size -> (latent frame, text mask) of the QwenImage inputs: each stream must split into as many equal shards
#: as ranks. 3 ranks: 6 image + 6 text tokens, the last 1 (sample 0) and 3 (sample 1) padding, so that rank 2's
#: text shard is all padding in sample 1 (a ring step whose text keys are all masked).
QWEN_SHAPES = {
    2: (QWEN_IMG_SHAPE, QWEN_TEXT_MASK),
    4: (QWEN_IMG_SHAPE, QWEN_TEXT_MASK),
    3: ((1, 2, 3), ((1, 1, 1, 1, 1, 0), (1, 1, 1, 0, 0, 0))),
}

RANK_DEADLINE_S = 240.0
PG_TIMEOUT_S = 90.0


# ------------------------------------------------------------------------------------------------------------
# Launcher (the process the test starts)
# ------------------------------------------------------------------------------------------------------------
def launch(
    package: bool,
    modes: tuple[str, ...] = MODES,
    steps: int = 2,
    deadline_s: float = RANK_DEADLINE_S,
    mask_switch: str | None = None,
    world_size: int = WORLD_SIZE,
) -> None:
    """Start the ranks, wait for them (at most ``deadline_s``), print one JSON line with their results.

    ``mask_switch``: the ``DIFFUSERS_CUDNN_FIX_MASK`` the ranks get; ``None`` removes it (package default).
    ``world_size``: 2, or 3 / 4 for the cases of that many ranks (``DEGREES``).
    """
    job = dict(
        package=package, modes=modes, steps=steps, deadline_s=deadline_s, mask_switch=mask_switch, world_size=world_size
    )
    _check_job(job)
    print(json.dumps(_run_job(job)))


def launch_many(jobs: list[dict[str, Any]]) -> None:
    """Run several jobs (each a dict of ``launch``'s arguments) one after the other, each with ranks of its own
    forked from this one launcher; print one JSON line ``{"jobs": [result, ...]}``, in the order given.

    One launcher per release instead of one per job: the interpreter start and torch's import are paid once.
    Before each job a line ``JOB_MARK + index`` goes to stderr, so that a job's own output can be told apart.
    Then the launcher ends at once (``os._exit``): every rank has been joined and every temporary folder
    removed, and the interpreter's teardown of torch's modules would only cost CPU time.
    """
    jobs = [{**job, "modes": tuple(job.get("modes", MODES))} for job in jobs]
    for job in jobs:
        _check_job(job)  # all of them before any runs
    results = []
    for index, job in enumerate(jobs):
        print(f"{JOB_MARK}{index}", file=sys.stderr, flush=True)
        results.append(_run_job(job))
    print(json.dumps({"jobs": results}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


#: The stderr line ``launch_many`` writes before each job (followed by the job's index).
JOB_MARK = "--- subprocess_cp_training job "


def _check_job(job: dict[str, Any]) -> None:
    unknown = [mode for mode in job["modes"] if mode not in CASES]
    if unknown:
        raise ValueError(f"unknown cases {unknown}; known: {list(CASES)}")
    world_size = job.get("world_size", WORLD_SIZE)
    for mode in job["modes"]:
        degrees = DEGREES[CASES[mode][1]]
        if math.prod(degrees.values()) != world_size:
            raise ValueError(f"case {mode} ({degrees}) needs a world size of {math.prod(degrees.values())}")


def _run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One job: fork its ranks, wait for them under the deadline, collect their files."""
    import multiprocessing as mp

    package = job["package"]
    modes = tuple(job["modes"])
    mask_switch = job.get("mask_switch")
    world_size = job.get("world_size", WORLD_SIZE)
    deadline_s = job.get("deadline_s", RANK_DEADLINE_S)
    # The forked ranks inherit this process's environment as it is when they start.
    if mask_switch is None:
        os.environ.pop(MASK_VAR, None)
    else:
        os.environ[MASK_VAR] = mask_switch
    started = time.monotonic()
    # The ranks are forked from this launcher after it imported torch (and nothing else: no diffusers, no
    # package, no thread, no process group), so that each rank imports diffusers and the package in its own
    # order without paying for torch's import again. torch._dynamo too: every release's diffusers imports it
    # (diffusers.utils.torch_utils) and it is most of the CPU time of diffusers' import; it is torch's own
    # module, so what a rank imports in its chosen order (diffusers, the package) is unchanged.
    import torch
    import torch._dynamo  # noqa: F401

    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="cp_training_") as tmp:
        spec = {
            "package": package,
            "modes": list(modes),
            "steps": job.get("steps", 2),
            "tmp": tmp,
            "mask_switch": mask_switch,
            "world_size": world_size,
        }
        procs = [ctx.Process(target=rank_main, args=(rank, spec), daemon=True) for rank in range(world_size)]
        for proc in procs:
            proc.start()
        end = started + deadline_s
        for proc in procs:
            proc.join(max(0.0, end - time.monotonic()))
        timed_out = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for rank in timed_out:
            procs[rank].terminate()  # our own child, by its Process object
            procs[rank].join(5)
        ranks = []
        for rank, proc in enumerate(procs):
            path = os.path.join(tmp, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
            else:
                ranks.append({"rank": rank, "fatal": "no result file", "exitcode": proc.exitcode})
    return {
        "package": package,
        "mask_switch": mask_switch,
        "modes": list(modes),
        "ranks": ranks,
        "exitcodes": [proc.exitcode for proc in procs],
        "timed_out": timed_out,
        "wall_s": round(time.monotonic() - started, 2),
    }


# ------------------------------------------------------------------------------------------------------------
# One rank
# ------------------------------------------------------------------------------------------------------------
class _Warnings:
    """Every warning of the process, kept with the 'always' filter so that a repeat is counted as one."""

    def __init__(self) -> None:
        self._cm = warnings.catch_warnings(record=True)
        self.log = self._cm.__enter__()
        warnings.simplefilter("always")

    def ours(self) -> list[str]:
        pkg = sys.modules.get("diffusers_cudnn_fix")
        if pkg is None:
            return []
        return [
            f"{w.category.__name__}: {w.message}"
            for w in self.log
            if isinstance(w.category, type) and issubclass(w.category, pkg.DiffusersCudnnFixWarning)
        ]


def rank_main(rank: int, spec: dict[str, Any]) -> None:
    rec = _Warnings()
    result: dict[str, Any] = {
        "rank": rank,
        "package": spec["package"],
        "mask_env": os.environ.get(MASK_VAR),
        "modes": {},
    }
    out_path = os.path.join(spec["tmp"], f"rank{rank}.json")
    code = 0
    try:
        _run_rank(rank, spec, rec, result)
    except BaseException as exc:
        result["fatal"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
        code = 1
    result["our_warnings_total"] = len(rec.ours())
    tmp_path = out_path + ".partial"
    with open(tmp_path, "w") as f:
        json.dump(result, f)
    os.replace(tmp_path, out_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip process-group teardown (and its noise); the file is the result


def _run_rank(rank: int, spec: dict[str, Any], rec: _Warnings, result: dict[str, Any]) -> None:
    import torch

    # One intra-op thread per rank: the tensors are tiny, and torch's default (one thread per core) in each of
    # 2-4 ranks oversubscribes a small machine, where the idle threads spin and take more CPU than the work.
    torch.set_num_threads(1)
    started = time.monotonic()
    order = IMPORT_ORDERS[rank % 2] if spec["package"] else None
    result["import_order"] = order
    if order == "package_first":
        import diffusers_cudnn_fix
    import datetime

    import diffusers
    import torch.distributed as dist

    result["diffusers_version"] = diffusers.__version__
    result["diffusers_file"] = diffusers.__file__
    result["torch_version"] = torch.__version__
    import diffusers.models.attention_dispatch as dispatch

    if order == "diffusers_first":
        import diffusers_cudnn_fix  # noqa: F401  (after diffusers' attention module: patches it at once)

    pkg = sys.modules.get("diffusers_cudnn_fix")
    if spec["package"]:
        report = pkg.status()
        result["status_ok"] = report.ok
        result["applied"] = sorted(f.id for f in report.fixes if f.applied)
    else:
        result["package_imported"] = pkg is not None
    result["our_warnings_after_import"] = rec.ours()

    wanted = [name for name in ("flux", "qwen", "qwen_ones") if any(CASES[mode][0] == name for mode in spec["modes"])]
    built = {}  # name -> (bf16 model, inputs, target, cast keys)
    result["seconds"] = {"imports": round(time.monotonic() - started, 2)}
    for name in wanted:
        t0 = time.monotonic()
        built[name] = _build(name, spec["world_size"])
        result["seconds"][f"build_{name}"] = round(time.monotonic() - t0, 2)

    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(spec['tmp'], 'rendezvous')}",
        rank=rank,
        world_size=spec["world_size"],
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    import standin_kernels

    refs32: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    if rank == 0:
        # Before the stand-ins exist: nothing on the reference path can use the ops under test.
        assert not standin_kernels.is_registered()
        result["references"] = {}
        for name, (model16, inputs16, target, cast) in built.items():
            t0 = time.monotonic()
            try:
                ref32 = _reference(model16, inputs16, target, torch.float32, cast)
                ref16 = _reference(model16, inputs16, target, torch.bfloat16, cast)
                if name == "flux":
                    assert not ref32["no_grad"], f"parameters without a gradient in the reference: {ref32['no_grad']}"
            except Exception as exc:
                failed[name] = f"{type(exc).__name__}: {str(exc)[:500]}"
                result["references"][name] = {"error": failed[name]}
                continue
            refs32[name] = ref32
            result["references"][name] = {
                "backend": ref32["backend"],
                "loss32": ref32["loss"],
                "loss16": ref16["loss"],
                "bf16_floor": _compare(ref16["grads"], ref32["grads"]),
                "compared_params": len(ref32["grads"]),
                # Parameters the loss does not reach (QwenImage: the last block's text-stream tail).
                "no_grad": ref32["no_grad"],
                "seconds": round(time.monotonic() - t0, 2),
            }
    # Both ranks must skip the same cases, or the other one would wait in a collective until the timeout.
    shared = [failed]
    dist.broadcast_object_list(shared, src=0)
    failed = shared[0]

    standin_kernels.register()
    for mode in spec["modes"]:
        t0, cpu0 = time.monotonic(), time.process_time()
        name, cp_mode = CASES[mode]
        if name in failed:
            result["modes"][mode] = {"status": "reference_raised", "model": name, "error": failed[name]}
            continue
        model16, inputs16, target, _ = built[name]
        stack = STACK_CASES[mode][2] if mode in STACK_CASES else None
        entry = _train(cp_mode, model16, inputs16, target, spec["steps"], rec, dispatch, stack)
        entry["model"] = name
        if rank == 0 and entry.get("grads") is not None:
            ref32 = refs32[name]
            entry["loss_rel_err"] = abs(entry["loss"][0] - ref32["loss"]) / abs(ref32["loss"])
            entry["compare"] = _compare(entry["grads"], ref32["grads"])
            # This rank's own (partial) gradients: far off, which is why they are summed over the ranks.
            entry["local_worst"] = _compare(entry["local_grads"], ref32["grads"])["worst"]
        entry.pop("grads", None)
        entry.pop("local_grads", None)
        entry["seconds"] = round(time.monotonic() - t0, 2)
        entry["cpu_s"] = round(time.process_time() - cpu0, 2)  # this rank's CPU time (wall varies with load)
        result["modes"][mode] = entry
        dist.barrier()
    if spec["package"]:
        result["status_ok_end"] = pkg.status().ok


def _build(name: str, world_size: int = WORLD_SIZE):
    """(bf16 model, bf16 inputs, fp32 target, input keys cast with the model) of ``name``, seeded; QwenImage's
    inputs shaped for ``world_size`` ranks (``QWEN_SHAPES``)."""
    import torch

    if name == "flux":
        from diffusers import FluxTransformer2DModel

        torch.manual_seed(0)
        base = FluxTransformer2DModel(**FLUX_CONFIG)
        model16 = copy.deepcopy(base).to(torch.bfloat16)  # the weights every run uses (bf16-exact)
        del base
        inputs16, target = _inputs()
        return model16, inputs16, target, ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")
    if name in ("qwen", "qwen_ones"):
        from diffusers import QwenImageTransformer2DModel

        torch.manual_seed(0)
        model16 = QwenImageTransformer2DModel(**QWEN_CONFIG).to(torch.bfloat16)
        img_shape, text_mask = QWEN_SHAPES[world_size]
        if name == "qwen_ones":
            text_mask = tuple((1,) * len(row) for row in text_mask)
        inputs16, target = _qwen_inputs(model16, img_shape, text_mask)
        return model16, inputs16, target, ("hidden_states", "encoder_hidden_states", "timestep")
    raise ValueError(name)


def _qwen_inputs(model, img_shape=QWEN_IMG_SHAPE, text_mask=QWEN_TEXT_MASK):
    """Padded prompts: ``encoder_hidden_states_mask`` has zeros (see ``QWEN_TEXT_MASK``)."""
    import inspect

    import torch

    gen = torch.Generator().manual_seed(2)
    bf16 = torch.bfloat16
    batch, txt_tokens = len(text_mask), len(text_mask[0])
    img_tokens = img_shape[0] * img_shape[1] * img_shape[2]
    channels = QWEN_CONFIG["in_channels"]
    inputs = {
        "hidden_states": torch.randn(batch, img_tokens, channels, generator=gen).to(bf16),
        "encoder_hidden_states": torch.randn(batch, txt_tokens, QWEN_CONFIG["joint_attention_dim"], generator=gen).to(
            bf16
        ),
        "encoder_hidden_states_mask": torch.tensor(text_mask, dtype=torch.int64),
        "timestep": torch.tensor([0.5, 0.25]).to(bf16),
        "img_shapes": [[img_shape]] * batch,
    }
    # 0.36.0's RoPE needs txt_seq_lens (the padded length: the text freqs must cover every token); 0.37.0+
    # derive it from the mask and deprecate the argument, 0.39.0+ no longer take it.
    if "max_txt_seq_len" not in inspect.signature(model.pos_embed.forward).parameters:
        inputs["txt_seq_lens"] = [txt_tokens] * batch
    target = torch.randn(batch, img_tokens, QWEN_CONFIG["out_channels"], generator=gen)
    return inputs, target


def _inputs():
    import torch

    gen = torch.Generator().manual_seed(1)
    bf16 = torch.bfloat16
    img_ids = torch.tensor([[0.0, i // 2, i % 2] for i in range(IMG_TOKENS)])
    txt_ids = torch.zeros(TXT_TOKENS, 3)
    inputs = {
        "hidden_states": torch.randn(BATCH, IMG_TOKENS, FLUX_CONFIG["in_channels"], generator=gen).to(bf16),
        "encoder_hidden_states": torch.randn(BATCH, TXT_TOKENS, FLUX_CONFIG["joint_attention_dim"], generator=gen).to(
            bf16
        ),
        "pooled_projections": torch.randn(BATCH, FLUX_CONFIG["pooled_projection_dim"], generator=gen).to(bf16),
        "timestep": torch.tensor([0.5, 0.25]).to(bf16),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
    }
    target = torch.randn(BATCH, IMG_TOKENS, FLUX_CONFIG["in_channels"], generator=gen)
    return inputs, target


def _loss(model, inputs, target):
    import torch

    out = model(**inputs, return_dict=False)[0]
    return torch.nn.functional.mse_loss(out.float(), target)


def _reference(model16, inputs16, target, dtype, cast: tuple[str, ...]) -> dict[str, Any]:
    """One process, no parallel config, diffusers' math backend, in ``dtype`` (the ``cast`` inputs too). Where
    the math backend refuses the model's inputs (0.37.x's 2-D QwenImage mask, which F.sdpa reads as (S_q, S_kv)),
    diffusers' default ``native`` backend, which reads that mask as key padding (as ``verify`` does)."""
    inputs = {k: (v.to(dtype) if k in cast else v) for k, v in inputs16.items()}
    for backend in (REFERENCE_BACKEND, FALLBACK_REFERENCE_BACKEND):
        model = copy.deepcopy(model16).to(dtype)
        model.set_attention_backend(backend)
        try:
            loss = _loss(model, inputs, target)
        except (RuntimeError, ValueError):
            if backend == FALLBACK_REFERENCE_BACKEND:
                raise
            continue
        loss.backward()
        break
    grads = {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}
    no_grad = [name for name, p in model.named_parameters() if p.grad is None]
    return {"loss": loss.item(), "grads": grads, "no_grad": no_grad, "backend": backend}


def _compare(got: dict, ref: dict) -> dict[str, Any]:
    """Per parameter max|g - g_ref| / max|g_ref|, and the worst of them."""
    import torch

    per_param = {}
    for name, g_ref in ref.items():
        g = got.get(name)
        denom = g_ref.abs().max().item()
        if g is None:
            per_param[name] = float("inf")
            continue
        diff = (g - g_ref).abs()
        diff = torch.nan_to_num(diff, nan=float("inf")).max().item()
        per_param[name] = diff / denom if denom > 0 else (0.0 if diff == 0 else float("inf"))
    worst = max(per_param, key=per_param.get)
    return {"worst": per_param[worst], "worst_param": worst, "per_param": per_param}


def _kernel_counter():
    """A dispatch mode counting calls of the ATen SDPA ops (proof that the step went through the cuDNN ops),
    and recording the dtype of the ``attn_bias`` each cuDNN call got (``"none"`` without one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: dict[str, int] = {}
            self.bias: dict[str, list[str]] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.partition(".")[0]
            if "scaled_dot_product" in name:
                self.calls[name] = self.calls.get(name, 0) + 1
                if "cudnn" in name:
                    bias = _attn_bias(func, args, kwargs or {})
                    seen = self.bias.setdefault(name, [])
                    text = "none" if bias is None else str(bias.dtype).replace("torch.", "")
                    if text not in seen:
                        seen.append(text)
            return func(*args, **(kwargs or {}))

    return Counter()


class _NoCounter(contextlib.nullcontext):
    """Stands in for the kernel counter where none can run (compiled cases): records nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}
        self.bias: dict[str, list[str]] = {}


def _attn_bias(func, args, kwargs):
    """The ``attn_bias`` argument of a cuDNN SDPA op call (forward or backward), by its schema name."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == "attn_bias":
            return kwargs["attn_bias"] if "attn_bias" in kwargs else (args[index] if index < len(args) else None)
    return None


@contextlib.contextmanager
def _cpu_accelerator_count_one():
    import torch

    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


def _parallelise(model16, mode: str):
    """A fresh bf16 copy with the cuDNN backend and diffusers' own context parallelism; (model, seam)."""
    from diffusers.models._modeling_parallel import ContextParallelConfig

    def build(seam: bool):
        model = copy.deepcopy(model16)
        model.set_attention_backend(BACKEND)
        config = ContextParallelConfig(**DEGREES[mode])
        if seam:
            with _cpu_accelerator_count_one():
                model.enable_parallelism(config=config)
        else:
            model.enable_parallelism(config=config)
        return model

    try:
        return build(seam=False), None
    except ZeroDivisionError:
        # diffusers 0.42.x: `rank % torch.accelerator.device_count()` with 0 accelerators on a CPU-only torch.
        return build(seam=True), "torch.accelerator.device_count() -> 1 during enable_parallelism"


def _ring_inference(model, inputs16, dispatch) -> dict[str, Any]:
    """With the package: the model's output under ``no_grad`` with the installed ring forward and with the one
    diffusers shipped (swapped in for this one call). The corrected forward must compute exactly the same."""
    import torch

    pkg = sys.modules["diffusers_cudnn_fix"]
    name = "TemplatedRingAttention.forward"
    if not pkg.is_patched(name):
        return {"patched": False}
    cls = dispatch.TemplatedRingAttention
    installed, shipped = cls.__dict__["forward"], pkg.get_original(name)
    with torch.no_grad():
        ours = model(**inputs16, return_dict=False)[0]
        try:
            cls.forward = shipped
            theirs = model(**inputs16, return_dict=False)[0]
        except Exception as exc:
            return {"patched": True, "shipped": f"raised {type(exc).__name__}: {str(exc)[:300]}"}
        finally:
            cls.forward = installed
    return {"patched": True, "shipped": "ok", "equal": bool(torch.equal(ours, theirs))}


def _train(mode, model16, inputs16, target, steps, rec: _Warnings, dispatch, stack=None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    entry: dict[str, Any] = {"status": "ok", "loss": [], "our_warnings_after_step": []}
    try:
        model, seam = _parallelise(model16, mode)
    except Exception as exc:
        entry.update(status="setup_raised", error=f"{type(exc).__name__}: {str(exc)[:500]}")
        return entry
    entry["seam"] = seam
    cp = model._parallel_config.context_parallel_config
    entry["cp"] = {"ring_degree": cp.ring_degree, "ulysses_degree": cp.ulysses_degree, "world": cp._world_size}
    if cp.ring_degree > 1 and "diffusers_cudnn_fix" in sys.modules:
        entry["inference"] = _ring_inference(model, inputs16, dispatch)
    # Which ops the cuDNN backend will hand to the templated CP attention, read at call time as diffusers does.
    entry["ops"] = {
        name: f"{getattr(dispatch, name).__module__}.{getattr(dispatch, name).__qualname__}"
        for name in ("_cudnn_attention_forward_op", "_cudnn_attention_backward_op")
    }
    forward = _with_stack(model, stack, entry)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    names = [name for name, _ in model.named_parameters()]
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        # Not under compile: dynamo would run the whole step eagerly while a dispatch mode is active.
        counter = _kernel_counter() if stack != "compile" else _NoCounter()
        try:
            with counter:
                loss = _loss(forward, inputs16, target)
                loss.backward()
        except Exception as exc:
            entry.update(status="raised", step=step + 1, error=f"{type(exc).__name__}: {str(exc)[:1000]}")
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if "diffusers" in f.filename]
            entry["where"] = [f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}" for f in frames[-3:]]
            entry["our_warnings_after_step"].append(len(rec.ours()))
            entry.setdefault("kernel_calls", []).append(counter.calls)
            entry.setdefault("attn_bias", []).append(counter.bias)
            return entry
        entry.setdefault("kernel_calls", []).append(counter.calls)
        entry.setdefault("attn_bias", []).append(counter.bias)
        params = list(model.parameters())
        grads = [
            p.grad.detach().float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32) for p in params
        ]
        if step == 0:
            entry["local_grads"] = {name: g.clone() for name, g in zip(names, grads)}
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)  # sum of the ranks' partial gradients
        summed = {}
        offset = 0
        for name, p, g in zip(names, params, grads):
            n = g.numel()
            summed[name] = flat[offset : offset + n].view_as(g).clone()
            offset += n
            p.grad = summed[name].to(p.dtype)
        optimizer.step()
        entry["loss"].append(loss.item())
        entry["our_warnings_after_step"].append(len(rec.ours()))
        if step == 0:
            entry["grads"] = summed
    entry["our_warning_messages"] = rec.ours()[-5:]
    if stack == "compile":
        entry["dynamo"] = _dynamo_counts()
    return entry


def _with_stack(model, stack: str | None, entry: dict[str, Any]):
    """What the training step calls: ``model`` itself, with gradient checkpointing turned on, or compiled."""
    import torch

    entry["stack"] = stack
    if stack is None:
        return model
    if stack == "checkpointing":
        model.enable_gradient_checkpointing()
        return model
    if stack == "compile":
        import torch._dynamo

        torch._dynamo.reset()  # each compiled case starts from nothing: its graph counts are its own
        torch._dynamo.utils.counters.clear()
        graphs: dict[str, Any] = {"forward": [], "backward": []}
        entry["graphs"] = graphs
        return torch.compile(model, backend=_recording_aot_eager(graphs))
    raise ValueError(stack)


def _recording_aot_eager(graphs: dict[str, Any]):
    """``aot_eager`` itself (``torch._dynamo.backends.debugging.aot_eager``: AOTAutograd, the default
    partitioner of that backend, and graphs run as they are), with forward and backward compilers that first
    note, per graph AOTAutograd produced, the SDPA ops in it and the dtype of each cuDNN call's ``attn_bias``.

    A ``TorchDispatchMode`` cannot count the kernel calls here: dynamo does not compile a frame while such a
    mode is active (it runs it eagerly), so the compiled cases are checked through their graphs instead."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    def recording(kind: str):
        def compiler(gm, example_inputs):
            ops: dict[str, int] = {}
            bias: list[str] = []
            for node in gm.graph.nodes:
                if node.op != "call_function" or "scaled_dot_product" not in str(node.target):
                    continue
                name = next(part for part in str(node.target).split(".") if "scaled_dot_product" in part)
                ops[name] = ops.get(name, 0) + 1
                if "cudnn" in name:
                    arg = _attn_bias(node.target, node.args, node.kwargs)
                    value = arg.meta.get("val") if hasattr(arg, "meta") else arg
                    bias.append("none" if value is None else str(value.dtype).replace("torch.", ""))
            graphs[kind].append({"sdpa_ops": ops, "attn_bias": sorted(set(bias))})
            return boxed_nop(gm, example_inputs)

        return compiler

    def backend(gm, example_inputs):
        return aot_eager(gm, example_inputs, fw_compiler=recording("forward"), bw_compiler=recording("backward"))

    return backend


def _dynamo_counts() -> dict[str, Any]:
    """How much of the step dynamo captured: graphs compiled, and the graph breaks by reason."""
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": counters["stats"].get("unique_graphs", 0),
        "graph_breaks": dict(counters["graph_break"]),
    }
