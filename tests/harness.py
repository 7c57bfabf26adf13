"""How the tests and the benchmarks drive diffusers' context-parallel attention: one place for each way.

* :func:`op_pair` -- an installed forward / backward op pair (``_cudnn_attention_forward_op`` and
  ``_cudnn_attention_backward_op``, or the native-flash pair) inside an ``autograd.Function``, called the way
  diffusers' templated attention calls it, minus the collectives: ``op_pair(fwd, bwd, ...).apply(q, k, v, mask)``.
* :func:`ulysses_attention` / :func:`ring_attention` -- diffusers' own ``TemplatedUlyssesAttention`` /
  ``TemplatedRingAttention``, with their positional argument list written out here once.
* :func:`pair_config` / :func:`ulysses_config` -- the context-parallel configs those calls take, and
  :func:`stand_in_collectives` -- Ulysses' collectives answered in place (degree 1, no process group).
* :func:`ulysses_against_reference` -- ``TemplatedUlyssesAttention`` as installed, a thread per rank
  (:class:`ThreadedUlysses`, :func:`ulysses_threads`) on a right op pair (:func:`sdpa_ops`), against attention
  over the whole sequence in one process.

Importable from the tests (``tests/`` is on the path under pytest), from the scripts ``releases.run`` starts
(it puts ``tests/`` on ``PYTHONPATH``) and from ``benchmarks/`` (which add ``tests/`` to ``sys.path``).
Imports nothing at module level beyond the standard library, so a script's import order (diffusers, the
package, torch) stays the script's own.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Literal


def pair_config(**fields: Any) -> types.SimpleNamespace:
    """The ``_parallel_config`` an op pair gets inside a Ulysses degree-2 run: world size 2, which is what
    diffusers' ops read to decide whether a backward may follow. ``fields`` add to it or replace its own."""
    cp = {"_world_size": 2, "ring_degree": 1, "ulysses_degree": 2, **fields}
    return types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(**cp))


def ulysses_config(mesh: Any, **fields: Any) -> types.SimpleNamespace:
    """The ``_parallel_config`` of ``TemplatedUlyssesAttention`` at Ulysses degree 1 on ``mesh`` (world size 2
    as in :func:`pair_config`). ``fields`` add to it or replace its own."""
    cp = {"_ulysses_mesh": mesh, "ulysses_degree": 1, "ring_degree": 1, "_world_size": 2, **fields}
    cp.setdefault("ulysses_anything", False)
    return types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(**cp))


def op_pair(
    forward_op: Any,
    backward_op: Any,
    *,
    dropout: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    keep_lse: bool = False,
    parallel_config: Any = None,
    inputs: Literal["clone", "detach", "as_given"] = "clone",
    set_backward_op: bool = False,
) -> Any:
    """An ``autograd.Function`` class running ``forward_op`` then ``backward_op`` as diffusers' templated
    attention does: ``Pair.apply(q, k, v, mask)`` (``mask`` may be None; it gets no gradient).

    * the ops' own arguments: ``dropout``, ``is_causal``, ``scale``, ``enable_gqa``, ``return_lse`` and
      ``parallel_config`` (``_parallel_config``); the forward op is called with ``_save_ctx=True``;
    * ``return_lse``: the Function returns the output alone, or ``(out, lse)`` with ``keep_lse`` (the
      log-sum-exp marked non-differentiable, as ``TemplatedUlyssesAttention`` does);
    * ``inputs``: what reaches the forward op -- ``"clone"`` (fresh tensors made under no-grad, as after the
      all-to-all: they do not require grad), ``"detach"`` (the same storage, not requiring grad) or
      ``"as_given"`` (the Function's own inputs);
    * ``set_backward_op``: set ``ctx.backward_op = backward_op`` before the forward op runs, as diffusers'
      templated classes do (a forward op may read it).
    """
    import torch

    class Pair(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, query: Any, key: Any, value: Any, mask: Any) -> Any:
            if set_backward_op:
                ctx.backward_op = backward_op
            if inputs == "clone":
                query, key, value = (x.clone() for x in (query, key, value))
            elif inputs == "detach":
                query, key, value = (x.detach() for x in (query, key, value))
            out = forward_op(
                ctx, query, key, value, mask, dropout, is_causal, scale, enable_gqa, return_lse,
                _save_ctx=True, _parallel_config=parallel_config,
            )  # fmt: skip
            if not return_lse:
                return out
            if not keep_lse:
                return out[0]
            out, lse = out[0], out[1]
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx: Any, grad: Any, *unused: Any) -> Any:
            grads = backward_op(ctx, grad)
            return grads[0], grads[1], grads[2], None

    return Pair


