# To add to tests/models/transformers/test_models_transformer_ltx2.py (diffusers). CPU, one process: the plan's
# structure. reproduce.py runs it over two gloo ranks against one process.
import pytest
from diffusers import LTX2VideoTransformer3DModel
from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoRotaryPosEmbed

CONFIG = dict(
    in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
    audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=8,
    audio_cross_attention_dim=16, num_layers=1, caption_channels=8,
)  # fmt: skip


@pytest.mark.parametrize("rope_type", ["interleaved", "split"])
def test_cp_plan_splits_every_rope_and_shards_both_streams(rope_type):
    model = LTX2VideoTransformer3DModel(**CONFIG, rope_type=rope_type)
    plan = model._cp_plan
    ropes = [name for name, m in model.named_modules() if isinstance(m, LTX2AudioVideoRotaryPosEmbed)]
    assert ropes == ["rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope"]
    layout = (2, 4) if rope_type == "split" else (1, 3)
    for name in ropes:
        assert sorted(plan[name]) == [0, 1]
        assert all(s.split_output and (s.split_dim, s.expected_dims) == layout for s in plan[name].values())
    for name in ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states"):
        assert plan[""][name].split_dim == 1
    assert {"proj_out", "audio_proj_out"} <= plan.keys()
