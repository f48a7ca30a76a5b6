"""Tiny Qwen3 (q/k norms, head_dim 32 != hidden / heads) and Qwen3-MoE refit into a vLLM CPU
engine: the engine then serves the policy (greedy tokens equal to HF, its logprobs the
policy's), before and after a training step.  The refit stream carries ``self_attn.q_norm`` /
``k_norm`` under their HF names, which vLLM's Qwen3 ``load_weights`` takes as they are, and
the MoE experts one tensor per expert (the torch backends split transformers' fused
``mlp.experts.gate_up_proj`` / ``down_proj`` on the way: core/refit/checkpoint_names.py), which
vLLM fuses again for its own kernel.  Qwen3 from FSDP1 and JAX; Qwen3-MoE from FSDP1,
DTensor (FSDP2) and JAX.

Slow (an engine of its own and two policies); the fast run refits Llama / Qwen2 engines
(tests/generation/test_refit_llama.py) and checks the Qwen3 name table in process
(tests/jax_backend/test_model_parity.py).
"""

from __future__ import annotations

import pytest
import torch

from core.distributed import RayVirtualCluster
from core.policy import Policy
from core.refit import refit_policy_generation
from tests.generation.conftest import (
    generated_rows,
    hf_greedy,
    hf_model_from,
    one_engine,
    prompts,
    refit_config,
    rollout_agreement,
)
from tests.torch_backends.conftest import pg_batch

pytestmark = pytest.mark.slow

BUCKET = 48 * 1024


@pytest.fixture(scope="module")
def engine(ray_session, gen_model_dirs, tokenizer):
    with one_engine(gen_model_dirs["qwen3_gen"], tokenizer, "vllm_qwen3") as generation:
        yield generation


def _assert_serves(policy, engine, hf_model, data, label):
    out = engine.generate(data, greedy=True)
    assert generated_rows(out, data) == hf_greedy(hf_model, data), f"{label}: greedy differs from HF generate"
    mult, kl = rollout_agreement(policy, out, data)
    assert 1.0 <= mult <= 1.001, f"{label}: token_mult_prob_error {mult}"
    assert abs(kl) < 1e-4, f"{label}: KL(gen || policy) {kl}"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from core.testing.tiny_models import save_tiny_model

    return save_tiny_model("qwen3_moe_gen", tmp_path_factory.mktemp("moe") / "qwen3_moe_gen")


@pytest.fixture(scope="module")
def moe_engine(ray_session, moe_dir, tokenizer):
    with one_engine(moe_dir, tokenizer, "vllm_qwen3_moe") as generation:
        yield generation


FSDP1, JAX = ("torch_fsdp", (2,), 1), ("jax_pjit", (1,), 2)


@pytest.mark.parametrize(
    "backend, bundles, cpus", [pytest.param(*FSDP1, id="fsdp1-dp2"), pytest.param(*JAX, id="jax-fsdp4-tp2")]
)
def test_qwen3_refit_serves_the_policy(engine, gen_model_dirs, tokenizer, tmp_path, backend, bundles, cpus):
    _refit_serves_the_policy(engine, gen_model_dirs["qwen3_gen"], tokenizer, tmp_path, backend, bundles, cpus)


@pytest.mark.parametrize(
    "backend, bundles, cpus",
    [
        pytest.param(*FSDP1, id="fsdp1-dp2"),
        pytest.param("torch_dtensor", (2,), 1, id="dtensor-dp2"),
        pytest.param(*JAX, id="jax-fsdp4-tp2"),
    ],
)
def test_qwen3_moe_refit_serves_the_policy(moe_engine, moe_dir, tokenizer, tmp_path, backend, bundles, cpus):
    _refit_serves_the_policy(moe_engine, moe_dir, tokenizer, tmp_path, backend, bundles, cpus)


def _refit_serves_the_policy(engine, model_dir, tokenizer, tmp_path, backend, bundles, cpus):
    from transformers import AutoModelForCausalLM

    from core.config.loader import DEFAULT_CONFIG_PATH, load_raw_config
    from core.losses import ClippedPGLossFn

    cfg = refit_config(model_dir, backend, bucket_bytes=BUCKET)
    cluster = RayVirtualCluster(list(bundles), use_gpus=False, num_cpus_per_bundle=cpus, name=f"qwen3_{backend}")
    policy = Policy(cluster, cfg, tokenizer, name_prefix=f"qwen3_{backend}")
    try:
        data = prompts(seed=5)
        refit_policy_generation(policy, engine, "collective")
        initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        _assert_serves(policy, engine, initial, data, f"{backend} collective")

        # After a step the norms' scales moved too: the engine must follow them.
        policy.train(pg_batch(4, seed=6), ClippedPGLossFn(load_raw_config(DEFAULT_CONFIG_PATH)["loss_fn"]))
        refit_policy_generation(policy, engine, "ipc")
        _assert_serves(policy, engine, hf_model_from(policy, tmp_path / "trained"), data, f"{backend} ipc after train")
    finally:
        policy.shutdown()
        cluster.shutdown()
