"""Behavioural check of diffusers' attention ops, without a GPU.

diffusers' forward/backward op pairs are run on tiny CPU tensors under a ``TorchDispatchMode`` that sees
every ATen call. The calls to the four ATen attention ops are recorded and answered with empty tensors
shaped as the op contract says (the contract the ops' meta kernels implement; ``tests/test_detect.py``
holds the two side by side); every other op runs normally. No attention is computed and CUDA is never
touched. From the record the fixes decide whether the installed code is broken: do q, k and v reach the
backward kernel in the layout they reached the forward kernel, is the log-sum-exp computed when a backward
will need it, does ``grad_out`` carry ``out``'s strides, what reaches the bias slot.

Shapes are chosen so that every dimension differs (B=2, S_q=5, S_kv=7, H=3, D=8): any transposition shows
up as a shape change.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from packaging.version import Version
from torch.utils._python_dispatch import TorchDispatchMode

from ._fix import Finding, Lookup, built_of, shipped_of
from ._target_names import RING_BACKWARD, RING_CLASS, RING_FORWARD, ULYSSES_BACKWARD


def spreads(config: Any) -> bool:
    """Whether ``config`` (diffusers' ``ParallelConfig``, or a ``ContextParallelConfig``) spreads attention over
    more than one rank; degrees that cannot be read count as doing so (a guard then acts rather than stay silent).
    Plain attribute reads: the flash backend's guard calls it on every call."""
    cp = getattr(config, "context_parallel_config", config)
    if cp is None:
        return False
    ulysses, ring = (getattr(cp, name, None) for name in ("ulysses_degree", "ring_degree"))
    return not (isinstance(ulysses, int) and isinstance(ring, int)) or ulysses * ring > 1


class StandInModel(torch.nn.Module):
    """The model a check hands ``enable_parallelism``: one 2 x 2 linear map whose weight is set, not drawn. A check
    runs inside the user's process, often after the training script seeded torch (diffusers imports model classes
    lazily), so it must take no number from the user's random generators: ``torch.nn.Linear`` would."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.eye(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


# Model layout (B, S, H, D) shapes used by the check. All distinct so that a swapped pair of dims is visible.
BATCH, SEQ_Q, SEQ_KV, HEADS, HEAD_DIM = 2, 5, 7, 3, 8

#: The watched ATen kernels as a trace names them (not targets: those are named in ``_target_names``).
CUDNN_FORWARD_KERNEL = "cudnn_forward"
CUDNN_BACKWARD_KERNEL = "cudnn_backward"
FLASH_FORWARD_KERNEL = "flash_forward"
FLASH_BACKWARD_KERNEL = "flash_backward"

_WATCHED = {
    "_scaled_dot_product_cudnn_attention": CUDNN_FORWARD_KERNEL,
    "_scaled_dot_product_cudnn_attention_backward": CUDNN_BACKWARD_KERNEL,
    "_scaled_dot_product_flash_attention": FLASH_FORWARD_KERNEL,
    "_scaled_dot_product_flash_attention_backward": FLASH_BACKWARD_KERNEL,
}

#: Parameters of diffusers' templated forward ops (0.36.0 to 0.42.1 spell them the same way); the corrected
#: forward (``fixes/cudnn_forward_lse.py``) is the one place they are written out as a signature.
FORWARD_PARAMS = (
    "ctx", "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa", "return_lse",
    "_save_ctx", "_parallel_config",
)  # fmt: skip


@dataclass(frozen=True)
class TensorInfo:
    """What the check keeps of a tensor argument."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, value: Any) -> TensorInfo | None:
        return cls(tuple(value.shape), tuple(value.stride()), value.dtype) if isinstance(value, torch.Tensor) else None


@dataclass(frozen=True)
class OpCall:
    """One call of a watched ATen op: its name and its arguments by schema name, defaults filled in."""

    op: str
    args: dict[str, Any]

    def tensor(self, name: str) -> TensorInfo | None:
        return TensorInfo.of(self.args.get(name))


@dataclass
class Trace:
    """What happened when an op pair ran: the watched ATen calls, the results, and any exception."""

    calls: list[OpCall] = field(default_factory=list)
    forward_result: Any = None
    grads: tuple[Any, ...] | None = None
    error: str | None = None

    def first(self, op: str) -> OpCall | None:
        return next((c for c in self.calls if c.op == op), None)


class _Recorder(TorchDispatchMode):
    """Records the watched ops into a trace and answers them; runs everything else."""

    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        aten_name = func.__name__.partition(".")[0]
        if aten_name not in _WATCHED:
            return func(*args, **(kwargs or {}))
        schema = func._schema.arguments
        bound = {arg.name: arg.default_value for arg in schema if arg.has_default_value()}
        bound.update(zip((arg.name for arg in schema), args, strict=False))  # trailing defaults left out
        bound.update(kwargs or {})
        op = _WATCHED[aten_name]
        self.trace.calls.append(OpCall(op, bound))
        return _answer(op, bound)


class ProbeCtx:
    """Stands in for the ``torch.autograd.Function`` context diffusers' templated attention passes.

    ``needs_input_grad`` says a backward will follow, as in a training step.
    """

    needs_input_grad = (True,) * 12
    saved_tensors: tuple[Any, ...] = ()

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors


def _parallel_config(**config: Any) -> Any:
    """What diffusers' ops are handed as ``_parallel_config``: a context-parallel config with these attributes."""
    return types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(**config))


