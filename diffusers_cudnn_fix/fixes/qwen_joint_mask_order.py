"""QwenImage's joint attention mask meets Ulysses' K/V in another token order: padded prompts train wrong.

Bug: QwenImage builds its joint mask in global order [all text, all image] while its CP plan shards text and
image apart, so Ulysses' K/V arrive as [text_0, image_0, text_1, ...]: padded prompts train silently wrong on
every backend. Releases 0.36.0-0.38.0 (0.39.0 shards the mask and gathers it; docs/cp-training-tests.md).
Detection: does diffusers' own Ulysses forward gather a sequence-local mask? If not, is QwenImage's refused?
The package: :func:`refuse_unordered_qwen_mask` raises :class:`UnsafeAttentionError` for a masking joint
mask from QwenImage with an unsharding plan at Ulysses degree > 1 (docs/fixes.md).
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from .. import _detect
from .._fix import Finding, Lookup, shipped_of
from .._warnings import UnsafeAttentionError

TARGET = "TemplatedUlyssesAttention.forward"
QWEN_MODULE = "diffusers.models.transformers.transformer_qwenimage"
QWEN_MODEL = "QwenImageTransformer2DModel"
MASK_INPUT = "encoder_hidden_states_mask"
#: Frames between the forward and the attention processor that called it are diffusers' dispatch, torch's
#: autograd and this package; a deeper caller is not the processor.
_MAX_FRAMES = 16
_PASS_THROUGH = ("diffusers.models.attention_dispatch", "torch", "diffusers_cudnn_fix", "functools")

MESSAGE = (
    "diffusers_cudnn_fix: QwenImage's joint attention mask reached diffusers' Ulysses attention (Ulysses degree "
    "{degree}) in the global token order [text, image], while this diffusers' QwenImage context-parallel plan "
    "shards text and image separately, so the K/V arrive in rank order [text_0, image_0, text_1, ...]: with "
    "padded prompts the mask would hide image tokens and let padding through, and the gradients would be "
    "silently wrong (on every attention backend). diffusers 0.39.0 fixed this upstream: upgrade diffusers, or "
    "train with prompts of one length (no padding, encoder_hidden_states_mask=None), or without context "
    "parallelism."
)

COMPILE_MESSAGE = (
    "diffusers_cudnn_fix: a mask reached diffusers' Ulysses attention (Ulysses degree {degree}) inside a "
    "torch.compile graph, with QwenImage loaded in a diffusers whose QwenImage plan hands its joint mask to Ulysses "
    "in the wrong token order (padded prompts would train silently wrong). While compiling, the package cannot "
    "tell which model calls or whether the mask pads anything, so it asks for this call to run eagerly, where it "
    "can: compile without fullgraph=True (only this call then runs eagerly), upgrade diffusers to >= 0.39.0, or "
    "pass encoder_hidden_states_mask=None."
)

# The last mask read: (the mask, weakly; its version counter; whether it masks anything).
_last: tuple[weakref.ref[torch.Tensor], int, bool] | None = None


def _masks_something(mask: torch.Tensor) -> bool:
    global _last
    last = _last
    if last is not None and last[0]() is mask and last[1] == mask._version:
        return last[2]
    if mask.dtype == torch.bool:
        masks = not bool(mask.all())
    else:
        masks = bool(mask.ne(0).any())
    if not mask.is_inference():  # an inference tensor has no version counter
        _last = (weakref.ref(mask), mask._version, masks)
    return masks


@torch.compiler.assume_constant_result
def _unsharded_qwen_loaded() -> bool:
    """Whether QwenImage is imported and its context-parallel plan leaves the joint mask unsharded (read while
    tracing, as a constant)."""
    model = getattr(sys.modules.get(QWEN_MODULE), QWEN_MODEL, None)
    return model is not None and not _plan_shards_the_mask(getattr(model, "_cp_plan", None))


def _plan_shards_the_mask(plan: Any) -> bool:
    """Whether a ``_cp_plan`` names ``encoder_hidden_states_mask`` among the inputs it splits."""
    if not isinstance(plan, Mapping):
        return False
    return any(isinstance(entry, Mapping) and MASK_INPUT in entry for entry in plan.values())


def _qwen_caller(frame: types.FrameType | None) -> dict[str, Any] | None:
    """The globals of QwenImage's module if it made this call (through dispatch, autograd and this package)."""
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        name = frame.f_globals.get("__name__", "")
        if name == QWEN_MODULE:
            return frame.f_globals
        if not name.startswith(_PASS_THROUGH):
            return None
        frame = frame.f_back
    return None


def refuse_unordered_qwen_mask(attn_mask: torch.Tensor, config: Any) -> None:
    """Raises where QwenImage's joint mask (read off the calling frames: through the package, dispatch and
    autograd) would meet the K/V in another token order at Ulysses degree > 1; returns for every other call."""
    degree = getattr(getattr(config, "context_parallel_config", None), "ulysses_degree", 1)
    if not isinstance(degree, int) or degree <= 1:
        return
    if torch.compiler.is_compiling():
        # Neither the calling frame nor the mask's values can be read while tracing. Raising here makes dynamo
        # run this call eagerly, where they can (with fullgraph=True it is an error that carries this message).
        if _unsharded_qwen_loaded():
            raise UnsafeAttentionError(COMPILE_MESSAGE.format(degree=degree))
        return
    qwen = _qwen_caller(sys._getframe(1))
    model = qwen.get(QWEN_MODEL) if qwen is not None else None
    if (
        model is not None
        and not _plan_shards_the_mask(getattr(model, "_cp_plan", None))
        and _masks_something(attn_mask)
    ):
        raise UnsafeAttentionError(MESSAGE.format(degree=degree))


