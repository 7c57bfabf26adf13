"""Two-rank Ulysses context parallelism of a tiny real LTX-Video transformer with its text mask, or of a tiny
Helios (``"model": "helios"``), on CPU (gloo).

Run in a fresh interpreter whose ``PYTHONPATH`` starts with one diffusers release (``releases.run`` does it), by
tests/test_cp_models.py::

    python -c "import subprocess_cp_models as s; s.launch_many([{'package': True}, {'package': False}])"

The launcher imports torch (nothing else: no diffusers, no package, no process group) and, per job, forks two rank
processes and waits for them under a deadline. Each rank runs on one torch thread and:

1. imports ``diffusers_cudnn_fix`` when the job has ``package`` (rank 0 before diffusers, rank 1 after: both
   import orders in one job), with ``DIFFUSERS_CUDNN_FIX_SKIP`` set to the job's ``skip`` (or unset);
2. builds the tiny LTX (``LTX_CONFIG``, fp32, seeded) and its inputs: a text mask that pads the last tokens of
   each prompt (``TEXT_MASK``), which LTX's attention processor repeats per head (``[B, heads, 1, S_kv]``), as the
   cross-attention's mask; or the tiny Helios (``HELIOS_CONFIG``: its plan splits and gathers around each
   attention and feed-forward, so the model runs replicated in between);
3. computes the one-process reference: the same model and inputs with diffusers' ``native`` backend and no
   parallel config (output and every parameter's gradient of the loss);
4. joins a 2-rank gloo group (``file://`` rendezvous in a temporary folder), sets the ``native`` backend and calls
   ``enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))``: diffusers shards the video tokens,
   the text tokens and the text mask with LTX's ``_cp_plan`` and gathers the output. Then an inference forward
   (``no_grad``) and a training step (forward, MSE loss, backward); the parameter gradients are summed over the
   ranks (each rank's are partial sums over its shard) and compared with the reference; each gradient off by more
   than ``OFF`` is reported with the ratio of the summed gradient to the reference (``off_ratios``);
5. writes one JSON file; the launcher prints every job's ranks as one JSON line.

Seam on 0.42.x: ``ModelMixin._resolve_parallel_config`` computes ``rank % torch.accelerator.device_count()``, which
is 0 on a CPU-only torch; only where that exact error comes out of ``enable_parallelism`` is it called again with
``torch.accelerator.device_count`` returning 1 for that one call (as tests/subprocess_cp_training.py does).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any

WORLD_SIZE = 2
#: Tiny LTX: 2 heads of 16 (one a rank under Ulysses 2), one block (self-attention, then cross-attention to the
#: text).
LTX_CONFIG = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    cross_attention_dim=32,
    num_layers=1,
    caption_channels=8,
)
#: Tiny Helios: 2 heads of 16, 40 blocks (its plan names blocks 0-39, so fewer fail in ``enable_parallelism``).
HELIOS_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=4,
    out_channels=4,
    text_dim=8,
    freq_dim=16,
    ffn_dim=32,
    num_layers=40,
    rope_dim=(4, 6, 6),
)
#: Helios' latents: 2 frames of 8 x 8, patched 2 x 2: 32 video tokens (16 a rank); 8 text tokens.
HELIOS_LATENT = (1, 4, 2, 8, 8)
#: A gradient counts as off where its relative error exceeds this (fp32 on both sides: measured ~1e-6).
OFF = 1e-3
#: 2 latent frames of 4 x 4: 32 video tokens (16 a rank); 8 text tokens (4 a rank), so the cross-attention's keys
#: are shorter than its queries. The text mask pads the last 2 and 5 tokens of the two prompts.
FRAMES, HEIGHT, WIDTH = 2, 4, 4
TEXT_MASK = ((1, 1, 1, 1, 1, 1, 0, 0), (1, 1, 1, 0, 0, 0, 0, 0))
BACKEND = "native"
SKIP_VAR = "DIFFUSERS_CUDNN_FIX_SKIP"
RANK_DEADLINE_S = 180.0
PG_TIMEOUT_S = 60.0
#: The stderr line ``launch_many`` writes before each job (followed by the job's index).
JOB_MARK = "--- subprocess_cp_models job "


def launch_many(jobs: list[dict[str, Any]]) -> None:
    """Run the jobs (each ``{"package": bool, "skip": fix id or None, "model": "ltx" (default) or "helios"}``) one
    after the other, each with two ranks forked from this launcher; print ``{"jobs": [result, ...]}`` as one JSON line,
    in the order given."""
    import torch  # noqa: F401  (once, before the forks: each rank would otherwise import it again)

    results = []
    for index, job in enumerate(jobs):
        print(f"{JOB_MARK}{index}", file=sys.stderr, flush=True)
        results.append(_run_job(job))
    print(json.dumps({"jobs": results}))
    sys.stdout.flush()
    os._exit(0)  # every rank joined, every folder removed: torch's teardown would only cost time


def _run_job(job: dict[str, Any]) -> dict[str, Any]:
    import multiprocessing as mp

    if job.get("skip"):
        os.environ[SKIP_VAR] = job["skip"]
    else:
        os.environ.pop(SKIP_VAR, None)
    started = time.monotonic()
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="cp_models_") as tmp:
        spec = {"package": job["package"], "tmp": tmp, "model": job.get("model", "ltx"), "plan": job.get("plan")}
        spec["variant"] = job.get("variant")
        procs = [ctx.Process(target=rank_main, args=(rank, spec), daemon=True) for rank in range(WORLD_SIZE)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(max(0.0, started + RANK_DEADLINE_S - time.monotonic()))
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
    return {**job, "ranks": ranks, "timed_out": timed_out, "wall_s": round(time.monotonic() - started, 2)}


def rank_main(rank: int, spec: dict[str, Any]) -> None:
    result: dict[str, Any] = {"rank": rank}
    code = 0
    try:
        _run_rank(rank, spec, result)
    except BaseException as exc:
        result["fatal"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-3000:]
        code = 1
    path = os.path.join(spec["tmp"], f"rank{rank}.json")
    with open(path + ".partial", "w") as f:
        json.dump(result, f)
    os.replace(path + ".partial", path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the process group's teardown; the file is the result


def _run_rank(rank: int, spec: dict[str, Any], result: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    order = ("package_first", "diffusers_first")[rank % 2] if spec["package"] else None
    result["import_order"] = order
    if order == "package_first":
        import diffusers_cudnn_fix
    import diffusers
    import diffusers.models.attention_dispatch
    import torch.distributed as dist

    if order == "diffusers_first":
        import diffusers_cudnn_fix  # noqa: F401  (after diffusers' attention module: patches it at once)
    result["diffusers_version"] = diffusers.__version__
    pkg = sys.modules.get("diffusers_cudnn_fix")
    if pkg is not None:
        result["applied"] = sorted(f.id for f in pkg.status().fixes if f.applied)

    build = BUILDERS[spec.get("model", "ltx")]
    model, inputs, target = build(spec["variant"]) if spec.get("variant") else build()
    reference = _step(copy.deepcopy(model), inputs, target)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(spec['tmp'], 'rendezvous')}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    model, result["seam"] = _parallelise(model, spec.get("plan"), spec.get("variant"))
    if pkg is not None:  # again: a model's import brings diffusers' ModelMixin, whose enable_parallelism is a target
        result["applied"] = sorted(f.id for f in pkg.status().fixes if f.applied)
    try:
        with torch.no_grad():
            out = _outputs(model(**inputs, return_dict=False), target)
    except Exception as exc:
        result.update(status="inference_raised", error=_said(exc), where=_where(exc))
        return
    result["inference_error"] = _relative(out, reference["out"])
    try:
        step = _step(model, inputs, target)
    except Exception as exc:
        result.update(status="training_raised", error=_said(exc), where=_where(exc))
        return
    result["output_error"] = _relative(step["out"], reference["out"])
    errors, ratios = {}, {}
    for name, grad in step["grads"].items():
        summed = grad.clone()
        dist.all_reduce(summed)  # the ranks' partial sums over their shards
        ref = reference["grads"][name]
        errors[name] = _relative(summed, ref)
        if errors[name] > OFF:  # how far off, as the ratio of the summed gradient to one process's (projection)
            ratios[name] = round(float((summed * ref).sum() / (ref * ref).sum().clamp_min(1e-30)), 3)
    worst = max(errors, key=errors.__getitem__)
    result.update(status="ok", grad_worst=errors[worst], grad_worst_param=worst, compared_params=len(errors))
    result.update(grads_off=len(ratios), off_ratios=ratios)


def _build() -> tuple[Any, dict[str, Any], Any]:
    """The tiny LTX (fp32, seeded), its inputs and an MSE target."""
    import torch
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(**LTX_CONFIG)
    model.set_attention_backend(BACKEND)
    gen = torch.Generator().manual_seed(1)
    batch, tokens = len(TEXT_MASK), FRAMES * HEIGHT * WIDTH
    inputs = {
        "hidden_states": torch.randn(batch, tokens, LTX_CONFIG["in_channels"], generator=gen),
        "encoder_hidden_states": torch.randn(batch, len(TEXT_MASK[0]), LTX_CONFIG["caption_channels"], generator=gen),
        "timestep": torch.tensor([500, 250]),
        "encoder_attention_mask": torch.tensor(TEXT_MASK),
        "num_frames": FRAMES,
        "height": HEIGHT,
        "width": WIDTH,
    }
    return model, inputs, torch.randn(batch, tokens, LTX_CONFIG["out_channels"], generator=gen)


def _build_video(cls_name: str, config: dict[str, Any]) -> tuple[Any, dict[str, Any], Any]:
    """A tiny video transformer of diffusers' class ``cls_name`` (fp32, seeded) with ``config``, its inputs (a latent
    of ``HELIOS_LATENT``, one timestep per sample, 8 text tokens) and an MSE target."""
    import diffusers
    import torch

    torch.manual_seed(0)
    model = getattr(diffusers, cls_name)(**config)
    model.set_attention_backend(BACKEND)
    gen = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(*HELIOS_LATENT, generator=gen),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(HELIOS_LATENT[0], 8, config["text_dim"], generator=gen),
    }
    return model, inputs, torch.randn(*HELIOS_LATENT, generator=gen)


def _build_helios() -> tuple[Any, dict[str, Any], Any]:
    """The tiny Helios, its inputs and an MSE target."""
    return _build_video("HeliosTransformer3DModel", HELIOS_CONFIG)


def _outputs(output: Any, target: Any) -> Any:
    """The model's outputs a loss is taken of: the first (a tensor target), or as many as ``target`` has (a tuple:
    LTX2's video and audio), concatenated flat for the comparison."""
    import torch

    if isinstance(target, tuple):
        return torch.cat([o.flatten() for o in output[: len(target)]])
    return output[0]