def _templated(
    cls: Any,
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    forward_op: Any,
    backward_op: Any,
    config: Any,
    dropout: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    return_lse: bool,
) -> Any:
    """diffusers' templated ``cls.apply``: its one positional argument list (the same for Ulysses and ring)."""
    return cls.apply(q, k, v, mask, dropout, is_causal, scale, enable_gqa, return_lse, forward_op, backward_op, config)


def ulysses_attention(
    module: Any,
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    *,
    config: Any,
    forward_op: Any = None,
    backward_op: Any = None,
    dropout: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
) -> Any:
    """``module.TemplatedUlyssesAttention.apply(...)`` (``module``: diffusers' ``attention_dispatch``) on the
    ops given, by default the installed cuDNN pair (looked up now)."""
    forward_op = module._cudnn_attention_forward_op if forward_op is None else forward_op
    backward_op = module._cudnn_attention_backward_op if backward_op is None else backward_op
    return _templated(
        module.TemplatedUlyssesAttention, q, k, v, mask, forward_op, backward_op, config,
        dropout, is_causal, scale, enable_gqa, return_lse,
    )  # fmt: skip


def ring_attention(
    module: Any,
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    *,
    config: Any,
    forward_op: Any,
    backward_op: Any,
    dropout: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
) -> Any:
    """``module.TemplatedRingAttention.apply(...)``, the same arguments as :func:`ulysses_attention`."""
    return _templated(
        module.TemplatedRingAttention, q, k, v, mask, forward_op, backward_op, config,
        dropout, is_causal, scale, enable_gqa, return_lse,
    )  # fmt: skip


def stand_in_collectives(module: Any, monkeypatch: Any) -> types.SimpleNamespace:
    """Ulysses at degree 1 without a process group: ``module._all_to_all_single`` returns its input and
    ``module.dist.all_gather`` copies the tensor into every slot (through pytest's ``monkeypatch``). Returns a
    mesh for :func:`ulysses_config` whose group is None."""
    monkeypatch.setattr(module, "_all_to_all_single", lambda x, group=None: x)

    def all_gather(out: Any, tensor: Any, group: Any = None) -> None:
        for part in out:
            part.copy_(tensor)

    monkeypatch.setattr(module, "dist", types.SimpleNamespace(all_gather=all_gather))
    return types.SimpleNamespace(get_group=lambda: None)


class ThreadedUlysses:
    """Ulysses' collectives between ``world`` threads, one per rank, each with a group of its own (``mesh(rank)``):
    ``_all_to_all_single`` (slot i of rank j's input goes to rank i, which gets them in rank order) and
    ``dist.all_gather``. ``overrides``: diffusers' module globals they stand in for."""

    def __init__(self, world: int) -> None:
        import threading

        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list[Any] = [None] * world
        self.overrides = {
            "_all_to_all_single": self.all_to_all_single,
            "dist": types.SimpleNamespace(all_gather=self.all_gather),
        }

    def mesh(self, rank: int) -> types.SimpleNamespace:
        group = types.SimpleNamespace(rank=rank)
        return types.SimpleNamespace(get_group=lambda: group)

    def _exchange(self, rank: int, tensor: Any) -> list[Any]:
        self.slots[rank] = tensor
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read them all
        return got

    def all_to_all_single(self, x: Any, group: Any = None) -> Any:
        import torch

        return torch.stack([sent[group.rank] for sent in self._exchange(group.rank, x)]).contiguous()

    def all_gather(self, out: list[Any], tensor: Any, group: Any = None) -> None:
        for part, got in zip(out, self._exchange(group.rank, tensor), strict=True):
            part.copy_(got)