def training_parallel_config() -> Any:
    """The attributes diffusers' ops read from a context-parallel config in a 2-way CP training run."""
    return _parallel_config(_world_size=2, ring_degree=1, ulysses_degree=2, convert_to_fp32=False)


def _positional_params(fn: Any) -> tuple[tuple[str, ...], bool] | None:
    """(positional parameter names, takes ``*args``) of ``fn`` (wrappers followed), or None if unreadable."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = tuple(p.name for p in params if p.kind in positional)
    return names, any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)


def signature_matches(fn: Any, params: tuple[str, ...]) -> bool:
    """Whether ``fn`` takes exactly these positional parameters (extra keyword-only ones allowed)."""
    found = _positional_params(fn)
    return found is not None and found[0] == params


def op_problem(forward: Any, *backward: Any) -> Finding | None:
    """Why the forward op (and the ``backward`` op, where given) cannot be checked: it does not exist, or takes
    other parameters than in every known release (diffusers' backward ops take ``(ctx, grad_out, *args)``); None
    if it can."""
    if forward is None or None in backward:
        return Finding("absent", "the op does not exist in this diffusers")
    backward_ok = all(_positional_params(op) == (("ctx", "grad_out"), True) for op in backward)
    if not signature_matches(forward, FORWARD_PARAMS) or not backward_ok:
        return Finding("unknown", "the op signatures differ from every known release")
    return None


def check_mask(kind: str) -> torch.Tensor:
    """A (B, 1, S_q, S_kv) mask with masked columns and one fully masked row (the last).

    ``"bool"``: True = attend. ``"float32"``: the same as an additive fp32 mask (0 / -inf). ``"int64"``: the
    bool mask as 0 / 1 integers.
    """
    keep = torch.ones(BATCH, 1, SEQ_Q, SEQ_KV, dtype=torch.bool)
    keep[..., 1::2] = False
    keep[..., -1, :] = False
    if kind == "bool":
        return keep
    if kind == "int64":
        return keep.to(torch.int64)
    return torch.zeros(keep.shape, dtype=getattr(torch, kind)).masked_fill_(~keep, float("-inf"))


def run_pair(
    forward: Callable[..., Any], backward: Callable[..., Any] | None, *, return_lse: bool,
    mask: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16, key_dtype: torch.dtype | None = None,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, enable_gqa: bool = False,
) -> Trace:  # fmt: skip
    """Run ``forward`` (and ``backward`` on its output) on tiny CPU tensors and record the ATen calls.

    Called as diffusers' templated attention calls it in training. ``dtype``: of q (and k, v unless
    ``key_dtype`` is given); ``qkv``: the (B, S, H, D) inputs to use instead; ``enable_gqa``: the op's own
    argument. The backward's ``grad_out`` is all ones. Never raises: an exception becomes ``trace.error`` (the
    calls recorded before it are kept).
    """
    trace = Trace()
    try:
        q, k, v = qkv or (
            torch.empty(BATCH, SEQ_Q, HEADS, HEAD_DIM, dtype=dtype),
            *(torch.empty(BATCH, SEQ_KV, HEADS, HEAD_DIM, dtype=key_dtype or dtype) for _ in range(2)),
        )
        ctx = ProbeCtx()
        # no_grad: diffusers calls these ops inside autograd.Function.forward, where grad mode is off.
        with torch.no_grad(), _Recorder(trace):
            trace.forward_result = result = forward(
                ctx, q, k, v, mask, 0.0, False, None, enable_gqa, return_lse,
                _save_ctx=True, _parallel_config=training_parallel_config(),
            )  # fmt: skip
            if backward is not None:
                out = result[0] if isinstance(result, tuple) else result
                trace.grads = tuple(backward(ctx, torch.ones(out.shape, dtype=out.dtype)))
    except Exception as exc:  # noqa: BLE001 - any failure is a finding, never a crash
        trace.error = f"{type(exc).__name__}: {exc}"
    return trace


def refuses_gqa(forward: Callable[..., Any], forward_op: str) -> bool:
    """Whether diffusers' forward op raises its own error for ``enable_gqa=True`` before reaching the ATen kernel
    ``forward_op`` (every release: "`enable_gqa` is not yet supported ..."). The replacements then hand such a
    call straight to it, guards skipped, so that diffusers' error, not one of the package's, is what surfaces."""
    trace = run_pair(forward, None, return_lse=False, enable_gqa=True)
    return trace.error is not None and trace.first(forward_op) is None


def _answer(name: str, args: dict[str, Any]) -> tuple[Any, ...]:
    """What the ATen op returns, minus the numbers: the outputs' shapes, strides and dtypes.

    Mirrors the ops' meta kernels (``tests/test_detect.py`` compares the two): the output and the gradients
    are laid out like their inputs; the cuDNN forward returns no log-sum-exp when not asked for one (the
    real kernel does so; the meta kernel returns one regardless).
    """
    if name in (CUDNN_BACKWARD_KERNEL, FLASH_BACKWARD_KERNEL):
        return tuple(torch.empty_like(args[n]) for n in ("query", "key", "value"))
    q, k = args["query"], args["key"]
    batch, heads, seq_q = q.shape[:3]
    if name == CUDNN_FORWARD_KERNEL:
        lse_shape = (batch, heads, seq_q, 1) if cudnn_lse_ndim() == 4 else (batch, heads, seq_q)
        lse = torch.empty(lse_shape, dtype=torch.float32) if args.get("compute_log_sumexp") else None
        seed = torch.empty((), dtype=torch.int64)
        return (torch.empty_like(q), lse, None, None, seq_q, k.shape[2], seed, torch.empty_like(seed), None)
    # FLASH_FORWARD_KERNEL: the log-sum-exp is always there, (B, H, S_q); then the rng state, an unused one, debug.
    lse = torch.empty(batch, heads, seq_q, dtype=torch.float32)
    rng = (torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64), torch.empty(0, dtype=q.dtype))
    return (torch.empty_like(q), lse, None, None, seq_q, k.shape[2], *rng)


_SEQ_OF = {"query": SEQ_Q, "key": SEQ_KV, "value": SEQ_KV}


def kernel_shapes() -> dict[str, tuple[int, ...]]:
    """The (B, H, S, D) shapes the ATen kernels must see for the check's inputs."""
    return {name: (BATCH, HEADS, seq, HEAD_DIM) for name, seq in _SEQ_OF.items()}


