"""A tensor-parallel engine (vLLM tp=2, two worker processes): every engine worker loads
its shard of every bucket, over both transports (collective: policy rank 0 + 2 engine ranks)."""

from __future__ import annotations

import pytest
import torch

from core.distributed import RayVirtualCluster
from core.generation import VllmGeneration
from core.policy import Policy
from core.refit import refit_policy_generation
from tests.generation.conftest import generated_rows, hf_greedy, prompts, refit_config, rollout_agreement


# slow (~30 s): a tp=2 engine; the one-worker engine refits on every transport in CI
@pytest.mark.slow
def test_tp2_engine_refit_from_fsdp1_both_transports(ray_session, gen_model_dirs, tokenizer):
    from transformers import AutoModelForCausalLM

    model_dir = gen_model_dirs["llama_gen"]
    cfg = refit_config(model_dir, "torch_fsdp", bucket_bytes=64 * 1024)
    cfg["generation"]["vllm_cfg"]["tensor_parallel_size"] = 2
    pcluster = RayVirtualCluster([2], use_gpus=False, num_cpus_per_bundle=1, name="tp2e_p")
    gcluster = RayVirtualCluster([2], use_gpus=False, num_cpus_per_bundle=1, name="tp2e_g")
    policy = Policy(pcluster, cfg, tokenizer, name_prefix="tp2e_policy")
    generation = VllmGeneration(gcluster, cfg, tokenizer, name_prefix="tp2e_vllm")
    try:
        assert generation.num_engines == 1 and generation.workers_per_engine == 2
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        data = prompts(seed=31)
        for transport in ("collective", "ipc"):
            refit_policy_generation(policy, generation, transport)
            out = generation.generate(data, greedy=True)
            assert generated_rows(out, data) == hf_greedy(hf, data), transport
            mult, kl = rollout_agreement(policy, out, data)
            assert 1.0 <= mult <= 1.001 and abs(kl) < 1e-4, (transport, mult, kl)
    finally:
        generation.shutdown()
        policy.shutdown()
        gcluster.shutdown()
        pcluster.shutdown()