class _ReachedOp(Exception):
    def __init__(self, mask: Any) -> None:
        super().__init__("the attention op was reached")
        self.mask = mask


class _ReachedCollectives(Exception):
    """The forward asked for its process group: it went on to diffusers' code without refusing."""


def _raise_reached_collectives() -> Any:
    raise _ReachedCollectives


def _call(forward: Any, args: tuple[Any, ...]) -> Any:
    """Calls ``forward``; the check runs a copy whose module globals look like QwenImage's (the refusal reads
    the calling frame's module)."""
    return forward(*args)


_BATCH, _SEQ, _HEADS, _DIM, _WORLD = 1, 4, 2, 8, 2


def _padded_local_mask() -> torch.Tensor:
    """A padded, sequence-local mask, as a plan that shards the mask hands it over. A Ulysses that gathers such
    a mask puts it in the K/V's order (0.39+); one that hands it on as it came relies on the model's order
    being the global one."""
    mask = torch.ones(_BATCH, 1, 1, _SEQ, dtype=torch.bool)
    mask[..., 1] = False  # a padded text token
    return mask


def _qwen_call(forward: Any, mesh: Any, mask: torch.Tensor) -> None:
    """Calls ``forward`` at Ulysses degree 2 with ``mask`` from a QwenImage stand-in whose plan does not shard
    the mask; raises what the forward raises. The attention op raises :class:`_ReachedOp` with the mask it
    got."""

    def forward_op(ctx: Any, query: Any, key: Any, value: Any, attn_mask: Any, *args: Any, **kwargs: Any) -> Any:
        raise _ReachedOp(attn_mask)

    config = types.SimpleNamespace(_ulysses_mesh=mesh, ulysses_degree=_WORLD, _world_size=_WORLD)
    q, k, v = (torch.zeros(_BATCH, _SEQ, _HEADS, _DIM) for _ in range(3))
    model = type(QWEN_MODEL, (), {"_cp_plan": {"transformer_blocks.0": {"hidden_states": None}}})
    call_from_qwen = _detect.with_globals(_call, __name__=QWEN_MODULE, **{QWEN_MODEL: model})
    parallel_config = types.SimpleNamespace(context_parallel_config=config)
    args = (types.SimpleNamespace(), q, k, v, mask, 0.0, False, None, False, False, forward_op, None, parallel_config)
    with torch.no_grad():  # as inside autograd.Function.forward
        call_from_qwen(forward, args)


def _shipped_gathers(shipped: Any) -> bool | str:
    """Whether diffusers' own forward (the innermost, run with stand-in collectives) gathers a sequence-local
    mask before the op; a text if it cannot be run."""

    def all_gather(out: list[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> None:
        for part in out:
            part.copy_(tensor)

    if not isinstance(shipped, types.FunctionType):
        return f"the innermost forward is a {type(shipped).__name__}, not a function"
    stand_ins = {"_all_to_all_single": lambda x, group=None: x, "dist": types.SimpleNamespace(all_gather=all_gather)}
    mask = _padded_local_mask()
    try:
        _qwen_call(_detect.with_globals(shipped, **stand_ins), _detect.FAKE_MESH, mask)
    except _ReachedOp as reached:
        return reached.mask is not mask
    except Exception as exc:  # noqa: BLE001 - an unknown build: say so
        return f"{type(exc).__name__}: {exc}"
    return "the forward returned without calling the attention op"


def check(lookup: Lookup) -> Finding:
    forward = lookup(TARGET)
    if forward is None:
        return Finding("absent", "this diffusers has no TemplatedUlyssesAttention")
    gathers = _shipped_gathers(shipped_of(lookup, TARGET))
    if isinstance(gathers, str):
        return Finding("unknown", f"the Ulysses forward could not be run in one process ({gathers})")
    if gathers:
        return Finding("ok", "Ulysses gathers a sequence-local mask into the K/V's order before the op")
    # diffusers' forward hands the op the mask as it came. Is it refused before that, from QwenImage? The
    # stand-in mesh stops the call where diffusers' code asks for its process group.
    try:
        _qwen_call(forward, types.SimpleNamespace(get_group=_raise_reached_collectives), _padded_local_mask())
    except UnsafeAttentionError:
        return Finding("ok", "QwenImage's joint mask, which Ulysses would hand on in another token order, is refused")
    except (_ReachedCollectives, _ReachedOp):
        pass
    except Exception as exc:  # noqa: BLE001 - an unknown build: say so
        return Finding("unknown", f"the Ulysses forward could not be run in one process ({type(exc).__name__}: {exc})")
    return Finding(
        "broken",
        "Ulysses hands the attention op the mask as it came, in global token order, while QwenImage's joint K/V "
        "arrive in rank order",
    )
