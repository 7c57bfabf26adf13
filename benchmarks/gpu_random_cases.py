"""Random inputs through diffusers' context-parallel attention ops with the package in place, on the GPU.

    python benchmarks/gpu_random_cases.py --release 0.39.0 --cases 300 --out gpu-random-0.39.0.json
    python benchmarks/gpu_random_cases.py --release 0.39.0 --cases 20 --device cpu --max-seq 77   # CPU stand-ins

Every case is drawn from a seeded generator (``--seed``), so a case id names the same inputs on any run:

* paths: diffusers' cuDNN op pair and native-flash op pair (where the release has it) driven inside an
  ``autograd.Function`` as ``TemplatedUlyssesAttention`` drives them (``return_lse=False``, context saved,
  a context-parallel config saying 2 ranks), and ``TemplatedUlyssesAttention`` itself at world size 1
  (NCCL, one rank) with either op pair;
* S_q, S_kv in {1, 7, 77, 333, 1024} (S_q != S_kv on the op pairs; Ulysses reshapes the K/V gradients
  with the query's length on every release, so it gets S_q == S_kv), D in {32, 64, 80, 96, 128}, H, B;
* q/k/v layouts: contiguous, slices of a fused QKV (or fused KV) projection, (B, H, S, D) memory seen as
  (B, S, H, D), a last dimension of stride 2, a sequence slice, a batch broadcast (stride 0), a storage
  offset of one element (pointer not 16-byte aligned); ``grad_out`` contiguous, transposed, strided or
  broadcast;
* causal, a scale, masks on the cuDNN paths (the mask mode is ``convert``, the contract's default): bool
  [B,1,Sq,Skv] / [1,1,Sq,Skv] / [B,H,Sq,Skv] / key padding [B,1,1,Skv] / [Sq,Skv] / with a fully masked
  row, additive in q's dtype (-inf fill, or a finite bias), additive fp32, integer (must raise), a mask
  that requires grad (must raise); dtypes bf16, fp16, and fp32 / mixed (must raise).

Before any case, ``diffusers_cudnn_fix.probe()`` runs (it switches the zero-copy layout on where it
passes); its state and ``zero_copy`` are recorded. Each case is classified:

* correct: out, dQ, dK, dV each within the probe's pass rule against fp32 eager attention (max-abs error
  <= REFERENCE_FACTOR x the bf16 (or fp16) eager error + ABSOLUTE_SLACK), no NaN (the reference has none:
  a fully masked row is 0, as in F.sdpa's math backend);
* clear error: ``UnsafeAttentionError``, or a torch / cuDNN / diffusers error raised with the CUDA context
  still usable;
* wrong: outside the rule, NaN, or the process died (a CUDA illegal memory access kills the context) or
  hung (faulthandler stack, ``--case-timeout``). A wrong case is run again through the bare ATen kernel on
  dense kernel-layout copies (``kernel_baseline``), to tell the kernel's errors from the path's, and the
  index of each tensor's worst error is kept;
* upstream semantics: a causal case with S_q != S_kv that is wrong against F.sdpa's top-left alignment but
  right against the bottom-right alignment flash kernels use (diffusers' shipped flash forward calls the
  kernel directly; F.sdpa refuses flash for it).

The cases run in chunks, each in its own subprocess (``--jobs`` side by side); when a worker dies, the case
it was running counts as wrong and a fresh worker takes the rest of its chunk. Prints the counts per class
and path, the worst errors (as a fraction of their limit) and every wrong / error case; ``--out`` writes it
all as JSON.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

SEQS = (1, 7, 77, 333, 1024)
DIMS = (32, 64, 80, 96, 128)
HEADS = (1, 2, 3, 4, 8, 16)
BATCHES = (1, 2, 3)
LAYOUTS = {
    "contiguous": 30,
    "fused": 15,
    "bhsd_memory": 15,
    "last_dim_stride2": 10,
    "seq_slice": 10,
    "batch_broadcast": 5,
    "misaligned": 15,
}
GRAD_LAYOUTS = {"contiguous": 45, "bhsd_memory": 25, "strided": 20, "broadcast": 10}
MASKS = {
    "none": 40,
    "bool_b1": 10,
    "bool_bcast": 6,
    "bool_bh": 6,
    "bool_keypad": 6,
    "bool_2d": 4,
    "bool_deadrow": 6,
    "add_inf": 8,
    "add_bias": 6,
    "add_fp32": 6,
    "int": 2,
    "requires_grad": 2,
}
PATHS = {"cudnn_pair": 45, "flash_pair": 20, "ulysses_cudnn": 25, "ulysses_flash": 10}
#: How the call is run: as it is, through torch.compile (inductor; graph breaks allowed, a fresh compilation per
#: case), or under torch.autocast(bf16). Drawn from each case's own seed, so the other fields of a case id stay
#: those of earlier runs.
STACKS = {"eager": 70, "compiled": 15, "autocast": 15}
NAMES = ("out", "dq", "dk", "dv")
#: Cases the contract says must raise (they are counted as clear errors, and listed if they do not raise).
MUST_RAISE_MASKS = ("int", "requires_grad")
MUST_RAISE_DTYPES = ("fp32", "mixed")


def _pick(rng: random.Random, weights: dict[str, int]) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def make_cases(count: int, seed: int, have_flash: bool, max_seq: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    seqs = tuple(s for s in SEQS if s <= max_seq)
    paths = {p: w for p, w in PATHS.items() if have_flash or "flash" not in p}
    cases = []
    while len(cases) < count:
        path = _pick(rng, paths)
        flash = "flash" in path
        ulysses = path.startswith("ulysses")
        s_q = rng.choice(seqs)
        s_kv = s_q if ulysses or rng.random() < 0.4 else rng.choice(seqs)
        batch, heads, dim = rng.choice(BATCHES), rng.choice(HEADS), rng.choice(DIMS)
        if batch * heads * s_q * s_kv > 2 * 16 * 1024 * 1024:
            continue
        roll = rng.random()
        dtype = "bf16" if roll < 0.78 else "fp16" if roll < 0.95 else rng.choice(MUST_RAISE_DTYPES)
        mask = "none" if flash else _pick(rng, MASKS)
        causal = rng.random() < (0.3 if mask == "none" else 0.1)
        cases.append(
            {
                "id": len(cases),
                "path": path,
                "B": batch,
                "Sq": s_q,
                "Skv": s_kv,
                "H": heads,
                "D": dim,
                "dtype": dtype,
                "layout": _pick(rng, LAYOUTS),
                "grad_layout": _pick(rng, GRAD_LAYOUTS),
                "mask": mask,
                "causal": causal,
                "scale": None if rng.random() < 0.7 else round(rng.uniform(0.05, 0.3), 4),
                "seed": rng.randrange(2**31),
            }
        )
        cases[-1]["stack"] = _pick(random.Random(cases[-1]["seed"] ^ 0x5EED), STACKS)
    return cases


# --- inputs ------------------------------------------------------------------------------------------------


def _leaves_and_view(case: dict[str, Any], torch: Any, device: Any) -> tuple[list[Any], Any]:
    """Leaf tensors (fp32 values, to be cast) and a function mapping leaves (or their grads) to q, k, v in
    (B, S, H, D) with the case's layout. The function is pure indexing, so applied to the leaves' grads it
    gives dQ, dK, dV."""
    b, sq, skv, h, d = case["B"], case["Sq"], case["Skv"], case["H"], case["D"]
    gen = torch.Generator(device=device).manual_seed(case["seed"])
    layout = case["layout"]

    def randn(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen, device=device)

    if layout == "fused":
        if sq == skv:
            leaves = [randn(b, sq, 3 * h * d)]

            def view(ts: list[Any]) -> tuple[Any, ...]:
                qkv = ts[0].view(b, sq, 3, h, d)
                return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            leaves = [randn(b, sq, h * d), randn(b, skv, 2 * h * d)]

            def view(ts: list[Any]) -> tuple[Any, ...]:
                kv = ts[1].view(b, skv, 2, h, d)
                return ts[0].view(b, sq, h, d), kv[:, :, 0], kv[:, :, 1]

        return leaves, view
    shapes = ((b, sq), (b, skv), (b, skv))
    if layout == "contiguous":
        leaves = [randn(bb, s, h, d) for bb, s in shapes]
        return leaves, lambda ts: tuple(ts)
    if layout == "bhsd_memory":
        leaves = [randn(bb, h, s, d) for bb, s in shapes]
        return leaves, lambda ts: tuple(t.transpose(1, 2) for t in ts)
    if layout == "last_dim_stride2":
        leaves = [randn(bb, s, h, 2 * d) for bb, s in shapes]
        return leaves, lambda ts: tuple(t[..., ::2] for t in ts)
    if layout == "seq_slice":
        leaves = [randn(bb, s + 5, h, d) for bb, s in shapes]
        return leaves, lambda ts: tuple(t[:, 3 : 3 + s] for t, (_, s) in zip(ts, shapes))
    if layout == "batch_broadcast":
        leaves = [randn(1, s, h, d) for _, s in shapes]
        return leaves, lambda ts: tuple(t.expand(b, -1, -1, -1) for t in ts)
    if layout == "misaligned":
        leaves = [randn(bb * s * h * d + 1) for bb, s in shapes]
        return leaves, lambda ts: tuple(t[1:].view(bb, s, h, d) for t, (bb, s) in zip(ts, shapes))
    raise ValueError(layout)


def _grad(case: dict[str, Any], torch: Any, device: Any, dtype: Any) -> Any:
    b, sq, h, d = case["B"], case["Sq"], case["H"], case["D"]
    gen = torch.Generator(device=device).manual_seed(case["seed"] + 1)
    kind = case["grad_layout"]
    if kind == "contiguous":
        return torch.randn(b, sq, h, d, generator=gen, device=device).to(dtype)
    if kind == "bhsd_memory":
        return torch.randn(b, h, sq, d, generator=gen, device=device).to(dtype).transpose(1, 2)
    if kind == "strided":
        return torch.randn(b, sq, h, 2 * d, generator=gen, device=device).to(dtype)[..., 1::2]
    if kind == "broadcast":
        return torch.randn(1, sq, h, d, generator=gen, device=device).to(dtype).expand(b, -1, -1, -1)
    raise ValueError(kind)


def _mask(case: dict[str, Any], torch: Any, device: Any, qdtype: Any) -> Any:
    """The mask handed to the op (None, bool, float, int), on the device."""
    kind = case["mask"]
    if kind == "none":
        return None
    b, sq, skv, h = case["B"], case["Sq"], case["Skv"], case["H"]
    gen = torch.Generator(device=device).manual_seed(case["seed"] + 2)

    def keep(*shape: int) -> Any:
        m = torch.rand(*shape, generator=gen, device=device) < 0.75
        m[..., 0] = True  # every query row attends somewhere, unless a case asks for a dead row
        return m

    if kind == "bool_b1":
        return keep(b, 1, sq, skv)
    if kind == "bool_bcast":
        return keep(1, 1, sq, skv)
    if kind == "bool_bh":
        return keep(b, h, sq, skv)
    if kind == "bool_2d":
        return keep(sq, skv)
    if kind == "bool_keypad":
        m = torch.ones(b, 1, 1, skv, dtype=torch.bool, device=device)
        m[..., max(1, skv - skv // 3) :] = False
        return m
    if kind == "bool_deadrow":
        m = keep(b, 1, sq, skv)
        m[:, :, sq // 2, :] = False
        return m
    if kind == "add_inf":
        return torch.zeros(b, 1, sq, skv, device=device).masked_fill_(~keep(b, 1, sq, skv), float("-inf")).to(qdtype)
    if kind == "add_bias":  # a finite bias (ALiBi-like), in q's dtype
        return (torch.randn(b, h, sq, skv, generator=gen, device=device) * 2).to(qdtype)
    if kind == "add_fp32":
        bias = torch.randn(b, 1, sq, skv, generator=gen, device=device)
        return bias.masked_fill_(~keep(b, 1, sq, skv), float("-inf"))
    if kind == "int":
        return keep(b, 1, sq, skv).to(torch.int64)
    if kind == "requires_grad":
        return torch.zeros(b, 1, sq, skv, device=device, dtype=qdtype).requires_grad_(True)
    raise ValueError(kind)


def _dtypes(case: dict[str, Any], torch: Any) -> tuple[Any, Any, Any]:
    return {
        "bf16": (torch.bfloat16,) * 3,
        "fp16": (torch.float16,) * 3,
        "fp32": (torch.float32,) * 3,
        "mixed": (torch.bfloat16, torch.float16, torch.bfloat16),
    }[case["dtype"]]


# --- the reference -----------------------------------------------------------------------------------------


def _eager(
    case: dict[str, Any],
    torch: Any,
    leaves: list[Any],
    view: Any,
    mask: Any,
    grad: Any,
    dtype: Any,
    bottom_right: bool = False,
) -> dict[str, Any]:
    """Attention computed eagerly in ``dtype`` with autograd; a fully masked row gives 0 (F.sdpa's math
    backend does the same for a bool mask). out, dq, dk, dv as fp32 (B, S, H, D). Causal is F.sdpa's
    top-left alignment, or with ``bottom_right`` the alignment flash kernels use when S_q != S_kv."""
    ls = [x.detach().to(dtype).requires_grad_(True) for x in leaves]
    with torch.enable_grad():
        q, k, v = (t.transpose(1, 2) for t in view(ls))
        scale = case["scale"] if case["scale"] is not None else q.shape[-1] ** -0.5
        s = (q @ k.transpose(-2, -1)) * scale
        if mask is not None:
            m = mask.detach()
            if m.dtype == torch.bool:
                s = s.masked_fill(~m, float("-inf"))
            else:
                s = s + m.to(dtype)
        if case["causal"]:
            sq, skv = s.shape[-2], s.shape[-1]
            upper = torch.ones(sq, skv, dtype=torch.bool, device=s.device).triu(1 + (skv - sq if bottom_right else 0))
            s = s.masked_fill(upper, float("-inf"))
        dead = torch.isneginf(s).all(-1, keepdim=True)
        p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
        out = (p @ v).transpose(1, 2)
        out.backward(grad.to(dtype))
    grads = view([x.grad for x in ls])
    return {n: t.detach().float() for n, t in zip(NAMES, (out, *grads))}


# --- the worker --------------------------------------------------------------------------------------------


def _context_alive(torch: Any, device: Any) -> tuple[bool, str]:
    if device.type != "cuda":
        return True, ""
    try:
        torch.cuda.synchronize(device)
        torch.ones(4, device=device).sum().item()
        return True, ""
    except Exception as exc:
        return False, f"{type(exc).__name__}: {str(exc)[:300]}"


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(args.release_dir))
    sys.path += [str(ROOT), str(TESTS)]  # last: a package earlier on PYTHONPATH (a baseline copy) wins
    import warnings

    warnings.simplefilter("ignore")
    if os.environ.get("DCF_RANDOM_SELFTEST_PACKAGE_OFF"):  # tests this script's wrong-case path: ops as shipped
        os.environ["DIFFUSERS_CUDNN_FIX"] = "0"
    import diffusers.models.attention_dispatch as module
    import torch
    from harness import pair_config, ulysses_config

    import diffusers_cudnn_fix
    from diffusers_cudnn_fix import UnsafeAttentionError, _probe

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    factor = float(getattr(_probe, "REFERENCE_FACTOR", 5.0))
    slack = float(getattr(_probe, "ABSOLUTE_SLACK", 1e-3))
    diffusers_cudnn_fix.set_mask_mode("convert")
    if args.device == "cpu":
        import standin_kernels

        standin_kernels.register()
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    probe = diffusers_cudnn_fix.probe(device if device.type == "cuda" else None)
    print(
        "PROBE "
        + json.dumps(
            {
                "state": probe.state,
                "zero_copy": getattr(probe, "zero_copy", None),
                "runs": getattr(probe, "runs", None),
                "reason": probe.reason,
            }
        ),
        flush=True,
    )
    specs = json.loads(Path(args.spec).read_text())
    todo = [specs[int(i)] for i in args.indices.split(",")]
    mesh = None
    if any(c["path"].startswith("ulysses") for c in todo):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        store = tempfile.NamedTemporaryFile(prefix="dcf-random-", delete=False)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store.name}", rank=0, world_size=1
        )
        mesh = init_device_mesh(device.type, (1,))
    ulysses_cp = ulysses_config(mesh)
    pair_cp = pair_config(_ulysses_mesh=None, ulysses_anything=False)
    ops = {
        "cudnn": (module._cudnn_attention_forward_op, module._cudnn_attention_backward_op),
        "flash": (
            getattr(module, "_native_flash_attention_forward_op", None),
            getattr(module, "_native_flash_attention_backward_op", None),
        ),
    }
    for case in todo:
        print(f"START {case['id']}", flush=True)
        if str(case["id"]) == os.environ.get("DCF_RANDOM_SELFTEST_CRASH"):  # tests the parent's restart path
            os.abort()
        faulthandler.dump_traceback_later(args.case_timeout, exit=True)
        result = run_case(case, torch, module, device, ops, pair_cp, ulysses_cp, factor, slack, UnsafeAttentionError)
        faulthandler.cancel_dump_traceback_later()
        print("RESULT " + json.dumps(result, default=str), flush=True)
        if result.get("context_dead"):
            sys.stdout.flush()
            os._exit(3)  # the CUDA context is gone: the parent starts a fresh worker for the rest
    os._exit(0)


def run_case(case, torch, module, device, ops, pair_cp, ulysses_cp, factor, slack, UnsafeAttentionError):
    from harness import op_pair, ulysses_attention  # tests/, on the worker's path

    start = time.perf_counter()
    result: dict[str, Any] = {"id": case["id"]}
    try:
        dq_t, dk_t, dv_t = _dtypes(case, torch)
        # Under autocast(bf16) an fp16 case computes in bf16, which is autocast's contract: bf16's error is the limit.
        low_dtype = torch.float16 if case["dtype"] == "fp16" and case.get("stack") != "autocast" else torch.bfloat16
        leaves32, view = _leaves_and_view(case, torch, device)
        grad = _grad(case, torch, device, dq_t)
        mask = _mask(case, torch, device, dq_t)
        golden = _eager(case, torch, leaves32, view, mask, grad, torch.float32)
        low = _eager(case, torch, leaves32, view, mask, grad, low_dtype)
        ref_errors = {n: (low[n] - golden[n]).abs().max().item() for n in NAMES}
        ref_nan = {n: bool(torch.isnan(golden[n]).any()) for n in NAMES}
    except Exception as exc:
        result.update(
            cls="harness_error", message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-1500:]
        )
        return result
    backend = "flash" if "flash" in case["path"] else "cudnn"
    fwd, bwd = ops[backend]
    # Leaves in the case's dtypes (k, v may differ from q in the "mixed" case).
    leaves = []
    for i, leaf in enumerate(leaves32):
        dtype = (dq_t, dk_t, dv_t)[i] if len(leaves32) == 3 else dq_t
        leaves.append(leaf.detach().to(dtype).requires_grad_(True))
    try:
        q, k, v = view(leaves)
        if case["dtype"] == "mixed" and len(leaves32) != 3:
            k, v = k.to(dk_t), v.to(dv_t)

        flags = {"is_causal": case["causal"], "scale": case["scale"]}
        # The op pair driven as TemplatedUlyssesAttention drives it (inputs as given: no copies).
        pair = op_pair(fwd, bwd, **flags, parallel_config=pair_cp, inputs="as_given")

        def call(q: Any, k: Any, v: Any, mask: Any) -> Any:
            if case["path"].endswith("_pair"):
                return pair.apply(q, k, v, mask)
            return ulysses_attention(module, q, k, v, mask, **flags, forward_op=fwd, backward_op=bwd, config=ulysses_cp)

        stack = case.get("stack", "eager")
        if stack == "compiled":
            torch._dynamo.reset()
            call = torch.compile(call, backend="inductor", dynamic=False)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=stack == "autocast")
        with autocast:
            out = call(q, k, v, mask)
        out.backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        got = {
            "out": out.detach().float(),
            **dict(zip(("dq", "dk", "dv"), (g.float() for g in view([x.grad for x in leaves])))),
        }
    except Exception as exc:
        alive, why = _context_alive(torch, device)
        message = f"{type(exc).__name__}: {str(exc)[:600]}"
        result["ms"] = round((time.perf_counter() - start) * 1e3, 1)
        if not alive:
            result.update(
                cls="wrong",
                kind="crash",
                message=message,
                context=why,
                context_dead=True,
                traceback=traceback.format_exc()[-1500:],
            )
        else:
            unsafe = isinstance(exc, UnsafeAttentionError)
            result.update(
                cls="clear_error",
                kind="UnsafeAttentionError" if unsafe else type(exc).__name__,
                message=message,
                traceback=traceback.format_exc()[-1200:],
            )
        return result
    errors, limits, nan = {}, {}, {}
    for n in NAMES:
        nan[n] = bool(not torch.isfinite(got[n]).all()) and not ref_nan[n]
        errors[n] = float("inf") if nan[n] else (got[n] - golden[n]).abs().max().item()
        limits[n] = factor * ref_errors[n] + slack
    ratio = max(errors[n] / limits[n] for n in NAMES)
    ok = all(errors[n] <= limits[n] for n in NAMES)
    result.update(
        cls="correct" if ok else "wrong",
        kind="ok" if ok else ("nan" if any(nan.values()) else "error"),
        errors=errors,
        limits=limits,
        worst_ratio=ratio,
        magnitudes={n: golden[n].abs().max().item() for n in NAMES},
    )
    if not ok:
        # Where the worst error sits (index into the (B, S, H, D) tensor), to tell a dead row from a layout bug.
        result["worst_at"] = {
            n: _unravel(torch, (got[n] - golden[n]).abs().nan_to_num(float("inf")).argmax().item(), got[n].shape)
            for n in NAMES
        }
        if case["causal"] and case["Sq"] != case["Skv"]:
            # Flash kernels align a causal mask bottom-right when S_q != S_kv; F.sdpa (the reference) top-left.
            try:
                g_br = _eager(case, torch, leaves32, view, mask, grad, torch.float32, bottom_right=True)
                l_br = _eager(case, torch, leaves32, view, mask, grad, low_dtype, bottom_right=True)
                br_ok = all(
                    torch.isfinite(got[n]).all()
                    and (got[n] - g_br[n]).abs().max().item() <= factor * (l_br[n] - g_br[n]).abs().max().item() + slack
                    for n in NAMES
                )
                if br_ok:
                    result.update(cls="upstream_semantics", kind="causal_bottom_right")
            except Exception as exc:
                result["bottom_right_check"] = f"{type(exc).__name__}: {exc}"[:300]
        result["kernel_baseline"] = _kernel_baseline(
            case, torch, backend, leaves32, view, mask, grad, dq_t, golden, limits, device
        )
        alive, why = _context_alive(torch, device)
        if not alive:
            result.update(context_dead=True, context=why)
    result["ms"] = round((time.perf_counter() - start) * 1e3, 1)
    return result


def _unravel(torch: Any, flat: int, shape: Any) -> list[int]:
    index = []
    for size in reversed(list(shape)):
        index.append(flat % size)
        flat //= size
    return index[::-1]


def _kernel_baseline(case, torch, backend, leaves32, view, mask, grad, dtype, golden, limits, device):
    """The same attention through the bare ATen kernel on dense kernel-layout copies (autograd's own backward),
    with the mask converted as the contract says: is a wrong result the kernel's, or the path's?"""
    if case["layout"] == "batch_broadcast" or case["mask"] in MUST_RAISE_MASKS or case["dtype"] in MUST_RAISE_DTYPES:
        return {"skipped": "not comparable (broadcast batch) or a case that must raise"}
    try:
        q, k, v = (x.to(dtype).transpose(1, 2).contiguous().requires_grad_(True) for x in view(leaves32))
        g = grad.to(dtype).transpose(1, 2).contiguous()
        if backend == "cudnn":
            bias = None
            if mask is not None:
                bias = (
                    torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))
                    if mask.dtype == torch.bool
                    else mask.detach().to(dtype)
                )
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, bias, True, 0.0, case["causal"], False, scale=case["scale"]
            )[0]
        else:
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, case["causal"], False, scale=case["scale"]
            )[0]
        out.backward(g)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
        errors = {}
        for n in NAMES:
            t = got[n].detach().transpose(1, 2).float()
            errors[n] = float("inf") if not torch.isfinite(t).all() else (t - golden[n]).abs().max().item()
        return {"errors": errors, "passed": all(errors[n] <= limits[n] for n in NAMES)}
    except Exception as exc:
        return {"raised": f"{type(exc).__name__}: {str(exc)[:300]}"}


# --- the parent --------------------------------------------------------------------------------------------


def _run_chunk(args: argparse.Namespace, spec_file: str, indices: list[int]) -> tuple[list[dict], list[dict]]:
    """Runs the chunk in fresh workers until every case has a result; returns (results, probes)."""
    pending = list(indices)
    results: list[dict] = []
    probes: list[dict] = []
    while pending:
        left = args.deadline - time.monotonic()
        if left < 15:  # out of --budget: what is left is reported as unrun, not as a verdict
            results += [{"id": i, "cls": "unrun", "kind": "budget"} for i in pending]
            break
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--release-dir",
            str(args.release_dir),
            "--spec",
            spec_file,
            "--indices",
            ",".join(map(str, pending)),
            "--device",
            args.device,
            "--case-timeout",
            str(args.case_timeout),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFUSERS_CUDNN_FIX")}
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
            cwd=str(ROOT),
        )
        if os.environ.get("DCF_PGID_FILE"):  # gpu_session.sh ends any group left behind if this run is stopped
            with open(os.environ["DCF_PGID_FILE"], "a") as fh:
                fh.write(f"{proc.pid}\n")
        timed_out = budget_hit = False
        limit = args.case_timeout * len(pending) + 120
        try:
            stdout, stderr = proc.communicate(timeout=min(limit, left))
        except subprocess.TimeoutExpired:
            timed_out, budget_hit = True, left < limit
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        done, started = set(), None
        for line in stdout.splitlines():
            if line.startswith("START "):
                started = int(line.split()[1])
            elif line.startswith("RESULT "):
                r = json.loads(line[7:])
                results.append(r)
                done.add(r["id"])
            elif line.startswith("PROBE "):
                probes.append(json.loads(line[6:]))
        if budget_hit:
            results += [{"id": i, "cls": "unrun", "kind": "budget"} for i in pending if i not in done]
            break
        if started is not None and started not in done:
            kind = "hang" if (timed_out or proc.returncode == 70) else "crash"
            results.append(
                {
                    "id": started,
                    "cls": "wrong",
                    "kind": kind,
                    "returncode": proc.returncode,
                    "message": f"worker {'hung' if kind == 'hang' else 'died'} in this case",
                    "stderr_tail": stderr[-4000:],
                }
            )
            done.add(started)
        elif not done and proc.returncode != 0:
            # Died before any case (import, probe, NCCL): the whole chunk is unrun.
            for i in pending:
                results.append(
                    {
                        "id": i,
                        "cls": "unrun",
                        "kind": "worker_failed",
                        "returncode": proc.returncode,
                        "stderr_tail": stderr[-3000:],
                    }
                )
            break
        pending = [i for i in pending if i not in done]
    return results, probes


def parent(args: argparse.Namespace) -> int:
    release_dir = Path(args.release_dir) if args.release_dir else None
    if release_dir is None:
        sys.path.insert(0, str(TESTS))
        from releases import release_dir as install

        release_dir = install(args.release)
    args.release_dir = release_dir
    source = (release_dir / "diffusers" / "models" / "attention_dispatch.py").read_text()
    have_flash = "def _native_flash_attention_forward_op" in source
    cases = make_cases(args.cases, args.seed, have_flash, args.max_seq)
    spec = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="dcf-random-spec-", delete=False)
    json.dump(cases, spec)
    spec.close()
    chunks = [list(range(i, min(i + args.chunk, len(cases)))) for i in range(0, len(cases), args.chunk)]
    args.deadline = time.monotonic() + args.budget
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = list(pool.map(lambda c: _run_chunk(args, spec.name, c), chunks))
    wall = time.perf_counter() - start
    results = {r["id"]: r for rs, _ in done for r in rs}
    probes = [p for _, ps in done for p in ps]
    rows = []
    for case in cases:
        r = results.get(case["id"], {"cls": "unrun", "kind": "missing"})
        rows.append({**case, **{k: v for k, v in r.items() if k != "id"}})
    counts = Counter(r["cls"] for r in rows)
    by_path = {
        p: dict(Counter(r["cls"] for r in rows if r["path"] == p)) for p in PATHS if any(r["path"] == p for r in rows)
    }
    by_stack = {
        st: dict(Counter(r["cls"] for r in rows if r["stack"] == st))
        for st in STACKS
        if any(r["stack"] == st for r in rows)
    }
    kinds = dict(Counter(f"{r['cls']}: {r.get('kind')}" for r in rows))
    must_raise = [r for r in rows if (r["mask"] in MUST_RAISE_MASKS or r["dtype"] in MUST_RAISE_DTYPES)]
    not_raised = [r for r in must_raise if r["cls"] != "clear_error"]
    correct = sorted((r for r in rows if r["cls"] == "correct"), key=lambda r: -r["worst_ratio"])
    wrong = [r for r in rows if r["cls"] == "wrong"]
    errors = [r for r in rows if r["cls"] == "clear_error"]
    summary = {
        "release": args.release,
        "device": args.device,
        "seed": args.seed,
        "cases": len(cases),
        "wall_s": round(wall, 1),
        "counts": dict(counts),
        "by_stack": by_stack,
        "by_path": by_path,
        "kinds": kinds,
        "probes": {
            "states": dict(Counter(p["state"] for p in probes)),
            "zero_copy": dict(Counter(str(p["zero_copy"]) for p in probes)),
            "first": probes[0] if probes else None,
        },
        "must_raise": {"cases": len(must_raise), "did_not_raise": [r["id"] for r in not_raised]},
        "clear_error_messages": dict(Counter(f"{r.get('kind')}: {str(r.get('message'))[:140]}" for r in errors)),
    }
    print(f"diffusers {args.release}, {len(cases)} random cases (seed {args.seed}) on {args.device}, {wall:.0f} s")
    print(f"probe before the cases: {summary['probes']}")
    print("counts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for p, c in {**by_path, **by_stack}.items():
        print(f"  {p:<14} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    print(
        f"must raise (int / requires_grad masks, fp32 / mixed dtypes): {len(must_raise)}, "
        f"did not raise: {summary['must_raise']['did_not_raise']}"
    )
    print("clear errors by message:")
    for m, n in sorted(summary["clear_error_messages"].items(), key=lambda x: -x[1]):
        print(f"  {n:4d}  {m}")
    print("worst correct cases (error / limit):")
    for r in correct[:8]:
        print(f"  #{r['id']:<4} {r['worst_ratio']:.2f}  {_describe(r)}")
    print(f"wrong: {len(wrong)}")
    for r in wrong:
        detail = _short(r.get("errors")) if r.get("errors") else str(r.get("message"))[:160]
        base = r.get("kernel_baseline") or {}
        base_s = (
            f"bare kernel {'passes' if base.get('passed') else 'ALSO WRONG'} {_short(base.get('errors'))}"
            if "errors" in base
            else f"bare kernel: {base.get('raised') or base.get('skipped') or '-'}"[:120]
        )
        print(f"  #{r['id']:<4} {r.get('kind')}  {_describe(r)}  {detail}  | {base_s}  | worst at {r.get('worst_at')}")
    upstream = [r for r in rows if r["cls"] == "upstream_semantics"]
    if upstream:
        print(
            f"upstream semantics (flash: causal aligned bottom-right for S_q != S_kv, F.sdpa aligns top-left): "
            f"{len(upstream)}: " + ", ".join(f"#{r['id']}" for r in upstream)
        )
    for r in rows:
        if r["cls"] == "harness_error":
            print(f"  harness error #{r['id']}: {str(r.get('message'))[-300:]}")
    unrun = [r for r in rows if r["cls"] == "unrun"]
    if unrun:
        print(f"unrun: {len(unrun)} ({dict(Counter(r.get('kind') for r in unrun))})")
        for r in unrun[:1]:
            print(f"  e.g. #{r['id']}: {str(r.get('stderr_tail') or '')[-600:]}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        keep = [r for r in rows if r["cls"] != "correct"]
        args.out.write_text(
            json.dumps(
                {
                    "summary": summary,
                    "worst_correct": [
                        {k: r.get(k) for k in ("id", "worst_ratio", "errors", "limits")} | {"case": _describe(r)}
                        for r in correct[:20]
                    ],
                    "not_correct": keep,
                    "cases": cases,
                },
                indent=1,
                default=str,
            )
        )
    return 1 if wrong or counts.get("harness_error") or counts.get("unrun") else 0


def _short(errors: Any) -> str:
    if not errors:
        return "-"
    return "{" + ", ".join(f"{n} {e:.3g}" for n, e in errors.items()) + "}"


def _describe(r: dict[str, Any]) -> str:
    return (
        f"{r['path']} B={r['B']} Sq={r['Sq']} Skv={r['Skv']} H={r['H']} D={r['D']} {r['dtype']} "
        f"layout={r['layout']} grad={r['grad_layout']} mask={r['mask']} causal={r['causal']} scale={r['scale']} "
        f"stack={r['stack']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--release", default="0.39.0")
    parser.add_argument(
        "--release-dir", type=Path, help="a folder holding diffusers (default: .cache/diffusers/<release>)"
    )
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--seed", type=int, default=20261203)
    parser.add_argument("--chunk", type=int, default=40)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--max-seq", type=int, default=max(SEQS))
    parser.add_argument("--case-timeout", type=float, default=60.0)
    parser.add_argument("--budget", type=float, default=1e9, help="seconds; cases not run by then are 'unrun'")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--indices", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        sys.exit(parent(args))


if __name__ == "__main__":
    main()
