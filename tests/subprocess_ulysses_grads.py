"""Gradients through diffusers' own ``TemplatedUlyssesAttention`` in a one-process gloo group.

Run in a fresh interpreter::

    python -c "import subprocess_ulysses_grads; subprocess_ulysses_grads.main('package_first')"

World size 1 is the most one process can drive: the all-to-alls run (over gloo, on CPU) but move nothing.
S_q != S_kv is left out: diffusers' Ulysses backward reshapes the K/V gradients with the query's sequence
length on every release (self-attention only), so that case fails with or without any fix.
The context-parallel config says ``_world_size=2`` as in a two-rank training run, which is what diffusers'
ops read to decide whether a backward may follow. Prints one JSON line like ``subprocess_op_pair_grads``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types
from typing import Any

from harness import ulysses_attention, ulysses_config
from subprocess_op_pair_grads import BACKENDS, CASES, import_in_order, passes

ULYSSES_CASES = tuple(case for case in CASES if case[2] == case[3])


def _init_gloo() -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        store = tempfile.NamedTemporaryFile(delete=False)
        dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    return init_device_mesh("cpu", (1,))


def run_case(module: types.ModuleType, mesh: Any, backend: str, case: tuple, return_lse: bool) -> dict[str, Any]:
    import torch
    from standin_kernels import max_abs_error, reference_attention

    fwd_name, bwd_name = BACKENDS[backend]
    if not hasattr(module, fwd_name) or not hasattr(module, "TemplatedUlyssesAttention"):
        return {"status": "absent"}
    _, batch, seq_q, seq_kv, heads, dim = case
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, s, heads, dim, generator=gen).to(torch.bfloat16) for s in (seq_q, seq_kv, seq_kv))
    grad_out = torch.randn(batch, seq_q, heads, dim, generator=gen).to(torch.bfloat16)
    config = ulysses_config(mesh)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    try:
        fwd, bwd = getattr(module, fwd_name), getattr(module, bwd_name)
        out = ulysses_attention(module, *leaves, return_lse=return_lse, forward_op=fwd, backward_op=bwd, config=config)
        if return_lse:
            out = out[0]
        out.backward(grad_out)
    except Exception as exc:
        return {"status": "raised", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    got = {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    ref = [x.float().transpose(1, 2).requires_grad_(True) for x in (q, k, v)]
    ref_out = reference_attention(*ref)
    ref_out.backward(grad_out.float().transpose(1, 2))
    golden = dict(
        zip(("out", "dq", "dk", "dv"), (t.transpose(1, 2) for t in (ref_out.detach(), *(x.grad for x in ref))))
    )
    bf16 = [x.transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        bf16_out = torch.nn.functional.scaled_dot_product_attention(*bf16)
    bf16_out.backward(grad_out.transpose(1, 2))
    bf16_ref = dict(
        zip(
            ("out", "dq", "dk", "dv"), (t.transpose(1, 2).float() for t in (bf16_out.detach(), *(x.grad for x in bf16)))
        )
    )
    errors = {n: max_abs_error(got[n].float(), golden[n]) for n in got}
    bf16_errors = {n: max_abs_error(bf16_ref[n], golden[n]) for n in got}
    magnitudes = {n: golden[n].abs().max().item() for n in got}
    ok = passes(errors, bf16_errors, magnitudes)
    return {"status": "pass" if ok else "wrong", "errors": errors, "bf16_errors": bf16_errors}


def run_cases(module: types.ModuleType) -> dict[str, dict[str, Any]]:
    """Every backend, self-attention shape and return_lse setting through TemplatedUlyssesAttention."""
    mesh = _init_gloo()
    results = {}
    for backend in BACKENDS:
        for case in ULYSSES_CASES:
            for return_lse in (False, True):
                results[f"{backend}/{case[0]}/return_lse={return_lse}"] = run_case(
                    module, mesh, backend, case, return_lse
                )
    return results


def main(order: str) -> None:
    module = import_in_order(order)
    import standin_kernels

    standin_kernels.register()
    results = run_cases(module)
    report = None
    if "diffusers_cudnn_fix" in sys.modules:
        report = sys.modules["diffusers_cudnn_fix"].status().to_dict()
    import diffusers

    print(
        json.dumps({"version": diffusers.__version__, "order": order, "status": report, "cases": results}), flush=True
    )
    os._exit(0)  # skip process-group teardown noise


if __name__ == "__main__":
    main(sys.argv[1])
