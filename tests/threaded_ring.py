"""diffusers' ring attention with several ring chunks in one process: one thread per ring rank.

``TemplatedRingAttention``'s forward and backward (whatever is installed: as shipped or as corrected) run
with the collectives they call (``funcol.all_gather_tensor``, ``funcol.permute_tensor``) answered by
stand-ins that exchange tensors between the threads, so no process group is needed and any ring degree can
run on one device (the CPU with the stand-in kernels, or one GPU). Each thread holds one rank's sequence
shard of q, k and v; the outputs and gradients of all ranks, put together, are compared with fp32 attention
over the whole sequence computed eagerly. Each rank calls the forward and then the backward itself, with a
stand-in autograd context (``Context``: autograd would run the CUDA backwards of all the ranks on its one
device thread, one after the other, and the first would wait forever for the others' collectives). The
functions themselves are not touched: diffusers' run as copies that see the stand-in collectives in place of the
module's ``funcol`` (``with_funcol``); the package's, where it replaced the ring, are built again by the package
with them (``harness.seeing``; the package is not imported here, so that runs without it stay without it).

A mask over the whole sequence (``mask``) reaches each rank as a model hands it over (``mask_layout``): whole
(``"global"``: every rank holds every row and column, as QwenImage's joint mask up to 0.38.0), or the rank's own
key columns (``"local"``: as QwenImage's plan shards its mask from 0.39.0), or the rank's own query rows with every
column (``"local_rows"``); the reference applies it to the whole sequence.

Also runnable in a fresh interpreter (the release first on ``PYTHONPATH``)::

    python -c "import threaded_ring; threaded_ring.main(package=False, worlds=(2, 3))"
"""

from __future__ import annotations

import json
import sys
import threading
import types
from typing import Any

import torch
from harness import seeing

#: Per rank: B=2, 4 tokens, 2 heads of 8 (the 4-token shard and 2 heads differ: a swapped pair of dims shows).
BATCH, SEQ_PER_RANK, HEADS, HEAD_DIM = 2, 4, 2, 8
#: Relative error (max |x - ref| / max |ref|) allowed on out, dq, dk, dv against fp32 eager attention.
#: bf16 inputs: a correct run measures about 1% on the CPU stand-ins; a wrong ring gradient is off by 30% or
#: more.
TOLERANCE = 0.05
BACKEND_OPS = {
    "cudnn": ("_cudnn_attention_forward_op", "_cudnn_attention_backward_op"),
    "flash": ("_native_flash_attention_forward_op", "_native_flash_attention_backward_op"),
    "native": ("_native_attention_forward_op", "_native_attention_backward_op"),  # F.sdpa: runs on a CPU as is
}


class Context:
    """Stands in for the autograd context: the ranks call the Function's forward and backward themselves.

    Not ``Function.apply`` and ``.backward()``: autograd runs every CUDA backward on one device thread, where
    the ranks' backwards would queue behind each other while the first waits for the others in a collective.
    """

    needs_input_grad = (True,) * 12
    saved_tensors: tuple[Any, ...] = ()

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors


class ThreadRing:
    """Stand-in functional collectives between ``world`` threads, one per ring rank."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list[Any] = [None] * world
        self.AsyncCollectiveTensor = type("AsyncCollectiveTensor", (), {})

    def _exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read them all
        return got

    def all_gather_tensor(self, tensor: torch.Tensor, gather_dim: int = 0, group: Any = None) -> torch.Tensor:
        return torch.cat(self._exchange(group.rank, tensor), dim=gather_dim)

    def permute_tensor(self, tensor: torch.Tensor, src_dst: list[int], group: Any = None) -> torch.Tensor:
        """``src_dst[m] == n``: rank m sends to rank n (torch's contract)."""
        got = self._exchange(group.rank, tensor)
        return got[src_dst.index(group.rank)].clone()


#: The class whose forward and backward run here.
RING = "TemplatedRingAttention"


def with_funcol(fn: Any, collectives: Any) -> Any:
    """A copy of ``fn`` that sees ``collectives`` as its module global ``funcol``."""
    globals_ = {**fn.__globals__, "funcol": collectives}
    return types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, fn.__closure__)