class _Ctx:
    """The autograd context of a rank that calls the Function's forward and backward itself."""

    saved_tensors: tuple[Any, ...] = ()
    needs_input_grad = (True,) * 12

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors


def ulysses_threads(
    forward: Any, backward: Any, collectives: ThreadedUlysses, inputs: list[tuple[Any, ...]], grad_outs: list[Any],
    *, forward_op: Any, backward_op: Any,
) -> list[Any]:  # fmt: skip
    """Ulysses attention of ``collectives.world`` ranks in one process, a thread per rank: rank r calls ``forward``
    on ``inputs[r]`` (its q, k, v and mask) and then ``backward`` on ``grad_outs[r]``, with a context of its own
    (autograd would run the ranks' backwards one after the other, the first waiting for the others). ``forward``
    and ``backward`` must see ``collectives`` in place of diffusers' (:func:`seeing` builds them). Returns, per
    rank, (out, dq, dk, dv), or the exception it raised."""
    import threading

    import torch

    results: list[Any] = [None] * collectives.world

    def rank_main(rank: int) -> None:
        cp = types.SimpleNamespace(
            _ulysses_mesh=collectives.mesh(rank), _ulysses_local_rank=rank, ulysses_degree=collectives.world,
            ring_degree=1, _world_size=collectives.world, ulysses_anything=False, convert_to_fp32=False,
        )  # fmt: skip
        config = types.SimpleNamespace(context_parallel_config=cp)
        ctx = _Ctx()
        try:
            with torch.no_grad():  # as inside autograd.Function.forward / backward
                q, k, v, mask = inputs[rank]
                out = forward(ctx, q, k, v, mask, 0.0, False, None, False, False, forward_op, backward_op, config)
                grads = backward(ctx, grad_outs[rank])
            results[rank] = (out, *grads[:3])
        except BaseException as exc:
            results[rank] = exc
            collectives.barrier.abort()  # the other ranks stop waiting for this one

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(collectives.world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def sdpa_ops() -> tuple[Any, Any]:
    """A forward / backward op pair (diffusers' op signature) computing attention with
    ``F.scaled_dot_product_attention`` in autograd, right on every release and device: for tests of the templated
    classes, not of the ops (diffusers' own ``native`` pair is wrong in 0.36.0 - 0.37.x's backward)."""
    import torch
    import torch.nn.functional as F

    def attention(query: Any, key: Any, value: Any, mask: Any, scale: Any) -> Any:
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)

    def forward_op(
        ctx: Any, query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
        is_causal: bool = False, scale: Any = None, enable_gqa: bool = False, return_lse: bool = False,
        _save_ctx: bool = True, _parallel_config: Any = None,
    ) -> Any:  # fmt: skip
        if _save_ctx:
            ctx.save_for_backward(query, key, value)
            ctx.mask_and_scale = (attn_mask, scale)
        return attention(query, key, value, attn_mask, scale)

    def backward_op(ctx: Any, grad_out: Any, *args: Any, **kwargs: Any) -> Any:
        inputs = [x.detach().requires_grad_() for x in ctx.saved_tensors]
        with torch.enable_grad():
            out = attention(*inputs, *ctx.mask_and_scale)
        return torch.autograd.grad(out, inputs, grad_out)

    return forward_op, backward_op


def seeing(module: Any, target: str, overrides: dict[str, Any], **seams: Any) -> Any:
    """What is installed at ``target`` of diffusers' attention ``module`` (``"Class.attr"``), seeing ``overrides``
    in place of diffusers' module globals: diffusers' own function as a copy with them; the package's replacement
    built again by the package (the same builder, as its checks do) around such a copy of diffusers' function, with
    the collaborators ``seams`` (the ring's ``collectives``, the Ulysses backward's ``all_to_all``). Nothing
    installed is touched; without the package imported, nothing of it is imported here."""
    cls, _, attr = target.partition(".")
    installed = getattr(getattr(module, cls), attr)
    package = sys.modules.get("diffusers_cudnn_fix")
    ours = package is not None and package.is_patched(target)
    shipped = package.get_original(target).__func__ if ours else installed
    globals_ = {**shipped.__globals__, **overrides}
    copy = types.FunctionType(shipped.__code__, globals_, shipped.__name__, shipped.__defaults__, shipped.__closure__)
    copy.__kwdefaults__ = shipped.__kwdefaults__
    if not ours:
        return copy
    from diffusers_cudnn_fix._fix import built_of
    from diffusers_cudnn_fix._registry import live_objects

    return built_of(live_objects(module), target, copy, **seams)


