"""diffusers' cuDNN context-parallel attention under ``torch.compile``, every mask kind, on CPU stand-in kernels.

Run in a fresh interpreter whose ``PYTHONPATH`` starts with one diffusers release (``releases.run`` does it)::

    python -c "import subprocess_compile_matrix as s; s.main('diffusers_first', ('eager', 'aot_eager', 'inductor'))"
    python -c "import subprocess_compile_matrix as s; s.main('package_first', s.GPU_BACKENDS, device='cuda')"

Imports diffusers and the package in ``order`` (``"none"``: the package is never imported, the control),
registers the stand-in kernels (on CPU; on ``device="cuda"`` the real kernels run, over NCCL), joins a
one-process group and runs, for each compiler setting (``COMPILERS``: ``eager`` is not compiled), each mask and
each path, one forward and backward in bf16, compared with an fp32 reference of the same masked attention:

- masks: none; bool, additive in q's dtype (bfloat16) and additive fp32 (another float dtype), each as a key-padding
  mask [B, 1, 1, S] (QwenImage's shape) and as [B, 1, S_q, S_kv] with random positions and a fully masked query row
  masked;
- paths: ``pair``, the cuDNN op pair inside an ``autograd.Function`` as diffusers' templated attention calls it;
  ``pair-odd-offset-h1``, the same with one head and q/k/v views one element into their buffers (where diffusers'
  ``.contiguous()`` copies nothing, so the view would reach the kernel off 16 bytes; no mask and the bool
  key-padding mask); ``ulysses``, diffusers' own ``TemplatedUlyssesAttention.apply`` at world size 1, which from 0.39.0
  all-gathers a sequence-local mask before the op (where inductor mistypes a gathered bool tensor,
  docs/kernel-facts.md).

Prints one JSON line: per ``backend/path/mask``, ``status`` (``pass``, ``wrong`` or ``raised``), the errors
against fp32 and the largest difference from the eager run of the same case.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types
from typing import Any

from harness import op_pair, ulysses_attention, ulysses_config
from subprocess_op_pair_grads import import_in_order, passes

#: (B, S, H, D) per device: the GPU's is the shape the compile bug was measured at.
SHAPES = {"cpu": (2, 32, 4, 32), "cuda": (2, 256, 8, 64)}
BATCH, SEQ, HEADS, DIM = SHAPES["cpu"]
#: Compiler setting -> torch.compile's keyword arguments (None: not compiled).
COMPILERS: dict[str, dict[str, Any] | None] = {
    "eager": None,
    "aot_eager": {"backend": "aot_eager", "fullgraph": True},
    "inductor": {"backend": "inductor", "fullgraph": True},
    "inductor-graph-breaks-allowed": {"backend": "inductor"},
    "aot_eager-graph-breaks-allowed": {"backend": "aot_eager"},
    "max-autotune": {"backend": "inductor", "mode": "max-autotune-no-cudagraphs", "fullgraph": True},
}
GPU_BACKENDS = ("eager", "inductor", "inductor-graph-breaks-allowed", "max-autotune")
#: A compiler setting in ``backends`` may name the paths it runs: ``"inductor:ulysses"`` runs inductor through
#: ``ulysses`` only (no name: every path).
MASKS = (None, "bool/keys", "bfloat16/keys", "float32/keys", "bool/full", "bfloat16/full", "float32/full")
PATHS = ("pair", "ulysses")


def keep_flags(shape: str) -> Any:
    """True = attend. ``keys``: [B, 1, 1, S], the second sample's last quarter of keys padded. ``full``:
    [B, 1, S, S] with 30 % of the positions masked at random (column 0 kept), and the last query row fully
    masked."""
    import torch

    if shape == "keys":
        keep = torch.ones(BATCH, 1, 1, SEQ, dtype=torch.bool)
        keep[1, ..., -SEQ // 4 :] = False
        return keep
    keep = torch.rand(BATCH, 1, SEQ, SEQ, generator=torch.Generator().manual_seed(1)) >= 0.3
    keep[..., 0] = True
    keep[..., -1, :] = False
    return keep


def mask_tensor(name: str) -> tuple[Any, Any]:
    """(the mask handed to diffusers, its bool keep flags) for a ``MASKS`` entry."""
    import torch

    kind, _, shape = name.partition("/")
    keep = keep_flags(shape)
    if kind == "bool":
        return keep, keep
    dtype = getattr(torch, kind)
    return torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf")), keep


def _init_group(device: str) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        store = tempfile.NamedTemporaryFile(delete=False)
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store.name}", rank=0, world_size=1)
    return init_device_mesh(device, (1,))


def attention_fn(module: types.ModuleType, path: str, mesh: Any) -> Any:
    """``fn(q, k, v, mask) -> out`` in model layout (B, S, H, D) through ``path``."""
    forward_op, backward_op = module._cudnn_attention_forward_op, module._cudnn_attention_backward_op
    config = ulysses_config(mesh)
    if path == "ulysses":

        def ulysses(q: Any, k: Any, v: Any, mask: Any) -> Any:
            return ulysses_attention(
                module, q, k, v, mask, config=config, forward_op=forward_op, backward_op=backward_op
            )

        return ulysses

    # What diffusers' templated attention does around the op pair, minus the collectives.
    pair_fn = op_pair(forward_op, backward_op, parallel_config=config, inputs="as_given")

    def pair(q: Any, k: Any, v: Any, mask: Any) -> Any:
        return pair_fn.apply(q, k, v, mask)

    return pair


def odd_offset(x: Any) -> Any:
    """A copy of ``x`` one element into a larger buffer: its data pointer is off 16 bytes."""
    import torch

    buffer = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    return buffer[1:].view(x.shape).copy_(x)


def run_all(fn: Any, inputs: tuple[Any, ...], masks: list[Any], layout: Any = None) -> list[dict[str, Any]] | str:
    """out, dq, dk, dv (float32) of ``fn`` for every mask, each on its own leaves (laid out by ``layout``), in one
    call of ``fn`` (one compiled graph for the whole list: a graph per mask would cost a compilation each); or
    the error's text."""
    layout = layout or (lambda x: x.clone())
    leaves = [[layout(x).detach().requires_grad_(True) for x in inputs[:3]] for _ in masks]
    try:
        outs = fn(leaves, masks)
        sum((out.float() * inputs[3].float()).sum() for out in outs).backward()
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:3000]}"
    return [
        {
            "out": out.detach().float().cpu(),
            "dq": q.grad.float().cpu(),
            "dk": k.grad.float().cpu(),
            "dv": v.grad.float().cpu(),
        }
        for out, (q, k, v) in zip(outs, leaves)
    ]


