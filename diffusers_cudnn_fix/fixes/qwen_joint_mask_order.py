"""QwenImage's joint attention mask meets Ulysses' K/V in another token order: padded prompts train wrong.

Bug: QwenImage's joint mask is in global order [all text, all image], Ulysses' K/V in rank order [text_0,
image_0, text_1, ...]: padded prompts train silently wrong. Releases 0.36.0-0.38.0 (0.39.0 gathers a sharded
mask). Detection: does diffusers' Ulysses forward gather a local mask; if not, which mask reaches it from a
stand-in QwenImage processor? The package: QwenImage's processor hands its text length on (:data:`TEXT_LEN`);
:func:`in_kv_order` reorders the mask into the K/V's order, refusing one it cannot map that masks something;
through ulysses_anything (unequal shards) every such mask (docs/fixes.md).
"""

from __future__ import annotations

import contextvars
import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import _detect, _ledger
from .._fix import Finding, Lookup
from .._key_padding import remembered
from .._target_names import QWEN_PROCESSOR, ULYSSES_ANYTHING_FORWARD, ULYSSES_FORWARD
from .._warnings import UnsafeAttentionError, explain

#: The record's id (the module is named after it: the registry finds the check so), for the policy's mark.
FIX_ID = __name__.rpartition(".")[2]

QWEN_MODULE = QWEN_PROCESSOR.partition(":")[0]
QWEN_MODEL = "QwenImageTransformer2DModel"
MASK_INPUT = "encoder_hidden_states_mask"
#: The rank-local text length of the QwenImage attention processor running now (the package's wrapper of it,
#: :func:`processor`, sets it around diffusers' own); None outside one: a mask that is not QwenImage's joint mask.
TEXT_LEN: contextvars.ContextVar[int | None] = contextvars.ContextVar("qwen_text_len", default=None)

_SECTION = "fixes.md#qwen_joint_mask_order"
MESSAGE = (
    "QwenImage's joint attention mask reached diffusers' Ulysses attention (Ulysses degree {degree}) as {layout}, "
    "which the package cannot put into the K/V's rank order [text_0, image_0, text_1, ...] (the mask is in the "
    "global order [text, image])."
)
WAY_OUT = (
    "{anything}Upgrade diffusers to >= 0.39.0 (fixed upstream), or train with prompts of one length "
    "(encoder_hidden_states_mask=None), or without context parallelism."
)
ANYTHING_WAY_OUT = "Or set ulysses_anything=False, where the package reorders the mask. "


def compile_message(degree: int) -> str:
    """Why a traced call with QwenImage's joint mask at Ulysses ``degree`` is handed back to eager execution."""
    return explain(
        f"QwenImage's attention ran under Ulysses (degree {degree}) inside a torch.compile graph, in a diffusers "
        "that hands its joint mask to Ulysses in another token order than the K/V.",
        "Traced, the package cannot reorder the mask (padded prompts would train silently wrong), so it asks for "
        "this call to run eagerly, where it does.",
        "Compile without fullgraph=True, upgrade diffusers to >= 0.39.0, or pass encoder_hidden_states_mask=None.",
        _SECTION,
    )


def rank_ordered_mask(mask: torch.Tensor, text_len: int, image_len: int, degree: int) -> torch.Tensor:
    """QwenImage's joint mask in the token order Ulysses hands the attention op.

    ``mask`` is 4-D, [B or 1, 1, 1 or S, S] with S = ``text_len + image_len``, in the global order
    [text, image] (the order of one process). Under Ulysses of degree ``degree`` each rank holds
    [its text shard, its image shard] (each stream split in ``degree`` equal parts, rank ``r`` holding the
    ``r``-th), and the all-to-all lays q/k/v out in rank order [text_0, image_0, text_1, image_1, ...]. The
    result is ``mask`` with its key dimension (and its query dimension, where that is S) in that order. Only
    views and one ``cat`` per dimension: no host sync, and it traces under ``torch.compile``.

    Raises ``ValueError`` where the shape or the lengths do not fit.
    """
    length = text_len + image_len
    if degree < 1 or text_len < 0 or image_len < 0 or text_len % degree or image_len % degree:
        raise ValueError(
            f"text length {text_len} and image length {image_len} must both split into {degree} equal parts"
        )
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != length or mask.shape[-2] not in (1, length):
        raise ValueError(f"expected a [B, 1, 1 or {length}, {length}] mask, got {tuple(mask.shape)}")
    out = _rank_order(mask, 3, text_len, image_len, degree)
    if mask.shape[-2] == length and length > 1:
        out = _rank_order(out, 2, text_len, image_len, degree)
    return out