#: Tiny LTX2: video 2 heads of 16, audio 2 heads of 8 (one a rank under Ulysses 2), one block (self-attention,
#: text cross-attention, audio-video cross-attention both ways, for each stream).
LTX2_CONFIG = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    cross_attention_dim=32,
    audio_in_channels=4,
    audio_out_channels=4,
    audio_num_attention_heads=2,
    audio_attention_head_dim=8,
    audio_cross_attention_dim=16,
    num_layers=1,
    caption_channels=8,
)
#: LTX2's audio: 8 latent frames (4 a rank when sharded).
AUDIO_FRAMES = 8


def _build_ltx2(variant: str | None = None) -> tuple[Any, dict[str, Any], Any]:
    """The tiny LTX2 (fp32, seeded), its inputs (the video's and the audio's text masked alike) and MSE targets
    for both outputs (video, audio). ``variant``: ``"no_mask"`` (no text masks: 0.37.x and 0.38.0 do not gather a
    key-sharded mask), ``"per_token"`` (a timestep per video token, as the image-to-video pipeline passes),
    ``"split_rope"`` (``rope_type="split"``: RoPE of (B, heads, tokens, D))."""
    import torch
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(0)
    config = {**LTX2_CONFIG, **({"rope_type": "split"} if variant == "split_rope" else {})}
    model = LTX2VideoTransformer3DModel(**config)
    model.set_attention_backend(BACKEND)
    gen = torch.Generator().manual_seed(1)
    batch, tokens, text = len(TEXT_MASK), FRAMES * HEIGHT * WIDTH, len(TEXT_MASK[0])
    channels, audio_channels = LTX2_CONFIG["in_channels"], LTX2_CONFIG["audio_in_channels"]
    inputs = {
        "hidden_states": torch.randn(batch, tokens, channels, generator=gen),
        "audio_hidden_states": torch.randn(batch, AUDIO_FRAMES, audio_channels, generator=gen),
        "encoder_hidden_states": torch.randn(batch, text, LTX2_CONFIG["caption_channels"], generator=gen),
        "audio_encoder_hidden_states": torch.randn(batch, text, LTX2_CONFIG["caption_channels"], generator=gen),
        "timestep": torch.tensor([500.0, 250.0]),
        "encoder_attention_mask": torch.tensor(TEXT_MASK),
        "audio_encoder_attention_mask": torch.tensor(TEXT_MASK),
        "num_frames": FRAMES,
        "height": HEIGHT,
        "width": WIDTH,
        "audio_num_frames": AUDIO_FRAMES,
    }
    if variant == "no_mask":
        inputs.update(encoder_attention_mask=None, audio_encoder_attention_mask=None)
    if variant == "per_token":
        inputs.update(timestep=torch.rand(batch, tokens, generator=gen) * 1000, audio_timestep=inputs["timestep"])
    target = (
        torch.randn(batch, tokens, LTX2_CONFIG["out_channels"], generator=gen),
        torch.randn(batch, AUDIO_FRAMES, LTX2_CONFIG["audio_out_channels"], generator=gen),
    )
    return model, inputs, target