def references(inputs: tuple[Any, ...], keep: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(fp32, bf16) references of the masked attention, in model layout, computed on the CPU."""
    import torch
    from standin_kernels import reference_attention

    result = []
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [x.cpu().to(dtype).transpose(1, 2).detach().requires_grad_(True) for x in inputs[:3]]
        out = reference_attention(*leaves, bool_mask=keep)
        out.backward(inputs[3].cpu().to(dtype).transpose(1, 2))
        tensors = [out.detach(), *(x.grad for x in leaves)]
        result.append(dict(zip(("out", "dq", "dk", "dv"), (t.transpose(1, 2).float() for t in tensors))))
    return result[0], result[1]


def run_matrix(module: types.ModuleType, backends: tuple[str, ...], device: str) -> dict[str, dict[str, Any]]:
    """Every case of ``backends`` (each ``setting`` or ``setting:path,path``), keyed ``setting/path/mask``."""
    import torch
    from standin_kernels import max_abs_error

    mesh = _init_group(device)
    gen = torch.Generator().manual_seed(0)
    inputs = tuple(
        torch.randn(BATCH, SEQ, HEADS, DIM, generator=gen).to(device=device, dtype=torch.bfloat16) for _ in range(4)
    )
    masks, keeps = zip(*(mask_tensor(name) if name else (None, None) for name in MASKS))
    masks = tuple(None if m is None else m.to(device) for m in masks)
    results: dict[str, dict[str, Any]] = {}
    eager: dict[str, dict[str, Any]] = {}
    for path in (*PATHS, "pair-odd-offset-h1"):
        one = attention_fn(module, path.partition("-")[0], mesh)
        names, path_masks, path_keeps, path_inputs, layout = MASKS, masks, keeps, inputs, None
        if path == "pair-odd-offset-h1":
            chosen = [MASKS.index(None), MASKS.index("bool/keys")]
            names, path_masks, path_keeps = ([seq[i] for i in chosen] for seq in (MASKS, masks, keeps))
            path_inputs, layout = tuple(x[:, :, :1] for x in inputs), odd_offset

        def every_mask(leaves: list[list[Any]], masks: list[Any], one: Any = one) -> list[Any]:
            return [one(*qkv, mask) for qkv, mask in zip(leaves, masks)]

        for backend, only in (b.partition(":")[::2] for b in backends):
            if only and path not in only.split(","):
                continue
            fn: Any = every_mask
            options = COMPILERS[backend]
            if options is not None:
                torch._dynamo.reset()
                fn = torch.compile(every_mask, **options)
            got = run_all(fn, path_inputs, list(path_masks), layout)
            for name, keep, case in zip(names, path_keeps, got if isinstance(got, list) else [got] * len(names)):
                key = f"{path}/{name or 'none'}"
                if isinstance(case, str):
                    results[f"{backend}/{key}"] = {"status": "raised", "error": case}
                    continue
                golden, bf16 = references(path_inputs, keep)
                errors = {n: max_abs_error(case[n], golden[n]) for n in golden}
                bf16_errors = {n: max_abs_error(bf16[n], golden[n]) for n in golden}
                magnitudes = {n: golden[n].abs().max().item() for n in golden}
                entry: dict[str, Any] = {
                    "status": "pass" if passes(errors, bf16_errors, magnitudes) else "wrong",
                    "errors": errors,
                }
                if backend == "eager":
                    eager[key] = case
                elif key in eager:
                    entry["from_eager"] = max(max_abs_error(case[n], eager[key][n]) for n in golden)
                results[f"{backend}/{key}"] = entry
    return results


def main(order: str, backends: tuple[str, ...] = ("eager", "aot_eager", "inductor"), device: str = "cpu") -> None:
    """Print one JSON line: the release, ``order``, whether the package was loaded, and the matrix."""
    global BATCH, SEQ, HEADS, DIM
    BATCH, SEQ, HEADS, DIM = SHAPES[device]
    module = import_in_order(order)
    import torch

    if device == "cpu":
        import standin_kernels

        torch.set_num_threads(1)
        standin_kernels.register()
    results = run_matrix(module, backends, device)
    import diffusers

    package = sys.modules.get("diffusers_cudnn_fix")
    print(
        json.dumps(
            {"version": diffusers.__version__, "order": order, "package": package is not None, "cases": results}
        ),
        flush=True,
    )
    os._exit(0)  # skip the gloo process group's teardown noise


if __name__ == "__main__":
    main(sys.argv[1], tuple(sys.argv[2:]) or ("eager", "aot_eager", "inductor"))