def _rank_order(x: torch.Tensor, dim: int, text_len: int, image_len: int, degree: int) -> torch.Tensor:
    text = x.narrow(dim, 0, text_len).unflatten(dim, (degree, text_len // degree))
    image = x.narrow(dim, text_len, image_len).unflatten(dim, (degree, image_len // degree))
    return torch.cat([text, image], dim=dim + 1).flatten(dim, dim + 1)


def _masks(mask: torch.Tensor, _: None) -> bool:
    """Whether ``mask`` masks anything (one host sync)."""
    return not bool(mask.all()) if mask.dtype == torch.bool else bool(mask.ne(0).any())


def _reorder(mask: torch.Tensor, lengths: tuple[int, int, int]) -> torch.Tensor:
    """:func:`rank_ordered_mask` of ``mask`` (2-D (B, S) read as [B, 1, 1, S]) for (text, image length, degree)."""
    return rank_ordered_mask(mask[:, None, None, :] if mask.dim() == 2 else mask, *lengths)


@torch.compiler.assume_constant_result
def _unsharded_qwen_loaded() -> bool:
    """Whether QwenImage is imported and its context-parallel plan leaves the joint mask unsharded, naming
    ``encoder_hidden_states_mask`` among no inputs it splits (read while tracing, as a constant)."""
    model = getattr(sys.modules.get(QWEN_MODULE), QWEN_MODEL, None)
    plan = getattr(model, "_cp_plan", None)
    shards = isinstance(plan, Mapping) and any(isinstance(e, Mapping) and MASK_INPUT in e for e in plan.values())
    return model is not None and not shards


def _layout_problem(
    mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor, degree: int, text_local: int, anything: bool
) -> str | None:
    """Why ``mask`` cannot be put into the K/V's order (a phrase for :data:`MESSAGE`), or None."""
    local, joint = key.shape[1], key.shape[1] * degree
    shape = tuple(mask.shape)
    if anything:
        return f"a mask {shape} of ulysses_anything attention, whose shards may differ in length"
    if mask.shape[-1] == local and local != joint:
        return f"a sequence-local mask {shape}, which this diffusers' Ulysses attention does not gather"
    if mask.shape[-1] != joint:
        return f"a mask {shape} whose last dimension is not the joint sequence length {joint}"
    if query.shape[1] != local:
        return f"a mask {shape} with {query.shape[1]} local query positions against {local} key positions"
    if mask.dim() == 2:
        if mask.shape[0] not in (1, query.shape[0]):
            return f"a 2-D mask {shape} whose first dimension is not the batch ({query.shape[0]})"
    elif mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] not in (1, joint):
        return f"a mask {shape} (per head, or neither [B, 1, 1, S] nor [B, 1, S, S])"
    if not 0 <= text_local <= local:
        return f"a mask {shape} with a text length {text_local} outside the local sequence {local}"
    return None


def _degree(config: Any) -> int:
    degree = getattr(getattr(config, "context_parallel_config", None), "ulysses_degree", 1)
    return degree if isinstance(degree, int) else 1


def _refuse_traced(degree: int) -> None:
    """While tracing, at Ulysses degree > 1 with QwenImage's unsharded mask: raise, so that dynamo runs the
    call eagerly, where the text length and the mask's values can be read (with fullgraph=True: an error)."""
    if degree > 1 and _unsharded_qwen_loaded():
        raise UnsafeAttentionError(compile_message(degree))


def processor(shipped: Callable[..., Any]) -> Callable[..., Any]:
    """QwenImage's attention processor ``shipped`` (``QwenDoubleStreamAttnProcessor2_0.__call__``) handing its
    rank-local text length on to :func:`in_kv_order` through :data:`TEXT_LEN` while it runs. Its signature reads
    as the shipped one (``__wrapped__``): diffusers' ``Attention`` drops keywords the processor's does not name."""

    @functools.wraps(shipped, assigned=())
    def __call__(
        self: Any, attn: Any, hidden_states: Any, encoder_hidden_states: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        if torch.compiler.is_compiling():  # ContextVar.set breaks a graph: refuse where the mask needs it
            if isinstance(args[1] if len(args) > 1 else kwargs.get("attention_mask"), torch.Tensor):
                _refuse_traced(_degree(getattr(self, "_parallel_config", None)))
            return shipped(self, attn, hidden_states, encoder_hidden_states, *args, **kwargs)
        text = encoder_hidden_states.shape[1] if isinstance(encoder_hidden_states, torch.Tensor) else None
        token = TEXT_LEN.set(text)
        try:
            return shipped(self, attn, hidden_states, encoder_hidden_states, *args, **kwargs)
        finally:
            TEXT_LEN.reset(token)

    return __call__


def in_kv_order(
    attn_mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor, config: Any, *, anything: bool = False
) -> torch.Tensor:
    """``attn_mask`` as the attention op must get it: QwenImage's joint mask (inside its processor:
    :data:`TEXT_LEN`) at Ulysses degree > 1 put into the K/V's order; every other mask as it came. Raises
    :class:`UnsafeAttentionError` for a QwenImage mask it cannot map: under ``anything``
    (``TemplatedUlyssesAnythingAttention``, whose ranks may hold shards of different lengths that no rank knows
    of the others) every such mask that masks something."""
    degree = _degree(config)
    if degree <= 1:
        return attn_mask
    if torch.compiler.is_compiling():
        _refuse_traced(degree)
        return attn_mask
    text_local = TEXT_LEN.get()
    if text_local is None:
        return attn_mask
    if _ledger.recording:
        _ledger.reached(FIX_ID)
    problem = _layout_problem(attn_mask, query, key, degree, text_local, anything)
    # A mask built once and handed to every layer is read, and reordered, once per mask object and version.
    if problem is None:
        return remembered(_reorder, attn_mask, (text_local * degree, (key.shape[1] - text_local) * degree, degree))
    if remembered(_masks, attn_mask, None):
        way_out = WAY_OUT.format(anything=ANYTHING_WAY_OUT if anything else "")
        cause = MESSAGE.format(degree=degree, layout=problem)
        raise UnsafeAttentionError(explain(cause, "Padded prompts would train silently wrong.", way_out, _SECTION))
    return attn_mask


_BATCH, _HEADS, _DIM, _WORLD = 1, 2, 8, 2
#: Per rank: 2 text + 2 image tokens; globally 4 + 4.
_TEXT_LOCAL, _IMAGE_LOCAL = 2, 2
_SEQ = _TEXT_LOCAL + _IMAGE_LOCAL


def _padded_local_mask() -> torch.Tensor:
    """A padded, sequence-local mask, as a plan that shards the mask hands it over. A Ulysses that gathers such
    a mask puts it in the K/V's order (0.39+); one that hands it on as it came relies on the model's order
    being the global one."""
    mask = torch.ones(_BATCH, 1, 1, _SEQ, dtype=torch.bool)
    mask[..., 1] = False  # a padded text token
    return mask


def _padded_global_mask() -> tuple[torch.Tensor, torch.Tensor]:
    """QwenImage's joint mask for degree 2 in the global order [text, image], the last text token padded, and
    the same mask in the K/V's rank order, position by position (rank r's text, then rank r's image)."""
    text, image = _TEXT_LOCAL * _WORLD, _IMAGE_LOCAL * _WORLD
    mask = torch.ones(_BATCH, 1, 1, text + image, dtype=torch.bool)
    mask[..., text - 1] = False
    position = torch.arange(text + image)
    order = torch.cat([position[:text].view(_WORLD, -1), position[text:].view(_WORLD, -1)], dim=1).flatten()
    return mask, mask[..., order]


#: :func:`_detect.call_ulysses`' arguments: Ulysses degree 2, q/k/v of 2 text + 2 image tokens per rank.
_CALL: dict[str, Any] = {"degree": _WORLD, "shape": (_BATCH, _SEQ, _HEADS, _DIM)}


def _from_qwen(run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``run(*args, **kwargs)`` as QwenImage's attention processor runs its attention: inside the package's
    wrapper (:func:`processor`) of a stand-in processor whose text stream holds ``_TEXT_LOCAL`` tokens per rank."""
    return processor(lambda *_: run(*args, **kwargs))(None, None, None, torch.zeros(_BATCH, _TEXT_LOCAL, _DIM))


def _shipped_gathers(lookup: Lookup, target: str, stand_ins: dict[str, Any] | None = None) -> bool | str:
    """Whether diffusers' own forward at ``target`` (run with stand-in collectives: ``stand_ins``, default
    Ulysses') gathers a sequence-local mask before the op (False where it hands the op the very mask it got); a
    text if it cannot be run."""
    mask = _padded_local_mask()
    reached = _detect.op_reached(lookup, target, mask, stand_ins=stand_ins, shipped=True, **_CALL)
    if isinstance(reached, str):
        return reached
    if reached.mask is mask:
        return False
    if isinstance(reached.mask, torch.Tensor) and reached.mask.shape[-1] == _SEQ * _WORLD:
        return True
    return f"the op got {getattr(reached.mask, 'shape', reached.mask)} for a local mask of {_SEQ} positions"


def _check_forward(lookup: Lookup, target: str, stand_ins: dict[str, Any] | None) -> Finding:
    """The check of one Ulysses forward (``target``: the plain class's or the ``anything`` class's)."""
    name = target.partition(".")[0]
    gathers = _shipped_gathers(lookup, target, stand_ins)
    if isinstance(gathers, str):
        return Finding("unknown", f"{name}'s forward could not be run in one process ({gathers})")
    if gathers:
        return Finding("ok", f"{name} gathers a sequence-local mask into the K/V's order before the op")
    # diffusers' forward hands the op the mask as it came: what reaches it from QwenImage's processor?
    mask, expected = _padded_global_mask()
    try:
        entering = _from_qwen(_detect.mask_entering, lookup, target, mask, passes=(UnsafeAttentionError,), **_CALL)
    except UnsafeAttentionError:
        return Finding("ok", f"QwenImage's joint mask, which {name} would hand on in another token order, is refused")
    if isinstance(entering, str):
        return Finding("unknown", f"{name}'s forward could not be run in one process ({entering})")
    if entering.shape == expected.shape and torch.equal(entering, expected):
        return Finding("ok", f"QwenImage's joint mask reaches {name} in the K/V's rank order")
    return Finding(
        "broken",
        f"{name} hands the attention op QwenImage's joint mask in the global token order [text, image], while "
        "the K/V arrive in rank order [text_0, image_0, text_1, ...]",
    )


def check(lookup: Lookup) -> Finding:
    if lookup(ULYSSES_FORWARD) is None:
        return Finding("absent", "this diffusers has no TemplatedUlyssesAttention")
    findings = [_check_forward(lookup, ULYSSES_FORWARD, None)]
    if lookup(ULYSSES_ANYTHING_FORWARD) is not None:  # 0.37.0 on
        findings.append(_check_forward(lookup, ULYSSES_ANYTHING_FORWARD, _detect.ULYSSES_ANYTHING_STAND_INS))
    for state in ("broken", "unknown"):
        found = [f for f in findings if f.state == state]
        if found:
            return Finding(state, "; ".join(f.detail for f in found))
    return Finding("ok", "; ".join(f.detail for f in findings))
