"""``policy.lora.adapter_path`` in process (no Ray): the driver's checks of a PEFT adapter
against the config and the model, each refusal by name, and the arrays reaching the torch
wrapper and the JAX Dense adapters.  The Ray round trip (export -> new run -> same
logprobs on fsdp1 / dtensor-tp2 / jax) is ``tests/backends/test_lora_backends.py`` (slow).

``tests/data/peft/adapter_config_peft_0.21.2.json`` is the ``adapter_config.json`` peft 0.21.2
wrote for ``LoraConfig(r=4, lora_alpha=8, target_modules=[q_proj, v_proj, down_proj],
init_lora_weights=False, task_type="CAUSAL_LM")`` (base model set to null), so the checks see
every field real PEFT writes; the test marked with ``importorskip("peft")`` checks against
peft itself where it is installed (extra ``lora``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from core.config import ConfigError
from core.models.lora import adapter_names, linear_module_shapes, peft_adapter_config, write_peft_adapter
from core.policy.config import PolicyConfig
from core.policy.lora_adapter import base_model_error, check_lora_adapter, config_errors
from tests.torch_backends.conftest import hf_logprobs, pg_batch, policy_config

PEFT_CONFIG = json.loads((Path(__file__).parents[1] / "data/peft/adapter_config_peft_0.21.2.json").read_text())
LORA = {"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _policy(model_dir, **lora) -> PolicyConfig:
    cfg = policy_config(Path(model_dir), "torch_fsdp")
    cfg["lora"] = {**LORA, **lora}
    return PolicyConfig.checked(cfg)


def _adapted(model_dir, policy: PolicyConfig, seed: int | None = None):
    """The tiny model with ``policy.lora``'s starting adapters; ``seed``: B random instead."""
    from transformers import AutoModelForCausalLM

    from backends.torch_common.lora import apply_lora

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    apply_lora(model, policy.lora)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("lora_B.weight"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _write(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """An adapter directory in PEFT's format: ``config`` + ``tensors`` (backend names)."""
    write_peft_adapter(path, config, tensors)
    return path


def _trained_adapter(model_dir, tmp_path) -> tuple[Path, torch.nn.Module]:
    """What an HF export writes for a LoRA run whose B moved: (adapter dir, that model)."""
    policy = _policy(model_dir)
    model = _adapted(model_dir, policy, seed=3)
    lora = policy.lora
    config = peft_adapter_config(policy.model_name, lora.rank, lora.alpha, 0.0, lora.targets, lora.use_rslora)
    adapters = {n: p.detach() for n, p in model.named_parameters() if ".lora_" in n}
    return _write(tmp_path / "adapter", config, adapters), model


@pytest.fixture(scope="module")
def llama(model_dirs):
    from transformers import AutoConfig

    return model_dirs["llama"], AutoConfig.from_pretrained(model_dirs["llama"])


def test_an_exported_adapter_starts_the_torch_model_where_it_ended(llama, tmp_path):
    model_dir, hf_config = llama
    adapter, trained = _trained_adapter(model_dir, tmp_path)
    policy = _policy(model_dir, adapter_path=str(adapter))
    check_lora_adapter(policy, hf_config)  # the driver's checks pass
    restarted = _adapted(model_dir, policy)
    data = pg_batch(4, seed=0)
    ids, lens = data["input_ids"], data["input_lengths"]
    assert torch.equal(hf_logprobs(restarted, ids, lens), hf_logprobs(trained, ids, lens))
    seeded = _adapted(
        model_dir, policy.model_copy(update={"lora": policy.lora.model_copy(update={"adapter_path": None})})
    )
    assert not torch.equal(hf_logprobs(seeded, ids, lens), hf_logprobs(trained, ids, lens))


def test_jax_dense_adapters_take_the_files_arrays(llama, tmp_path):
    from backends.jax_pjit.hf_mapping import flat_values, from_pretrained
    from backends.jax_pjit.lora import apply_lora
    from backends.jax_pjit.models import make_apply_fn

    model_dir, _ = llama
    adapter, trained = _trained_adapter(model_dir, tmp_path)
    policy = _policy(model_dir, adapter_path=str(adapter))
    jmodel, mcfg, _ = from_pretrained(str(model_dir))
    adapted = apply_lora(jmodel, mcfg, policy.lora)
    flat = flat_values(make_apply_fn(jmodel)[1])
    state = trained.state_dict()
    assert len(adapted) == 3 * trained.config.num_hidden_layers
    for item in adapted:  # JAX lora_a [*in, r] / lora_b [r, *out] are the file's A^T / B^T
        base = item.kernel_path[:-1]
        a, b = np.asarray(flat[base + ("lora_a",)]), np.asarray(flat[base + ("lora_b",)])
        name_a, name_b = adapter_names(item.module)
        np.testing.assert_array_equal(a.reshape(-1, a.shape[-1]).T, state[name_a].numpy())
        np.testing.assert_array_equal(b.reshape(b.shape[0], -1).T, state[name_b].numpy())


def test_peft_writes_what_we_load(llama, tmp_path):
    """Checked against peft itself where it is installed (``pip install -e .[lora]``)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model_dir, hf_config = llama
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=LORA["target_modules"], init_lora_weights=False, task_type="CAUSAL_LM"
    )
    peft_model = peft.get_peft_model(base, peft_cfg).eval()
    peft_model.save_pretrained(tmp_path / "peft")
    policy = _policy(model_dir, adapter_path=str(tmp_path / "peft"))
    check_lora_adapter(policy, hf_config)
    data = pg_batch(4, seed=0)
    ids, lens = data["input_ids"], data["input_lengths"]
    ours = hf_logprobs(_adapted(model_dir, policy), ids, lens)
    torch.testing.assert_close(ours, hf_logprobs(peft_model, ids, lens), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- refusals
def _peft_dir(tmp_path: Path, model_dir, hf_config, **changes) -> Path:
    """PEFT 0.21.2's config (``changes`` applied) + zero tensors of the right PEFT names."""
    from core.models.lora import adapter_shapes

    config = {**copy.deepcopy(PEFT_CONFIG), "base_model_name_or_path": str(model_dir), **changes}
    shapes = adapter_shapes(linear_module_shapes(hf_config), LORA["target_modules"], LORA["rank"])
    return _write(tmp_path / "peft", config, {n: torch.zeros(s) for n, s in shapes.items()})


def test_peft_0_21_config_passes_and_each_unsupported_feature_is_named(llama, tmp_path):
    model_dir, hf_config = llama
    policy = _policy(model_dir, adapter_path=str(_peft_dir(tmp_path, model_dir, hf_config)))
    check_lora_adapter(policy, hf_config)
    assert config_errors(PEFT_CONFIG, policy.lora, "f") == []
    for field, value in [
        ("use_dora", True),
        ("bias", "lora_only"),
        ("modules_to_save", ["lm_head"]),
        ("layers_to_transform", 0),
        ("rank_pattern", {"q_proj": 8}),
        ("alpha_pattern", {"q_proj": 16}),
        ("peft_type", "IA3"),
        ("target_modules", ".*proj"),
    ]:
        (error,) = config_errors({**PEFT_CONFIG, field: value}, policy.lora, "f")
        assert error.startswith(f"f: {field}") and repr(value) in error, error


def test_config_mismatches_name_both_fields(llama):
    model_dir, _ = llama
    policy = _policy(model_dir, rank=8, alpha=4.0, use_rslora=True, target_modules=["q_proj"])
    errors = config_errors(PEFT_CONFIG, policy.lora, "a/adapter_config.json")
    assert errors == [
        "policy.lora.rank=8 but a/adapter_config.json has r=4: set policy.lora.rank to the adapter's",
        "policy.lora.alpha=4.0 but a/adapter_config.json has lora_alpha=8: set policy.lora.alpha to the adapter's",
        "policy.lora.use_rslora=True but a/adapter_config.json has use_rslora=False: "
        "set policy.lora.use_rslora to the adapter's",
        "policy.lora.target_modules=['q_proj'] but a/adapter_config.json has target_modules="
        "['down_proj', 'q_proj', 'v_proj']: set policy.lora.target_modules to the adapter's",
    ]
    all_linear = _policy(model_dir, target_modules="all-linear")
    assert config_errors({**PEFT_CONFIG, "target_modules": "all-linear"}, all_linear.lora, "f") == []


def test_base_model_compares_hub_ids_and_local_paths(tmp_path):
    hub_cache = tmp_path / "hub/models--Qwen--Qwen3-0.6B/snapshots/abc"
    hub_cache.mkdir(parents=True)
    assert base_model_error("Qwen/Qwen3-0.6B", str(hub_cache), "f") is None
    assert base_model_error("qwen/qwen3-0.6b", "Qwen/Qwen3-0.6B", "f") is None
    assert base_model_error("Qwen/Qwen3-0.6B", "/models/Qwen3-0.6B", "f") is None  # a downloaded copy
    assert base_model_error(str(tmp_path / "a/../hub"), str(tmp_path / "hub"), "f") is None
    assert base_model_error(None, "anything", "f") is None  # the adapter names no base: nothing to compare
    error = base_model_error("Qwen/Qwen3-0.6B", "meta-llama/Llama-3.2-1B", "f")
    assert error is not None and "policy.lora.adapter_check_base_model=false" in error
    assert base_model_error("/models/a", "/models/b", "f") is not None


def test_a_foreign_base_or_wrong_tensors_are_refused_before_any_worker(llama, tmp_path):
    model_dir, hf_config = llama
    path = _peft_dir(tmp_path, model_dir, hf_config, base_model_name_or_path="meta-llama/Llama-3.2-1B")
    with pytest.raises(ValueError, match=r"base_model_name_or_path='meta-llama/Llama-3.2-1B'"):
        check_lora_adapter(_policy(model_dir, adapter_path=str(path)), hf_config)
    check_lora_adapter(_policy(model_dir, adapter_path=str(path), adapter_check_base_model=False), hf_config)

    from safetensors.torch import load_file, save_file

    weights = path / "adapter_model.safetensors"
    tensors = load_file(weights)
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[q_a] = torch.zeros(4, 7)
    del tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] = torch.zeros(4, 64)
    save_file(tensors, weights)
    policy = _policy(model_dir, adapter_path=str(path), adapter_check_base_model=False)
    with pytest.raises(ValueError) as err:
        check_lora_adapter(policy, hf_config)
    text = str(err.value)
    assert "1 adapter tensor(s) missing: base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in text
    assert (
        "1 unexpected tensor(s) (not an adapter of a targeted module): base_model.model.model.layers.0.self_attn.k_proj"
        in text
    )
    in_features = hf_config.hidden_size
    assert f"tensor {q_a}: expected shape [4, {in_features}], found [4, 7]" in text


def test_missing_pickled_and_unset_adapters_are_named(llama, tmp_path):
    model_dir, hf_config = llama
    with pytest.raises(FileNotFoundError, match=r"policy.lora.adapter_path: no such directory"):
        check_lora_adapter(_policy(model_dir, adapter_path=str(tmp_path / "nope")), hf_config)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no adapter_config.json \(not a PEFT adapter directory\)"):
        check_lora_adapter(_policy(model_dir, adapter_path=str(tmp_path / "empty")), hf_config)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text(json.dumps(PEFT_CONFIG))
    (pickled / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"adapter_model.bin: pickled adapter weights are not read"):
        check_lora_adapter(_policy(model_dir, adapter_path=str(pickled)), hf_config)
    off = policy_config(Path(model_dir), "torch_fsdp")
    off["lora"] = {"enabled": False, "adapter_path": str(pickled)}
    with pytest.raises(ConfigError, match=r"policy.lora.adapter_path: .* policy.lora.enabled is false"):
        PolicyConfig.checked(off)


def test_the_policy_refuses_a_bad_adapter_before_any_worker(llama, tokenizer, tmp_path):
    from benchmarks.lib.layouts import parse_layout
    from tests.backends.conftest import layout_config, refused_on_driver

    model_dir, hf_config = llama
    path = _peft_dir(tmp_path, model_dir, hf_config, r=8)
    cfg = layout_config("fsdp1-dp2", model_dir, lora={**LORA, "adapter_path": str(path)})
    with pytest.raises(ValueError, match=r"policy.lora.rank=4 but .*adapter_config.json has r=8"):
        refused_on_driver(parse_layout("fsdp1-dp2"), cfg, tokenizer)
