"""LTX2's context-parallel plan splits ``rope`` but not ``cross_attn_rope``, and never shards the audio stream.

Bug: the audio-video cross-attention meets full-length RoPE on sharded video tokens and fails in the forward; a plan
splitting that RoPE alone runs, but the audio stream, replicated on every rank, trains silently wrong. 0.37.0 on.
Detection: the release has LTX2, and ``enable_parallelism`` applies a plan leaving a RoPE module of the same class as
one the plan splits unsplit (a stand-in model): read off the plan's structure (:func:`unsplit_siblings`).
The package: ``enable_parallelism``'s replacement hands diffusers the complete plan (:func:`complete`); a structure it
does not know raises ``UnsafeAttentionError`` naming the unsplit modules and the way out (docs/fixes.md).
"""

from __future__ import annotations

import importlib.machinery
import inspect
import os
import sys
import types
from collections.abc import Mapping
from typing import Any

import torch

from .. import _ledger
from .._detect import spreads
from .._fix import Finding, Lookup, built_of
from .._warnings import UnsafeAttentionError, explain
from . import ENABLE_PARALLELISM

#: The record's id (the module is named after it: the registry finds the check so), for the policy's mark.
FIX_ID = __name__.rpartition(".")[2]

#: The model's module in diffusers' ``models/transformers`` (0.37.0 on): whether the installed release has it.
LTX2_MODULE = "transformer_ltx2"

#: What the completion knows: the RoPE modules of both streams and of the audio-video cross-attention, the inputs of
#: the model's forward sharded along their tokens (latents, texts and text masks of both streams; the timestep where
#: it is given per token), the two output projections gathered.
ROPES = ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope")
TOKENS_3D = ("hidden_states", "encoder_hidden_states", "audio_hidden_states", "audio_encoder_hidden_states")
TOKENS_2D = ("encoder_attention_mask", "audio_encoder_attention_mask", "timestep")
OUTPUTS = ("proj_out", "audio_proj_out")

CAUSE = (
    "this model's context-parallel plan splits the output of {split} but not of {unsplit}, modules of the same "
    "class, and the package does not know this model's structure well enough to complete the plan."
)
CONSEQUENCE = (
    "Their full-length outputs meet sharded tokens: the forward fails, or (where only the RoPE is split) a stream "
    "left unsharded runs replicated on every rank and trains silently wrong (a tiny LTX2 under Ulysses 2: 103 of "
    "126 gradients off), so enable_parallelism is refused."
)
WAY_OUT = (
    "Do not use context parallelism for this model, or pass your own complete plan to enable_parallelism(cp_plan=...) "
    "that splits every such module's output and shards every stream they serve."
)
_SECTION = "fixes.md#ltx2_cp_plan"


def _splits_output(entry: Any) -> bool:
    """Whether a plan entry splits a module's outputs: a mapping whose every item has ``split_output`` set."""
    return (
        isinstance(entry, Mapping)
        and bool(entry)
        and all(getattr(item, "split_output", False) for item in entry.values())
    )


def _submodule(model: Any, name: str) -> Any:
    if not isinstance(model, torch.nn.Module) or "*" in name:
        return None
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def unsplit_siblings(model: Any, plan: Any) -> tuple[list[str], list[str]]:
    """The modules whose outputs ``plan`` splits, and the modules of ``model`` of the same class that the plan does
    not name (empty where there are none): read off the plan's and the model's structure, never a class name. LTX2's
    own plan splits ``rope`` and leaves ``audio_rope``, ``cross_attn_rope`` and ``cross_attn_audio_rope``."""
    if not isinstance(plan, Mapping):
        return [], []
    split = [key for key, entry in plan.items() if isinstance(key, str) and _splits_output(entry)]
    classes = {type(module) for module in (_submodule(model, key) for key in split) if module is not None}
    if not classes:
        return split, []
    named = {key for key in plan if isinstance(key, str)}
    unsplit = [name for name, module in model.named_modules() if type(module) in classes and name not in named]
    return split, unsplit


def _forward_parameters(model: Any) -> set[str]:
    try:
        return set(inspect.signature(type(model).forward).parameters)
    except (TypeError, ValueError):
        return set()


