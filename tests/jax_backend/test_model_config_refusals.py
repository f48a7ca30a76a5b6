"""HF configs the flax models refuse, by name (model type, rope type, options of Qwen3 and
Qwen3-MoE, a binding sliding window), and the ones they accept; checkpoint errors and the
forward parity: tests/jax_backend/test_model_parity.py."""

from __future__ import annotations

import pytest
import torch

from backends.jax_pjit import hf_mapping
from backends.jax_pjit.models import config_from_hf


def test_unsupported_model_type_is_named():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="gpt2"):
        config_from_hf(GPT2Config(n_layer=1, n_embd=32, n_head=2))


def test_unsupported_rope_type_is_named():
    from transformers import LlamaConfig

    hf = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    )
    with pytest.raises(ValueError, match="'linear'"):
        config_from_hf(hf)


def test_mistral_with_binding_window_is_rejected():
    from transformers import MistralConfig

    with pytest.raises(ValueError, match="sliding_window"):
        config_from_hf(MistralConfig(num_hidden_layers=1, sliding_window=16, max_position_embeddings=512))


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), "sliding_window=16"),
        (
            dict(use_sliding_window=True, layer_types=["full_attention", "sliding_attention"], sliding_window=16),
            "1 sliding_attention",
        ),
        (dict(attention_bias=True), "attention_bias"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_qwen3_unsupported_options_are_named(fields, named):
    from transformers import Qwen3Config

    base = dict(
        vocab_size=256,
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    with pytest.raises(ValueError, match=rf"'qwen3'.*{named}"):
        config_from_hf(Qwen3Config(**base, **fields))


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(use_sliding_window=True, sliding_window=16), "sliding_window=16"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
        (dict(attention_bias=True), "attention_bias"),
    ],
)
def test_qwen3_moe_unsupported_options_are_named(fields, named):
    from transformers import Qwen3MoeConfig

    from core.testing.tiny_models import TINY_MODELS

    base = {k: v for k, v in TINY_MODELS["qwen3_moe"].items() if k != "family"} | dict(vocab_size=256)
    with pytest.raises(ValueError, match=named):
        config_from_hf(Qwen3MoeConfig(**(base | fields)))


def test_qwen3_moe_sparse_layers_follow_hf():
    """decoder_sparse_step and mlp_only_layers pick the same sparse layers as HF's model."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from backends.jax_pjit.models.qwen3_moe import layer_kind

    hf = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    cfg = config_from_hf(hf)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf)
    hf_sparse = [hasattr(layer.mlp, "experts") for layer in hf_model.model.layers]
    assert hf_sparse == [False, True, False, False, False, True]
    assert [layer_kind(cfg, i) == "moe" for i in range(6)] == hf_sparse
    shapes = {e.hf_name: e.hf_shape for e in hf_mapping.expected_entries(cfg)}
    assert shapes["model.layers.5.mlp.experts.3.down_proj.weight"] == (64, 32)
    assert shapes["model.layers.3.mlp.down_proj.weight"] == (64, 128)
    assert "model.layers.3.mlp.gate.weight" not in shapes


def test_qwen3_window_that_never_binds_is_accepted():
    """A window of max_position_embeddings tokens masks nothing: the full-attention model."""
    from transformers import Qwen3Config

    hf = Qwen3Config(
        vocab_size=256,
        num_key_value_heads=2,
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=32,
        max_position_embeddings=512,
        use_sliding_window=True,
        sliding_window=512,
        max_window_layers=0,
    )
    assert "sliding_attention" in hf.layer_types
    assert config_from_hf(hf).qk_norm