def ltx2_complete_plan(variant: str | None = None) -> dict[str, Any]:
    """A complete context-parallel plan for LTX2, as a user passes it with ``cp_plan=``: both streams sharded along
    their tokens at the model's entry (the latents, their texts and text masks, a timestep per token), every RoPE's
    output split along its tokens (dim 1 of (B, tokens, D); dim 2 of ``"split_rope"``'s (B, heads, tokens, D)),
    both outputs gathered."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    def tokens(dims: int) -> Any:
        return ContextParallelInput(split_dim=1, expected_dims=dims, split_output=False)

    split, dims = (2, 4) if variant == "split_rope" else (1, 3)
    rope = {i: ContextParallelInput(split_dim=split, expected_dims=dims, split_output=True) for i in (0, 1)}
    streams = ("hidden_states", "encoder_hidden_states", "audio_hidden_states", "audio_encoder_hidden_states")
    entry = {name: tokens(3) for name in streams}
    entry.update(encoder_attention_mask=tokens(2), audio_encoder_attention_mask=tokens(2))
    if variant == "per_token":
        entry.update(timestep=tokens(2))
    plan: dict[str, Any] = {"": entry}
    plan.update({name: dict(rope) for name in ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope")})
    gather = ContextParallelOutput(gather_dim=1, expected_dims=3)
    plan.update(proj_out=gather, audio_proj_out=gather)
    return plan


#: Tiny Wan: 2 heads of 16, one block.
WAN_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=4,
    out_channels=4,
    text_dim=8,
    freq_dim=16,
    ffn_dim=32,
    num_layers=1,
)


def _build_wan() -> tuple[Any, dict[str, Any], Any]:
    """The tiny Wan (fp32, seeded), its inputs with a 1-D timestep (one per sample: what its plan's ``timestep``
    split, which expects one per token, skips with a warning) and an MSE target."""
    return _build_video("WanTransformer3DModel", WAN_CONFIG)


BUILDERS = {"ltx": _build, "helios": _build_helios, "ltx2": _build_ltx2, "wan": _build_wan}


def ltx2_rope_only_plan() -> dict[str, Any]:
    """LTX2's own plan with ``cross_attn_rope`` split as ``rope`` is, the audio left unsharded: the forward runs."""
    import copy as _copy

    from diffusers import LTX2VideoTransformer3DModel

    plan = _copy.copy(LTX2VideoTransformer3DModel._cp_plan)
    plan["cross_attn_rope"] = plan["rope"]
    return plan


