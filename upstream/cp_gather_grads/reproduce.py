"""A context-parallel plan that gathers inside the model (Helios) trains wrong: the parameters run replicated
between its split/gather pairs get wrong gradients, silently (the output is exact).

Standalone: needs torch and diffusers only; runs on a CPU (2 processes over gloo). A tiny random
`HeliosTransformer3DModel` (fp32; 2 latent frames of 8 x 8: 32 video tokens, 8 text tokens; 40 blocks, as its plan
names them) is run in one process, then under `enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))`
with the `native` backend: one forward and backward, the parameter gradients summed over the ranks and compared with
one process.

On a CPU-only torch, diffusers 0.42's `enable_parallelism` computes `rank % torch.accelerator.device_count()`, which
divides by zero: only there, `device_count` reads 1 during that one call.

Exit status: 1 while the output or a gradient is wrong (the bug), 0 once all match.

    python reproduce.py
"""

import copy
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
CONFIG = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=8,
    freq_dim=16, ffn_dim=32, num_layers=40, rope_dim=(4, 6, 6),
)  # fmt: skip
LATENT = (1, 4, 2, 8, 8)
#: A gradient counts as off beyond this relative error (fp32 both sides: a right run is within about 1e-6).
OFF = 1e-4


def _model_and_inputs():
    from diffusers import HeliosTransformer3DModel

    torch.manual_seed(0)
    model = HeliosTransformer3DModel(**CONFIG)
    model.set_attention_backend("native")
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(*LATENT, generator=gen), timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(LATENT[0], 8, CONFIG["text_dim"], generator=gen), return_dict=False,
    )  # fmt: skip
    return model, inputs, torch.randn(*LATENT, generator=gen)


def _step(model, inputs, target):
    out = model(**inputs)[0]
    torch.nn.functional.mse_loss(out, target).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().flatten(), grads


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
        model, inputs, target = _model_and_inputs()
        ref_out, ref_grads = _step(copy.deepcopy(model), inputs, target)
        _enable(model)
        out, grads = _step(model, inputs, target)
        worst, worst_name, off = 0.0, "", 0
        for name, grad in grads.items():
            dist.all_reduce(grad)  # each rank's gradients are its shard's share
            error = ((grad - ref_grads[name]).abs().max() / ref_grads[name].abs().max().clamp_min(1e-30)).item()
            off += error > OFF
            if error > worst:
                worst, worst_name = error, name
        out_error = ((out - ref_out).abs().max() / ref_out.abs().max()).item()
        results[rank] = {"out": out_error, "grad": worst, "worst": worst_name, "off": off, "of": len(grads)}
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        results[rank] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        dist.destroy_process_group()


def main():
    import diffusers
    import diffusers.models.transformers.transformer_helios  # imported once, before the ranks fork

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        start_method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        mp.start_processes(_worker, (WORLD_SIZE, port, results), nprocs=WORLD_SIZE, start_method=start_method)
        found = dict(results)
    print(f"diffusers {diffusers.__version__}, torch {torch.__version__}, tiny Helios, native backend, "
          f"ulysses_degree={WORLD_SIZE}")  # fmt: skip
    if any("error" in found.get(rank, {"error": "no report"}) for rank in range(WORLD_SIZE)):
        print(f"could not run: {found}")
        return 2
    result = found[0]
    if result["out"] > OFF or result["off"]:
        print(f"BUG: output error {result['out']:.3g}; {result['off']} of {result['of']} gradients off "
              f"(worst {result['worst']}: {result['grad']:.3g})")  # fmt: skip
        return 1
    print(f"ok: output and all {result['of']} gradients match one process (worst {result['grad']:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
