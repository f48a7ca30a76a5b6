"""Gemma 3 text through the vLLM engine: refit from torch_fsdp and jax_pjit into a CPU engine
started with dummy weights, then greedy generation equal to HF ``generate`` and the policy's
logprobs on the engine's samples within token_mult_prob_error 1.001.  The tiny ``gemma3_gen``
has a sliding window of 8 and prompts + completions up to 14 tokens, so the window binds in
the engine, in HF and in both policies.  Slow: an engine and two policies."""

from __future__ import annotations

import pytest
import torch

from core.distributed import RayVirtualCluster
from core.policy import Policy
from core.refit import refit_policy_generation
from core.testing.tiny_models import save_tiny_model
from tests.generation.conftest import (
    MAX_NEW,
    PROMPT_WIDTH,
    generated_rows,
    hf_greedy,
    one_engine,
    prompts,
    refit_config,
    rollout_agreement,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return save_tiny_model("gemma3_gen", tmp_path_factory.mktemp("gemma3_gen"))


@pytest.fixture(scope="module")
def engine(ray_session, gemma3_dir, tokenizer):
    with one_engine(gemma3_dir, tokenizer, "vllm_gemma3") as generation:
        yield generation


@pytest.mark.parametrize(("backend", "transport"), [("torch_fsdp", "ipc"), ("jax_pjit", "collective")])
def test_gemma3_refit_serves_the_policy(backend, transport, engine, gemma3_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    assert PROMPT_WIDTH + MAX_NEW > hf.config.sliding_window
    jax = backend == "jax_pjit"
    name = f"refit_gemma3_{backend}"
    cluster = RayVirtualCluster([1 if jax else 2], use_gpus=False, num_cpus_per_bundle=2 if jax else 1, name=name)
    policy = Policy(cluster, refit_config(gemma3_dir, backend), tokenizer, name_prefix=name)
    try:
        refit_policy_generation(policy, engine, transport)
        data = prompts(seed=11)
        out = engine.generate(data, greedy=True)
        assert generated_rows(out, data) == hf_greedy(hf, data)
        mult, kl = rollout_agreement(policy, out, data)
        assert 1.0 <= mult <= 1.001, f"token_mult_prob_error {mult}"
        assert abs(kl) < 1e-4, f"KL(gen || policy) {kl}"
    finally:
        policy.shutdown()
        cluster.shutdown()
