# To add to tests/hooks/ (diffusers), e.g. test_context_parallel.py. CPU, two gloo processes: a tiny model under
# Ulysses 2 against one process. Helios' plan gathers inside the model (around each attention and feed-forward), Flux's
# once at its end; with every gather's backward a reduce-scatter and the output's gradient shared out, both match.
import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
MODELS = {
    "helios": (
        "HeliosTransformer3DModel",
        dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
             text_dim=8, freq_dim=16, ffn_dim=32, num_layers=40, rope_dim=(4, 6, 6)),
    ),
    "flux": (
        "FluxTransformer2DModel",
        dict(patch_size=1, in_channels=4, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=8,
             axes_dims_rope=(4, 6, 6), num_layers=1, num_single_layers=1, pooled_projection_dim=8),
    ),
}  # fmt: skip


def _inputs(name, config):
    gen = torch.Generator().manual_seed(1)
    if name == "helios":
        latent = (1, 4, 2, 8, 8)
        text = torch.randn(1, 8, config["text_dim"], generator=gen)
        inputs = dict(hidden_states=torch.randn(*latent, generator=gen), timestep=torch.tensor([500]),
                      encoder_hidden_states=text)  # fmt: skip
        return inputs, torch.randn(*latent, generator=gen)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 4, generator=gen), encoder_hidden_states=torch.randn(1, 4, 8, generator=gen),
        timestep=torch.tensor([0.5]), pooled_projections=torch.randn(1, 8, generator=gen),
        img_ids=torch.tensor([[0.0, i // 2, i % 2] for i in range(4)]), txt_ids=torch.zeros(4, 3),
    )  # fmt: skip
    return inputs, torch.randn(1, 4, 4, generator=gen)


def _step(model, inputs, target):
    out = model(**inputs, return_dict=False)[0]
    torch.nn.functional.mse_loss(out, target).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank, name, port, results):
    import diffusers
    from diffusers.models._modeling_parallel import ContextParallelConfig

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        cls, config = MODELS[name]
        torch.manual_seed(0)
        model = getattr(diffusers, cls)(**config)
        model.set_attention_backend("native")
        inputs, target = _inputs(name, config)
        reference = _step(copy.deepcopy(model), inputs, target)
        count = torch.accelerator.device_count
        torch.accelerator.device_count = lambda: count() or 1  # a CPU-only torch (another issue)
        try:
            model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD_SIZE))
        finally:
            torch.accelerator.device_count = count
        grads = _step(model, inputs, target)
        worst = 0.0
        for key, grad in grads.items():
            dist.all_reduce(grad)
            scale = reference[key].abs().max().clamp_min(1e-30)
            worst = max(worst, ((grad - reference[key]).abs().max() / scale).item())
        results[rank] = worst
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_context_parallel_gradients_match_one_process(name):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, (name, port, results), nprocs=WORLD_SIZE, start_method="fork")
        assert results[0] < 1e-4, results[0]
