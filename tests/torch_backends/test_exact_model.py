"""Exact mode on the torch backends' HF models, bit for bit, without Ray: a sequence's
logprobs are the same whatever its batch, micro batch, padding or KV-cache decoding, and the
exact sampler reports, for every token it samples, the trainer's logprob.

The trainer here is what ``TorchPolicyWorker.get_logprobs`` computes (the model called as
the worker calls it, then ``apply_temperature`` and ``next_token_logprobs``); the policy-level
run of the same checks through the workers is ``tests/backends/test_exact_policy.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.torch_common.exact_generation import exact_generate
from backends.torch_common.exact_ops import ExactKVCache, apply_exact_numerics
from core.data import BatchedDataDict
from core.kernels import apply_temperature, logprobs_to_sequence_layout, next_token_logprobs
from core.kernels.logprobs import logprobs_from_logits
from core.policy.generation_config import GenerationConfig
from core.testing.tiny_models import build_tiny_model, random_batch

CASES = [("llama", torch.float32), ("llama", torch.bfloat16), ("qwen2", torch.float32), ("qwen3", torch.bfloat16)]
TEMPERATURE = 0.8


def bits(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().contiguous().numpy().view(np.int32)


def exact_model(name: str, dtype: torch.dtype):
    return apply_exact_numerics(build_tiny_model(name, dtype=dtype).eval())


def trainer_logprobs(model, ids: torch.Tensor, lengths: torch.Tensor, micro_batch: int) -> torch.Tensor:
    """``get_logprobs`` of the torch worker: [B, S] in its layout, ``micro_batch`` rows per forward,
    each micro batch as wide as the batch (as the worker pads it)."""
    out = []
    for start in range(0, ids.shape[0], micro_batch):
        mb_ids, mb_len = ids[start : start + micro_batch], lengths[start : start + micro_batch]
        mask = (torch.arange(ids.shape[1])[None] < mb_len[:, None]).long()
        with torch.no_grad():
            logits = model(input_ids=mb_ids, attention_mask=mask, use_cache=False).logits
        next_lp = next_token_logprobs(apply_temperature(logits, TEMPERATURE), mb_ids)
        out.append(logprobs_to_sequence_layout(next_lp, mb_len).float())
    return torch.cat(out)


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_logprobs_do_not_depend_on_batch_padding_or_kv_cache(name, dtype):
    model = exact_model(name, dtype)
    ids, lengths = random_batch(5, 24, model.config.vocab_size, seed=1, min_len=3)
    whole = trainer_logprobs(model, ids, lengths, micro_batch=5)
    assert np.array_equal(bits(trainer_logprobs(model, ids, lengths, micro_batch=2)), bits(whole))
    wider = torch.nn.functional.pad(ids, (0, 37))
    assert np.array_equal(bits(trainer_logprobs(model, wider, lengths, micro_batch=3)[:, :24]), bits(whole))
    for row in range(5):
        n = int(lengths[row])
        alone = trainer_logprobs(model, ids[row : row + 1, :n], lengths[row : row + 1], micro_batch=1)
        assert np.array_equal(bits(alone[0]), bits(whole[row, :n])), row
    # Token by token with the exact cache: a prefill of 2 tokens, then one position per call.
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = ExactKVCache(config.num_hidden_layers, 5, config.num_key_value_heads, 64, head_dim, dtype, "cpu")
    with torch.no_grad():
        steps = [model(input_ids=ids[:, :2], position_ids=torch.arange(2)[None], exact_cache=cache).logits]
        for t in range(2, 23):
            steps.append(
                model(input_ids=ids[:, t : t + 1], position_ids=torch.full((5, 1), t), exact_cache=cache).logits
            )
    decoded = logprobs_from_logits(apply_temperature(torch.cat(steps, 1), TEMPERATURE), ids[:, 1:])
    decoded = logprobs_to_sequence_layout(decoded, lengths).float()
    assert np.array_equal(bits(decoded), bits(whole))


def generate(model, ids, lengths, seeds, batch_size=None, greedy=False, **gen):
    cfg = GenerationConfig(backend="hf", max_new_tokens=10, temperature=TEMPERATURE, **gen)
    data = BatchedDataDict(input_ids=ids, input_lengths=lengths, sample_seeds=seeds)
    return exact_generate(
        model, data, cfg, greedy=greedy, pad_token_id=0, eos_token_ids=[2], tokenizer=None, max_new_tokens=10,
        batch_size=batch_size,
    )  # fmt: skip


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_sampler_reports_the_trainers_logprobs(name, dtype):
    model = exact_model(name, dtype)
    ids, lengths = random_batch(6, 9, model.config.vocab_size, seed=3, min_len=2)
    seeds = torch.arange(6) + 100
    # Generated 4 rows per call; scored 5 rows per micro batch.
    out = generate(model, ids, lengths, seeds, batch_size=4, top_p=0.9)
    full_lengths = out["unpadded_sequence_lengths"]
    policy = trainer_logprobs(model, out["output_ids"], full_lengths, micro_batch=5)
    columns = torch.arange(out["output_ids"].shape[1])[None]
    generated = (columns >= lengths[:, None]) & (columns < full_lengths[:, None])
    assert int(generated.sum()) > 20
    assert np.array_equal(bits(out["logprobs"][generated]), bits(policy[generated]))
    # A row sampled alone gets the tokens (and logprobs) it gets inside the batch.
    for row in (0, 4):
        alone = generate(model, ids[row : row + 1], lengths[row : row + 1], seeds[row : row + 1], top_p=0.9)
        n = int(full_lengths[row])
        assert torch.equal(alone["output_ids"][0, :n], out["output_ids"][row, :n])
        assert np.array_equal(bits(alone["logprobs"][0]), bits(out["logprobs"][row]))
    # Greedy decoding scores at the same temperature.
    greedy = generate(model, ids, lengths, seeds, greedy=True)
    policy = trainer_logprobs(model, greedy["output_ids"], greedy["unpadded_sequence_lengths"], micro_batch=4)
    generated = (columns >= lengths[:, None]) & (columns < greedy["unpadded_sequence_lengths"][:, None])
    assert np.array_equal(bits(greedy["logprobs"][generated]), bits(policy[generated]))


@pytest.mark.parametrize("name", ["gemma3", "qwen3_moe"])
def test_models_without_exact_layers_are_refused(name):
    with pytest.raises(ValueError, match=r"policy.numerics=exact: model_type '.*' is not covered"):
        apply_exact_numerics(build_tiny_model(name))
