"""LTX2's context-parallel plan splits `rope` but not `cross_attn_rope`, and never shards the audio stream.

Standalone: needs torch and diffusers only; runs on a CPU (2 processes over gloo). A tiny random
`LTX2VideoTransformer3DModel` (fp32; 32 video tokens, 32 audio frames, 32 text tokens for each stream, no text masks:
lengths and masks that meet no other open issue; a timestep per video token, as the image-to-video pipeline passes,
and one per sample for the audio) is run in one process, then under
`enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))` with the `native` backend: one forward and
backward, a loss over both outputs, the parameter gradients summed over the ranks and compared with one process.

On a CPU-only torch, diffusers 0.42's `enable_parallelism` computes `rank % torch.accelerator.device_count()`, which
divides by zero: only there, `device_count` reads 1 during that one call.

Exit status: 1 while the forward raises or the output or a gradient is wrong (the bug), 0 once all match.

    python reproduce.py
"""

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
CONFIG = dict(
    in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
    audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=8,
    audio_cross_attention_dim=16, num_layers=1, caption_channels=8,
)  # fmt: skip
B, FRAMES, HEIGHT, WIDTH, AUDIO, TEXT = 1, 2, 4, 4, 32, 32


def _model_and_inputs():
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(0)
    model = LTX2VideoTransformer3DModel(**CONFIG)
    model.set_attention_backend("native")
    gen = torch.Generator().manual_seed(1)
    tokens = FRAMES * HEIGHT * WIDTH
    inputs = dict(
        hidden_states=torch.randn(B, tokens, 4, generator=gen),
        audio_hidden_states=torch.randn(B, AUDIO, 4, generator=gen),
        encoder_hidden_states=torch.randn(B, TEXT, 8, generator=gen),
        audio_encoder_hidden_states=torch.randn(B, TEXT, 8, generator=gen),
        timestep=torch.rand(B, tokens, generator=gen) * 1000, audio_timestep=torch.tensor([500.0]),
        encoder_attention_mask=None, audio_encoder_attention_mask=None,
        num_frames=FRAMES, height=HEIGHT, width=WIDTH, audio_num_frames=AUDIO, return_dict=False,
    )  # fmt: skip
    targets = (torch.randn(B, tokens, 4, generator=gen), torch.randn(B, AUDIO, 4, generator=gen))
    return model, inputs, targets


def _step(model, inputs, targets):
    out = model(**inputs)
    sum(torch.nn.functional.mse_loss(o, t) for o, t in zip(out, targets, strict=True)).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat([o.detach().flatten() for o in out]), grads


def _enable(model):
    from diffusers.models._modeling_parallel import ContextParallelConfig

    config = ContextParallelConfig(ulysses_degree=WORLD_SIZE)
    if torch.cuda.is_available() or not hasattr(torch, "accelerator") or torch.accelerator.device_count() > 0:
        return model.enable_parallelism(config=config)
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        model.enable_parallelism(config=config)
    finally:
        torch.accelerator.device_count = original


def _worker(rank, world_size, port, results):
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model, inputs, targets = _model_and_inputs()
        import copy

        ref_out, ref_grads = _step(copy.deepcopy(model), inputs, targets)
        try:
            _enable(model)
            out, grads = _step(model, inputs, targets)
        except RuntimeError as exc:
            results[rank] = {"raised": f"{type(exc).__name__}: {str(exc)[:300]}"}
            return
        worst, off = 0.0, 0
        for name, grad in grads.items():
            dist.all_reduce(grad)  # each rank's gradients are its shard's share
            error = ((grad - ref_grads[name]).abs().max() / ref_grads[name].abs().max().clamp_min(1e-30)).item()
            worst, off = max(worst, error), off + (error > 1e-4)
        out_error = ((out - ref_out).abs().max() / ref_out.abs().max()).item()
        results[rank] = {"out": out_error, "grad": worst, "off": off, "of": len(grads)}
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        results[rank] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        dist.destroy_process_group()


def main():
    import diffusers
    import diffusers.models.transformers.transformer_ltx2  # imported once, before the ranks fork

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        start_method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        mp.start_processes(_worker, (WORLD_SIZE, port, results), nprocs=WORLD_SIZE, start_method=start_method)
        found = dict(results)
    print(f"diffusers {diffusers.__version__}, torch {torch.__version__}, tiny LTX2, native backend, "
          f"ulysses_degree={WORLD_SIZE}")  # fmt: skip
    if any("error" in found.get(rank, {"error": "no report"}) for rank in range(WORLD_SIZE)):
        print(f"could not run: {found}")
        return 2
    raised = [found[rank]["raised"] for rank in range(WORLD_SIZE) if "raised" in found[rank]]
    if raised:
        print(f"BUG: the forward or backward raised {raised[0]}")
        return 1
    result = found[0]
    if result["out"] > 1e-4 or result["off"]:
        print(f"BUG: output error {result['out']:.3g}; {result['off']} of {result['of']} gradients off "
              f"(worst {result['grad']:.3g})")  # fmt: skip
        return 1
    print(f"ok: output and all {result['of']} gradients match one process (worst {result['grad']:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