def _known(model: Any, plan: Mapping[Any, Any], unsplit: list[str]) -> bool:
    """Whether ``model`` has the structure :func:`complete` knows (LTX2's): its RoPE modules are :data:`ROPES`, its
    forward takes every input it shards, its output projections are :data:`OUTPUTS`, and ``plan`` names nothing
    else."""
    if not set(unsplit) <= set(ROPES) or _submodule(model, "rope") is None:
        return False
    if not {*TOKENS_3D, *TOKENS_2D} <= _forward_parameters(model):
        return False
    if any(_submodule(model, name) is None for name in (*ROPES, *OUTPUTS)):
        return False
    return set(plan) <= {"", *ROPES, *OUTPUTS} and isinstance(plan.get(""), Mapping)


def _classes(plan: Mapping[Any, Any]) -> tuple[type, type] | None:
    """diffusers' ``ContextParallelInput`` and ``ContextParallelOutput``, as the plan itself holds them."""
    inputs = [item for entry in plan.values() if isinstance(entry, Mapping) for item in entry.values()]
    outputs = [entry for entry in plan.values() if hasattr(entry, "gather_dim")]
    if not inputs or not outputs:
        return None
    return type(inputs[0]), type(outputs[0])


def complete(model: Any, plan: Mapping[Any, Any]) -> dict[Any, Any]:
    """LTX2's plan completed: every RoPE's outputs split along their tokens (dim 1 of (B, tokens, D); dim 2 of the
    ``"split"`` layout's (B, heads, tokens, D)), both streams' latents, texts and text masks and a per-token timestep
    split at the model's entry, both outputs gathered. What the plan has besides is kept."""
    found = _classes(plan)
    if found is None:
        raise ValueError("the plan holds no ContextParallelInput and ContextParallelOutput to build on")
    split_input, gather_output = found
    entry = dict(plan[""])
    for name in TOKENS_3D:
        entry[name] = split_input(split_dim=1, expected_dims=3, split_output=False)
    for name in TOKENS_2D:
        entry[name] = split_input(split_dim=1, expected_dims=2, split_output=False)
    completed: dict[Any, Any] = {**plan, "": entry}
    for name in ROPES:
        split_dim, dims = (2, 4) if getattr(_submodule(model, name), "rope_type", None) == "split" else (1, 3)
        completed[name] = {i: split_input(split_dim=split_dim, expected_dims=dims, split_output=True) for i in (0, 1)}
    for name in OUTPUTS:
        completed[name] = gather_output(gather_dim=1, expected_dims=3)
    return completed


def message(split: list[str], unsplit: list[str]) -> str:
    """The refusal's message for a plan splitting ``split``'s outputs and not ``unsplit``'s."""
    return explain(CAUSE.format(split=", ".join(split), unsplit=", ".join(unsplit)), CONSEQUENCE, WAY_OUT, _SECTION)


def plan_for(model: Any, config: Any, plan: Any) -> Any:
    """The plan to hand diffusers' ``enable_parallelism``: ``plan`` where it leaves no module of the same class as
    one it splits the output of unsplit (or ``config`` spreads nothing), LTX2's completed (:func:`complete`) where
    the model has LTX2's structure; otherwise :class:`UnsafeAttentionError`."""
    if not spreads(config):
        return plan
    split, unsplit = unsplit_siblings(model, plan)
    if not unsplit:
        return plan
    if _ledger.recording:
        _ledger.reached(FIX_ID)
    if _known(model, plan, unsplit):
        return complete(model, plan)
    raise UnsafeAttentionError(message(split, unsplit))


class _StandInInput:
    """A stand-in of diffusers' ``ContextParallelInput`` (the fields the plan's hooks read)."""

    def __init__(self, split_dim: int, expected_dims: int | None = None, split_output: bool = False) -> None:
        self.split_dim, self.expected_dims, self.split_output = split_dim, expected_dims, split_output


class _StandInOutput:
    """A stand-in of diffusers' ``ContextParallelOutput``."""

    def __init__(self, gather_dim: int, expected_dims: int | None = None) -> None:
        self.gather_dim, self.expected_dims = gather_dim, expected_dims


class _Rope(torch.nn.Module):
    pass


class _StandInModel(torch.nn.Module):
    """A model of LTX2's structure (its RoPE modules, output projections and forward's inputs), nothing more."""

    def __init__(self) -> None:
        super().__init__()
        for name in ROPES:
            self.add_module(name, _Rope())
        for name in OUTPUTS:
            self.add_module(name, torch.nn.Identity())

    def forward(
        self, hidden_states: Any, audio_hidden_states: Any, encoder_hidden_states: Any,
        audio_encoder_hidden_states: Any, timestep: Any, encoder_attention_mask: Any = None,
        audio_encoder_attention_mask: Any = None,
    ) -> Any:  # fmt: skip
        return hidden_states


