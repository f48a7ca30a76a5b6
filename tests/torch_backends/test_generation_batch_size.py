"""``policy.generation_batch_size`` in ``hf_generate`` (one process): HF generation runs in chunks
of at most that many rows per ``model.generate`` call, with the results of one call over all
rows -- also when rows stop early and with per-row seeds.  Through the Policy on every layout:
tests/backends/test_generation.py."""

from __future__ import annotations

import pytest
import torch

from backends.torch_common import generation as gen_mod
from backends.torch_common.generation import build_hf_generation_config, hf_generate
from core.config import ConfigError
from core.data import BatchedDataDict
from core.policy.generation_config import GenerationConfig
from core.testing.tiny_models import PAD_ID, build_tiny_model, random_batch

ROWS, WIDTH, VOCAB = 5, 7, 256


def gen_cfg(**overrides):
    """A raw ``policy.generation`` section (``hf_generate`` validates it)."""
    cfg = dict(
        backend="hf", max_new_tokens=6, temperature=0.7, top_p=1.0, top_k=None, stop_token_ids=None, stop_strings=None
    )
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("llama", seed=3)


@pytest.fixture(scope="module")
def prompts():
    ids, lengths = random_batch(ROWS, WIDTH, VOCAB, seed=11)
    assert len(set(lengths.tolist())) > 1  # ragged: chunks have different longest prompts
    return BatchedDataDict(input_ids=ids, input_lengths=lengths)


@pytest.fixture
def generate_calls(monkeypatch):
    """Rows of every ``model.generate`` call hf_generate makes."""
    rows, run = [], gen_mod._run_generate

    def counting(model, left_ids, *args, **kwargs):
        rows.append(left_ids.shape[0])
        return run(model, left_ids, *args, **kwargs)

    monkeypatch.setattr(gen_mod, "_run_generate", counting)
    return rows


def assert_same_output(chunked, whole):
    """Token ids and lengths equal; logprobs to one fp32 ulp (CPU matmuls of another batch
    size may round a row's sums differently -- measured: 4.8e-7 at |logprob| ~ 5)."""
    assert set(chunked) == set(whole)
    for key in ("output_ids", "generation_lengths", "unpadded_sequence_lengths"):
        assert torch.equal(chunked[key], whole[key]), key
    torch.testing.assert_close(chunked["logprobs"], whole["logprobs"], rtol=0, atol=1e-6)


def test_greedy_chunks_equal_one_call(model, prompts, generate_calls):
    whole = hf_generate(model, prompts, gen_cfg(), greedy=True, pad_token_id=PAD_ID)
    assert generate_calls == [ROWS]
    chunked = hf_generate(model, prompts, gen_cfg(), greedy=True, pad_token_id=PAD_ID, batch_size=2)
    assert generate_calls[1:] == [2, 2, 1]
    assert_same_output(chunked, whole)
    assert (whole["generation_lengths"] > 0).all()


def test_seeded_sampling_with_stop_tokens_chunks_equal_one_call(model, prompts, generate_calls):
    """Rows that stop early (a stop token some rows hit, others not) and per-row seeds: a
    chunk that finishes sooner than the whole batch must not change any row."""
    data = BatchedDataDict(**prompts, sample_seeds=torch.arange(ROWS) + 100)
    probe = hf_generate(model, data, gen_cfg(), greedy=False, pad_token_id=PAD_ID)
    stop = int(probe["output_ids"][0, int(prompts["input_lengths"][0]) + 1])  # row 0's 2nd new token
    cfg = gen_cfg(stop_token_ids=[stop], top_k=-1)
    whole = hf_generate(model, data, cfg, greedy=False, pad_token_id=PAD_ID)
    chunked = hf_generate(model, data, cfg, greedy=False, pad_token_id=PAD_ID, batch_size=1)
    assert generate_calls[-ROWS:] == [1] * ROWS  # row 0's call ends after <= 2 of the 6 steps
    assert_same_output(chunked, whole)
    assert int(whole["generation_lengths"][0]) <= 2 < int(whole["generation_lengths"].max())


def test_a_batch_size_over_the_rows_is_one_call(model, prompts, generate_calls):
    hf_generate(model, prompts, gen_cfg(), greedy=True, pad_token_id=PAD_ID, batch_size=64)
    assert generate_calls == [ROWS]


@pytest.mark.parametrize("bad", [0, -2, True, 1.5])
def test_a_bad_batch_size_is_refused(model, prompts, bad):
    with pytest.raises(ValueError, match="policy.generation_batch_size must be a positive int"):
        hf_generate(model, prompts, gen_cfg(), greedy=True, pad_token_id=PAD_ID, batch_size=bad)


def test_top_k_minus_one_means_off_and_zero_is_refused():
    off = GenerationConfig.coerce(gen_cfg(top_k=-1), "policy.generation")
    config = build_hf_generation_config(off, greedy=False, max_new_tokens=2, stop_token_ids=[], pad_token_id=PAD_ID)
    assert config.top_k == 0  # HF's "off"
    with pytest.raises(ConfigError, match=r"policy\.generation\.top_k: 0: use -1 or null"):
        GenerationConfig.coerce(gen_cfg(top_k=0), "policy.generation")
    # A section built without validation is still refused where HF's config is built.
    zero = off.model_copy(update={"top_k": 0})
    with pytest.raises(ValueError, match="top_k must be None or -1"):
        build_hf_generation_config(zero, greedy=False, max_new_tokens=2, stop_token_ids=[], pad_token_id=PAD_ID)