def _qkv_shapes(call: OpCall) -> dict[str, tuple[int, ...] | None]:
    return {name: getattr(call.tensor(name), "shape", None) for name in ("query", "key", "value")}


def check_backward_layout(forward: Any, backward: Any, forward_op: str, backward_op: str) -> Finding:
    """Do q, k, v reach the backward kernel in the layout they reached the forward kernel?

    ``forward`` / ``backward``: the op pair (None where missing); ``forward_op`` / ``backward_op``: the
    watched ATen ops they reach (``CUDNN_FORWARD_KERNEL``, ...). Runs with ``return_lse=True`` so that a missing
    log-sum-exp (a separate bug) cannot mask this one. Also checks that ``grad_out`` reaches the kernel with
    ``out``'s shape and strides and that the gradients come back in model layout.
    """
    if (problem := op_problem(forward, backward) or aten_contract_problem(forward_op, backward_op)) is not None:
        return problem
    trace = run_pair(forward, backward, return_lse=True)
    fwd, bwd = trace.first(forward_op), trace.first(backward_op)
    if fwd is None or bwd is None:
        return Finding("unknown", f"the ops never reached the ATen kernels ({trace.error or 'no call recorded'})")
    fwd_shapes, bwd_shapes = _qkv_shapes(fwd), _qkv_shapes(bwd)
    if fwd_shapes != kernel_shapes():
        return Finding("unknown", f"the forward hands the kernel q/k/v as {fwd_shapes}, not (B, H, S, D)")
    if bwd_shapes != fwd_shapes:
        return Finding("broken", f"the backward kernel gets q/k/v of shapes {bwd_shapes} but the forward kernel got "
                       f"{fwd_shapes}: saved tensors are re-transposed")  # fmt: skip
    grad_out, out = bwd.tensor("grad_out"), bwd.tensor("out")
    if grad_out is None or out is None or (grad_out.shape, grad_out.stride) != (out.shape, out.stride):
        return Finding(
            "broken", f"grad_out reaches the backward kernel as {grad_out}, out as {out}: strides must match"
        )
    if trace.error is not None:
        return Finding("unknown", f"the backward raised {trace.error}")
    grad_shapes = tuple(tuple(g.shape) if isinstance(g, torch.Tensor) else None for g in (trace.grads or ())[:3])
    # The gradients come back in the check's (B, S, H, D) model layout.
    if grad_shapes != tuple((BATCH, seq, HEADS, HEAD_DIM) for seq in _SEQ_OF.values()):
        return Finding("unknown", f"the backward returns gradients of shapes {grad_shapes}")
    return Finding("ok", "q/k/v reach the backward kernel in the forward's (B, H, S, D) layout")


