# To add to tests/models/test_attention_dispatch.py (diffusers), next to TestContextParallelAttentionBackward.
# Runs on CPU: gloo process groups, and an fp32 op pair with log-sum-exp handed to the ring directly, so no
# accelerator and no attention kernel is needed to check the ring's own bookkeeping.
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
from diffusers.models.attention_dispatch import TemplatedRingAttention


def _math_forward_op(
    ctx,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    return_lse=False,
    _save_ctx=True,
    _parallel_config=None,
):
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", query.float(), key.float()) * scale
    lse = scores.logsumexp(dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", (scores - lse[..., None]).exp(), value.float()).to(query.dtype)
    if _save_ctx:
        ctx.save_for_backward(query, key, value)
        ctx.scale = scale
    lse = lse.transpose(1, 2)  # (B, S, H), as the other forward ops return it
    return (out, lse) if return_lse else out


def _math_backward_op(ctx, grad_out, *args, query=None, key=None, value=None, out=None, lse=None, **kwargs):
    # Like the flash / cuDNN kernels: this iteration's share of the softmax recomputed from the reduced out / lse.
    q, k, v, do, o = (x.float() for x in (query, key, value, grad_out, out))
    probs = (torch.einsum("bqhd,bkhd->bhqk", q, k) * ctx.scale - lse.float().transpose(1, 2)[..., None]).exp()
    grad_probs = torch.einsum("bqhd,bkhd->bhqk", do, v)
    grad_scores = probs * (grad_probs - (do * o).sum(dim=-1).transpose(1, 2)[..., None])
    grad_query = torch.einsum("bhqk,bkhd->bqhd", grad_scores, k) * ctx.scale
    grad_key = torch.einsum("bhqk,bqhd->bkhd", grad_scores, q) * ctx.scale
    grad_value = torch.einsum("bhqk,bqhd->bkhd", probs, do)
    return grad_query, grad_key, grad_value


def _ring_backward_parity_worker(rank, world_size, master_port, return_dict):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(master_port)
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("ring", "ulysses"))
        cp_config = ContextParallelConfig(ring_degree=world_size)
        cp_config.setup(rank, world_size, torch.device("cpu"), mesh)
        parallel_config = ParallelConfig(context_parallel_config=cp_config)

        # Identical inputs on every rank so each rank can compute the same full-sequence reference.
        B, S, H, D = 1, 4 * world_size, 2, 8
        torch.manual_seed(0)
        q, k, v, grad_out = (torch.randn(B, S, H, D) for _ in range(4))
        q_ref, k_ref, v_ref = (t.clone().requires_grad_(True) for t in (q, k, v))
        ref_out = torch.nn.functional.scaled_dot_product_attention(
            q_ref.transpose(1, 2), k_ref.transpose(1, 2), v_ref.transpose(1, 2)
        ).transpose(1, 2)
        ref_grads = torch.autograd.grad(ref_out, (q_ref, k_ref, v_ref), grad_out)

        shard = slice(rank * S // world_size, (rank + 1) * S // world_size)
        qs, ks, vs = (t[:, shard].clone().requires_grad_(True) for t in (q, k, v))
        out = TemplatedRingAttention.apply(
            qs, ks, vs, None, 0.0, False, None, False, False, _math_forward_op, _math_backward_op, parallel_config
        )
        out.backward(grad_out[:, shard])

        rel_errs = {}
        for name, got, ref in zip(("dq", "dk", "dv"), (qs.grad, ks.grad, vs.grad), ref_grads, strict=True):
            rel_errs[name] = ((got - ref[:, shard]).norm() / ref[:, shard].norm()).item()
        return_dict[rank] = rel_errs
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_attention_backward_any_ring_degree(world_size):
    """Each rank's K/V gradients must reach the rank that owns that K/V chunk, at any ring degree (the gradient
    accumulator used to travel the same way as the K/V chunks, which is right at ring degree 2 only)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available.")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        master_port = sock.getsockname()[1]
    with mp.Manager() as manager:
        return_dict = manager.dict()
        mp.spawn(_ring_backward_parity_worker, args=(world_size, master_port, return_dict), nprocs=world_size)
        rel_errs = dict(return_dict)
    assert sorted(rel_errs) == list(range(world_size))
    for rank, errs in rel_errs.items():
        for name, rel in errs.items():
            assert rel < 1e-4, f"ring_degree={world_size} rank {rank}: `{name}` rel_err={rel:.3e}: {rel_errs}"
