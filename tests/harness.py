"""How the tests and the benchmarks drive diffusers' context-parallel attention: one place for each way.

* :func:`op_pair` -- an installed forward / backward op pair (``_cudnn_attention_forward_op`` and
  ``_cudnn_attention_backward_op``, or the native-flash pair) inside an ``autograd.Function``, called the way
  diffusers' templated attention calls it, minus the collectives: ``op_pair(fwd, bwd, ...).apply(q, k, v, mask)``.
* :func:`ulysses_attention` / :func:`ring_attention` -- diffusers' own ``TemplatedUlyssesAttention`` /
  ``TemplatedRingAttention``, with their positional argument list written out here once.
* :func:`pair_config` / :func:`ulysses_config` -- the context-parallel configs those calls take, and
  :func:`stand_in_collectives` -- Ulysses' collectives answered in place (degree 1, no process group).

Importable from the tests (``tests/`` is on the path under pytest), from the scripts ``releases.run`` starts
(it puts ``tests/`` on ``PYTHONPATH``) and from ``benchmarks/`` (which add ``tests/`` to ``sys.path``).
Imports nothing at module level beyond the standard library, so a script's import order (diffusers, the
package, torch) stays the script's own.
"""

from __future__ import annotations

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