def check_forward_lse(forward: Any, *, forward_op: str) -> Finding:
    """Is the log-sum-exp computed when a backward will follow, while the caller gets what it asked for?"""
    backward_op = CUDNN_BACKWARD_KERNEL if forward_op == CUDNN_FORWARD_KERNEL else FLASH_BACKWARD_KERNEL
    if (problem := op_problem(forward) or aten_contract_problem(forward_op, backward_op)) is not None:
        return problem
    trace = run_pair(forward, None, return_lse=False)
    fwd = trace.first(forward_op)
    if fwd is None:
        return Finding("unknown", f"the forward never reached the ATen kernel ({trace.error or 'no call'})")
    if not fwd.args.get("compute_log_sumexp", False):
        return Finding(
            "broken",
            "the forward runs the kernel with compute_log_sumexp=False although a backward will follow, "
            "so the backward reads an undefined log-sum-exp",
        )
    result = trace.forward_result
    if not isinstance(result, torch.Tensor) or tuple(result.shape) != (BATCH, SEQ_Q, HEADS, HEAD_DIM):
        return Finding("broken", f"asked for the output only, the forward returned {type(result).__name__}")
    with_lse = run_pair(forward, None, return_lse=True).forward_result
    if not (isinstance(with_lse, tuple) and len(with_lse) == 2):
        return Finding("unknown", "asked for (out, lse), the forward returned something else")
    return Finding("ok", "the log-sum-exp is computed whenever the autograd context is saved for a backward")


def cudnn_lse_ndim() -> int:
    """Dims of the log-sum-exp the running torch's cuDNN kernels produce and take: 4, (B, H, S, 1), from
    torch 2.9 on; 3, (B, H, S), before (docs/kernel-facts.md). ``tests/test_detect.py`` checks the rule against
    the meta kernel of the torch in use, and the GPU probe runs the real kernels with this value."""
    return 4 if Version(torch.__version__).release[:2] >= (2, 9) else 3