#: Relative error (max |x - ref| / max |ref|) allowed by :func:`ulysses_against_reference`: fp32 on both sides, so
#: only the order of the sums differs; a wrong head or token is off by tens of percent.
ULYSSES_TOLERANCE = 1e-4


def ulysses_against_reference(
    module: Any, world: int, *, seq_q: int, seq_kv: int, mask: Any = None, mask_layout: str = "local",
    batch: int = 2, heads: int = 4, head_dim: int = 8, seed: int = 0, keep: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """``module.TemplatedUlyssesAttention`` as installed (diffusers' or the package's), ``world`` ranks in threads
    (:func:`ulysses_threads`) on :func:`sdpa_ops`, fp32, against attention over the whole sequence in one process.

    ``seq_q`` / ``seq_kv``: tokens a rank; ``mask``: None, or one over every key, ``(batch, 1|heads, 1, seq_kv x
    world)``, handed to each rank as ``mask_layout`` says: ``"local"``, its own keys (as a model's plan shards it;
    0.39+ all-gather it) or ``"global"``, every key. Returns ``{"status": "pass" | "wrong" | "raised", "errors":
    {out, dq, dk, dv: relative error}, "error": text}`` (``keep``: and ``"got"``, the four put together)."""
    import threading

    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq * world, heads, head_dim, generator=gen) for seq in (seq_q, seq_kv, seq_kv))
    grad_out = torch.randn(q.shape, generator=gen)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in full), attn_mask=mask).transpose(1, 2)
    ref_out.backward(grad_out)
    golden = [ref_out.detach(), *(x.grad for x in full)]

    def shard(x: Any, seq: int, rank: int) -> Any:
        return x[:, rank * seq : (rank + 1) * seq]

    def rank_mask(rank: int) -> Any:
        if mask is None or mask_layout == "global":
            return mask
        return mask[..., rank * seq_kv : (rank + 1) * seq_kv]

    inputs = [(shard(q, seq_q, r), shard(k, seq_kv, r), shard(v, seq_kv, r), rank_mask(r)) for r in range(world)]
    collectives = ThreadedUlysses(world)
    seams = {"all_to_all": collectives.all_to_all_single}
    forward, backward = (
        seeing(module, f"TemplatedUlyssesAttention.{name}", collectives.overrides, **seams)
        for name in ("forward", "backward")
    )
    forward_op, backward_op = sdpa_ops()
    results = ulysses_threads(
        forward, backward, collectives, inputs, [shard(grad_out, seq_q, r) for r in range(world)],
        forward_op=forward_op, backward_op=backward_op,
    )  # fmt: skip
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:  # the rank that raised first, not those it left waiting at a barrier
        exc = next((r for r in failed if not isinstance(r, threading.BrokenBarrierError)), failed[0])
        return {"status": "raised", "error": f"{type(exc).__name__}: {exc}"}
    got = [torch.cat([r[i] for r in results], dim=1) for i in range(4)]
    errors = {}
    for name, g, ref in zip(("out", "dq", "dk", "dv"), got, golden, strict=True):
        if g.shape != ref.shape:
            return {"status": "wrong", "error": f"{name} of shape {tuple(g.shape)}, not {tuple(ref.shape)}"}
        errors[name] = ((g - ref).abs().max() / ref.abs().max()).item()
    result = {"status": "pass" if max(errors.values()) <= ULYSSES_TOLERANCE else "wrong", "errors": errors}
    return {**result, "got": got} if keep else result
