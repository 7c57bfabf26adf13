"""The tiny transformers ``diffusers-cudnn-fix verify --model M`` builds: one row per diffusers transformer that
declares a context-parallel plan (``_cp_plan``), with its tiny config and valid inputs (docs/verify.md, "Models").

Imported only by ``_verify`` (so only when the subcommand runs); torch and diffusers are handed to the builders,
never imported here. A builder gets :class:`Shapes` and returns the seeded fp32 model, its inputs (fp32, on the
CPU) and one MSE target per tensor the model returns (``return_dict=False``): the loss covers every output, so
a model with a video and an audio head is checked on both.

Each stream the plan shards divides by the world size; the text streams are half as long as the image or video
streams (``Shapes``), so that a cross-attention's keys have another length than its queries, as in real use.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Batch size of every model's inputs.
BATCH = 2


@dataclass(frozen=True)
class Shapes:
    """What every builder gets: ``heads`` attention heads of 16, ``tokens`` text tokens, ``padded``: right-padded
    prompts through the model's text mask (``--mask padded``). Joint-attention models (Flux, Flux2, QwenImage)
    take as many image tokens as text tokens, the others ``visual`` (twice as many) video tokens: either way the
    sequence the attention op sees first holds ``2 x tokens`` positions (:func:`shapes` says why)."""

    heads: int
    tokens: int
    padded: bool = False

    @property
    def visual(self) -> int:
        return 2 * self.tokens


ModelAndInputs = tuple[Any, dict[str, Any], tuple[Any, ...]]


@dataclass(frozen=True)
class TinyModel:
    """One row of the table. ``name``: ``--model``'s value; ``cls``: diffusers' class (``diffusers.<cls>``);
    ``source``: its module under ``diffusers/models/transformers/``; ``since``: the first diffusers release whose
    class declares the plan (the first with the class, for one that declares none); ``plan``: whether the class
    declares ``_cp_plan`` (verify refuses one that does not); ``mask``: the forward argument ``--mask padded``
    fills (None: the model has no text-mask path); ``ring``: whether ``--ring`` can run (else why not);
    ``cast``: the inputs cast to the checked dtype with the model; ``blocks``: why the block count is what it
    is, where that matters; ``build``: the builder."""

    name: str
    cls: str
    source: str
    since: str
    build: Callable[[Any, Any, Shapes, Any], ModelAndInputs] | None = None
    plan: bool = True
    mask: str | None = None
    ring: bool | str = True
    cast: tuple[str, ...] = ("hidden_states", "encoder_hidden_states", "timestep")
    blocks: str = ""


def installed(entry: TinyModel) -> str | None:
    """What the installed diffusers has of ``entry``, read from its source file without importing diffusers (the
    ``--nproc`` launcher and ``--model list`` stay quick; each rank checks the imported class again): "plan" (the
    class declares ``_cp_plan``), "no plan", "missing"; None where diffusers is not found."""
    try:
        spec = importlib.util.find_spec("diffusers")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "models", "transformers", f"{entry.source}.py")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return "missing"
    found = re.search(rf"^class {entry.cls}\(.*?(?=^class |\Z)", text, re.M | re.S)
    if found is None:
        return "missing"
    return "plan" if re.search(r"^    _cp_plan = (?!None)", found.group(0), re.M) else "no plan"


def shapes(ulysses: int, ring: int) -> tuple[int, int]:
    """(heads, text tokens) for these degrees.

    Each stream's length divides by the world size (diffusers' plans shard image and text apart), and the
    attention op sees as many heads as sequence positions (heads / U == tokens / R): where a layout bug hands
    the op (B, S, H, D) as (B, H, S, D), every shape check passes and the bug shows as wrong numbers, as it
    does on a real model, instead of as a shape error. At least 4 text tokens, so that a padded prompt has
    room for padding.
    """
    world = ulysses * ring
    n = max(1, math.ceil(4 / world))
    return 2 * n * ulysses * ulysses, n * world


def _padded_mask(torch: Any, tokens: int) -> Any:
    """Right-padded prompts as a tokenizer gives them (int64 1/0): a quarter and a half of the text padded."""
    mask = torch.ones(BATCH, tokens, dtype=torch.int64)
    mask[0, tokens - max(1, tokens // 4) :] = 0
    mask[1, tokens - max(1, tokens // 2) :] = 0
    return mask


def _grid(tokens: int) -> tuple[int, int, int]:
    """(frames, height, width) of a latent video of ``tokens`` patches: 1 frame, 2 rows."""
    return 1, 2, tokens // 2


def _randn(torch: Any, gen: Any, *shape: int) -> Any:
    return torch.randn(*shape, generator=gen)


# ------------------------------------------------------------------------------------------------------------
# The builders (each seeded by the caller: ``torch.manual_seed`` before, ``gen`` for the inputs)
# ------------------------------------------------------------------------------------------------------------
def _flux(torch: Any, diffusers: Any, s: Shapes, gen: Any) -> ModelAndInputs:
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, attention_head_dim=16, num_attention_heads=s.heads, joint_attention_dim=8,
        axes_dims_rope=(4, 6, 6), num_layers=1, num_single_layers=1, pooled_projection_dim=8, guidance_embeds=False,
    )  # fmt: skip
    inputs = {
        "hidden_states": _randn(torch, gen, BATCH, s.tokens, 4),
        "encoder_hidden_states": _randn(torch, gen, BATCH, s.tokens, 8),
        "timestep": torch.tensor([0.5, 0.25]),
        "pooled_projections": _randn(torch, gen, BATCH, 8),
        "img_ids": torch.tensor([[0.0, i // 2, i % 2] for i in range(s.tokens)]),
        "txt_ids": torch.zeros(s.tokens, 3),
    }
    return model, inputs, (_randn(torch, gen, BATCH, s.tokens, 4),)


def _flux2(torch: Any, diffusers: Any, s: Shapes, gen: Any) -> ModelAndInputs:
    import inspect

    # 0.36.0's Flux2 always embeds a guidance scale (no guidance_embeds switch): it gets one as an input.
    switch = "guidance_embeds" in inspect.signature(diffusers.Flux2Transformer2DModel.__init__).parameters
    model = diffusers.Flux2Transformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=s.heads, joint_attention_dim=8, timestep_guidance_channels=16, mlp_ratio=2.0,
        axes_dims_rope=(4, 4, 4, 4), **({"guidance_embeds": False} if switch else {}),
    )  # fmt: skip
    img_ids = torch.tensor([[0.0, i // 2, i % 2, 0.0] for i in range(s.tokens)])
    txt_ids = torch.tensor([[0.0, 0.0, 0.0, float(i)] for i in range(s.tokens)])
    inputs = {
        "hidden_states": _randn(torch, gen, BATCH, s.tokens, 4),
        "encoder_hidden_states": _randn(torch, gen, BATCH, s.tokens, 8),
        "timestep": torch.tensor([0.5, 0.25]),
        # (B, S, 4): the plan splits the ids along the sequence (dim 1); the model reads the first batch row.
        "img_ids": img_ids.expand(BATCH, -1, -1).contiguous(),
        "txt_ids": txt_ids.expand(BATCH, -1, -1).contiguous(),
    }
    if not switch:
        inputs["guidance"] = torch.tensor([3.5, 3.5])
    return model, inputs, (_randn(torch, gen, BATCH, s.tokens, 4),)


def _qwen(torch: Any, diffusers: Any, s: Shapes, gen: Any) -> ModelAndInputs:
    import inspect

    model = diffusers.QwenImageTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=s.heads, joint_attention_dim=8, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    inputs = {
        "hidden_states": _randn(torch, gen, BATCH, s.tokens, 4),
        "encoder_hidden_states": _randn(torch, gen, BATCH, s.tokens, 8),
        "timestep": torch.tensor([0.5, 0.25]),
        "img_shapes": [[(1, 1, s.tokens)]] * BATCH,
    }
    if s.padded:
        inputs["encoder_hidden_states_mask"] = _padded_mask(torch, s.tokens)
    if "max_txt_seq_len" not in inspect.signature(model.pos_embed.forward).parameters:
        inputs["txt_seq_lens"] = [s.tokens] * BATCH  # 0.36.0's RoPE (later releases take the mask, or none)
    return model, inputs, (_randn(torch, gen, BATCH, s.tokens, 4),)


def _wan_like(cls: str, per_token_timestep: bool) -> Callable[[Any, Any, Shapes, Any], ModelAndInputs]:
    """Wan and ChronoEdit (Wan's blocks; the text is not sharded: the cross-attention runs on each rank alone)."""

    def build(torch: Any, diffusers: Any, s: Shapes, gen: Any) -> ModelAndInputs:
        frames, height, width = _grid(s.visual)
        model = getattr(diffusers, cls)(
            patch_size=(1, 2, 2), num_attention_heads=s.heads, attention_head_dim=16, in_channels=4, out_channels=4,
            text_dim=8, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
        )  # fmt: skip
        latent = (BATCH, 4, frames, 2 * height, 2 * width)
        # Wan's plan splits a per-token timestep (B, S: Wan 2.2's form) along the sequence; a 1-D timestep (B,)
        # is left whole, after diffusers' hook logs that it cannot split it (docs/verify.md, "Models").
        timestep = torch.tensor([[500.0] * s.visual, [250.0] * s.visual]) if per_token_timestep else None
        inputs = {
            "hidden_states": _randn(torch, gen, *latent),
            "timestep": timestep if timestep is not None else torch.tensor([500.0, 250.0]),
            "encoder_hidden_states": _randn(torch, gen, BATCH, s.tokens, 8),
        }
        return model, inputs, (_randn(torch, gen, *latent),)

    return build


def _minimax_h3(torch: Any, diffusers: Any, s: Shapes, gen: Any) -> ModelAndInputs:
    # One packed sequence of 2 x tokens rows (the plan shards it as a whole): text, then video, then audio; two
    # noise levels, the text at the first, video and audio at the second.
    text = audio = s.tokens // 2
    video = s.visual - text - audio
    inner = 16 * s.heads
    model = diffusers.MiniMaxH3Transformer3DModel(
        num_attention_heads=s.heads, attention_head_dim=16, hidden_size=inner, num_layers=1, num_refiner_layers=1,
        ffn_dim=32, in_channels=1, audio_in_channels=4, patch_size=(1, 2, 2), text_dim=8, freq_dim=16,
        time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2,
    )  # fmt: skip
    length = text + video + audio
    tags = torch.tensor([1] * text + [0] * video + [2] * audio)
    positions = torch.zeros(length, 3)
    positions[text : text + video, 1] = torch.arange(video) // 2
    positions[text : text + video, 2] = torch.arange(video) % 2
    positions[text + video :, 0] = torch.arange(audio).float()
    inputs = {
        "hidden_states": _randn(torch, gen, BATCH, video, 4),
        "audio_hidden_states": _randn(torch, gen, BATCH, audio, 4),
        "encoder_hidden_states": _randn(torch, gen, BATCH, text, 8),
        "timestep": torch.tensor([0.5, 0.25]),
        "timestep_indices": (tags != 1).long(),
        "token_tags": tags,
        "position_ids": positions,
        "text_indices": torch.arange(text),
        "video_indices": torch.arange(text, text + video),
        "audio_indices": torch.arange(text + video, length),
    }
    targets = (_randn(torch, gen, BATCH, video, 4), _randn(torch, gen, BATCH, audio, 4))
    return model, inputs, targets


#: Helios' plan names blocks 0 - 39 (enable_parallelism fails on fewer: "'2' is not a submodule of 'ModuleList'").
HELIOS_BLOCKS = 40


def _helios(torch: Any, diffusers: Any, s: Shapes, gen: Any) -> ModelAndInputs:
    frames, height, width = _grid(s.visual)
    model = diffusers.HeliosTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=s.heads, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=8, freq_dim=16, ffn_dim=32, num_layers=HELIOS_BLOCKS, rope_dim=(4, 6, 6),
    )  # fmt: skip
    latent = (BATCH, 4, frames, 2 * height, 2 * width)
    inputs = {
        "hidden_states": _randn(torch, gen, *latent),
        "timestep": torch.tensor([500.0, 250.0]),
        "encoder_hidden_states": _randn(torch, gen, BATCH, s.tokens, 8),
    }
    return model, inputs, (_randn(torch, gen, *latent),)


