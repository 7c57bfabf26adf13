# To add to tests/models/test_attention_dispatch.py (diffusers). CPU: gloo, the `native` backend.
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
from diffusers.models.attention_dispatch import dispatch_attention_fn


def _kv_length_worker(rank, world_size, master_port, seq_q, seq_kv, return_dict):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(master_port)
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (1, world_size), mesh_dim_names=("ring", "ulysses"))
        cp_config = ContextParallelConfig(ulysses_degree=world_size)
        cp_config.setup(rank, world_size, torch.device("cpu"), mesh)
        parallel_config = ParallelConfig(context_parallel_config=cp_config)

        torch.manual_seed(0)
        B, H, D = 2, 4, 16
        query, grad_out = (torch.randn(B, seq_q, H, D) for _ in range(2))
        key, value = (torch.randn(B, seq_kv, H, D) for _ in range(2))
        full = [x.clone().requires_grad_() for x in (query, key, value)]
        ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in full)).transpose(1, 2)
        ref.backward(grad_out)

        def shard(x):
            n = x.shape[1] // world_size
            return x[:, rank * n : (rank + 1) * n]

        # Each rank holds its shard of the queries and of the keys, as a context-parallel plan splits them.
        local = [shard(x).clone().requires_grad_() for x in (query, key, value)]
        out = dispatch_attention_fn(*local, backend="native", parallel_config=parallel_config)
        out.backward(shard(grad_out))
        torch.testing.assert_close(out, shard(ref.detach()))
        for x, r in zip(local, full, strict=True):
            torch.testing.assert_close(x.grad, shard(r.grad))
        return_dict[rank] = "ok"
    except Exception as e:  # noqa: BLE001 - reported by the parent
        return_dict[rank] = repr(e)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("seq_q, seq_kv", [(16, 8), (8, 16), (8, 8)])
def test_ulysses_attention_gradients_with_keys_of_another_length(seq_q, seq_kv):
    # Cross-attention (e.g. video tokens attending to text) has keys of another length than its queries.
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available.")
    world_size = 2
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        master_port = sock.getsockname()[1]
    with mp.Manager() as manager:
        return_dict = manager.dict()
        mp.spawn(_kv_length_worker, args=(world_size, master_port, seq_q, seq_kv, return_dict), nprocs=world_size)
        results = dict(return_dict)
    assert results == dict.fromkeys(range(world_size), "ok"), results
