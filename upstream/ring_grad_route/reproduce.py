"""Ring attention's backward in diffusers sends the K/V gradients the wrong way round the ring.

Standalone: needs torch and diffusers only; runs on a CPU (3 processes over gloo). The flash attention ATen ops
have no CPU kernels, so this file registers small fp32 CPU kernels for them (the backward computes from the
`out` / `logsumexp` it is handed, as the CUDA kernel does). diffusers' own `dispatch_attention_fn` with the
`_native_flash` backend and `ContextParallelConfig(ring_degree=3)` then runs as in training.

Exit status: 1 when the gradients are wrong (the bug), 0 when they match a single-process fp32 reference.

    python reproduce.py [--ring-degree 3]
"""

import argparse
import os
import socket
import sys
import warnings
from math import inf

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOLERANCE = 1e-3  # relative error (norm); the CPU kernels compute in fp32, a correct ring is ~1e-6 off
B, S_PER_RANK, H, D = 1, 4, 2, 8


def _flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (query.float() @ key.float().transpose(-2, -1)) * scale
    lse = scores.logsumexp(dim=-1)
    out = (scores - lse[..., None]).exp() @ value.float()
    rng_state, unused = torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    debug = torch.empty(0, dtype=query.dtype)
    return out.to(query.dtype), lse, None, None, query.shape[2], key.shape[2], rng_state, unused, debug


def _flash_backward(
    grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
    philox_seed, philox_offset, *, scale=None,
):  # fmt: skip
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, do, o = (x.float() for x in (query, key, value, grad_out, out))
    p = ((q @ k.transpose(-2, -1)) * scale - logsumexp[..., None].float()).exp()
    ds = p * (do @ v.transpose(-2, -1) - (do * o).sum(dim=-1, keepdim=True))
    dq, dk, dv = ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ do
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def _register_cpu_flash_kernels():
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_flash_attention", _flash_forward, "CPU")
    lib.impl("_scaled_dot_product_flash_attention_backward", _flash_backward, "CPU")
    return lib  # keep it alive: the kernels go with it


def _worker(rank, world_size, port, results):
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's funcol deprecations, called by diffusers
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        lib = _register_cpu_flash_kernels()  # noqa: F841
        from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        mesh = dist.device_mesh.init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("ring", "ulysses"))
        cp_config = ContextParallelConfig(ring_degree=world_size)
        cp_config.setup(rank, world_size, torch.device("cpu"), mesh)
        parallel_config = ParallelConfig(context_parallel_config=cp_config)

        # The same full-sequence inputs on every rank; each rank attends with its own sequence shard.
        gen = torch.Generator().manual_seed(0)
        q, k, v, grad_out = (torch.randn(B, S_PER_RANK * world_size, H, D, generator=gen) for _ in range(4))
        refs = [x.clone().requires_grad_() for x in (q, k, v)]
        ref_out = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in refs)).transpose(1, 2)
        ref_grads = torch.autograd.grad(ref_out, refs, grad_out)

        shard = slice(rank * S_PER_RANK, (rank + 1) * S_PER_RANK)
        local = [x[:, shard].clone().requires_grad_() for x in (q, k, v)]
        out = dispatch_attention_fn(*local, backend="_native_flash", parallel_config=parallel_config)
        out.backward(grad_out[:, shard])

        errors = {"out": out.detach(), "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
        refs = {"out": ref_out.detach(), "dq": ref_grads[0], "dk": ref_grads[1], "dv": ref_grads[2]}
        results[rank] = {
            name: ((got - refs[name][:, shard]).norm() / refs[name][:, shard].norm()).nan_to_num(nan=inf).item()
            for name, got in errors.items()
        }
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        results[rank] = f"{type(exc).__name__}: {exc}"
    finally:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ring-degree", type=int, default=3)
    world_size = parser.parse_args().ring_degree

    import diffusers
    import diffusers.models.attention_dispatch  # imported once, before the ranks fork

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        start_method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        mp.start_processes(_worker, (world_size, port, results), nprocs=world_size, start_method=start_method)
        results = dict(results)

    print(f"diffusers {diffusers.__version__}, torch {torch.__version__}, _native_flash, ring_degree={world_size}")
    failed = [f"rank {r}: {results[r]}" for r in range(world_size) if isinstance(results.get(r), str)]
    if failed or len(results) != world_size:
        print("could not run:", *failed, sep="\n  ")
        return 2
    worst = {name: max(results[r][name] for r in range(world_size)) for name in ("out", "dq", "dk", "dv")}
    print("relative error vs fp32 single process (worst rank): " + ", ".join(f"{n} {e:.2e}" for n, e in worst.items()))
    if max(worst.values()) > TOLERANCE:
        print(f"BUG: gradients are wrong at ring_degree={world_size} (tolerance {TOLERANCE:.0e})")
        return 1
    print("ok: ring attention gradients match the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