#: How a mask over the whole sequence reaches each rank (see the module's docstring).
MASK_LAYOUTS = ("global", "local", "local_rows")


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    mask: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """out, dq, dk, dv of attention over the whole sequence computed eagerly in ``dtype`` on ``device``,
    (B, S, H, D), as fp32 on the CPU. fp32: the golden values; bf16: the low-precision yardstick of the
    probe's rule. ``mask``: bool (True = attend) or additive, broadcasting to (B, H, S, S); a row that sees no
    key gets output 0 and no gradient (what the cuDNN kernel gives it), not softmax's NaN."""
    q, k, v = (x.detach().to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    if mask is not None:
        mask = mask.to(device)
        bias = (
            mask if mask.dtype != torch.bool else torch.zeros(mask.shape, device=device).masked_fill(~mask, -torch.inf)
        )
        scores = scores + bias.to(dtype)
        dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
        probs = torch.where(dead, 0.0, scores).softmax(dim=-1) * ~dead
    else:
        probs = scores.softmax(dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    out.backward(grad_out.to(device=device, dtype=dtype))
    return [t.float().cpu() for t in (out.detach(), q.grad, k.grad, v.grad)]


def run(
    module: types.ModuleType,
    backend: str,
    world: int,
    *,
    device: str = "cpu",
    attn_mask: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    mask_layout: str = "global",
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
    convert_to_fp32: bool = False,
    seed: int = 0,
    ring_forward: Any = None,
    ring_backward: Any = None,
    forward_op: Any = None,
    bf16_yardstick: bool = False,
    shape: tuple[int, int, int, int] = (BATCH, SEQ_PER_RANK, HEADS, HEAD_DIM),
) -> dict[str, Any]:
    """Ring attention of ``world`` chunks through ``module.TemplatedRingAttention`` as installed (or through
    ``ring_forward`` / ``ring_backward`` / the attention ``forward_op`` given instead).

    ``shape``: (batch, tokens per rank, heads, head dim). ``attn_mask`` reaches every rank as it is (and the
    reference ignores it); ``mask`` is a mask over the whole sequence, (B|1, 1|H, 1|S, S) with S = tokens per rank x
    ``world``, handed to each rank as ``mask_layout`` says and applied by the reference.

    Returns ``{"status": "pass" | "wrong" | "raised", "errors": {...}, "error": text, "op_calls": n,
    "masked_calls": m}`` (the forward op's calls, and those of them handed a mask). With
    ``bf16_yardstick``, also the max-abs errors (``abs_errors``) and those of the same attention computed
    eagerly in bf16 on ``device`` (``bf16_errors``), for the probe's rule.
    """
    forward_name, backward_name = BACKEND_OPS[backend]
    inner_op = forward_op or getattr(module, forward_name)
    backward_op = getattr(module, backward_name)
    masked: list[bool] = []

    def forward_op(ctx: Any, query: Any, key: Any, value: Any, op_mask: Any, *args: Any, **kwargs: Any) -> Any:
        masked.append(op_mask is not None)  # list.append: safe from the ranks' threads
        return inner_op(ctx, query, key, value, op_mask, *args, **kwargs)

    ring = ThreadRing(world)
    forward, backward = (
        with_funcol(given, ring)
        if given is not None
        else seeing(module, f"{RING}.{name}", {"funcol": ring}, collectives=ring)
        for given, name in ((ring_forward, "forward"), (ring_backward, "backward"))
    )
    gen = torch.Generator().manual_seed(seed)
    batch, per_rank, heads, head_dim = shape
    q, k, v, grad_out = (
        torch.randn(batch, per_rank * world, heads, head_dim, generator=gen).to(torch.bfloat16) for _ in range(4)
    )
    results: list[Any] = [None] * world

    def rank_main(rank: int) -> None:
        shard = slice(rank * per_rank, (rank + 1) * per_rank)
        group = types.SimpleNamespace(rank=rank)
        config = types.SimpleNamespace(
            _ring_mesh=types.SimpleNamespace(get_group=lambda: group),
            _ring_local_rank=rank,
            ring_degree=world,
            convert_to_fp32=convert_to_fp32,
            _world_size=world,
        )
        inputs = [x[:, shard].to(device) for x in (q, k, v)]
        rank_mask = attn_mask if mask is None else _rank_mask(mask, mask_layout, shard).to(device)
        ctx = Context()
        try:
            with torch.no_grad():  # as inside autograd.Function.forward / backward
                out = forward(
                    ctx, *inputs, rank_mask, dropout_p, is_causal, None, enable_gqa, False, forward_op, backward_op,
                    types.SimpleNamespace(context_parallel_config=config),
                )  # fmt: skip
                grads = backward(ctx, grad_out[:, shard].to(device))
            results[rank] = [out.cpu()] + [g.cpu() for g in grads[:3]]
        except BaseException as exc:
            results[rank] = exc
            ring.barrier.abort()  # the other ranks stop waiting for this one

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [r for r in results if isinstance(r, BaseException) and not isinstance(r, threading.BrokenBarrierError)]
    if failed or any(isinstance(r, BaseException) for r in results):
        exc = failed[0] if failed else next(r for r in results if isinstance(r, BaseException))
        return {
            "status": "raised", "error": f"{type(exc).__name__}: {exc}", "raised": type(exc).__name__,
            "op_calls": len(masked), "masked_calls": sum(masked),
        }  # fmt: skip
    got = [torch.cat([r[i] for r in results], dim=1).float() for i in range(4)]
    names = ("out", "dq", "dk", "dv")
    golden = _reference(q, k, v, grad_out, mask=mask)
    errors, abs_errors = {}, {}
    for name, g, ref in zip(names, got, golden, strict=True):
        diff = torch.nan_to_num((g - ref).abs(), nan=float("inf")).max().item()
        abs_errors[name] = diff
        errors[name] = diff / ref.abs().max().item()
    result: dict[str, Any] = {"status": "pass" if max(errors.values()) <= TOLERANCE else "wrong", "errors": errors}
    result.update(op_calls=len(masked), masked_calls=sum(masked))
    if bf16_yardstick:
        low = _reference(q, k, v, grad_out, torch.bfloat16, device, mask=mask)
        result["abs_errors"] = abs_errors
        result["bf16_errors"] = {n: (x - ref).abs().max().item() for n, x, ref in zip(names, low, golden, strict=True)}
    return result


#: Masks over the whole sequence (:func:`make_mask`), with the layouts each reaches the ranks in: key padding
#: (QwenImage's, [B, 1, 1, S]), a general bool mask [B, 1, S, S] and an additive one [B, H, S, S] (finite values and
#: -inf), key padding that masks every key of one ring chunk, and two that mask nothing (all true, all zero).
MASK_KINDS = {
    "key_padding": ("local", "global"),
    "bool": ("global", "local_rows"),
    "additive": ("global", "local_rows"),
    "padded_chunk": ("local", "global"),
    "all_true": ("local", "global"),
    "all_zero": ("local", "global"),
}
#: The kinds that mask nothing: the ring drops them (no step's op gets a mask).
MASKS_NOTHING = ("all_true", "all_zero")


def make_mask(
    kind: str, world: int, *, seed: int = 0, shape: tuple[int, int, int, int] = (BATCH, SEQ_PER_RANK, HEADS, HEAD_DIM)
) -> torch.Tensor:
    """A mask of ``kind`` (:data:`MASK_KINDS`) over the whole sequence of ``world`` ranks of ``shape`` (as
    :func:`run` takes it), drawn from ``seed``. Rows that see no key at all may occur (the bool and additive
    kinds): they are part of what is checked."""
    batch, per_rank, heads, _ = shape
    n = per_rank * world
    gen = torch.Generator().manual_seed(seed)
    if kind == "key_padding":
        keep = torch.rand(batch, 1, 1, n, generator=gen) > 0.3
        padded, kept = (int(i) for i in torch.randperm(n, generator=gen)[:2])
        keep[..., padded] = False  # at least one key padded,
        keep[..., kept] = True  # and one key for every query
        return keep
    if kind == "bool":
        return torch.rand(batch, 1, n, n, generator=gen) > 0.4
    if kind == "additive":
        values = torch.rand(batch, heads, n, n, generator=gen) * 2 - 1
        return values.masked_fill(torch.rand(batch, heads, n, n, generator=gen) > 0.6, -torch.inf).to(torch.bfloat16)
    if kind == "padded_chunk":
        keep = torch.ones(batch, 1, 1, n, dtype=torch.bool)
        chunk = int(torch.randint(world, (1,), generator=gen))
        keep[..., chunk * per_rank : (chunk + 1) * per_rank] = False
        return keep
    if kind == "all_true":
        return torch.ones(batch, 1, 1, n, dtype=torch.bool)
    if kind == "all_zero":
        return torch.zeros(batch, 1, 1, n, dtype=torch.bfloat16)
    raise ValueError(f"mask kind {kind!r}: one of {list(MASK_KINDS)}")


def search(module: types.ModuleType, max_examples: int) -> list[str]:
    """A hypothesis search over ring degree (2 - 4), shapes, mask kinds and layouts through the installed ring on
    the cuDNN ops: every example must match the fp32 reference, and a mask that masks nothing must reach no op.
    Derandomized, no database, no deadline: bounded and reproducible. Returns the shrunk failure, if any."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    failures: list[str] = []

    @st.composite
    def examples(draw: Any) -> dict[str, Any]:
        kind = draw(st.sampled_from(sorted(MASK_KINDS)))
        return {
            "world": draw(st.integers(2, 4)),
            # 2 tokens per rank at least: the cuDNN kernel (and its stand-in) refuses one query with one key.
            "shape": (draw(st.integers(1, 2)), draw(st.integers(2, 5)), draw(st.integers(1, 3)), 8),
            "kind": kind,
            "layout": draw(st.sampled_from(MASK_KINDS[kind])),
            "seed": draw(st.integers(0, 2**16)),
        }

    @settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(examples())
    def check(example: dict[str, Any]) -> None:
        world, shape = example["world"], example["shape"]
        mask = make_mask(example["kind"], world, seed=example["seed"], shape=shape)
        result = run(
            module, "cudnn", world, mask=mask, mask_layout=example["layout"], shape=shape, seed=example["seed"]
        )
        # Dropped exactly where the mask masks nothing (the kinds made so, or a draw that happens to).
        dropped = bool(mask.all()) if mask.dtype == torch.bool else not bool(mask.ne(0).any())
        ok = result["status"] == "pass" and (result["masked_calls"] == 0) == dropped
        if not ok:
            failures.append(f"{example}: {result}")
        assert ok, failures[-1]

    try:
        check()
    except AssertionError:
        return failures[-1:]  # the shrunk counterexample: hypothesis runs it last
    return []


def _rank_mask(mask: torch.Tensor, layout: str, shard: slice) -> torch.Tensor:
    """What one rank holds of ``mask`` (over the whole sequence) in ``layout``."""
    if layout == "global":
        return mask
    if layout == "local":
        return mask[..., shard]
    if layout == "local_rows":
        return mask[..., shard, :]
    raise ValueError(f"mask_layout {layout!r}: one of {MASK_LAYOUTS}")


def main(package: bool, worlds: tuple[int, ...] = (2, 3, 4), backends: tuple[str, ...] = ("cudnn", "flash")) -> None:
    """In a fresh interpreter: each ring degree and backend through the installed ring, one JSON line."""
    if package:
        import diffusers_cudnn_fix  # noqa: F401  (arms the hook)
    import diffusers
    import diffusers.models.attention_dispatch as module
    import standin_kernels

    standin_kernels.register()
    cases = {}
    for backend in backends:
        if not hasattr(module, BACKEND_OPS[backend][1]):
            continue
        for world in worlds:
            cases[f"{backend}/world={world}"] = run(module, backend, world)
    print(json.dumps({"version": diffusers.__version__, "cases": cases}))
    sys.stdout.flush()
