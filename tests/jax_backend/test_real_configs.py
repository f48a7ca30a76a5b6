"""Real HF ``config.json`` files (tests/data/hf_configs, copied verbatim from the hub
repositories) read by the JAX backend: the parameter shapes it builds must be the ones HF's
model has.  HF's model is built on the meta device: no 0.6B parameters are allocated."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from backends.jax_pjit import hf_mapping
from backends.jax_pjit.models import abstract_model, config_from_hf, logical_axes_tree

CONFIGS = Path(__file__).parent.parent / "data" / "hf_configs"


def _hf_config(name: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(CONFIGS / name)


@pytest.mark.parametrize("name", ["Qwen3-0.6B"])
def test_param_shapes_match_hf_model(name):
    from transformers import AutoModelForCausalLM

    hf_config = _hf_config(name)
    cfg = config_from_hf(hf_config)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    hf_shapes = {k: tuple(p.shape) for k, p in hf_model.named_parameters()}  # tied: one embedding
    ours = {e.hf_name: e.hf_shape for e in hf_mapping.expected_entries(cfg)}
    assert ours == hf_shapes


def test_qwen3_0_6b_reads_as_published():
    """The fields that distinguish Qwen3 from Llama, read from the real file."""
    cfg = config_from_hf(_hf_config("Qwen3-0.6B"))
    # head_dim 128 although hidden / heads = 1024 / 16 = 64
    assert (cfg.family, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == ("qwen3", 128, 16, 8)
    assert cfg.qk_norm and cfg.tie_word_embeddings and not cfg.qkv_bias
    assert cfg.rope_theta == 1e6 and cfg.rope_type == "default"
    entries = {e.hf_name: e for e in hf_mapping.expected_entries(cfg)}
    assert entries["model.layers.27.self_attn.q_proj.weight"].hf_shape == (2048, 1024)
    assert entries["model.layers.27.self_attn.o_proj.weight"].hf_shape == (1024, 2048)
    assert entries["model.layers.0.self_attn.k_norm.weight"].hf_shape == (128,)
    assert "lm_head.weight" not in entries
    one_layer = dataclasses.replace(cfg, num_layers=1)  # the axes of every layer are the same
    axes = logical_axes_tree(abstract_model(one_layer), pure=True)["layers"][0]["self_attn"]
    assert axes["q_norm"]["scale"] == axes["k_norm"]["scale"] == ("norm",)
