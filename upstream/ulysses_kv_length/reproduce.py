"""diffusers' Ulysses attention raises in the backward when the keys are not as long as the queries.

Standalone: needs torch and diffusers only; runs on a CPU (2 processes over gloo). Cross-attention (queries of 32
tokens, keys and values of 8, as LTX-Video's video tokens attend to its text) goes through `dispatch_attention_fn`
with the `native` backend and `ContextParallelConfig(ulysses_degree=2)`, each rank holding its shard of the
queries and of the keys; after `backward()` each rank's gradients are compared with its shard of the gradients
that `F.scaled_dot_product_attention` gives over the whole sequence in one process.

Exit status: 1 while the backward raises or gives wrong gradients (the bug), 0 once they match.

    python reproduce.py
"""

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

B, S_Q, S_KV, H, D = 1, 32, 8, 2, 16
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
        q, grad_out = (torch.randn(B, S_Q, H, D, generator=gen) for _ in range(2))
        k, v = (torch.randn(B, S_KV, H, D, generator=gen) for _ in range(2))
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in full)).transpose(1, 2)
        ref.backward(grad_out)

        def shard(x):
            n = x.shape[1] // world_size
            return x[:, rank * n : (rank + 1) * n]

        local = [shard(x).clone().requires_grad_() for x in (q, k, v)]
        out = dispatch_attention_fn(*local, backend="native", parallel_config=parallel_config)
        try:
            out.backward(shard(grad_out))
        except RuntimeError as exc:
            results[rank] = {"raised": f"{type(exc).__name__}: {exc}"}
            return
        reference = [shard(x.grad) for x in full]
        errors = [((x.grad - r).abs().max() / r.abs().max()).item() for x, r in zip(local, reference, strict=True)]
        results[rank] = {"errors": errors}
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

    print(
        f"diffusers {diffusers.__version__}, torch {torch.__version__}, native backend, ulysses_degree={WORLD_SIZE}, "
        f"queries of {S_Q} tokens, keys of {S_KV}"
    )
    if "error" in result:
        print(f"could not run: {result['error']}")
        return 2
    if "raised" in result:
        print(f"BUG: backward() raised {result['raised']}")
        return 1
    worst = max(result["errors"])
    if worst > 1e-4:
        print(f"BUG: wrong gradients: relative error of dq, dk, dv {[f'{e:.3g}' for e in result['errors']]}")
        return 1
    print(f"ok: dq, dk, dv match the single-process reference (relative error {worst:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
