"""diffusers' Ulysses attention hands the attention op a per-head mask with every head, where q holds this rank's.

Standalone: needs torch and diffusers only; runs on a CPU (2 processes over gloo). A mask with a heads dimension,
`[B, heads, 1, S_kv]` (LTX-Video's and LTX-2's attention processors repeat their text mask per head; here each head's
differs), goes through `dispatch_attention_fn` with the `native` backend and `ContextParallelConfig(ulysses_degree=2)`,
each rank holding its shard of the queries, of the keys and of the mask's keys (as LTX's context-parallel plan
shards them); the output, under `torch.no_grad()` (inference), is compared with the rank's shard of
`F.scaled_dot_product_attention` over the whole sequence in one process.

Exit status: 1 while the forward raises or gives a wrong output (the bug), 0 once it matches.

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
        q = torch.randn(B, S_Q, H, D, generator=gen)
        k, v = (torch.randn(B, S_KV, H, D, generator=gen) for _ in range(2))
        mask = torch.randn(B, H, 1, S_KV, generator=gen)  # an additive mask, another one per head
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(1, 2) for x in (q, k, v)), attn_mask=mask
        ).transpose(1, 2)

        def shard(x, dim=1):
            n = x.shape[dim] // world_size
            return x.narrow(dim, rank * n, n)

        with torch.no_grad():
            try:
                out = dispatch_attention_fn(
                    shard(q), shard(k), shard(v), attn_mask=shard(mask, -1), backend="native",
                    parallel_config=parallel_config,
                )  # fmt: skip
            except RuntimeError as exc:
                results[rank] = {"raised": f"{type(exc).__name__}: {exc}"}
                return
        results[rank] = {"error_rel": ((out - shard(ref)).abs().max() / ref.abs().max()).item()}
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
        found = dict(results)

    print(
        f"diffusers {diffusers.__version__}, torch {torch.__version__}, native backend, ulysses_degree={WORLD_SIZE}, "
        f"a [{B}, {H}, 1, {S_KV}] mask (one per head)"
    )
    if any("error" in found.get(rank, {"error": "no report"}) for rank in range(WORLD_SIZE)):
        print(f"could not run: {found}")
        return 2
    raised = [found[rank]["raised"] for rank in range(WORLD_SIZE) if "raised" in found[rank]]
    if raised:
        print(f"BUG: the forward raised {raised[0]}")
        return 1
    worst = max(found[rank]["error_rel"] for rank in range(WORLD_SIZE))
    if worst > 1e-4:
        print(f"BUG: wrong output: relative error {worst:.3g} against the single-process reference")
        return 1
    print(f"ok: every rank's output matches the single-process reference (relative error {worst:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