def _step(model: Any, inputs: dict[str, Any], target: Any) -> dict[str, Any]:
    """Forward, MSE loss (summed over the outputs with a target), backward: the output and every parameter's
    gradient."""
    import torch

    output = model(**inputs, return_dict=False)
    targets = target if isinstance(target, tuple) else (target,)
    loss = sum(torch.nn.functional.mse_loss(o, t) for o, t in zip(output, targets, strict=False))
    loss.backward()
    out = _outputs(output, target)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"out": out.detach(), "grads": grads}


def _parallelise(model: Any, plan: str | None = None, variant: str | None = None) -> tuple[Any, str | None]:
    """``model`` under diffusers' own Ulysses degree 2 (and the 0.42.x seam used, if it was), with the model's own
    plan, or a plan passed for LTX2: ``"complete"`` (:func:`ltx2_complete_plan`), ``"rope_only"``."""
    import torch
    from diffusers.models._modeling_parallel import ContextParallelConfig

    plans = {"complete": lambda: ltx2_complete_plan(variant), "rope_only": ltx2_rope_only_plan}
    kwargs = {"cp_plan": plans[plan]()} if plan else {}
    pristine = copy.deepcopy(model)
    try:
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD_SIZE), **kwargs)
        return model, None
    except ZeroDivisionError:  # diffusers 0.42.x on a CPU-only torch: again, on a fresh copy
        original = torch.accelerator.device_count
        torch.accelerator.device_count = lambda: 1
        try:
            pristine.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD_SIZE), **kwargs)
        finally:
            torch.accelerator.device_count = original
        return pristine, "torch.accelerator.device_count() -> 1 during enable_parallelism"


def _relative(got: Any, ref: Any) -> float:
    """max |got - ref| / max |ref| (NaN counted as infinitely far)."""
    import torch

    diff = torch.nan_to_num((got - ref).abs(), nan=float("inf")).max().item()
    return diff / ref.abs().max().item()


def _said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:500]}"


def _where(exc: BaseException) -> list[str]:
    """The last diffusers frames of the traceback (which function raised)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "diffusers" in f.filename]
    return [f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}" for f in frames[-3:]]