#: The four ATen ops as the corrected ops call them (by keyword): arguments, then return types, exactly as
#: ``torch.ops.aten.<op>.default._schema`` spells them. Unchanged from torch 2.5 (the first with
#: ``attn_bias`` / ``compute_log_sumexp``; docs/kernel-facts.md) through the newest the suite runs on. A torch
#: whose ops differ in any of it gets no correction: the checks below say "unknown" (not applied).
ATEN_SIGNATURES = {
    "_scaled_dot_product_cudnn_attention": (
        "Tensor query, Tensor key, Tensor value, Tensor? attn_bias, bool compute_log_sumexp, float dropout_p=0., "
        "bool is_causal=False, bool return_debug_mask=False, *, float? scale=None",
        "Tensor, Tensor, Tensor, Tensor, int, int, Tensor, Tensor, Tensor",
    ),
    "_scaled_dot_product_cudnn_attention_backward": (
        "Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor logsumexp, Tensor philox_seed, "
        "Tensor philox_offset, Tensor attn_bias, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, "
        "float dropout_p, bool is_causal, *, float? scale=None",
        "Tensor, Tensor, Tensor",
    ),
    "_scaled_dot_product_flash_attention": (
        "Tensor query, Tensor key, Tensor value, float dropout_p=0., bool is_causal=False, "
        "bool return_debug_mask=False, *, float? scale=None",
        "Tensor, Tensor, Tensor, Tensor, int, int, Tensor, Tensor, Tensor",
    ),
    "_scaled_dot_product_flash_attention_backward": (
        "Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor logsumexp, Tensor cum_seq_q, "
        "Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, Tensor philox_seed, "
        "Tensor philox_offset, *, float? scale=None",
        "Tensor, Tensor, Tensor",
    ),
}


def aten_signature(name: str) -> tuple[str, str] | None:
    """(arguments, return types) of ``aten::<name>``'s default overload in the running torch; None if absent."""
    try:
        schema = getattr(torch.ops.aten, name).default._schema
    except (AttributeError, RuntimeError):
        return None
    arguments = str(schema).partition("(")[2].partition(") -> ")[0]
    return arguments, ", ".join(str(ret.type) for ret in schema.returns)


def _meta_lse_ndim() -> int | None:
    """Dims of the log-sum-exp the cuDNN forward's meta kernel returns (no CUDA needed), or None if it fails."""
    q = torch.empty(1, 1, 2, 8, device="meta", dtype=torch.bfloat16)
    try:
        lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            query=q, key=q, value=q, attn_bias=None, compute_log_sumexp=True,
            dropout_p=0.0, is_causal=False, return_debug_mask=False, scale=None,
        )[1]  # fmt: skip
    except Exception:  # noqa: BLE001 - any failure means the contract is not the known one
        return None
    return lse.dim() if isinstance(lse, torch.Tensor) else None


def _difference(found: tuple[str, str] | None, known: tuple[str, str]) -> str:
    """What differs between two (arguments, return types) signatures, in a few words."""
    if found is None:
        return "is missing"
    got, want = found[0].split(", "), known[0].split(", ")
    parts = [f"takes `{a}`" for a in got if a not in want] + [f"lacks `{a}`" for a in want if a not in got]
    if not parts and got != want:
        parts.append("takes its arguments in another order")
    if found[1] != known[1]:
        parts.append(f"returns ({found[1]})")
    return ", ".join(parts)


