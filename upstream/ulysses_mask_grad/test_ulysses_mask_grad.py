# To add to tests/models/test_attention_dispatch.py (diffusers). CPU: gloo, the `native` backend.
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
from diffusers.models.attention_dispatch import dispatch_attention_fn


def _mask_grad_worker(rank, world_size, master_port, cp_type, return_dict):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(master_port)
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)
    try:
        mesh_shape = (world_size, 1) if cp_type == "ring_degree" else (1, world_size)
        mesh = dist.device_mesh.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("ring", "ulysses"))
        cp_config = ContextParallelConfig(**{cp_type: world_size})
        cp_config.setup(rank, world_size, torch.device("cpu"), mesh)
        parallel_config = ParallelConfig(context_parallel_config=cp_config)

        torch.manual_seed(0)
        B, S, H, D = 1, 8, 2, 16
        query, key, value = (torch.randn(B, S // world_size, H, D) for _ in range(3))
        mask = torch.randn(B, 1, S, S, requires_grad=True)  # a learnable additive mask over the whole sequence

        # With grad enabled the mask would silently get no gradient: refused.
        try:
            dispatch_attention_fn(query, key, value, attn_mask=mask, backend="native", parallel_config=parallel_config)
            return_dict[rank] = "no error with grad enabled"
            return
        except ValueError as e:
            if "attn_mask" not in str(e):
                raise
        # Without grad (inference) nothing is lost: it runs, as with the detached mask.
        with torch.no_grad():
            out = dispatch_attention_fn(
                query, key, value, attn_mask=mask, backend="native", parallel_config=parallel_config
            )
            expected = dispatch_attention_fn(
                query, key, value, attn_mask=mask.detach(), backend="native", parallel_config=parallel_config
            )
        torch.testing.assert_close(out, expected)
        return_dict[rank] = "ok"
    except Exception as e:  # noqa: BLE001 - reported by the parent
        return_dict[rank] = repr(e)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp_type", ["ulysses_degree"])
def test_context_parallel_attention_refuses_mask_requiring_grad(cp_type):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available.")
    world_size = 2
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        master_port = sock.getsockname()[1]
    with mp.Manager() as manager:
        return_dict = manager.dict()
        mp.spawn(_mask_grad_worker, args=(world_size, master_port, cp_type, return_dict), nprocs=world_size)
        results = dict(return_dict)
    assert results == dict.fromkeys(range(world_size), "ok"), results


def test_single_process_attention_keeps_mask_gradient():
    # Without context parallelism the mask's gradient flows through `F.scaled_dot_product_attention`, which is what
    # a user who trains a mask expects; the check above must not get in that way.
    query, key, value = (torch.randn(1, 8, 2, 16) for _ in range(3))
    mask = torch.randn(1, 1, 8, 8, requires_grad=True)
    dispatch_attention_fn(query, key, value, attn_mask=mask, backend="native").sum().backward()
    assert mask.grad is not None and mask.grad.abs().sum() > 0
