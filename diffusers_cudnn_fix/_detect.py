"""Behavioural check of diffusers' attention ops, without a GPU.

diffusers' forward/backward op pairs are run on tiny CPU tensors, and the calls they make to the four ATen
attention ops are recorded and answered with empty tensors shaped as the op contract says (the contract the
ops' meta kernels implement; ``tests/test_detect.py`` holds the two side by side). No attention is
computed, no kernel of ours or PyTorch's attention runs, and CUDA is never touched. From the record the
fixes decide whether the installed code is broken: do q, k and v reach the backward kernel in the layout
they reached the forward kernel, is the log-sum-exp computed when a backward will need it, does
``grad_out`` carry ``out``'s strides.

How the calls are caught. Fast path: the ops are run as copies whose ``torch`` global is a view of torch in
which ``torch.ops.aten``'s four watched ops record and answer; every other tensor op runs natively. Copies
are made only of functions that reach ``torch.ops`` (and, through closures, of the functions a wrapper
calls); the installed objects are never touched. Thorough path: a ``TorchDispatchMode`` that sees every
ATen call, however it is made. The fast path costs about a third of the mode per run (the hook has a
10 ms budget); the thorough one is taken whenever the fast one cannot vouch for its record: the run
raised anything but this package's own refusal, or it ran through without reaching a watched op (code
that calls the ops in a way the view does not cover, e.g. through a helper in another namespace).
``tests/test_detect.py`` checks that both give the same record on every release.

Shapes are chosen so that every dimension differs (B=2, S_q=5, S_kv=7, H=3, D=8): any transposition shows
up as a shape change.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._fix import Finding, Record
from ._warnings import UnsafeAttentionError

# Model layout (B, S, H, D) shapes used by the check. All distinct so that a swapped pair of dims is visible.
BATCH, SEQ_Q, SEQ_KV, HEADS, HEAD_DIM = 2, 5, 7, 3, 8

CUDNN_FORWARD = "cudnn_forward"
CUDNN_BACKWARD = "cudnn_backward"
FLASH_FORWARD = "flash_forward"
FLASH_BACKWARD = "flash_backward"

_WATCHED = {
    "_scaled_dot_product_cudnn_attention": CUDNN_FORWARD,
    "_scaled_dot_product_cudnn_attention_backward": CUDNN_BACKWARD,
    "_scaled_dot_product_flash_attention": FLASH_FORWARD,
    "_scaled_dot_product_flash_attention_backward": FLASH_BACKWARD,
}

# Parameters of diffusers' templated forward ops (0.36.0 to 0.42.1 spell them the same way).
FORWARD_PARAMS = (
    "ctx",
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
    "return_lse",
    "_save_ctx",
    "_parallel_config",
)


class TensorInfo(Record):
    """What the check keeps of a tensor argument."""

    __slots__ = ("shape", "stride", "dtype")
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, value: Any) -> TensorInfo | None:
        if not isinstance(value, torch.Tensor):
            return None
        return cls(tuple(value.shape), tuple(value.stride()), value.dtype)


class OpCall(Record):
    """One call of a watched ATen op: its name and its arguments by schema name."""

    __slots__ = ("op", "args")
    op: str
    args: dict[str, Any]

    def tensor(self, name: str) -> TensorInfo | None:
        return TensorInfo.of(self.args.get(name))


class Trace:
    """What happened when an op pair ran: the watched ATen calls, the results, and any exception."""

    __slots__ = ("calls", "forward_result", "grads", "error", "raised")

    def __init__(self) -> None:
        self.calls: list[OpCall] = []
        self.forward_result: Any = None
        self.grads: tuple[Any, ...] | None = None
        self.error: str | None = None
        self.raised: type[BaseException] | None = None

    def first(self, op: str) -> OpCall | None:
        return next((c for c in self.calls if c.op == op), None)

    def record(self, aten_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """Note a call of a watched op and return the contract's answer.

        Arguments are bound by schema name, defaults filled in: the dispatcher drops arguments equal to
        their defaults before a dispatch mode sees them, so both ways of catching a call record the same.
        """
        op = _WATCHED[aten_name]
        params, defaults = _schema_params(aten_name)
        bound = dict(defaults)
        bound.update(zip(params, args))
        for name in params[len(args) :]:
            if name in kwargs:
                bound[name] = kwargs[name]
        # Keep the tensors themselves: TensorInfo is taken by the readers, and they are tiny.
        self.calls.append(OpCall(op, bound))
        return _answer(op, bound)


_params: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {}


def _schema_params(aten_name: str) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The watched op's parameter names in schema order, and its defaults (read once from torch)."""
    found = _params.get(aten_name)
    if found is None:
        arguments = getattr(torch.ops.aten, aten_name).default._schema.arguments
        names = tuple(arg.name for arg in arguments)
        defaults = {arg.name: arg.default_value for arg in arguments if arg.has_default_value()}
        found = _params[aten_name] = (names, defaults)
    return found