def aten_contract_problem(*ops: str) -> Finding | None:
    """Why the running torch's ATen ops behind ``ops`` (``CUDNN_FORWARD_KERNEL``, ...) are not the ones the corrected
    ops were written for ("unknown"), or None when they are: the one check every fix calling them consults."""
    for name in (aten for aten, op in _WATCHED.items() if op in ops):
        found, known = aten_signature(name), ATEN_SIGNATURES[name]
        if found != known:
            return Finding(
                "unknown",
                f"torch {torch.__version__}'s aten::{name} {_difference(found, known)}, unlike every torch the "
                "package was written for",
            )
    if CUDNN_FORWARD_KERNEL in ops and _meta_lse_ndim() != cudnn_lse_ndim():
        return Finding(
            "unknown",
            f"torch {torch.__version__}'s cuDNN attention returns a log-sum-exp of {_meta_lse_ndim()} dims (meta "
            f"kernel), not the {cudnn_lse_ndim()} this package expects of it",
        )
    return None


def with_globals(fn: Callable[..., Any], **overrides: Any) -> Callable[..., Any]:
    """A copy of diffusers' function ``fn`` that sees ``overrides`` in place of some of its module globals (its
    collectives); ``fn`` itself is untouched.

    diffusers' own code reaches its collectives through its module's globals, so this is how a check runs it in one
    process with stand-ins, without touching ``torch.distributed`` or diffusers' module. The package's own
    replacements are never copied so: a check builds them again with its collaborators (``_fix.built_of``).
    """
    assert isinstance(fn, types.FunctionType)
    copy = types.FunctionType(
        fn.__code__, {**fn.__globals__, **overrides}, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def with_stand_ins(lookup: Lookup, name: str, stand_ins: dict[str, Any], **seams: Any) -> Callable[..., Any] | str:
    """What a check runs at ``name`` with ``stand_ins`` in place of some globals of diffusers' function there (its
    collectives): diffusers' own a copy of it (:func:`with_globals`), a replacement built again around that copy
    with ``seams`` (``_fix.built_of``). A text where diffusers' object there is not a plain function, or where the
    replacement cannot be built so."""
    shipped = shipped_of(lookup, name)
    if not isinstance(shipped, types.FunctionType):
        return f"diffusers' {name} is a {type(shipped).__name__}, not a function"
    run = built_of(lookup, name, with_globals(shipped, **stand_ins), **seams)
    return f"the replacement of {name} could not be built around a stand-in" if run is None else run


#: Stands in for a DeviceMesh in the class checks: the stand-in collectives ignore the group.
FAKE_MESH = types.SimpleNamespace(get_group=lambda: None)


class ReachedOp(Exception):
    """Raised by :func:`call_ulysses`' stand-in attention op, with the mask it was handed (or by :func:`op_reached`'s
    stand-in all-gather, with the tensor gathered)."""

    def __init__(self, mask: Any) -> None:
        super().__init__("the attention op was reached")
        self.mask = mask


def _all_gather(out: list[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> None:
    for part in out:
        part.copy_(tensor)


#: Stand-ins for the collectives of diffusers' Ulysses forward (globals of a copy, :func:`with_globals`).
ULYSSES_STAND_INS = {
    "_all_to_all_single": lambda x, group=None: x,
    "dist": types.SimpleNamespace(all_gather=_all_gather),
}


#: Stand-ins for the collectives of diffusers' ``TemplatedUlyssesAnythingAttention.forward`` (0.37+): its
#: all-to-alls hand back their input (when waited for, as async ones do); the mask all-gather (0.39+) gathers two
#: equal shards.
ULYSSES_ANYTHING_STAND_INS = {
    "all_to_all_single_any_qkv_async": lambda x, group=None, **kwargs: lambda: x,
    "all_to_all_single_any_o_async": lambda x, group=None, **kwargs: lambda: x,
    "gather_size_by_comm": lambda size, group=None: [size, size],
    "dist": types.SimpleNamespace(all_gather=_all_gather, get_world_size=lambda group=None: 2),
}


def _reach_op(ctx: Any, query: Any, key: Any, value: Any, attn_mask: Any, *args: Any, **kwargs: Any) -> Any:
    raise ReachedOp(attn_mask)


def call_ulysses(
    forward: Any, mask: torch.Tensor, mesh: Any, *, degree: int, forward_op: Any = _reach_op,
    shape: tuple[int, ...] = (1, 4, 2, 8), dtype: torch.dtype = torch.float32, **extra: Any,
) -> None:  # fmt: skip
    """Call a Ulysses ``forward`` as diffusers' dispatch does in training, at Ulysses ``degree`` of 2 ranks on
    ``mesh`` (``extra``: more attributes of its config), with zero q/k/v of ``shape`` and ``mask``; raises what it
    raises (the default ``forward_op``: :class:`ReachedOp`)."""
    config = _parallel_config(_ulysses_mesh=mesh, ulysses_degree=degree, _world_size=2, **extra)
    q, k, v = (torch.zeros(shape, dtype=dtype) for _ in range(3))
    with torch.no_grad():  # as inside autograd.Function.forward
        forward(ProbeCtx(), q, k, v, mask, 0.0, False, None, False, False, forward_op, None, config)


def mask_entering(
    lookup: Lookup, name: str, mask: torch.Tensor, *, passes: tuple[type[Exception], ...] = (),
    seams: dict[str, Any] | None = None, **call: Any,
) -> torch.Tensor | str:  # fmt: skip
    """The mask diffusers' own Ulysses forward at ``name`` receives when the forward ``lookup`` shows there is called
    with ``mask`` (:func:`call_ulysses` with ``call``): ``mask`` itself where that is diffusers' own; where it is a
    replacement, what it hands diffusers': the replacement is built around a stand-in that stops there
    (``_fix.built_of``, with ``seams``). Else a text saying what happened instead. ``passes``: exceptions the
    caller handles itself (raised on, not turned into a text)."""
    stopping = built_of(lookup, name, _reach_op, **(seams or {}))
    if stopping is None:
        return f"the replacement of {name} could not be built around a stand-in"
    try:
        call_ulysses(stopping, mask, FAKE_MESH, **call)
    except passes:
        raise
    except ReachedOp as reached:
        return reached.mask if isinstance(reached.mask, torch.Tensor) else f"it received {reached.mask!r}"
    except Exception as exc:  # noqa: BLE001 - a refusal, or an unknown build: the caller decides
        return f"{type(exc).__name__}: {exc}"
    return "the forward returned without calling diffusers' forward"


def _reach_gather(out: list[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> None:
    raise ReachedOp(tensor)


def op_reached(
    lookup: Lookup, name: str, mask: torch.Tensor, *, stand_ins: dict[str, Any] | None = None, gather: bool = False,
    shipped: bool = False, seams: dict[str, Any] | None = None, **call: Any,
) -> ReachedOp | str:  # fmt: skip
    """Call the Ulysses forward ``lookup`` shows at ``name`` (``shipped``: diffusers' own whatever it shows) with
    stand-in collectives (:func:`with_stand_ins`; ``stand_ins``, default :data:`ULYSSES_STAND_INS`) and ``mask``
    (:func:`call_ulysses` on :data:`FAKE_MESH` with ``call``): what its attention op raised, with the mask it was
    handed (``gather``: what stopped it at diffusers' all-gather of the mask, with the tensor gathered; the call's
    ``forward_op`` then must not be the default); else a text saying what happened instead. ``seams``: a
    replacement's collaborators (:func:`with_stand_ins`)."""
    overrides = dict(ULYSSES_STAND_INS if stand_ins is None else stand_ins)
    if gather:
        overrides["dist"] = types.SimpleNamespace(**{**vars(overrides["dist"]), "all_gather": _reach_gather})
    view: Lookup = (lambda n: shipped_of(lookup, n)) if shipped else lookup
    forward = with_stand_ins(view, name, overrides, **(seams or {}))
    if isinstance(forward, str):
        return forward
    try:
        call_ulysses(forward, mask, FAKE_MESH, **call)
    except ReachedOp as reached:
        return reached
    except Exception as exc:  # noqa: BLE001 - a refusal, or an unknown build: the caller decides
        return f"{type(exc).__name__}: {exc}"
    return f"the forward returned without {'all-gathering the mask' if gather else 'calling the attention op'}"


def run_ulysses_backward(lookup: Lookup) -> tuple[tuple[Any, ...] | None, str | None]:
    """Run the Ulysses backward ``lookup`` shows (degree 1, stand-in collectives, a backward op returning empty
    gradients) in this process; returns what it returned, or None and the error."""

    def backward_op(ctx: Any, grad: torch.Tensor, *a: Any, **kw: Any) -> tuple[torch.Tensor, ...]:
        return torch.empty_like(grad), torch.empty_like(grad), torch.empty_like(grad)  # only counted

    config = _parallel_config(_ulysses_mesh=FAKE_MESH, ulysses_degree=1, _world_size=2)
    ctx = types.SimpleNamespace(_parallel_config=config, backward_op=backward_op)
    identity = ULYSSES_STAND_INS["_all_to_all_single"]
    run = with_stand_ins(lookup, ULYSSES_BACKWARD, {"_all_to_all_single": identity}, all_to_all=identity)
    if isinstance(run, str):
        return None, run
    try:
        return tuple(run(ctx, torch.empty(1, 4, 2, 8))), None
    except Exception as exc:  # noqa: BLE001 - an unknown build: say so
        return None, f"{type(exc).__name__}: {exc}"


def input_count(forward: Callable[..., Any]) -> int | None:
    """How many inputs an ``autograd.Function.forward`` takes (its parameters after ``ctx``)."""
    found = _positional_params(forward)
    return None if found is None or found[1] else len(found[0]) - 1


#: Positional parameters of ``TemplatedRingAttention.forward`` in 0.36.0 to 0.42.1 (the op's, with the op pair
#: in place of ``_save_ctx``); a class whose forward takes others is left alone.
RING_FORWARD_PARAMS = (*FORWARD_PARAMS[:-2], "forward_op", "backward_op", "_parallel_config")


def installed_ring(lookup: Lookup) -> tuple[Any, Any] | Finding:
    """The ``TemplatedRingAttention`` forward and backward as ``lookup`` sees them, or why they cannot be checked."""
    forward, backward = lookup(RING_FORWARD), lookup(RING_BACKWARD)
    if lookup(RING_CLASS) is None or forward is None or backward is None:
        return Finding("absent", "this diffusers has no TemplatedRingAttention")
    if not all(isinstance(fn, types.FunctionType) for fn in (forward, backward)):
        return Finding("unknown", "TemplatedRingAttention's forward/backward are not plain functions")
    if not signature_matches(forward, RING_FORWARD_PARAMS):
        return Finding("unknown", "TemplatedRingAttention.forward takes other parameters than every known release")
    return forward, backward


def ring_collectives(gather: Any, permute: Any) -> Any:
    """Stand-ins for the functional collectives a ring calls: ``all_gather_tensor`` (``gather``) and
    ``permute_tensor`` (``permute``), whose results need no waiting."""
    return types.SimpleNamespace(
        all_gather_tensor=gather, permute_tensor=permute, AsyncCollectiveTensor=type("AsyncCollectiveTensor", (), {})
    )


def run_ring(forward: Any, backward: Any, step: Any, backward_op: Any, *, world: int, shape: Any) -> tuple[Any, Any]:
    """Run a ring ``forward``, then its ``backward`` (each already seeing stand-in collectives, and a corrected one
    built to drive ``backward_op``), as rank 0 of ``world`` ranks in this process, with attention ops on zero q/k/v
    of ``shape``. Returns (output, gradients).

    The stand-in forward op returns ``step(k)``, (output, log-sum-exp) for a step's K, and saves what the
    0.36-0.39 ops save, in kernel layout."""

    def forward_op(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out, lse = step(k)
        if kwargs.get("_save_ctx"):
            kernel = (x.transpose(1, 2).contiguous() for x in (q, k, v, out))
            ctx.save_for_backward(*kernel, lse.transpose(1, 2).contiguous(), None, None, None, None)
        return out, lse

    config = _parallel_config(
        _ring_mesh=FAKE_MESH, _ring_local_rank=0, ring_degree=world, convert_to_fp32=False, _world_size=world
    )
    ctx = ProbeCtx()
    q, k, v = (torch.zeros(shape) for _ in range(3))
    result = forward(ctx, q, k, v, None, 0.0, False, None, False, False, forward_op, backward_op, config)
    return result, backward(ctx, torch.zeros(shape))
