"""Real HF ``config.json`` files (tests/data/hf_configs, copied verbatim from the hub
repositories) read by the JAX backend: the parameter shapes it builds must be the ones HF's
model has.  HF's model is built on the meta device: no 0.6B parameters are allocated."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from jax.sharding import PartitionSpec

from backends.jax_pjit import hf_mapping
from backends.jax_pjit.models import abstract_model, config_from_hf, logical_axes_tree
from backends.jax_pjit.sharding import logical_to_mesh_spec

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


def _hf_memory_layout(shapes: dict[str, tuple]) -> dict[str, tuple]:
    """Checkpoint names (one tensor per expert) -> transformers 5's in-memory parameters, which
    fuse the experts: ``experts.gate_up_proj`` [X, 2I, H] and ``experts.down_proj`` [X, H, I]."""
    out: dict[str, tuple] = {}
    experts: dict[str, dict[str, tuple]] = {}
    for name, shape in shapes.items():
        if ".mlp.experts." not in name:
            out[name] = shape
            continue
        prefix, rest = name.split(".mlp.experts.")
        j, proj = rest.split(".")[:2]
        experts.setdefault(prefix, {})[f"{proj}/{j}"] = shape
    for prefix, parts in experts.items():
        n = len(parts) // 3
        inter, hidden = parts["gate_proj/0"]
        assert all(
            parts[f"{p}/{j}"] == parts[f"{p}/0"] for p in ("gate_proj", "up_proj", "down_proj") for j in range(n)
        )
        out[f"{prefix}.mlp.experts.gate_up_proj"] = (n, 2 * inter, hidden)
        out[f"{prefix}.mlp.experts.down_proj"] = (n,) + parts["down_proj/0"]
    return out


@pytest.mark.slow  # ~6 s: 18k expert entries and HF's 48-layer meta model
def test_qwen3_30b_a3b_param_shapes_match_hf_model():
    from transformers import AutoModelForCausalLM

    hf_config = _hf_config("Qwen3-30B-A3B")
    cfg = config_from_hf(hf_config)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    hf_shapes = {k: tuple(p.shape) for k, p in hf_model.named_parameters()}
    entries = hf_mapping.expected_entries(cfg)
    assert _hf_memory_layout({e.hf_name: e.hf_shape for e in entries}) == hf_shapes
    # 128 experts x 3 per-expert tensors in each of the 48 (all sparse) layers
    assert sum(e.expert is not None for e in entries) == 48 * 128 * 3
    assert sum(math.prod(e.hf_shape) for e in entries) == sum(math.prod(s) for s in hf_shapes.values())


def test_qwen3_30b_a3b_reads_as_published():
    cfg = config_from_hf(_hf_config("Qwen3-30B-A3B"))
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        "qwen3_moe",
        128,
        8,
        768,
    )
    assert cfg.norm_topk_prob and cfg.qk_norm and cfg.head_dim == 128 and cfg.mlp_only_layers == ()
    one_layer = dataclasses.replace(cfg, num_layers=1)
    axes = logical_axes_tree(abstract_model(one_layer), pure=True)["layers"][0]["mlp"]
    assert axes["experts"]["gate_proj"] == ("expert", "expert_embed", "mlp")
    assert axes["experts"]["down_proj"] == ("expert", "mlp", "expert_embed")
    assert axes["gate"]["kernel"] == ("expert_embed", "expert")
    # experts over fsdp, their columns over tp: every device holds a distinct block
    assert logical_to_mesh_spec(axes["experts"]["gate_proj"]) == PartitionSpec("fsdp", None, "tp")
