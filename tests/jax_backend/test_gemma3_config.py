"""Gemma 3 configs in the JAX backend: the real gemma-3-1b-it config.json read into a
``ModelConfig`` whose parameter shapes are HF's (HF built on the meta device: no 1B
allocation), and the options the JAX model refuses by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.jax_pjit import hf_mapping
from backends.jax_pjit.models import config_from_hf
from backends.jax_pjit.models.gemma3 import Gemma3Config
from core.testing.tiny_models import tiny_config

GEMMA3_1B = Path(__file__).parents[1] / "data" / "hf_configs" / "gemma-3-1b-it"


def test_gemma3_1b_config_and_shapes_match_hf():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(GEMMA3_1B)
    cfg = config_from_hf(hf_config)
    assert isinstance(cfg, Gemma3Config) and cfg.family == "gemma3"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (26, 4, 1, 256)
    assert cfg.tie_word_embeddings and cfg.sliding_window == 512 and cfg.query_pre_attn_scalar == 256
    assert cfg.layer_types.count("full_attention") == 4  # every 6th of 26 layers
    assert dict(cfg.rope_of("sliding_attention"))["rope_theta"] == 10000
    assert dict(cfg.rope_of("full_attention"))["rope_theta"] == 1000000
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    hf_shapes = {name: tuple(p.shape) for name, p in hf_model.state_dict().items() if name != "lm_head.weight"}
    ours = {e.hf_name: e.hf_shape for e in hf_mapping.expected_entries(cfg)}
    assert ours == hf_shapes


def _gemma3(**overrides):
    hf = tiny_config("gemma3")
    for key, value in overrides.items():
        setattr(hf, key, value)
    return hf


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        (dict(hidden_activation="gelu"), "hidden_activation"),
        (dict(attention_bias=True), "attention_bias"),
        (
            dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
            "rope_parameters",
        ),
    ],
)
def test_unsupported_gemma3_options_are_named(overrides, field):
    with pytest.raises(ValueError, match=rf"gemma3_text.*{field}"):
        config_from_hf(_gemma3(**overrides))


def test_gemma3_rope_types_are_named():
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6},
    }
    with pytest.raises(ValueError, match="'yarn'.*gemma3"):
        config_from_hf(_gemma3(rope_parameters=rope))
    rope["sliding_attention"], rope["full_attention"] = rope["full_attention"], rope["sliding_attention"]
    with pytest.raises(ValueError, match=r"gemma3_text.*sliding_attention.*'yarn'"):
        config_from_hf(_gemma3(rope_parameters=rope))


def test_multimodal_gemma3_is_refused_naming_the_text_model():
    from transformers import Gemma3Config as HFGemma3Config

    with pytest.raises(ValueError, match=r"'gemma3'.*text model only.*gemma3_text"):
        config_from_hf(HFGemma3Config())
