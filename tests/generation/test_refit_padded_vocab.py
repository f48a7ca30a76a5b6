"""Refit from a padded-vocabulary policy (vocab 301 padded to 302: DTensor tp=2, and JAX on a
4 x 2 mesh) into a vLLM engine: the stream carries the HF shapes and the engine serves the policy.

In its own module, not in tests/backends/test_padded_vocab.py: the contract suite's pooled
policy holds Ray CPU slots until that package ends, and an engine plus a policy need 3.
"""

from __future__ import annotations

import pytest

from core.distributed import RayVirtualCluster
from core.losses import ClippedPGLossFn
from core.policy import Policy
from tests.padded_vocab import V, ids_301, pg_batch_301, save_v301_model
from tests.padded_vocab import hf_model as _hf


# Slow on both backends (22 s each on the 2-core machine): the contract suite checks, on every
# fast layout, that a padded policy's refit manifest and stream carry the HF [301, H] shapes
# (tests/backends/test_padded_vocab.py); this adds only the engine serving them.
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch_dtensor", "jax_pjit"])
def test_refit_tp2_padded_policy_into_vllm(backend, ray_session, tokenizer, tmp_path):
    """A vLLM engine (CPU, dummy weights) for the 301-token model (head_dim 32, which vLLM's
    CPU attention serves) is refit from the tp=2 padded policy: the stream carries [301, H]
    (the engine checks every shape against its own config), and the engine then serves the
    policy -- greedy tokens of HF generate, logprobs within token_mult_prob_error 1.001 of
    the policy's -- before and after a training step."""
    from core.config.loader import DEFAULT_CONFIG_PATH, load_raw_config
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

    model_dir = save_v301_model("llama_gen", tmp_path / "llama_gen_v301")
    data = prompts(seed=3)
    data["input_ids"] = ids_301(data["input_ids"])
    data["input_ids"][:, 0] = 1  # BOS
    with one_engine(model_dir, tokenizer, "vllm_v301") as engine:
        cfg = refit_config(model_dir, backend, tp=2, bucket_bytes=64 * 1024)  # JAX: fsdp 4 x tp 2
        bundles, cpus = ([2], 1) if backend == "torch_dtensor" else ([1], 2)
        cluster = RayVirtualCluster(bundles, use_gpus=False, num_cpus_per_bundle=cpus, name="refit_v301")
        policy = Policy(cluster, cfg, tokenizer, name_prefix="refit_v301")
        try:
            hidden = 128
            info = policy.prepare_refit_info()
            assert tuple(info["model.embed_tokens.weight"][0]) == (V, hidden)
            assert tuple(info["lm_head.weight"][0]) == (V, hidden)
            stats = refit_policy_generation(policy, engine, "ipc")
            assert stats.bytes == sum(p.numel() * 4 for p in _hf(model_dir).parameters())
            results = []
            for label, hf_model in (("initial", _hf(model_dir)), ("trained", None)):
                if hf_model is None:
                    policy.train(
                        pg_batch_301(4, seed=5), ClippedPGLossFn(load_raw_config(DEFAULT_CONFIG_PATH)["loss_fn"])
                    )
                    refit_policy_generation(policy, engine, "collective")
                    hf_model = hf_model_from(policy, tmp_path / "trained")
                out = engine.generate(data, greedy=True)
                assert generated_rows(out, data) == hf_greedy(hf_model, data), label
                mult, kl = rollout_agreement(policy, out, data)
                assert 1.0 <= mult <= 1.001 and abs(kl) < 1e-4, (label, mult, kl)
                results.append((label, mult, kl))
            print(f"vLLM vs policy (token_mult_prob_error, KL): {results}")
        finally:
            policy.shutdown()
            cluster.shutdown()