def _stand_in_plan() -> dict[str, Any]:
    """LTX2's own plan's structure (0.37.0 - 0.42.1), with stand-in classes."""
    tokens = {name: _StandInInput(1, 3) for name in ("hidden_states", "encoder_hidden_states")}
    rope = {i: _StandInInput(1, 3, split_output=True) for i in (0, 1)}
    return {"": {**tokens, "encoder_attention_mask": _StandInInput(1, 2)}, "rope": rope, "proj_out": _StandInOutput(1)}


def _plan_handed(lookup: Lookup) -> Any:
    """The plan the ``enable_parallelism`` a model gets (as ``lookup`` shows it) hands diffusers' own for a stand-in
    LTX2 whose plan is LTX2's own, over two ranks (run in one process, diffusers' own stood in: where it is what the
    model gets, the plan it is given); a text where it cannot be run."""
    plan = _stand_in_plan()
    handed: list[Any] = []
    run = built_of(lookup, ENABLE_PARALLELISM, lambda self, *args, **kwargs: handed.append(kwargs.get("cp_plan")))
    if run is None:
        return "the replacement could not be built around a stand-in"
    config = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(ulysses_degree=2, ring_degree=1))
    try:
        run(_StandInModel(), config=config, cp_plan=plan)
    except UnsafeAttentionError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - a replacement this check cannot run: said as unknown
        return f"{type(exc).__name__}: {exc}"
    return handed[0] if handed else "diffusers' own enable_parallelism was not called"


def _has_ltx2() -> bool:
    """Whether the installed diffusers has LTX2's module, found on ``diffusers.models``' path without importing
    ``diffusers.models.transformers`` (whose import brings every model)."""
    models = sys.modules.get("diffusers.models")
    folders = [os.path.join(path, "transformers") for path in getattr(models, "__path__", None) or ()]
    return bool(folders) and importlib.machinery.PathFinder.find_spec(LTX2_MODULE, folders) is not None


def _completed(plan: Any) -> bool:
    """Whether ``plan`` splits every RoPE of :data:`ROPES` and shards and gathers the audio stream."""
    entry = plan.get("") if isinstance(plan, Mapping) else None
    return (
        isinstance(entry, Mapping)
        and all(name in plan for name in (*ROPES, *OUTPUTS))
        and all(name in entry for name in TOKENS_3D)
    )


def check(lookup: Lookup) -> Finding:
    if not _has_ltx2():
        return Finding("absent", "this diffusers has no LTX2 (no transformer_ltx2 module)")
    # Where LTX2's module is imported already, its own plan is read (a diffusers that completed it needs nothing);
    # the check does not import it (its import costs what every model's does).
    shipped_model = getattr(
        sys.modules.get(f"diffusers.models.transformers.{LTX2_MODULE}"), "LTX2VideoTransformer3DModel", None
    )
    if shipped_model is not None and _completed(getattr(shipped_model, "_cp_plan", None)):
        return Finding("ok", "LTX2's own plan splits every RoPE and shards both streams")
    enable = lookup(ENABLE_PARALLELISM)
    if enable is None:  # diffusers' ModelMixin not imported yet: checked again once it is (the hook watches it)
        return Finding("broken", "this diffusers ships LTX2, whose plan leaves cross_attn_rope and the audio stream "
                       "unsplit; ModelMixin.enable_parallelism is not imported yet")  # fmt: skip
    handed = _plan_handed(lookup)
    if isinstance(handed, str):
        return Finding("unknown", f"ModelMixin.enable_parallelism could not be run in one process ({handed})")
    if isinstance(handed, UnsafeAttentionError):
        return Finding("unknown", f"enable_parallelism refused a plan of LTX2's structure ({handed})")
    _, unsplit = unsplit_siblings(_StandInModel(), handed)
    if not unsplit and _completed(handed):
        return Finding("ok", "enable_parallelism hands diffusers LTX2's plan completed: every RoPE split, both "
                       "streams sharded")  # fmt: skip
    return Finding("broken", f"this diffusers ships LTX2, and enable_parallelism applies a plan of its structure "
                   f"leaving {', '.join(unsplit) or 'the audio stream'} unsplit")  # fmt: skip
