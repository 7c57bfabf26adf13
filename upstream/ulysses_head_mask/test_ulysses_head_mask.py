# To add to tests/models/test_attention_dispatch.py (diffusers). CPU: gloo, the `native` backend.
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
from diffusers.models.attention_dispatch import dispatch_attention_fn


def _head_mask_worker(rank, world_size, master_port, mask_heads, return_dict):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(master_port)
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (1, world_size), mesh_dim_names=("ring", "ulysses"))
        cp_config = ContextParallelConfig(ulysses_degree=world_size)
        cp_config.setup(rank, world_size, torch.device("cpu"), mesh)
        parallel_config = ParallelConfig(context_parallel_config=cp_config)

        torch.manual_seed(0)
        B, S_Q, S_KV, H, D = 2, 16, 8, 4, 16
        query = torch.randn(B, S_Q, H, D)
        key, value = (torch.randn(B, S_KV, H, D) for _ in range(2))
        # An additive mask per head (LTX's processors repeat theirs per head), or one for every head.
        mask = torch.randn(B, mask_heads, 1, S_KV)
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(1, 2) for x in (query, key, value)), attn_mask=mask
        ).transpose(1, 2)

        def shard(x, dim=1):
            n = x.shape[dim] // world_size
            return x.narrow(dim, rank * n, n)

        # Each rank holds its shard of the queries, the keys and the mask's keys, as a context-parallel plan splits
        # them.
        with torch.no_grad():
            out = dispatch_attention_fn(
                shard(query),
                shard(key),
                shard(value),
                attn_mask=shard(mask, -1),
                backend="native",
                parallel_config=parallel_config,
            )
        torch.testing.assert_close(out, shard(ref))
        return_dict[rank] = "ok"
    except Exception as e:  # noqa: BLE001 - reported by the parent
        return_dict[rank] = repr(e)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mask_heads", [4, 1])
def test_ulysses_attention_with_a_mask_per_head(mask_heads):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available.")
    world_size = 2
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        master_port = sock.getsockname()[1]
    with mp.Manager() as manager:
        return_dict = manager.dict()
        mp.spawn(_head_mask_worker, args=(world_size, master_port, mask_heads, return_dict), nprocs=world_size)
        results = dict(return_dict)
    assert results == dict.fromkeys(range(world_size), "ok"), results