# Fast path: a view of torch for the check's copies of the ops.


class _RecordedOp:
    """Stands in for one watched ``torch.ops.aten`` op (and its ``.default`` overload) in the copies."""

    __slots__ = ("_trace", "_aten_name", "default")

    def __init__(self, trace: Trace, aten_name: str) -> None:
        self._trace = trace
        self._aten_name = aten_name
        self.default = self

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        return self._trace.record(self._aten_name, args, kwargs)


class _View:
    """``target`` with some attributes replaced: what the copies see as ``torch``, ``torch.ops``, ``torch.ops.aten``."""

    def __init__(self, target: Any, replaced: dict[str, Any]) -> None:
        self.__dict__.update(replaced)
        self._target = target

    def __getattr__(self, name: str) -> Any:  # only called for what is not replaced
        return getattr(self._target, name)


def _torch_view(trace: Trace) -> _View:
    """torch, except that ``torch.ops.aten``'s watched ops record into ``trace``."""
    aten = _View(torch.ops.aten, {name: _RecordedOp(trace, name) for name in _WATCHED})
    return _View(torch, {"ops": _View(torch.ops, {"aten": aten})})


def _reaches_ops(code: types.CodeType) -> bool:
    """Whether ``code`` (or code nested in it) reads an attribute or global named ``ops``."""
    if "ops" in code.co_names:
        return True
    return any(isinstance(c, types.CodeType) and _reaches_ops(c) for c in code.co_consts)


def _intercepting(fn: Any, view: _View, namespaces: dict[int, dict[str, Any]], depth: int = 0) -> Any:
    """``fn`` as a copy that sees ``view`` for torch, if it reaches ``torch.ops``; wrappers are followed
    through their closures (a guard around the forward op holds the op it calls in a cell). ``fn`` itself
    is untouched; anything but a plain function is returned as is.
    """
    if not isinstance(fn, types.FunctionType) or depth > 8:
        return fn
    closure = fn.__closure__
    if closure:
        cells = []
        for cell in closure:
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                cells.append(cell)
                continue
            inner = _intercepting(contents, view, namespaces, depth + 1)
            cells.append(cell if inner is contents else types.CellType(inner))
        if all(new is old for new, old in zip(cells, closure)):
            new_closure = closure
        else:
            new_closure = tuple(cells)
    else:
        new_closure = closure
    globals_ = fn.__globals__
    # torch under its own name only (diffusers' modules and ours): code reaching it under another name
    # records nothing here, and the thorough path takes over.
    if globals_.get("torch") is torch and _reaches_ops(fn.__code__):
        namespace = namespaces.get(id(globals_))
        if namespace is None:
            namespace = namespaces[id(globals_)] = dict(globals_)
            namespace["torch"] = view
        globals_ = namespace
    if globals_ is fn.__globals__ and new_closure is closure:
        return fn
    return _function_copy(fn, globals_, new_closure)


