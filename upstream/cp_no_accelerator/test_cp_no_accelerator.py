# To add to tests/models/test_modeling_common.py (diffusers), or beside the context-parallel tests. CPU-only torch, two
# gloo processes: enable_parallelism sets a rank's device up where torch counts no accelerator.
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers import FluxTransformer2DModel
from diffusers.models._modeling_parallel import ContextParallelConfig


def _worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=4, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=8,
            axes_dims_rope=(4, 6, 6), num_layers=1, num_single_layers=1, pooled_projection_dim=8,
        )  # fmt: skip
        try:
            model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
            results[rank] = str(model._parallel_config.context_parallel_config._device)
        except ZeroDivisionError as exc:
            results[rank] = f"ZeroDivisionError: {exc}"
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.accelerator.device_count() > 0, reason="needs a torch without an accelerator")
def test_enable_parallelism_on_a_cpu_only_torch():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, (port, results), nprocs=2, start_method="fork")
        assert [results[0], results[1]] == ["cpu:0", "cpu:0"]
