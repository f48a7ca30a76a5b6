"""LoRA in process (no Ray): the config's refusals, core's math, the torch wrapper and the
JAX Dense adapters against each other.  The Ray cases (three backends, refit, export) are
``tests/backends/test_lora_backends.py`` (slow)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from core.config import ConfigError
from core.models.lora import (
    adapter_names,
    init_adapter,
    lora_scale,
    merge_adapter_stream,
    peft_name,
)
from core.policy.config import PolicyConfig
from tests.torch_backends.conftest import hf_logprobs, policy_config

LORA = {"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": "all-linear"}


def _cfg(backend: str = "torch_fsdp", **lora) -> dict:
    cfg = policy_config(Path("unused-model"), backend)
    cfg["lora"] = {**LORA, **lora}
    return cfg


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("lora", "field"),
    [
        ({"rank": 0}, "policy.lora.rank"),
        ({"alpha": -1.0}, "policy.lora.alpha"),
        ({"dropout": 1.0}, "policy.lora.dropout"),
        ({"target_modules": ["q_proj", "qkv"]}, "policy.lora.target_modules[1]"),
        ({"target_modules": []}, "policy.lora.target_modules"),
    ],
)
def test_bad_lora_fields_are_refused_by_the_schema(lora, field):
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        PolicyConfig.checked(_cfg(**lora))


def test_unsupported_combinations_are_refused_by_name():
    tp2 = _cfg("torch_dtensor", dropout=0.1)
    tp2["parallel"]["tensor_parallel_size"] = 2
    with pytest.raises(ConfigError, match=r"policy.lora.dropout: 0.1: .*tensor_parallel_size=2.*torch_dtensor"):
        PolicyConfig.checked(tp2)
    tp2["lora"]["dropout"] = 0.0
    assert PolicyConfig.checked(tp2).lora.enabled  # LoRA itself composes with TP
    with pytest.raises(ConfigError, match=r"policy.lora.dropout: 0.1: .*jax_pjit"):
        PolicyConfig.checked(_cfg("jax_pjit", dropout=0.1))
    assert PolicyConfig.checked(_cfg("torch_fsdp", dropout=0.1)).lora.dropout == 0.1
    for backend in ("torch_fsdp", "torch_dtensor"):
        cfg = _cfg(backend, dropout=0.1)
        cfg["activation_checkpointing"] = True
        with pytest.raises(
            ConfigError, match=r"policy.lora.dropout: 0.1: .*activation_checkpointing=true.*another mask"
        ):
            PolicyConfig.checked(cfg)
        cfg["lora"]["dropout"] = 0.0
        assert PolicyConfig.checked(cfg).lora.enabled  # LoRA itself composes with checkpointing


def test_tp_plan_switches_adapted_entries_to_lora_styles():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput

    from backends.torch_dtensor.tp_plans import (
        LoRAColwiseParallel,
        LoRARowwiseParallel,
        llama_style_plan,
        with_lora,
    )

    plan = llama_style_plan(sequence_parallel=True)
    lora = with_lora(plan, ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"])
    assert type(lora["model.layers.*.self_attn.q_proj"]) is LoRAColwiseParallel
    assert type(lora["model.layers.*.mlp.down_proj"]) is LoRARowwiseParallel
    assert lora["model.layers.*.mlp.down_proj"].output_layouts == (Shard(1),)  # layouts kept
    assert type(lora["model.layers.*.self_attn.k_proj"]) is ColwiseParallel  # not adapted: unchanged
    bad = {"model.layers.*.self_attn.q_proj": PrepareModuleInput()}
    with pytest.raises(ValueError, match=r"policy.lora: module 'model.layers.0.self_attn.q_proj' .*PrepareModuleInput"):
        with_lora(bad, ["model.layers.0.self_attn.q_proj"])


def test_a_target_the_model_lacks_is_named_with_the_linears_it_has():
    from transformers import GPT2Config, PhiConfig

    from core.policy.preflight import check_lora_targets

    phi = PhiConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64)
    cfg = PolicyConfig.checked(_cfg(target_modules=["q_proj", "gate_proj"]))
    with pytest.raises(ValueError, match=r"'gate_proj' is not a linear module of model_type 'phi'") as err:
        check_lora_targets(cfg, phi)
    assert "['dense', 'fc1', 'fc2', 'k_proj', 'q_proj', 'v_proj']" in str(err.value)
    check_lora_targets(PolicyConfig.checked(_cfg(target_modules=["q_proj"])), phi)  # q_proj exists
    with pytest.raises(
        ValueError, match=r"'all-linear' on model_type 'phi' cannot adapt its linears \['dense', 'fc1', 'fc2'\]"
    ):
        check_lora_targets(PolicyConfig.checked(_cfg()), phi)  # PEFT's all-linear would adapt them
    gpt2 = GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64)  # Conv1D layers: no linear but lm_head
    with pytest.raises(ValueError, match=r"'all-linear' adapts nothing in model_type 'gpt2'"):
        check_lora_targets(PolicyConfig.checked(_cfg()), gpt2)


def test_moe_experts_are_refused_by_name_and_all_linear_means_the_linears_there_are():
    """Qwen3-MoE's experts are fused 3-D tensors in transformers 5: naming an MLP projection is
    refused (naming the tensors), attention and "all-linear" pass -- also without dense layers,
    where "all-linear" is attention only -- and an expert's per-expert checkpoint name (what the
    JAX weight table lists) is never adapted."""
    from core.models.lora import adapted_modules
    from core.policy.preflight import check_lora_targets
    from core.testing.tiny_models import tiny_config

    moe = tiny_config("qwen3_moe")  # layer 0 dense (mlp_only_layers), layer 1 sparse
    for targets in (["q_proj", "gate_proj"], ["down_proj"]):
        with pytest.raises(ValueError, match=r"model_type 'qwen3_moe', a mixture of experts") as err:
            check_lora_targets(PolicyConfig.checked(_cfg(target_modules=targets)), moe)
        assert "model.layers.1.mlp.experts.gate_up_proj [8, 64, 64]" in str(err.value)
    check_lora_targets(PolicyConfig.checked(_cfg(target_modules=["q_proj", "o_proj"])), moe)
    check_lora_targets(PolicyConfig.checked(_cfg()), moe)
    moe.mlp_only_layers = []  # every layer sparse, as the released Qwen3-MoE models
    check_lora_targets(PolicyConfig.checked(_cfg()), moe)
    names = ["model.layers.0.mlp.gate_proj", "model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.mlp.gate"]
    assert adapted_modules(names, ["gate_proj", "up_proj"]) == ["model.layers.0.mlp.gate_proj"]


# ----------------------------------------------------------------------------- core math
def test_init_is_peft_default_and_depends_on_seed_and_name_only():
    a, b = init_adapter("model.layers.0.self_attn.q_proj", 64, 48, 4, seed=3)
    assert a.shape == (4, 64) and b.shape == (48, 4) and a.dtype == np.float32
    assert not b.any() and np.abs(a).max() <= 1 / math.sqrt(64) and np.abs(a).max() > 0.9 / math.sqrt(64)
    again, _ = init_adapter("model.layers.0.self_attn.q_proj", 64, 48, 4, seed=3)
    other, _ = init_adapter("model.layers.0.self_attn.k_proj", 64, 48, 4, seed=3)
    reseeded, _ = init_adapter("model.layers.0.self_attn.q_proj", 64, 48, 4, seed=4)
    assert np.array_equal(a, again) and not np.array_equal(a, other) and not np.array_equal(a, reseeded)
    assert lora_scale(16, 4) == 4.0 and lora_scale(16, 4, use_rslora=True) == 8.0


def test_merged_stream_replaces_adapted_weights_and_drops_adapters():
    g = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(6, 5, generator=g), torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g))
    name_a, name_b = adapter_names("m.q_proj")
    stream = [
        ("m.norm.weight", torch.ones(5)),
        ("m.q_proj.weight", w),
        (name_a, a),
        (name_b, b),
        ("m.k_proj.weight", w),
    ]
    out = dict(merge_adapter_stream(stream, ["m.q_proj"], 0.5, lambda t: t.to(torch.float64)))
    assert list(out) == ["m.norm.weight", "m.q_proj.weight", "m.k_proj.weight"]
    torch.testing.assert_close(out["m.q_proj.weight"], (w + 0.5 * b @ a).double())
    assert peft_name(name_a) == "base_model.model.m.q_proj.lora_A.weight"
    with pytest.raises(RuntimeError, match="incomplete adapters.*m.q_proj"):
        list(merge_adapter_stream(stream[:3], ["m.q_proj"], 0.5, lambda t: t))


# ----------------------------------------------------------------------------- torch and JAX models
@pytest.fixture(scope="module")
def qwen2(model_dirs):
    from transformers import AutoModelForCausalLM

    return model_dirs["qwen2"], AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"], dtype=torch.float32).eval()


def _batch():
    from tests.torch_backends.conftest import pg_batch

    return pg_batch(4, seed=0)


def _adapted(model_dir, **lora):
    from transformers import AutoModelForCausalLM

    from backends.torch_common.lora import apply_lora, trainable_parameters
    from core.policy.config import LoRAConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    modules = apply_lora(model, LoRAConfig(**{**LORA, **lora}))
    return model, modules, list(trainable_parameters(model))


def test_torch_zero_b_is_the_base_model_and_only_adapters_train(qwen2):
    model_dir, base = qwen2
    model, modules, trainable = _adapted(model_dir)
    data = _batch()
    ids, lens = data["input_ids"], data["input_lengths"]
    assert torch.equal(hf_logprobs(model, ids, lens), hf_logprobs(base, ids, lens))  # B = 0: exactly the base
    assert len(modules) == 7 * base.config.num_hidden_layers and len(trainable) == 2 * len(modules)
    model.train()
    model(input_ids=ids).logits.sum().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(".lora_" in n for n in grads)


def _random_b(model, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_torch_merged_weights_compute_the_adapted_model(qwen2):
    from transformers import AutoModelForCausalLM

    model_dir, _ = qwen2
    model, modules, _ = _adapted(model_dir, target_modules=["q_proj", "o_proj", "down_proj"], use_rslora=True)
    _random_b(model)
    scale = lora_scale(LORA["alpha"], LORA["rank"], use_rslora=True)
    merged = dict(merge_adapter_stream(model.state_dict().items(), modules, scale, lambda t: t))
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    plain.load_state_dict(merged)
    data = _batch()
    ids, lens = data["input_ids"], data["input_lengths"]
    torch.testing.assert_close(hf_logprobs(plain, ids, lens), hf_logprobs(model, ids, lens), rtol=0, atol=1e-5)


def test_jax_adapters_match_torch_from_the_same_init(qwen2):
    """JAX Dense + LoRAParam vs torch LoRALinear: B = 0 is exactly the base JAX model; with the
    same non-zero B both compute the same logits (1e-5), and only adapters get gradients."""
    import jax
    import jax.numpy as jnp

    from backends.jax_pjit.hf_mapping import flat_values, from_pretrained
    from backends.jax_pjit.lora import LoRAParam, apply_lora
    from backends.jax_pjit.models import make_apply_fn
    from backends.jax_pjit.steps import value_and_grad_of
    from core.policy.config import LoRAConfig

    model_dir, _ = qwen2
    data = _batch()
    ids = jnp.asarray(data["input_ids"].numpy())
    mask = (np.arange(ids.shape[1])[None] < data["input_lengths"].numpy()[:, None]).astype(np.int32)
    base_fn, base_params = make_apply_fn(from_pretrained(str(model_dir))[0])
    jmodel, mcfg, _ = from_pretrained(str(model_dir))
    adapted = apply_lora(jmodel, mcfg, LoRAConfig(**LORA))
    apply_fn, params = make_apply_fn(jmodel)
    base_fn, apply_fn = jax.jit(base_fn), jax.jit(apply_fn)  # eager nnx runs op by op: slow
    assert np.array_equal(np.asarray(apply_fn(params, ids, mask)), np.asarray(base_fn(base_params, ids, mask)))

    torch_model, modules, _ = _adapted(model_dir)
    assert sorted(a.module for a in adapted) == sorted(modules)
    _random_b(torch_model)
    state = torch_model.state_dict()
    flat = flat_values(params)
    for item in adapted:  # torch's B [out, r] -> JAX's lora_b [r, *out]
        path = item.kernel_path[:-1] + ("lora_b",)
        b = state[adapter_names(item.module)[1]].numpy()
        flat[path] = jnp.asarray(b.T.reshape(flat[path].shape))
        a_jax = np.asarray(flat[item.kernel_path[:-1] + ("lora_a",)])
        np.testing.assert_array_equal(
            a_jax.reshape(-1, a_jax.shape[-1]).T, state[adapter_names(item.module)[0]].numpy()
        )
    from flax import nnx

    nnx.replace_by_pure_dict(params, _nested(flat))
    with torch.no_grad():
        ref = torch_model(input_ids=data["input_ids"], attention_mask=torch.as_tensor(mask)).logits.numpy()
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(apply_fn(params, ids, mask))[valid], ref[valid], rtol=0, atol=1e-5)

    grad_fn = jax.jit(value_and_grad_of(lambda p: (apply_fn(p, ids, mask).sum(), None), LoRAParam))
    (_, _), grads = grad_fn(params)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert len(leaves) == 2 * len(adapted) and all("lora_" in jax.tree_util.keystr(p) for p, _ in leaves)


def _nested(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out
