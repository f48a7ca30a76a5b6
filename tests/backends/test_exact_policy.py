"""``policy.numerics: exact`` through the workers, on every backend: the policy's own sampler
(``generation.backend: hf``) reports, for every token it samples, the logprob ``get_logprobs``
computes for it and the one the training forward computes for it, bit for bit -- so a GRPO
step's ``token_mult_prob_error`` is exactly 1.0 and its mismatch KL exactly 0 -- with ragged
prompts, a generation call of another size than the logprob micro batch, and a row sampled
alone getting the tokens it gets in a batch.  What exact mode does not cover is refused by
name on the driver, before any worker starts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.lib.layouts import parse_layout
from core.data import BatchedDataDict
from core.losses import ClippedPGLossFn
from core.testing.tiny_models import random_batch
from tests.backends.conftest import layout_config, refused_on_driver, started_policy
from tests.hf_reference import PG_CFG

# Importance correction on, so the generation logprobs take part in the loss as well (no KL
# term: a rollout batch has no reference logprobs).
LOSS_CFG = {**PG_CFG, "use_importance_sampling_correction": True, "reference_policy_kl_penalty": 0.0}
CASES = [
    pytest.param("fsdp1-dp2", "float32", "llama", id="fsdp1-dp2-fp32"),
    pytest.param("dtensor-dp2", "bfloat16", "qwen3", id="dtensor-dp2-bf16", marks=pytest.mark.slow),
    pytest.param("jax-fsdp8", "float32", "llama", id="jax-fsdp8-fp32", marks=pytest.mark.slow),
    pytest.param("fsdp1-dp2", "bfloat16", "qwen2", id="fsdp1-dp2-bf16", marks=pytest.mark.slow),
    pytest.param("dtensor-dp2", "float32", "llama", id="dtensor-dp2-fp32", marks=pytest.mark.slow),
    pytest.param("jax-fsdp8", "bfloat16", "qwen3", id="jax-fsdp8-bf16", marks=pytest.mark.slow),
]


def exact_config(layout: str, model_dir, precision: str) -> dict:
    cfg = layout_config(layout, model_dir, numerics="exact", precision=precision)
    cfg["generation"].update(backend="hf", vllm_cfg=None, max_new_tokens=8, temperature=0.9, top_k=40)
    # 8 rows per generate call per worker, 3 per logprob micro batch, 8 per training one.
    cfg.update(generation_batch_size=8, logprob_batch_size=3, train_global_batch_size=16, train_micro_batch_size=8)
    return cfg


def bits(x: torch.Tensor) -> np.ndarray:
    return x.float().contiguous().numpy().view(np.int32)


def rollout_batch(out: BatchedDataDict, prompt_lengths: torch.Tensor) -> BatchedDataDict:
    """A GRPO training batch from a generation: loss on the generated tokens only."""
    ids, lengths = out["output_ids"], out["unpadded_sequence_lengths"]
    columns = torch.arange(ids.shape[1])[None]
    generated = ((columns >= prompt_lengths[:, None]) & (columns < lengths[:, None])).float()
    advantages = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(5))[:, None] * generated
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=generated,
        sample_mask=torch.ones(ids.shape[0]),
        advantages=advantages,
        generation_logprobs=out["logprobs"],
    )


@pytest.mark.parametrize(("layout", "precision", "model"), CASES)
def test_exact_sampler_trainer_bits(layout, precision, model, policies, model_dirs, tokenizer):
    lay = parse_layout(layout)
    policies.make_room(lay)
    cfg = exact_config(layout, model_dirs[model], precision)
    prompts, prompt_lengths = random_batch(16, 7, 256, seed=9, min_len=2)
    seeds = torch.arange(16) + 1000
    with started_policy(lay, cfg, tokenizer, f"exact_{lay.name.replace('-', '_')}") as policy:
        out = policy.generate(BatchedDataDict(input_ids=prompts, input_lengths=prompt_lengths, sample_seeds=seeds))
        batch = rollout_batch(out, prompt_lengths)
        generated = batch["token_mask"] > 0
        assert int(generated.sum()) > 60
        scored = policy.get_logprobs(batch)["logprobs"]
        assert np.array_equal(bits(out["logprobs"][generated]), bits(scored[generated]))
        alone = policy.generate(
            BatchedDataDict(input_ids=prompts[5:6], input_lengths=prompt_lengths[5:6], sample_seeds=seeds[5:6])
        )
        n = int(out["unpadded_sequence_lengths"][5])
        assert torch.equal(alone["output_ids"][0, :n], out["output_ids"][5, :n])
        assert np.array_equal(bits(alone["logprobs"][0]), bits(out["logprobs"][5]))
        # One GRPO update whose old logprobs are the training forward's own (fused).
        result = policy.train(batch, ClippedPGLossFn(LOSS_CFG, old_logprobs="forward"))
    assert result.metrics["token_mult_prob_error"] == [1.0]
    assert result.metrics["gen_kl_error"] == [0.0]


REFUSED = [
    ("dtensor-tp2", {}, r"policy.parallel.tensor_parallel_size: 2 is refused with numerics 'exact'"),
    ("jax-fsdp4-tp2", {}, r"policy.parallel.tensor_parallel_size: 2 is refused with numerics 'exact'"),
    ("fsdp1-dp2", {"lora": {"enabled": True}}, r"policy.lora.enabled: True is refused with numerics 'exact'"),
    ("jax-fsdp8", {"sequence_packing": {"enabled": True}}, r"policy.sequence_packing.enabled: True is refused"),
    ("dtensor-dp2", {"precision": "float16"}, r"policy.precision: 'float16' is refused with numerics 'exact'"),
]


@pytest.mark.parametrize(("layout", "overrides", "message"), REFUSED)
def test_exact_mode_refuses_what_it_does_not_cover(layout, overrides, message, model_dirs, tokenizer):
    cfg = exact_config(layout, model_dirs["llama"], "float32")
    for key, value in overrides.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    with pytest.raises(Exception, match=message):
        refused_on_driver(parse_layout(layout), cfg, tokenizer)


def test_exact_mode_refuses_vllm_generation_and_models_without_exact_layers(model_dirs, tokenizer):
    cfg = exact_config("fsdp1-dp2", model_dirs["llama"], "float32")
    cfg["generation"].update(backend="vllm", vllm_cfg={"max_model_len": 32})
    with pytest.raises(Exception, match=r"policy.generation.backend: 'vllm' is refused with numerics 'exact'"):
        refused_on_driver(parse_layout("fsdp1-dp2"), cfg, tokenizer)
    cfg = exact_config("jax-fsdp8", model_dirs["qwen3_moe"], "float32")
    with pytest.raises(ValueError, match=r"policy.numerics='exact': model_type 'qwen3_moe' has no exact layers"):
        refused_on_driver(parse_layout("jax-fsdp8"), cfg, tokenizer)
