"""Tensor-parallel plans are data: built-in per model family, or a custom plan from config."""

import fnmatch

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

from backends.torch_common.optim import import_object
from backends.torch_dtensor.tp_plans import TP_PLANS, plan_for
from core.testing.tiny_models import build_tiny_model

CUSTOM_PLAN = {"lm_head": ColwiseParallel()}


def custom_plan_fn(model, sequence_parallel):
    return {"model.layers.*.mlp.up_proj": ColwiseParallel()}


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma3"])
def test_builtin_plan_covers_every_projection(name):
    model = build_tiny_model(name)
    plan = plan_for(model, sequence_parallel=True)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"model.layers.*.self_attn.{proj}" in plan
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.*.mlp.{proj}" in plan
    assert isinstance(plan["model.norm"], SequenceParallel)
    assert "model.norm" not in plan_for(model, sequence_parallel=False)
    # Per-head q/k norms (Qwen3, Gemma 3): DTensors over the heads dim with or without SP, so
    # their scales' gradients are summed over tp (tests/backends/test_parity.py,
    # dtensor-tp2*-qwen3; tests/torch_backends/test_gemma3_tp.py).  The heads dim: 2 in Qwen3's
    # [B, S, H, D] (normed before the transpose), 1 in Gemma 3's [B, H, S, D] (after it).
    heads_dim = {"qwen3": 2, "gemma3": 1}.get(name)
    for sp in (True, False):
        norms = {k: v for k, v in plan_for(model, sp).items() if k.endswith(("q_norm", "k_norm"))}
        assert len(norms) == (0 if heads_dim is None else 2)
        assert all(isinstance(v, SequenceParallel) and v.sequence_sharding[0].dim == heads_dim for v in norms.values())


def _style_of(plan, module_name):
    styles = [style for key, style in plan.items() if fnmatch.fnmatchcase(module_name, key)]
    assert len(styles) <= 1, (module_name, styles)
    return styles[0] if styles else None


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_sequence_parallel_shards_every_residual_norm(name):
    """Every norm on the residual stream (Gemma 3's pre/post feed-forward norms included) runs on
    sequence shards (dim 1 of [B, S, E]); Gemma's per-head q/k norms, with or without sequence
    parallelism, get replicated weights over head-sharded inputs (dim 1 of [B, heads, S, D]),
    so their gradients are reduced over the TP group."""
    model = build_tiny_model(name)
    norms = [n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
    per_head = [n for n in norms if n.endswith(("q_norm", "k_norm"))]
    residual = [n for n in norms if n not in per_head]
    assert len(residual) == 1 + model.config.num_hidden_layers * (4 if name == "gemma3" else 2)
    assert len(per_head) == (2 * model.config.num_hidden_layers if name == "gemma3" else 0)
    for sequence_parallel in (True, False):
        plan = plan_for(model, sequence_parallel=sequence_parallel)
        for n in residual:
            style = _style_of(plan, n)
            assert isinstance(style, SequenceParallel) if sequence_parallel else style is None, n
        for n in per_head:
            style = _style_of(plan, n)
            assert isinstance(style, SequenceParallel) and style.sequence_sharding[0].dim == 1, n


def test_custom_plan_from_config_path():
    model = build_tiny_model("llama")
    assert plan_for(model, False, import_object(f"{__name__}.CUSTOM_PLAN", "plan")) is CUSTOM_PLAN
    plan = plan_for(model, False, import_object(f"{__name__}.custom_plan_fn", "plan"))
    assert list(plan) == ["model.layers.*.mlp.up_proj"]
    with pytest.raises(ValueError, match="custom_parallel_plan must give a dict"):
        plan_for(model, False, lambda m, sp: ["not", "a", "dict"])
    with pytest.raises(ValueError, match="cannot import 'no.such.PLAN'"):
        import_object("no.such.PLAN", "policy.dtensor_cfg.custom_parallel_plan")


def test_unknown_family_needs_a_custom_plan():
    model = build_tiny_model("llama")
    model.config.model_type = "gpt_neox"
    with pytest.raises(ValueError, match="no tensor-parallel plan for model_type 'gpt_neox'"):
        plan_for(model, False)
    assert {"llama", "qwen2", "qwen3"} <= set(TP_PLANS)
    # Qwen3-MoE's experts have no plan (the JAX backend serves it; torch without tp does too).
    with pytest.raises(ValueError, match="no tensor-parallel plan for model_type 'qwen3_moe'"):
        plan_for(build_tiny_model("qwen3_moe"), False)
