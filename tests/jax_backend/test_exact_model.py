"""Exact mode on the JAX backend's own models, bit for bit, without Ray: the exact logprob
step gives a sequence the same bits whatever its batch, micro batch or padding; the training
forward (under ``value_and_grad``) gives the logprob step's bits; the exact sampler, each
device on its own rows of a 2-device mesh, reports for every sampled token the trainer's
logprob, and a row sampled alone gets the tokens it gets in a batch.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from backends.jax_pjit.exact_generate import make_exact_decode_fns  # noqa: E402
from backends.jax_pjit.exact_steps import make_exact_logprob_step  # noqa: E402
from backends.jax_pjit.generate import generate  # noqa: E402
from backends.jax_pjit.hf_mapping import from_pretrained  # noqa: E402
from backends.jax_pjit.models.exact import exact_next_logprobs  # noqa: E402
from core.kernels import logprobs_to_sequence_layout  # noqa: E402
from core.policy.generation_config import GenerationConfig  # noqa: E402
from core.testing.tiny_models import random_batch  # noqa: E402

TEMPERATURE = 0.8
CASES = [
    ("llama", jnp.float32),
    pytest.param("llama", jnp.bfloat16, marks=pytest.mark.slow),
    pytest.param("qwen2", jnp.float32, marks=pytest.mark.slow),
    pytest.param("qwen3", jnp.bfloat16, marks=pytest.mark.slow),
]


def bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.int32)


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < 2:
        pytest.skip("needs 2 (virtual) jax devices")
    return jax.make_mesh((2, 1, 1), ("fsdp", "cp", "tp"), axis_types=(AxisType.Auto,) * 3, devices=jax.devices()[:2])


def scored(step, params, ids, lengths, micro_batch):
    out = [
        step(params, ids[s : s + micro_batch], lengths[s : s + micro_batch]) for s in range(0, len(ids), micro_batch)
    ]
    return np.concatenate([np.asarray(o) for o in out])


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_exact_jax_logprobs_and_sampler(model_dirs, mesh, name, dtype):
    model, cfg, _ = from_pretrained(model_dirs[name], dtype=dtype)
    fns = make_exact_decode_fns(model, mesh)
    step = make_exact_logprob_step(model, TEMPERATURE, mesh)
    prompts, prompt_lengths = (a.numpy() for a in random_batch(6, 8, cfg.vocab_size, seed=5, min_len=2))
    gen_cfg = GenerationConfig(backend="hf", max_new_tokens=9, temperature=TEMPERATURE, top_k=50)
    seeds = np.arange(6) + 7
    with mesh:
        # Generated 4 rows per call (split over the 2 devices); scored 3 rows per micro batch
        # (replicated: 3 does not split over 2), then 6 (split), then padded wider.
        out = generate(fns, None, prompts, prompt_lengths, gen_cfg, greedy=False, pad_token_id=0,
                       eos_token_ids=[2], sample_seeds=seeds, batch_size=4)  # fmt: skip
        ids = out["output_ids"].astype(np.int32)
        lengths = out["unpadded_sequence_lengths"].astype(np.int32)
        policy = scored(step, fns.params, ids, lengths, 3)
        assert np.array_equal(bits(scored(step, fns.params, ids, lengths, 6)), bits(policy))
        wide = scored(step, fns.params, np.pad(ids, ((0, 0), (0, 13))), lengths, 2)
        assert np.array_equal(bits(wide[:, : ids.shape[1]]), bits(policy))
        alone = generate(fns, None, prompts[3:4], prompt_lengths[3:4], gen_cfg, greedy=False, pad_token_id=0,
                         eos_token_ids=[2], sample_seeds=seeds[3:4])  # fmt: skip
    columns = np.arange(ids.shape[1])[None]
    generated = (columns >= prompt_lengths[:, None]) & (columns < lengths[:, None])
    assert generated.sum() > 20
    assert np.array_equal(bits(out["logprobs"][generated]), bits(policy[generated]))
    n = lengths[3]
    assert np.array_equal(alone["output_ids"][0, :n], out["output_ids"][3, :n])
    assert np.array_equal(bits(alone["logprobs"][0]), bits(out["logprobs"][3]))

    # The training forward, differentiated, scores with the same bits (GRPO's fused old logprobs).
    next_logprobs, params = exact_next_logprobs(model, mesh)

    def loss(params, ids, temperature):  # an argument: a constant would be folded into the division
        lp = next_logprobs(params, ids, temperature, differentiable=True)
        return lp.sum(), lp

    with mesh:
        (_, train_lp), _ = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, ids, jnp.float32(TEMPERATURE))
    train_lp = np.asarray(logprobs_to_sequence_layout(train_lp, lengths), np.float32)
    assert np.array_equal(bits(train_lp), bits(policy))