def _function_copy(fn: types.FunctionType, globals_: dict[str, Any], closure: Any) -> types.FunctionType:
    """``fn`` with other globals and closure cells; defaults and attributes kept."""
    copy = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    return copy


# Thorough path: a dispatch mode, made on first use (creating the class costs the hook time it rarely needs).
_recorder_class: type | None = None


def _recorder(trace: Trace) -> Any:
    global _recorder_class
    if _recorder_class is None:
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Recorder(TorchDispatchMode):
            def __init__(self, trace: Trace) -> None:
                super().__init__()
                self._trace = trace

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
                aten_name = func.__name__.partition(".")[0]
                if aten_name in _WATCHED:
                    return self._trace.record(aten_name, args, kwargs or {})
                return func(*args, **(kwargs or {}))

        _recorder_class = _Recorder
    return _recorder_class(trace)


class ProbeCtx:
    """Stands in for the ``torch.autograd.Function`` context diffusers' templated attention passes.

    ``needs_input_grad`` says a backward will follow, as in a training step.
    """

    needs_input_grad = (True,) * 12

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors


def training_parallel_config() -> Any:
    """The attributes diffusers' ops read from a context-parallel config in a 2-way CP training run."""
    return types.SimpleNamespace(
        context_parallel_config=types.SimpleNamespace(
            _world_size=2, ring_degree=1, ulysses_degree=2, convert_to_fp32=False
        )
    )


def _positional_params(fn: Any) -> tuple[tuple[str, ...], bool] | None:
    """(positional parameter names, takes *args) of ``fn``, or None if it cannot be read.

    Reads the code object (inspect.signature costs ~0.1 ms a call, the hook has 10 ms); falls back to
    inspect for callables without one.
    """
    code = getattr(fn, "__code__", None)
    if code is not None:
        names = code.co_varnames[: code.co_argcount]
        return tuple(names), bool(code.co_flags & inspect.CO_VARARGS)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = sig.parameters.values()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = tuple(p.name for p in params if p.kind in positional)
    return names, any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)


def signature_matches(fn: Any, params: tuple[str, ...]) -> bool:
    """Whether ``fn`` takes exactly these positional parameters (extra keyword-only ones allowed)."""
    found = _positional_params(fn)
    return found is not None and found[0] == params


def backward_signature_ok(fn: Any) -> bool:
    """diffusers' backward ops take ``(ctx, grad_out, *args, ...)``."""
    found = _positional_params(fn)
    return found is not None and found[0] == ("ctx", "grad_out") and found[1]


# Traces of one apply() pass, keyed by the functions run: the fixes' checks and their verifications share
# runs (a check is a pure function of the code it runs). None outside a pass: nothing is kept for later.
_memo: dict[tuple[Any, ...], Trace] | None = None


@contextlib.contextmanager
def shared_runs() -> Iterator[None]:
    """Within this block, identical runs are made once (the caller holds the registry lock)."""
    global _memo
    _memo = {}
    try:
        yield
    finally:
        _memo = None