def _ltx(torch: Any, diffusers: Any, s: Shapes, gen: Any) -> ModelAndInputs:
    frames, height, width = _grid(s.visual)
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=s.heads, attention_head_dim=16,
        cross_attention_dim=16 * s.heads, num_layers=1, caption_channels=8,
    )  # fmt: skip
    inputs = {
        "hidden_states": _randn(torch, gen, BATCH, s.visual, 4),
        "encoder_hidden_states": _randn(torch, gen, BATCH, s.tokens, 8),
        "timestep": torch.tensor([500, 250]),
        "encoder_attention_mask": _padded_mask(torch, s.tokens) if s.padded else None,
        "num_frames": frames,
        "height": height,
        "width": width,
    }
    return model, inputs, (_randn(torch, gen, BATCH, s.visual, 4),)


def _ltx2(torch: Any, diffusers: Any, s: Shapes, gen: Any) -> ModelAndInputs:
    frames, height, width = _grid(s.visual)
    audio = s.visual
    model = diffusers.LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=s.heads, attention_head_dim=16,
        cross_attention_dim=16 * s.heads, audio_in_channels=4, audio_out_channels=4,
        audio_num_attention_heads=s.heads, audio_attention_head_dim=16, audio_cross_attention_dim=16 * s.heads,
        num_layers=1, caption_channels=8,
    )  # fmt: skip
    mask = _padded_mask(torch, s.tokens) if s.padded else None
    inputs = {
        "hidden_states": _randn(torch, gen, BATCH, s.visual, 4),
        "audio_hidden_states": _randn(torch, gen, BATCH, audio, 4),
        "encoder_hidden_states": _randn(torch, gen, BATCH, s.tokens, 8),
        "audio_encoder_hidden_states": _randn(torch, gen, BATCH, s.tokens, 8),
        "timestep": torch.tensor([500.0, 250.0]),
        "encoder_attention_mask": mask,
        "audio_encoder_attention_mask": None if mask is None else mask.clone(),
        "num_frames": frames,
        "height": height,
        "width": width,
        "audio_num_frames": audio,
    }
    targets = (_randn(torch, gen, BATCH, s.visual, 4), _randn(torch, gen, BATCH, audio, 4))
    return model, inputs, targets


