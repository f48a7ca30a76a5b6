"""``policy.generation_batch_size`` in the JAX decoder (one process): KV-cache decoding in chunks
of at most that many rows, with the results of one pass over all rows and one compiled shape
per call.  Through the Policy on every layout: tests/backends/test_generation.py."""

from __future__ import annotations

import numpy as np
import pytest

from backends.jax_pjit import generate as gen_mod
from backends.jax_pjit.generate import compile_cache_sizes, generate, make_decode_fns
from backends.jax_pjit.hf_mapping import from_pretrained
from core.testing.tiny_models import PAD_ID, random_batch, save_tiny_model

ROWS, WIDTH = 5, 7


def gen_cfg(**overrides):
    # 7 new tokens: a length no other test decodes, so the compile counts below see only this module.
    # backend "hf": the policy's own decoder (this one), not vLLM.
    cfg = dict(
        backend="hf", max_new_tokens=7, temperature=0.7, top_p=1.0, top_k=None, stop_token_ids=None, stop_strings=None
    )
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="module")
def fns(tmp_path_factory):
    model, _, _ = from_pretrained(save_tiny_model("llama", tmp_path_factory.mktemp("llama"), seed=4))
    return make_decode_fns(model)


@pytest.fixture(scope="module")
def prompts():
    ids, lengths = random_batch(ROWS, WIDTH, 256, seed=21)
    return ids.numpy(), lengths.numpy()


@pytest.fixture
def decoded_rows(monkeypatch):
    """Rows of every chunk ``generate`` decodes."""
    rows, call = [], gen_mod._Decoder.__call__

    def counting(self, input_ids, *args):
        rows.append(input_ids.shape[0])
        return call(self, input_ids, *args)

    monkeypatch.setattr(gen_mod._Decoder, "__call__", counting)
    return rows


def run(fns, prompts, cfg, **kw):
    kw.setdefault("greedy", True)
    return generate(fns, None, prompts[0], prompts[1], cfg, pad_token_id=PAD_ID, **kw)


def assert_same_output(chunked, whole):
    """Token ids and lengths equal; logprobs to one fp32 ulp (another batch size may round a
    row's sums differently on the CPU)."""
    for key in ("output_ids", "generation_lengths", "unpadded_sequence_lengths"):
        np.testing.assert_array_equal(chunked[key], whole[key], err_msg=key)
    np.testing.assert_allclose(chunked["logprobs"], whole["logprobs"], rtol=0, atol=1e-6)


def test_greedy_chunks_equal_one_pass_with_one_compiled_shape(fns, prompts, decoded_rows):
    whole = run(fns, prompts, gen_cfg())
    before = compile_cache_sizes()
    chunked = run(fns, prompts, gen_cfg(), batch_size=2)
    # Chunks of 2, 2 and 1 row -- the last filled up to 2 rows, so one new program per step kind.
    assert decoded_rows == [ROWS, 2, 2, 2]
    assert compile_cache_sizes() == {k: v + 1 for k, v in before.items()}
    assert_same_output(chunked, whole)


@pytest.mark.slow  # four sampling programs to compile (~15-30 s on 2 cores)
def test_seeded_sampling_chunks_equal_one_pass(fns, prompts):
    seeds = np.arange(ROWS) + 7
    cfg = gen_cfg(top_k=-1)  # -1: no top-k filtering (vLLM's spelling)
    whole = run(fns, prompts, cfg, greedy=False, sample_seeds=seeds)
    assert_same_output(run(fns, prompts, cfg, greedy=False, sample_seeds=seeds, batch_size=3), whole)


def test_unseeded_chunks_draw_from_different_keys():
    """One rng for the call: chunk k must not reuse chunk 0's key (rows at the same position of
    two chunks would get the same noise); a single chunk keeps the call's own key."""
    import jax

    (only,) = gen_mod._chunk_keys(5, 1)
    assert np.array_equal(jax.random.key_data(only), jax.random.key_data(jax.random.key(5)))
    keys = [jax.random.key_data(k).tolist() for k in gen_mod._chunk_keys(5, 3)]
    assert len({str(k) for k in keys}) == 3


def test_a_bad_batch_size_is_refused(fns, prompts):
    with pytest.raises(ValueError, match="policy.generation_batch_size must be a positive int, got 0"):
        run(fns, prompts, gen_cfg(), batch_size=0)
