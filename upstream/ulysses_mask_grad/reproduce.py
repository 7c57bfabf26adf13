"""diffusers' context-parallel attention gives an attention mask that requires grad no gradient, silently.

Standalone: needs torch and diffusers only; runs on a CPU (2 processes over gloo). A float attention mask that
requires grad (a learnable bias) goes through `dispatch_attention_fn` with the `native` backend and
`ContextParallelConfig(ulysses_degree=2)`; after `backward()` its `.grad` is compared with the gradient that
`F.scaled_dot_product_attention` gives it in one process. The same holds for every backend and for ring
attention: the templated context-parallel autograd functions return None for the mask.

Exit status: 1 when the mask silently gets no gradient (the bug), 0 when diffusers refuses such a mask (or
gives it the right gradient).

    python reproduce.py
"""

import os
import socket
import sys
import warnings
from math import inf

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

B, S, H, D = 1, 8, 2, 16
WORLD_SIZE = 2


def _worker(rank, world_size, port, results):
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's funcol deprecations, called by diffusers
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        mesh = dist.device_mesh.init_device_mesh("cpu", (1, world_size), mesh_dim_names=("ring", "ulysses"))
        cp_config = ContextParallelConfig(ulysses_degree=world_size)
        cp_config.setup(rank, world_size, torch.device("cpu"), mesh)
        parallel_config = ParallelConfig(context_parallel_config=cp_config)

        gen = torch.Generator().manual_seed(0)
        q, k, v, grad_out = (torch.randn(B, S, H, D, generator=gen) for _ in range(4))
        bias = torch.randn(B, 1, S, S, generator=gen)  # a learnable additive mask over the whole sequence

        ref_bias = bias.clone().requires_grad_()
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(1, 2) for x in (q, k, v)), attn_mask=ref_bias
        ).transpose(1, 2)
        ref.backward(grad_out)

        shard = slice(rank * S // world_size, (rank + 1) * S // world_size)
        local = [x[:, shard].clone().requires_grad_() for x in (q, k, v)]
        mask = bias.clone().requires_grad_()
        try:
            out = dispatch_attention_fn(*local, attn_mask=mask, backend="native", parallel_config=parallel_config)
        except ValueError as exc:
            results[rank] = {"refused": str(exc)}
            return
        out.backward(grad_out[:, shard])
        if mask.grad is not None:
            dist.all_reduce(mask.grad)  # each rank holds its own queries' share
        results[rank] = {
            "reference": ref_bias.grad.abs().max().item(),
            "grad": None if mask.grad is None else (mask.grad - ref_bias.grad).abs().max().nan_to_num(nan=inf).item(),
        }
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        results[rank] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        dist.destroy_process_group()


def main():
    import diffusers
    import diffusers.models.attention_dispatch  # imported once, before the ranks fork

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        start_method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        mp.start_processes(_worker, (WORLD_SIZE, port, results), nprocs=WORLD_SIZE, start_method=start_method)
        result = dict(results).get(0, {"error": "rank 0 reported nothing"})

    print(f"diffusers {diffusers.__version__}, torch {torch.__version__}, native backend, ulysses_degree={WORLD_SIZE}")
    if "error" in result:
        print(f"could not run: {result['error']}")
        return 2
    if "refused" in result:
        print(f"ok: a mask that requires grad is refused: ValueError: {result['refused']}")
        return 0
    if result["grad"] is None:
        reference = result["reference"]
        print(f"BUG: attn_mask.grad is None after backward (single-process reference: max |grad| {reference:.3f})")
        return 1
    if result["grad"] > 1e-4:
        print(f"BUG: attn_mask.grad is wrong: max abs error {result['grad']:.3e}")
        return 1
    print(f"ok: attn_mask.grad matches the reference (max abs error {result['grad']:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
