"""GPU checks of one diffusers release, run in a fresh interpreter by ``test_gpu.py`` (marker ``gpu``).

    python -c "import gpu_checks; gpu_checks.main()"

With the package imported first, on the CUDA device:

* the probe on the ops as shipped (after ``revert()``), then on the corrected ops (after ``apply()``);
* diffusers' own ``TemplatedUlyssesAttention`` in a one-process NCCL group (world size 1), cuDNN backend,
  against an fp32 eager reference (the path h200-facts.md measured);
* a bool mask with masked columns and one fully masked row (B=1 S=64 H=2 D=64) through the cuDNN CP op in
  each mask mode, and converted with -65504 (F.sdpa's own fill) for comparison, against fp32
  ``F.scaled_dot_product_attention`` on the math backend with the bool mask;
* ``TemplatedRingAttention`` with 2, 3 and 4 ring chunks on the one GPU (``threaded_ring``: a thread per ring
  rank), as installed and, where the package replaced it, as shipped.

Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import tempfile
import types
import warnings
from collections import Counter
from typing import Any

import diffusers.models.attention_dispatch as module
import torch
from harness import op_pair, ulysses_attention, ulysses_config

import diffusers_cudnn_fix
from diffusers_cudnn_fix import _probe as probe

DEVICE = torch.device("cuda", 0)
NAMES = ("out", "dq", "dk", "dv")


def _errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    out = {}
    for n in NAMES:
        g = got[n].float()
        out[n] = float("inf") if not torch.isfinite(g).all() else (g - ref[n]).abs().max().item()
    return out


def _as_dict(result: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(result) if dataclasses.is_dataclass(result) else result.as_dict()


def _forget_probes() -> None:
    """Let the next probe on the device run afresh (its verdict lives in ``_devices`` from this version on)."""
    from diffusers_cudnn_fix import _devices

    _devices._results.clear()


def probes() -> dict[str, Any]:
    diffusers_cudnn_fix.revert()
    shipped = _as_dict(probe.probe(DEVICE))
    _forget_probes()  # let the corrected ops be probed afresh
    diffusers_cudnn_fix.apply()
    corrected = _as_dict(probe.probe(DEVICE))
    return {"shipped": shipped, "corrected": corrected}


def ulysses_nccl() -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not hasattr(module, "TemplatedUlyssesAttention"):
        return {"status": "absent"}
    if not dist.is_initialized():
        store = tempfile.NamedTemporaryFile(delete=False)
        dist.init_process_group("nccl", init_method=f"file://{store.name}", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    config = ulysses_config(mesh)
    results = {}
    for case in (*probe.CASES[:1], ("heads_ne_seq", 2, 128, 128, 8, 64)):
        q, k, v, grad = probe._inputs(case, DEVICE)
        golden = probe.reference(case, DEVICE, torch.float32)
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        try:
            out = ulysses_attention(module, *leaves, config=config)
            out.backward(grad)
            got = {"out": out.detach(), **dict(zip(("dq", "dk", "dv"), (x.grad for x in leaves)))}
            low = probe.reference(case, DEVICE, torch.bfloat16)
            ref_errors = {n: (low[n] - golden[n]).abs().max().item() for n in NAMES}
            errors = _errors(got, golden)
            results[case[0]] = {
                "errors": errors,
                "ref_errors": ref_errors,
                "magnitudes": {n: golden[n].abs().max().item() for n in NAMES},
                "passed": all(probe.within_rule(errors[n], ref_errors[n]) for n in NAMES),
            }
        except Exception as exc:
            results[case[0]] = {"raised": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return results


def _mask_pair(backward_op: Any = None) -> Any:
    """The installed cuDNN CP forward op (its ``mask`` an argument of ``apply``); its backward through
    ``backward_op`` (None: the installed one)."""
    backward_op = backward_op or module._cudnn_attention_backward_op
    return op_pair(module._cudnn_attention_forward_op, backward_op, parallel_config=probe._TRAINING_CP)


def masks() -> dict[str, Any]:
    batch, seq, heads, dim = 1, 64, 2, 64
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    q, k, v, grad = (
        torch.randn(batch, seq, heads, dim, generator=gen, device=DEVICE, dtype=torch.bfloat16) for _ in range(4)
    )
    keep = torch.ones(batch, 1, seq, seq, dtype=torch.bool, device=DEVICE)
    keep[..., seq // 2 :: 3] = False
    keep[..., -1, :] = False  # a fully masked query row
    # The reference: fp32 math SDPA with the bool mask (its fully masked row is 0).
    ref_leaves = [x.float().transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref_out = torch.nn.functional.scaled_dot_product_attention(*ref_leaves, attn_mask=keep)
    ref_out.backward(grad.float().transpose(1, 2))
    golden = {n: t.transpose(1, 2).float() for n, t in zip(NAMES, (ref_out.detach(), *(x.grad for x in ref_leaves)))}
    golden = {n: torch.nan_to_num(t) for n, t in golden.items()}

    def run(mask: torch.Tensor) -> dict[str, Any]:
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = _mask_pair().apply(*leaves, mask)
                out.backward(grad)
        except Exception as exc:
            return {"raised": f"{type(exc).__name__}: {str(exc)[:160]}"}
        got = {"out": out.detach(), **dict(zip(("dq", "dk", "dv"), (x.grad for x in leaves)))}
        errs = _errors(got, golden)
        return {
            "errors": errs,
            "dead_row_max": got["out"][:, -1].abs().max().item(),
            "nan": any(not torch.isfinite(t).all().item() for t in got.values()),
        }

    results = {"magnitudes": {n: golden[n].abs().max().item() for n in NAMES}}
    for mode in ("warn", "convert", "error"):
        diffusers_cudnn_fix.set_mask_mode(mode)
        results[f"bool mask, mode {mode}"] = run(keep)
    diffusers_cudnn_fix.set_mask_mode("warn")
    results["additive bf16, fill -inf"] = run(
        torch.zeros(keep.shape, dtype=torch.bfloat16, device=DEVICE).masked_fill_(~keep, float("-inf"))
    )
    results["additive bf16, fill finfo.min"] = run(
        torch.zeros(keep.shape, dtype=torch.bfloat16, device=DEVICE).masked_fill_(
            ~keep, torch.finfo(torch.bfloat16).min
        )
    )
    results["additive bf16, fill -65504"] = run(
        torch.zeros(keep.shape, dtype=torch.bfloat16, device=DEVICE).masked_fill_(~keep, -65504.0)
    )
    return results


def one_key_masked_rows() -> dict[str, Any]:
    """S_kv = 1 with fully masked query rows (bf16, S_q = 7: where the bare cuDNN backward goes wrong) through
    the installed op pair, and through the backward the masked-row guard wraps (the control). Errors are
    relative to the fp32 math SDPA reference's largest value over out, dq, dk and dv."""
    backward = module._cudnn_attention_backward_op
    # The control: the backward the package builds without the masked-row policy (with the K/V correction where
    # the installed one has it); None where no backward of the package's is installed.
    from diffusers_cudnn_fix.targets import cudnn as cudnn_target

    unguarded = None
    if diffusers_cudnn_fix.is_patched(cudnn_target.CUDNN_BACKWARD):
        corrected = any(f.id == "cudnn_backward_kv" and f.applied for f in diffusers_cudnn_fix.status().fixes)
        policies = frozenset({"cudnn_backward_kv"} if corrected else ())
        unguarded = cudnn_target.backward_op(diffusers_cudnn_fix.get_original(cudnn_target.CUDNN_BACKWARD), policies)
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    q, grad = (torch.randn(2, 7, 3, 32, generator=gen, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 1, 3, 32, generator=gen, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    keep = torch.ones(2, 1, 7, 1, dtype=torch.bool, device=DEVICE)
    keep[:, :, 3] = False
    keep[1, :, 5] = False
    ref_leaves = [x.float().transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref_out = torch.nn.functional.scaled_dot_product_attention(*ref_leaves, attn_mask=keep)
    ref_out.backward(grad.float().transpose(1, 2))
    golden = {n: t.transpose(1, 2).float() for n, t in zip(NAMES, (ref_out.detach(), *(x.grad for x in ref_leaves)))}
    golden = {n: torch.nan_to_num(t) for n, t in golden.items()}

    def run(mask: torch.Tensor, backward_op: Any) -> dict[str, Any]:
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        try:
            out = _mask_pair(backward_op).apply(*leaves, mask)
            out.backward(grad)
        except Exception as exc:
            return {"raised": f"{type(exc).__name__}: {str(exc)[:160]}"}
        got = {"out": out.detach(), **dict(zip(("dq", "dk", "dv"), (x.grad for x in leaves)))}
        # One key: the true dQ and dK are 0, so every error is taken relative to the largest reference value.
        scale = max(golden[n].abs().max().item() for n in NAMES)
        return {
            n: torch.nan_to_num((got[n].float() - golden[n]).abs(), nan=float("inf")).max().item() / scale
            for n in NAMES
        }

    diffusers_cudnn_fix.set_mask_mode("convert")
    fills = {
        "bool (converted)": keep,
        "additive bf16, fill -inf": torch.zeros(keep.shape, dtype=torch.bfloat16, device=DEVICE).masked_fill_(
            ~keep, float("-inf")
        ),
        "additive bf16, fill finfo.min": torch.zeros(keep.shape, dtype=torch.bfloat16, device=DEVICE).masked_fill_(
            ~keep, torch.finfo(torch.bfloat16).min
        ),
    }
    results: dict[str, Any] = {"guarded": unguarded is not None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, mask in fills.items():
            results[name] = run(mask, backward)
            if unguarded is not None:
                results[f"{name}, unguarded"] = run(mask, unguarded)
    return results


#: Ring degrees run on the GPU: 2, and 3 and 4, where diffusers 0.40+'s own route goes wrong (ring_grad_route).
RING_WORLDS = (2, 3, 4)


def ring_chunks() -> dict[str, Any]:
    """``TemplatedRingAttention`` with 2, 3 and 4 ring chunks on this one GPU (one thread per ring rank,
    ``threaded_ring``), cuDNN and flash ops, as installed (corrected where the package replaced the ring) and,
    where it did, diffusers' own ring forward/backward with the same ops (the control). Each case is also
    judged by the probe's rule (``rule_passed``: every max-abs error within 5x that of the same attention
    computed eagerly in bf16, + 1e-3, against fp32)."""
    import threaded_ring

    diffusers_cudnn_fix.apply()
    shipped = {
        name: diffusers_cudnn_fix.get_original(f"TemplatedRingAttention.{name}").__func__
        for name in ("forward", "backward")
        if diffusers_cudnn_fix.is_patched(f"TemplatedRingAttention.{name}")
    }

    def judged(result: dict[str, Any]) -> dict[str, Any]:
        if "abs_errors" in result:
            result["rule_passed"] = all(
                probe.within_rule(result["abs_errors"][n], result["bf16_errors"][n]) for n in NAMES
            )
        return result

    results: dict[str, Any] = {}
    for backend, (_, backward_name) in threaded_ring.BACKEND_OPS.items():
        if backend == "native" or not hasattr(module, backward_name):
            continue
        for world in RING_WORLDS:
            results[f"{backend}/world={world}"] = judged(
                threaded_ring.run(module, backend, world, device="cuda", bf16_yardstick=True)
            )
            if shipped:
                # diffusers' own ring as it shipped: the package's corrected forward/backward (ring_grad_route's)
                # replaced by the originals.
                control = {f"ring_{name}": function for name, function in shipped.items()}
                results[f"{backend}/world={world}/shipped ring"] = judged(
                    threaded_ring.run(module, backend, world, device="cuda", bf16_yardstick=True, **control)
                )
    return {"ring_patched": "forward" in shipped, "ring_replaced": sorted(shipped), "cases": results}


#: Shapes of the masked ring cases on the GPU: the threaded ring's own (4 tokens a rank, head dim 8), and one with
#: the head dim and a token count a real model has (alignment of the kernel's bias and its strides).
RING_MASK_SHAPES = {"tiny": (2, 4, 2, 8), "model": (1, 64, 2, 64)}


def ring_masks(device: str = "cuda") -> dict[str, Any]:
    """``TemplatedRingAttention`` with a mask on the real kernels at ring degrees 2 - 4 (a thread per ring rank):
    every mask kind and layout of ``threaded_ring.MASK_KINDS`` through the installed (corrected) ring on the cuDNN
    ops, judged by the probe's rule against fp32 attention over the whole sequence; a mask that masks nothing
    must reach no op (``masked_calls`` 0). The flash ops take no mask: their masked ring must be refused. And
    the control where the package replaced the ring: diffusers' own ring forward/backward with a key-padding mask.
    ``device="cpu"``: the same on the CPU stand-in kernels (tests/test_gpu_ring_masks.py's dry run)."""
    import threaded_ring

    diffusers_cudnn_fix.apply()
    shipped = {
        name: diffusers_cudnn_fix.get_original(f"TemplatedRingAttention.{name}").__func__
        for name in ("forward", "backward")
        if diffusers_cudnn_fix.is_patched(f"TemplatedRingAttention.{name}")
    }
    results: dict[str, Any] = {}
    for shape_name, shape in RING_MASK_SHAPES.items():
        for world in RING_WORLDS:
            for kind, layouts in threaded_ring.MASK_KINDS.items():
                mask = threaded_ring.make_mask(kind, world, seed=world, shape=shape)
                for layout in layouts:
                    case = threaded_ring.run(
                        module, "cudnn", world, device=device, mask=mask, mask_layout=layout, shape=shape,
                        seed=world, bf16_yardstick=True,
                    )  # fmt: skip
                    if "abs_errors" in case:
                        case["rule_passed"] = all(
                            probe.within_rule(case["abs_errors"][n], case["bf16_errors"][n]) for n in NAMES
                        )
                    case["masks_nothing"] = kind in threaded_ring.MASKS_NOTHING
                    results[f"cudnn/{shape_name}/world={world}/{kind}/{layout}"] = case
            mask = threaded_ring.make_mask("key_padding", world, seed=world, shape=shape)
            if hasattr(module, threaded_ring.BACKEND_OPS["flash"][1]):
                results[f"flash/{shape_name}/world={world}/key_padding/local"] = threaded_ring.run(
                    module, "flash", world, device=device, mask=mask, mask_layout="local", shape=shape, seed=world
                )
            if shipped:
                control = {f"ring_{name}": function for name, function in shipped.items()}
                results[f"cudnn/{shape_name}/world={world}/key_padding/local/shipped ring"] = threaded_ring.run(
                    module, "cudnn", world, device=device, mask=mask, mask_layout="local", shape=shape, seed=world,
                    **control,
                )  # fmt: skip
    return {"ring_replaced": sorted(shipped), "cases": results}


def main_ring_masks() -> None:
    """Only ``ring_masks``, one JSON line."""
    import diffusers

    result = {
        "version": diffusers.__version__,
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "gpu": torch.cuda.get_device_name(),
        "ring_masks": ring_masks(),
    }
    print(json.dumps(result, default=str))
    os._exit(0)


#: The Ulysses cases at world size 1 (issue #42): (batch, query tokens, key tokens, heads, head dim), keys shorter than
#: the queries (cross-attention to text, as LTX's): the threaded ring's head dim, and a real model's (a CLIP-length
#: prompt of 77 tokens, 8 heads of 64).
def _one_process_group(device: str) -> bool:
    """Start a process group of this process alone (NCCL on CUDA, gloo on the CPU) unless one is up; whether it
    started one (the caller then destroys it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    store = tempfile.NamedTemporaryFile(delete=False)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store.name}", rank=0, world_size=1)
    return True


ULYSSES_SHAPES = {"tiny": (2, 64, 24, 2, 8), "model": (1, 256, 77, 8, 64)}


def _padded_keys(batch: int, heads: int, seq_q: int, seq_kv: int) -> torch.Tensor:
    """A per-head bool mask ``[B, H, S_q, S_kv]`` (True = attend) padding the last keys, a different number of them
    for each batch item and head (1 up to half the keys: every query keeps a key), so a wrong head order shows."""
    pads = 1 + (5 * torch.arange(batch * heads)) % (seq_kv // 2)
    keep = torch.arange(seq_kv) < (seq_kv - pads).view(batch, heads, 1, 1)
    return keep.expand(batch, heads, seq_q, seq_kv).contiguous()


def ulysses_models(device: str = "cuda") -> dict[str, Any]:
    """diffusers' own ``TemplatedUlyssesAttention`` (as installed: the package's forward and backward) in a
    one-process group (NCCL on CUDA, gloo on the CPU) at Ulysses degree 1, the findings of issue #42 that world size
    1 reaches, on the real kernels:

    * ``ulysses_kv_length``: cross-attention, keys shorter than the queries (:data:`ULYSSES_SHAPES`), forward and
      backward on the cuDNN op pair and, where the release has it, the native-flash one;
    * ``ulysses_head_mask``: the same with a per-head bool mask of padded keys (:func:`_padded_keys`), cuDNN only
      (diffusers' flash ops take no mask). At degree 1 the rank holds every head: the package's path must hand the
      mask on whole.

    Each case against fp32 attention on the same bf16 inputs (``threaded_ring._reference``): ``status`` ``"pass"``
    (every relative error within ``threaded_ring.TOLERANCE``), ``"wrong"`` or ``"raised"``, and ``rule_passed``, the
    probe's rule against the same attention computed eagerly in bf16. The control: the model shape's key-length case
    through diffusers' shipped backward (``/shipped backward``), which reshapes dK/dV with the queries' length.
    ``device="cpu"``: the same on the CPU stand-in kernels (tests/test_gpu_ulysses_models.py's dry run)."""
    import threaded_ring
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not hasattr(module, "TemplatedUlyssesAttention"):
        return {"status": "absent"}
    diffusers_cudnn_fix.apply()
    started = _one_process_group(device)
    config = ulysses_config(init_device_mesh(device, (1,)))
    cls = module.TemplatedUlyssesAttention
    shipped = diffusers_cudnn_fix.get_original("TemplatedUlyssesAttention.backward").__func__
    # The control: the installed forward with the backward diffusers shipped, as an autograd Function of its own.
    control = types.SimpleNamespace(
        TemplatedUlyssesAttention=type(
            "ShippedBackward", (torch.autograd.Function,), {"forward": cls.forward, "backward": staticmethod(shipped)}
        )
    )

    def run(backend: str, shape: tuple[int, ...], masked: bool, attention: Any = module) -> dict[str, Any]:
        batch, seq_q, seq_kv, heads, dim = shape
        gen = torch.Generator().manual_seed(seq_q + seq_kv)
        q, k, v, grad = (
            torch.randn(batch, seq, heads, dim, generator=gen).to(torch.bfloat16)
            for seq in (seq_q, seq_kv, seq_kv, seq_q)
        )
        mask = _padded_keys(batch, heads, seq_q, seq_kv) if masked else None
        forward_name, backward_name = threaded_ring.BACKEND_OPS[backend]
        leaves = [x.clone().to(device).requires_grad_(True) for x in (q, k, v)]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the bool mask's conversion warning
                out = ulysses_attention(
                    attention, *leaves, None if mask is None else mask.to(device), config=config,
                    forward_op=getattr(module, forward_name), backward_op=getattr(module, backward_name),
                )  # fmt: skip
                out.backward(grad.to(device))
        except Exception as exc:
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
            return {"status": "raised", "raised": type(exc).__name__, "error": error}
        got = [t.float().cpu() for t in (out.detach(), *(x.grad for x in leaves))]
        golden = threaded_ring._reference(q, k, v, grad, mask=mask)
        for name, g, ref in zip(NAMES, got, golden, strict=True):
            if g.shape != ref.shape:
                return {"status": "wrong", "error": f"{name} of shape {tuple(g.shape)}, not {tuple(ref.shape)}"}
        low = threaded_ring._reference(q, k, v, grad, torch.bfloat16, device, mask=mask)
        abs_errors = {
            n: torch.nan_to_num((g - ref).abs(), nan=float("inf")).max().item()
            for n, g, ref in zip(NAMES, got, golden, strict=True)
        }
        errors = {n: abs_errors[n] / ref.abs().max().item() for n, ref in zip(NAMES, golden, strict=True)}
        bf16_errors = {n: (x - ref).abs().max().item() for n, x, ref in zip(NAMES, low, golden, strict=True)}
        return {
            "status": "pass" if max(errors.values()) <= threaded_ring.TOLERANCE else "wrong",
            "errors": errors, "abs_errors": abs_errors, "bf16_errors": bf16_errors,
            "rule_passed": all(probe.within_rule(abs_errors[n], bf16_errors[n]) for n in NAMES),
        }  # fmt: skip

    results: dict[str, Any] = {}
    for shape_name, shape in ULYSSES_SHAPES.items():
        for backend in ("cudnn", "flash"):
            if hasattr(module, threaded_ring.BACKEND_OPS[backend][1]):
                results[f"{backend}/{shape_name}/kv_length"] = run(backend, shape, masked=False)
        results[f"cudnn/{shape_name}/head_mask"] = run("cudnn", shape, masked=True)
    results["cudnn/model/kv_length/shipped backward"] = run("cudnn", ULYSSES_SHAPES["model"], False, control)
    if started:
        dist.destroy_process_group()
    return {"backward_replaced": diffusers_cudnn_fix.is_patched("TemplatedUlyssesAttention.backward"), "cases": results}


#: The layer stack of :func:`ulysses_mask_syncs`: (batch, tokens, heads, head dim, layers); the share of each
#: element's tokens that is prompt padding.
MASK_SYNC_STACK = {"cuda": (2, 1024, 8, 64, 8), "cpu": (2, 32, 2, 16, 4)}
MASK_SYNC_PADDING = (0.125, 0.0)
MASK_SYNC_STEPS = {"cuda": 10, "cpu": 2}


def _relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference between two tensors, relative to ``want``'s largest magnitude."""
    return ((got - want).abs().max() / want.abs().max()).item()


def ulysses_mask_syncs(
    device: str = "cuda", stack: tuple[int, int, int, int, int] | None = None, steps: int | None = None
) -> dict[str, Any]:
    """Issue #40, item 3: host syncs and step time of a stack of attention layers under Ulysses with a padded-prompt
    bool mask (the model's, made once per step and handed to every layer), diffusers' ``TemplatedUlyssesAttention``
    as installed in a one-process group (NCCL on CUDA) on the package's cuDNN ops; diffusers all-gathers the mask
    in every layer (0.39+). Two ways, steps interleaved: ``package`` (the key-padding plan kept for the model's mask:
    ``_key_padding.plan_of``) and ``per_gathered_tensor`` (the control, as before: kept for each layer's gathered
    copy). Per way: ``plans`` per step (``_key_padding.plan`` counted; the most in any step), ``syncs`` per step
    (CUDA only: ``torch.cuda.set_sync_debug_mode("warn")``'s warnings, in the steps after the warm-up; the median
    step's, and ``syncs_max``, the most in any step) and ``sync_sites`` (where they were raised, the frame's last
    three path parts and line, summed over the steps), ``step_ms`` (median; forward and backward of the stack) and
    the largest relative error of the input gradient against the same stack in fp32 eager attention (meaningful for
    a shallow stack: a deep one of random layers amplifies rounding). ``ways_differ_by``: the largest difference
    between the two ways' input gradients, relative to the control's largest; ``repeat_differs_by``: the same
    between two runs of the control (the kernels' own run-to-run noise: cuDNN's backward may accumulate in another
    order each run). ``stack`` and
    ``steps``: default :data:`MASK_SYNC_STACK` and :data:`MASK_SYNC_STEPS` for ``device``
    (``benchmarks/bench_mask_plan.py`` hands others)."""
    import statistics
    import time

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from diffusers_cudnn_fix import _key_padding

    if not hasattr(module, "TemplatedUlyssesAttention"):
        return {"status": "absent"}
    diffusers_cudnn_fix.apply()
    started = _one_process_group(device)
    config = ulysses_config(init_device_mesh(device, (1,)))
    stack = MASK_SYNC_STACK[device] if stack is None else stack
    batch, seq, heads, dim, layers = stack
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, seq, heads, dim, generator=gen).to(device, torch.bfloat16)
    weights = [torch.randn(3, dim, dim, generator=gen).div(dim**0.5).to(device, torch.bfloat16) for _ in range(layers)]
    keep = torch.ones(batch, 1, 1, seq, dtype=torch.bool)
    for element, share in enumerate(MASK_SYNC_PADDING):
        if padded := int(seq * share):
            keep[element, ..., -padded:] = False
    plans: list[int] = []
    real_plan, real_plan_of = _key_padding.plan, _key_padding.plan_of

    def counted(mask: torch.Tensor, dtype: torch.dtype) -> Any:
        plans.append(1)
        return real_plan(mask, dtype)

    def per_gathered_tensor(given: Any, dtype: Any, source: Any, config: Any) -> Any:
        return _key_padding.remembered(_key_padding.plan, given, dtype)  # kept for the gathered tensor alone

    def step(exact: bool = False) -> torch.Tensor:
        mask = keep.to(device, copy=True)  # the model's mask: a new one each step, handed to every layer
        hidden = x.float().requires_grad_() if exact else x.clone().requires_grad_()
        h = hidden
        for w in weights:
            q, k, v = (h @ (wi.float() if exact else wi) for wi in w)
            if exact:
                heads_first = [t.transpose(1, 2) for t in (q, k, v)]
                out = F.scaled_dot_product_attention(*heads_first, attn_mask=mask).transpose(1, 2)
            else:
                out = ulysses_attention(module, q, k, v, mask, config=config)
            h = h + out
        h.float().square().mean().backward()
        return hidden.grad

    _key_padding.plan = counted
    results: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the bool mask's conversion notice
            golden = step(exact=True)
            ways = {"package": real_plan_of, "per_gathered_tensor": per_gathered_tensor}
            grads = {}
            for way, plan_of in ways.items():  # warm-up (the probe runs on the first CUDA call), and the error
                _key_padding.plan_of = plan_of
                grads[way] = got = step()
                results[way] = {"error": _relative_gap(got.float(), golden)}
            # The same plan, so the same kernels on the same keys: the two ways' gradients differ no more than one
            # way's differ between two runs.
            differ_by = _relative_gap(grads["package"], grads["per_gathered_tensor"])
            _key_padding.plan_of = per_gathered_tensor  # the control's way again: the run-to-run noise
            repeat_differs_by = _relative_gap(step(), grads["per_gathered_tensor"])
            times: dict[str, list[float]] = {way: [] for way in ways}
            counts: dict[str, list[int]] = {way: [] for way in ways}
            syncs: dict[str, list[int]] = {way: [] for way in ways}
            sites: dict[str, Counter[str]] = {way: Counter() for way in ways}  # where they were, summed over steps
            for _ in range(MASK_SYNC_STEPS[device] if steps is None else steps):
                for way, plan_of in ways.items():
                    _key_padding.plan_of = plan_of
                    plans.clear()
                    if device == "cuda":
                        torch.cuda.synchronize()
                    with warnings.catch_warnings(record=True) as seen:
                        warnings.simplefilter("always")
                        if device == "cuda":
                            torch.cuda.set_sync_debug_mode("warn")
                        start = time.perf_counter()
                        try:
                            step()
                        finally:
                            if device == "cuda":
                                torch.cuda.set_sync_debug_mode("default")
                        if device == "cuda":
                            torch.cuda.synchronize()
                        times[way].append((time.perf_counter() - start) * 1e3)
                    synced = [w for w in seen if "synchronizing" in str(w.message)]
                    syncs[way].append(len(synced))
                    sites[way].update(f"{'/'.join(w.filename.split(os.sep)[-3:])}:{w.lineno}" for w in synced)
                    counts[way].append(len(plans))
            cuda = device == "cuda"
            for way in ways:
                results[way] |= {
                    "plans": max(counts[way]), "syncs": statistics.median(syncs[way]) if cuda else None,
                    "syncs_max": max(syncs[way]) if cuda else None, "step_ms": statistics.median(times[way]),
                    "sync_sites": dict(sites[way]),
                }  # fmt: skip
    finally:
        _key_padding.plan, _key_padding.plan_of = real_plan, real_plan_of
        if started:
            dist.destroy_process_group()
    shape = dict(zip(("batch", "tokens", "heads", "head_dim", "layers"), stack, strict=True))
    return {
        "stack": shape, "padding": MASK_SYNC_PADDING, "ways": results, "ways_differ_by": differ_by,
        "repeat_differs_by": repeat_differs_by,
    }  # fmt: skip


def main_ulysses_models() -> None:
    """Only ``ulysses_models`` and ``ulysses_mask_syncs``, one JSON line."""
    import diffusers

    result = {
        "version": diffusers.__version__,
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "gpu": torch.cuda.get_device_name(),
        "ulysses_models": ulysses_models(),
        "ulysses_mask_syncs": ulysses_mask_syncs(),
    }
    print(json.dumps(result, default=str), flush=True)
    os._exit(0)


def main_ring() -> None:
    """Only ``ring_chunks`` (the releases the GPU tests run in full have it in ``main``), one JSON line."""
    import diffusers

    result = {"version": diffusers.__version__, "ring_chunks": ring_chunks()}
    print(json.dumps(result, default=str))
    os._exit(0)


def main() -> None:
    import diffusers

    result: dict[str, Any] = {
        "version": diffusers.__version__,
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "gpu": torch.cuda.get_device_name(),
    }
    result["probes"] = probes()
    result["ulysses_nccl"] = ulysses_nccl()
    result["masks"] = masks()
    result["one_key_masked_rows"] = one_key_masked_rows()
    result["ring_chunks"] = ring_chunks()
    result["status"] = diffusers_cudnn_fix.status().to_dict()
    print(json.dumps(result, default=str))
    os._exit(0)


if __name__ == "__main__":
    main()