# ------------------------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------------------------
MODELS: dict[str, TinyModel] = {
    m.name: m
    for m in (
        TinyModel("flux", "FluxTransformer2DModel", "transformer_flux", "0.36.0", _flux,
                  cast=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")),
        TinyModel("flux2", "Flux2Transformer2DModel", "transformer_flux2", "0.36.0", _flux2),
        TinyModel("qwen", "QwenImageTransformer2DModel", "transformer_qwenimage", "0.36.0", _qwen,
                  mask="encoder_hidden_states_mask"),
        TinyModel("wan", "WanTransformer3DModel", "transformer_wan", "0.36.0",
                  _wan_like("WanTransformer3DModel", True)),
        TinyModel("chronoedit", "ChronoEditTransformer3DModel", "transformer_chronoedit", "0.36.0",
                  _wan_like("ChronoEditTransformer3DModel", False)),
        TinyModel("minimax_h3", "MiniMaxH3Transformer3DModel", "transformer_minimax_h3", "0.40.0", _minimax_h3,
                  cast=("hidden_states", "audio_hidden_states", "encoder_hidden_states")),
        TinyModel("helios", "HeliosTransformer3DModel", "transformer_helios", "0.37.0", _helios,
                  blocks=f"{HELIOS_BLOCKS} blocks: its plan names blocks 0 - {HELIOS_BLOCKS - 1}"),
        TinyModel("ltx", "LTXVideoTransformer3DModel", "transformer_ltx", "0.36.0", _ltx,
                  mask="encoder_attention_mask"),
        TinyModel("ltx2", "LTX2VideoTransformer3DModel", "transformer_ltx2", "0.37.0", _ltx2,
                  mask="encoder_attention_mask", cast=("hidden_states", "audio_hidden_states",
                  "encoder_hidden_states", "audio_encoder_hidden_states", "timestep")),
        # A packed dual-pathway model: its context parallelism lives outside it (no ``_cp_plan``).
        TinyModel("cosmos3", "Cosmos3OmniTransformer", "transformer_cosmos3", "0.39.0", plan=False),
    )
}  # fmt: skip