def run_pair(
    forward: Callable[..., Any],
    backward: Callable[..., Any] | None,
    *,
    return_lse: bool,
    mask: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Trace:
    """Run ``forward`` (and ``backward`` on its output) on tiny CPU tensors and record the ATen calls.

    ``mask``: None, or ``"bool"`` / ``"float32"`` for :func:`check_mask`'s mask. ``dtype``: of q, k, v.
    Never raises: an exception becomes ``trace.error`` (the calls recorded before it are kept).
    """
    key = (forward, backward, return_lse, mask, dtype)
    if _memo is not None and key in _memo:
        return _memo[key]
    trace = _run_pair(forward, backward, return_lse=return_lse, mask=mask, dtype=dtype)
    if _memo is not None:
        _memo[key] = trace
    return trace


_masks: dict[str, torch.Tensor] = {}


def check_mask(kind: str) -> torch.Tensor:
    """A (B, 1, S_q, S_kv) mask with masked columns and one fully masked row (the last); a fresh copy.

    ``"bool"``: True = attend. ``"float32"``: the same as an additive fp32 mask (0 / -inf).
    """
    mask = _masks.get(kind)
    if mask is None:
        keep = torch.ones(BATCH, 1, SEQ_Q, SEQ_KV, dtype=torch.bool)
        keep[..., 1::2] = False
        keep[..., -1, :] = False
        _masks["bool"] = keep
        _masks["float32"] = torch.zeros(keep.shape, dtype=torch.float32).masked_fill_(~keep, float("-inf"))
        mask = _masks[kind]
    return mask.clone()  # the code under check may write to what it is given


def _run_pair(
    forward: Callable[..., Any],
    backward: Callable[..., Any] | None,
    *,
    return_lse: bool,
    mask: str | None,
    dtype: torch.dtype,
    thorough: bool | None = None,
) -> Trace:
    """One run. ``thorough``: None = fast path, thorough path where the fast one cannot vouch for its
    record (see the module docstring); True / False = that path only (the tests compare the two)."""
    if not thorough:
        trace = Trace()
        view = _torch_view(trace)
        namespaces: dict[int, dict[str, Any]] = {}
        fast_forward = _intercepting(forward, view, namespaces)
        fast_backward = _intercepting(backward, view, namespaces) if backward is not None else None
        _drive(trace, fast_forward, fast_backward, return_lse, mask, dtype, None)
        if thorough is False or (not _unvouched(trace)):
            return trace
    trace = Trace()
    _drive(trace, forward, backward, return_lse, mask, dtype, _recorder(trace))
    return trace


def _unvouched(trace: Trace) -> bool:
    """Whether a fast-path record may have missed a call: it raised (other than this package's refusal,
    which is what a guard is for), or never reached a watched op."""
    if trace.raised is not None:
        return not issubclass(trace.raised, UnsafeAttentionError)
    return not trace.calls


def _drive(
    trace: Trace,
    forward: Callable[..., Any],
    backward: Callable[..., Any] | None,
    return_lse: bool,
    mask: str | None,
    dtype: torch.dtype,
    mode: Any,
) -> None:
    """Call ``forward`` as diffusers' templated attention does in training, then ``backward`` on its output."""
    try:
        q, k, v = _model_qkv(dtype)
        attn_mask = check_mask(mask) if mask is not None else None
        ctx = ProbeCtx()
        # no_grad: diffusers calls these ops inside autograd.Function.forward, where grad mode is off.
        with torch.no_grad(), (mode if mode is not None else contextlib.nullcontext()):
            result = forward(
                ctx,
                q,
                k,
                v,
                attn_mask,
                0.0,
                False,
                None,
                False,
                return_lse,
                _save_ctx=True,
                _parallel_config=training_parallel_config(),
            )
            trace.forward_result = result
            if backward is not None:
                out = result[0] if isinstance(result, tuple) else result
                grad_out = torch.empty(out.shape, dtype=out.dtype)
                trace.grads = tuple(backward(ctx, grad_out))
    except Exception as exc:  # noqa: BLE001 - any failure is a finding, never a crash
        trace.error = f"{type(exc).__name__}: {exc}"
        trace.raised = type(exc)


def _model_qkv(dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Model-layout (B, S, H, D) inputs as they reach the op inside CP attention (fresh, no grad)."""
    q = torch.empty(BATCH, SEQ_Q, HEADS, HEAD_DIM, dtype=dtype)
    k = torch.empty(BATCH, SEQ_KV, HEADS, HEAD_DIM, dtype=dtype)
    v = torch.empty(BATCH, SEQ_KV, HEADS, HEAD_DIM, dtype=dtype)
    return q, k, v


def _answer(name: str, args: dict[str, Any]) -> tuple[Any, ...]:
    """What the ATen op returns, minus the numbers: the outputs' shapes, strides and dtypes.

    Mirrors the ops' meta kernels (``tests/test_detect.py`` compares the two): the output and the gradients
    are laid out like their inputs; the cuDNN forward returns no log-sum-exp when not asked for one (the
    real kernel does so; the meta kernel returns one regardless).
    """
    if name in (CUDNN_BACKWARD, FLASH_BACKWARD):
        return tuple(torch.empty_like(args[n]) for n in ("query", "key", "value"))
    q, k = args["query"], args["key"]
    batch, heads, seq_q = q.shape[:3]
    if name == CUDNN_FORWARD:
        lse = None
        if args.get("compute_log_sumexp"):
            lse_shape = (batch, heads, seq_q, 1) if cudnn_lse_ndim() == 4 else (batch, heads, seq_q)
            lse = torch.empty(lse_shape, dtype=torch.float32)
        seed = torch.empty((), dtype=torch.int64)
        return (torch.empty_like(q), lse, None, None, seq_q, k.shape[2], seed, torch.empty_like(seed), None)
    # FLASH_FORWARD: the log-sum-exp is always there, (B, H, S_q).
    lse = torch.empty(batch, heads, seq_q, dtype=torch.float32)
    rng_state = torch.empty(2, dtype=torch.uint64)
    unused = torch.empty((), dtype=torch.uint64)
    debug = torch.empty(0, dtype=q.dtype)
    return (torch.empty_like(q), lse, None, None, seq_q, k.shape[2], rng_state, unused, debug)


def kernel_shapes() -> dict[str, tuple[int, ...]]:
    """The (B, H, S, D) shapes the ATen kernels must see for the check's inputs."""
    return {
        "query": (BATCH, HEADS, SEQ_Q, HEAD_DIM),
        "key": (BATCH, HEADS, SEQ_KV, HEAD_DIM),
        "value": (BATCH, HEADS, SEQ_KV, HEAD_DIM),
    }


def model_shapes() -> dict[str, tuple[int, ...]]:
    """The (B, S, H, D) shapes of the check's inputs, which the backward's gradients must have."""
    return {
        "query": (BATCH, SEQ_Q, HEADS, HEAD_DIM),
        "key": (BATCH, SEQ_KV, HEADS, HEAD_DIM),
        "value": (BATCH, SEQ_KV, HEADS, HEAD_DIM),
    }


def _qkv_shapes(call: OpCall) -> dict[str, tuple[int, ...] | None]:
    infos = {name: call.tensor(name) for name in ("query", "key", "value")}
    return {name: (info.shape if info else None) for name, info in infos.items()}


def check_backward_layout(
    forward: Callable[..., Any] | None,
    backward: Callable[..., Any] | None,
    *,
    forward_op: str,
    backward_op: str,
) -> Finding:
    """Do q, k, v reach the backward kernel in the layout they reached the forward kernel?

    Runs with ``return_lse=True`` so that a missing log-sum-exp (a separate bug) cannot mask this one.
    Also checks that ``grad_out`` reaches the kernel with ``out``'s shape and strides and that the
    gradients come back in model layout.
    """
    if forward is None or backward is None:
        return Finding("absent", "the op pair does not exist in this diffusers")
    if not signature_matches(forward, FORWARD_PARAMS) or not backward_signature_ok(backward):
        return Finding("unknown", "the forward/backward op signatures differ from every known release")
    trace = run_pair(forward, backward, return_lse=True)
    fwd, bwd = trace.first(forward_op), trace.first(backward_op)
    if fwd is None or bwd is None:
        return Finding("unknown", f"the ops never reached the ATen kernels ({trace.error or 'no call recorded'})")
    if _qkv_shapes(fwd) != kernel_shapes():
        return Finding("unknown", f"the forward hands the kernel q/k/v as {_qkv_shapes(fwd)}, not (B, H, S, D)")
    if _qkv_shapes(bwd) != _qkv_shapes(fwd):
        return Finding(
            "broken",
            f"the backward kernel gets q/k/v of shapes {_qkv_shapes(bwd)} but the forward kernel got "
            f"{_qkv_shapes(fwd)}: saved tensors are re-transposed",
        )
    grad_out, out = bwd.tensor("grad_out"), bwd.tensor("out")
    if grad_out is None or out is None or (grad_out.shape, grad_out.stride) != (out.shape, out.stride):
        return Finding(
            "broken",
            f"grad_out reaches the backward kernel as {grad_out}, out as {out}: strides must match",
        )
    if trace.error is not None:
        return Finding("unknown", f"the backward raised {trace.error}")
    grad_shapes = tuple(tuple(g.shape) if isinstance(g, torch.Tensor) else None for g in (trace.grads or ())[:3])
    if grad_shapes != tuple(model_shapes().values()):
        return Finding("unknown", f"the backward returns gradients of shapes {grad_shapes}")
    return Finding("ok", "q/k/v reach the backward kernel in the forward's (B, H, S, D) layout")


def check_forward_lse(
    forward: Callable[..., Any] | None,
    backward: Callable[..., Any] | None,
    *,
    forward_op: str,
    backward_op: str,
) -> Finding:
    """Is the log-sum-exp computed when a backward will follow, while the caller gets what it asked for?"""
    if forward is None:
        return Finding("absent", "the op does not exist in this diffusers")
    if not signature_matches(forward, FORWARD_PARAMS):
        return Finding("unknown", "the forward op's signature differs from every known release")
    # Forward only: the flag reaching the kernel is the finding.
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
    want = (BATCH, SEQ_Q, HEADS, HEAD_DIM)
    if not isinstance(result, torch.Tensor) or tuple(result.shape) != want:
        return Finding("broken", f"asked for the output only, the forward returned {type(result).__name__}")
    # With the backward too: the same run serves the backward-layout check of the pair.
    with_lse = run_pair(forward, backward, return_lse=True).forward_result
    if not (isinstance(with_lse, tuple) and len(with_lse) == 2):
        return Finding("unknown", "asked for (out, lse), the forward returned something else")
    return Finding("ok", "the log-sum-exp is computed whenever the autograd context is saved for a backward")


_lse_ndim: int | None = None


def cudnn_lse_ndim() -> int:
    """Dims of the log-sum-exp the running torch's cuDNN kernels produce and take.

    4, (B, H, S, 1), from torch 2.9 on; 3, (B, H, S), before (h200-facts.md). Read off the torch release:
    asking the op's meta kernel costs 1-2 ms on first use (and, before anything else loaded torch's meta
    registrations, hundreds), too much for the hook. ``tests/test_detect.py`` checks the rule against the
    meta kernel of the torch in use, and the GPU probe runs the real kernels with this value.
    """
    global _lse_ndim
    if _lse_ndim is None:
        release = torch.__version__.split("+")[0].split(".")[:2]
        try:
            major, minor = int(release[0]), int("".join(c for c in release[1] if c.isdigit()) or 0)
        except (IndexError, ValueError):  # an unreadable version: assume a current torch
            major, minor = 2, 9
        _lse_ndim = 4 if (major, minor) >= (2, 9) else 3
    return _lse_ndim


def with_globals(fn: Callable[..., Any], **overrides: Any) -> Callable[..., Any]:
    """A copy of ``fn`` that sees ``overrides`` in place of some module globals; ``fn`` itself is untouched.

    Lets the checks of the templated context-parallel classes run their backward in one process with
    stand-in collectives, without touching ``torch.distributed`` or diffusers' module.
    """
    namespace = dict(fn.__globals__)
    namespace.update(overrides)
    return _function_copy(fn, namespace, fn.__closure__)


#: Stands in for a DeviceMesh in the class checks: the stand-in collectives ignore the group.
FAKE_MESH = types.SimpleNamespace(get_group=lambda: None)


def input_count(forward: Callable[..., Any]) -> int | None:
    """How many inputs an ``autograd.Function.forward`` takes (its parameters after ``ctx``)."""
    found = _positional_params(forward)
    return None if found is None or found[1] else len(found[0]) - 1
