"""Adapter-only LoRA refit (``policy.lora.refit: adapter``) into a real vLLM engine.

Two fp32 engines for the tiny Llama: one started with LoRA (adapter refit), one without
(merged refit).  From FSDP1, DTensor (tp2: A/B sharded with their base layers) and JAX: the
first refit sends the base and the adapter, later ones the adapter alone (its bytes only);
after LoRA train steps the engine's logprobs match the policy's (token_mult_prob_error in
[1, 1.001)) and the adapter engine's logprobs equal the merged engine's.
"""

from __future__ import annotations

import pytest
import torch

from core.config.loader import DEFAULT_CONFIG_PATH, load_raw_config
from core.distributed import RayVirtualCluster
from core.losses import ClippedPGLossFn
from core.policy import Policy
from core.refit import RefitError, refit_policy_generation
from tests.generation.conftest import prompts, refit_config, rollout_agreement
from tests.torch_backends.conftest import pg_batch

pytestmark = pytest.mark.slow

LORA = {"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": "all-linear", "init_seed": 0}


def lora_config(model_dir, backend: str, refit: str, tp: int = 1) -> dict:
    cfg = refit_config(model_dir, backend, tp=tp)
    cfg["lora"] = dict(LORA, refit=refit)
    return cfg


def adapter_bytes(model_dir) -> int:
    """fp32 bytes of A [r, in] and B [out, r] of every decoder linear (counted from HF)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n]
    return sum(LORA["rank"] * (m.in_features + m.out_features) * 4 for m in linears)


@pytest.fixture(scope="module")
def engines(ray_session, gen_model_dirs, tokenizer):
    from core.generation import VllmGeneration

    model_dir = gen_model_dirs["llama_gen"]
    made = []
    try:
        for mode in ("adapter", "merged"):
            cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1, name=f"vllm_lora_{mode}")
            gen = VllmGeneration(
                cluster, lora_config(model_dir, "torch_fsdp", mode), tokenizer, name_prefix=f"vl_{mode}"
            )
            made.append((gen, cluster))
        assert made[0][0].refit_mode == "adapter" and made[1][0].refit_mode == "merged"
        yield made[0][0], made[1][0]
    finally:
        for gen, cluster in made:
            gen.shutdown()
            cluster.shutdown()


def _check(policy, adapter_engine, merged_engine, data, label):
    refit_policy_generation(policy, merged_engine, "ipc")
    out = adapter_engine.generate(data, greedy=True)
    mult, kl = rollout_agreement(policy, out, data)
    assert 1.0 <= mult < 1.001, f"{label}: token_mult_prob_error {mult}"
    merged = merged_engine.generate(data, greedy=True)
    assert torch.equal(out["output_ids"], merged["output_ids"]), f"{label}: adapter vs merged engine tokens"
    diff = (out["logprobs"] - merged["logprobs"]).abs().max().item()
    assert diff <= 1e-4, f"{label}: adapter vs merged engine logprobs differ by {diff}"
    return out


def _run(policy, engines, model_dir, seed: int, transports: tuple[str, str], label: str) -> None:
    adapter_engine, merged_engine = engines
    loss = ClippedPGLossFn(load_raw_config(DEFAULT_CONFIG_PATH)["loss_fn"])
    data = prompts(seed=seed)
    first = refit_policy_generation(policy, adapter_engine, transports[0])
    assert first.parts == ("base", "adapter") and first.mode == "adapter"
    before = _check(policy, adapter_engine, merged_engine, data, f"{label} at B=0")
    for step in range(3):
        policy.train(pg_batch(4, seed=seed + step), loss)
    later = refit_policy_generation(policy, adapter_engine, transports[1])
    assert later.parts == ("adapter",), later
    assert later.bytes == adapter_bytes(model_dir) and later.as_metrics()["refit/adapter_only"] == 1.0
    after = _check(policy, adapter_engine, merged_engine, data, f"{label} after 3 LoRA steps")
    assert not torch.equal(before["logprobs"], after["logprobs"]), f"{label}: the adapter did not change the engine"


def test_fsdp1_adapter_refit(engines, gen_model_dirs, tokenizer):
    model_dir = gen_model_dirs["llama_gen"]
    cluster = RayVirtualCluster([2], use_gpus=False, num_cpus_per_bundle=1, name="lora_refit_fsdp1")
    policy = Policy(cluster, lora_config(model_dir, "torch_fsdp", "auto"), tokenizer, name_prefix="lora_refit_fsdp1")
    try:
        _run(policy, engines, model_dir, 11, ("ipc", "collective"), "fsdp1-dp2")
        # An adapter of another rank is refused by name before anything changes.
        policy.set_refit_part("adapter")
        wrong = {n: ((5, *s[1:]) if ".lora_A." in n else s, d) for n, (s, d) in policy.prepare_refit_info().items()}
        with pytest.raises(RefitError, match="lora_A.weight.*stream shape \\[5"):
            engines[0].prepare_adapter_refit(wrong)
        assert engines[0].weights_valid()
    finally:
        policy.shutdown()
        cluster.shutdown()


def test_dtensor_tp2_adapter_refit(engines, gen_model_dirs, tokenizer):
    model_dir = gen_model_dirs["llama_gen"]
    cfg = lora_config(model_dir, "torch_dtensor", "auto", tp=2)
    cluster = RayVirtualCluster([2], use_gpus=False, num_cpus_per_bundle=1, name="lora_refit_dtensor")
    policy = Policy(cluster, cfg, tokenizer, name_prefix="lora_refit_dtensor")
    try:
        # The engine holds another policy's base (or none): this one sends its own base first.
        _run(policy, engines, model_dir, 31, ("collective", "ipc"), "dtensor-tp2")
    finally:
        policy.shutdown()
        cluster.shutdown()


def test_jax_adapter_refit(engines, gen_model_dirs, tokenizer):
    model_dir = gen_model_dirs["llama_gen"]
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=2, name="lora_refit_jax")
    policy = Policy(cluster, lora_config(model_dir, "jax_pjit", "auto"), tokenizer, name_prefix="lora_refit_jax")
    try:
        # The engine holds FSDP1's base: a new policy sends its own base first.
        _run(policy, engines, model_dir, 21, ("collective", "ipc"), "jax-fsdp4-tp2")
    finally:
        policy.shutdown()
        cluster.shutdown()
