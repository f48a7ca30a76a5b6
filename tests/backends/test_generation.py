"""``Policy.generate`` (HF generate on the torch workers, KV-cache decoding on the JAX worker):
on the current (trained) weights, the greedy tokens and logprobs of plain HF generate, in
chunks of at most ``policy.generation_batch_size`` rows with the result of one call.

The chunking mechanics of each engine (stop tokens and per-row seeds across chunks, one compiled
shape per call, one rng per chunk) are tests/torch_backends/test_generation_batch_size.py and
tests/jax_backend/test_generation_batch_size.py.
"""

from __future__ import annotations

import math

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from backends.torch_common.generation import hf_generate
from core.config import ConfigError
from core.data import BatchedDataDict
from core.losses import ClippedPGLossFn
from core.testing.tiny_models import random_batch
from tests.backends.conftest import GENERATION_BATCH_SIZE, SLOW_LAYOUTS, layout_config, layout_params, refused_on_driver
from tests.hf_reference import PG_CFG
from tests.row_budget_checks import assert_rows_keep_their_own_budgets
from tests.torch_backends.conftest import VOCAB, pg_batch

#: Where each engine hands one chunk of rows to its decoder: (module, attribute); the patched
#: callable's second positional argument is the chunk's [rows, width] ids.
DECODE_CALL = {
    False: ("backends.torch_common.generation", "_run_generate"),  # torch: one HF model.generate
    True: ("backends.jax_pjit.generate", "_Decoder.__call__"),  # JAX: one KV-cache decode
}


def _count_chunks(worker, module: str, attr: str) -> None:
    """In a worker: record the rows of every chunk it decodes (``worker.chunk_rows``)."""
    import importlib

    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    real, worker.chunk_rows = getattr(owner, name), []

    def counting(*args, **kwargs):
        worker.chunk_rows.append(args[1].shape[0])
        return real(*args, **kwargs)

    setattr(owner, name, counting)
    worker.restore_decode = lambda: setattr(owner, name, real)


def test_generate_in_chunks_equals_hf_generate_of_the_trained_weights(fresh_policy, tokenizer, tmp_path):
    """After a training step (so weights the HF checkpoint on disk does not have): greedy
    tokens and lengths equal HF generate of the policy's HF export; each rank decodes its rows
    in chunks of at most ``generation_batch_size``; the generation logprobs are the policy's own
    ``get_logprobs`` of the generated tokens."""
    lp = fresh_policy
    policy = lp.policy
    policy.train(pg_batch(4, seed=50), ClippedPGLossFn(PG_CFG))
    policy.save_hf_checkpoint(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()

    workers = policy.worker_group.workers
    ray.get([w.__ray_call__.remote(_count_chunks, *DECODE_CALL[lp.layout.backend == "jax_pjit"]) for w in workers])
    try:
        ids, lengths = random_batch(5, 6, VOCAB, seed=52)
        prompts = BatchedDataDict(input_ids=ids, input_lengths=lengths)
        out = policy.generate(prompts, greedy=True)
        rows = ray.get(workers[0].__ray_call__.remote(lambda w: w.chunk_rows))
    finally:
        ray.get([w.__ray_call__.remote(lambda w: w.restore_decode()) for w in workers])
    rank_rows = math.ceil(5 / policy.dp)  # the driver pads 5 rows to a multiple of dp
    assert rows and max(rows) <= GENERATION_BATCH_SIZE and len(rows) == math.ceil(rank_rows / GENERATION_BATCH_SIZE)

    expected = hf_generate(
        exported,
        prompts,
        lp.cfg["generation"],
        greedy=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_ids=[tokenizer.eos_token_id],
    )
    assert torch.equal(out["output_ids"], expected["output_ids"])
    assert torch.equal(out["generation_lengths"], expected["generation_lengths"])
    assert torch.equal(out["unpadded_sequence_lengths"], expected["unpadded_sequence_lengths"])
    torch.testing.assert_close(out["logprobs"], expected["logprobs"], rtol=0, atol=1e-5)
    assert (out["generation_lengths"] > 0).all()

    lp_of_output = policy.get_logprobs(
        BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
    )["logprobs"]
    generated = torch.arange(out["output_ids"].shape[1])[None] >= prompts["input_lengths"][:, None]
    torch.testing.assert_close(out["logprobs"], torch.where(generated, lp_of_output, 0.0), rtol=0, atol=1e-5)


@pytest.mark.parametrize("bad", [0, -2, True, 1.5])
def test_a_bad_generation_batch_size_is_refused_on_the_driver(layout, bad, model_dirs, tokenizer):
    cfg = layout_config(layout, model_dirs["llama"], generation_batch_size=bad)
    with pytest.raises(ConfigError, match="generation_batch_size"):
        refused_on_driver(layout, cfg, tokenizer)


# The torch layouts share one generate path (hf_generate on the rank's replica): FSDP1 and JAX
# in the fast run, every layout in make test-all.
@pytest.mark.parametrize("layout", layout_params(slow=SLOW_LAYOUTS | {"dtensor-dp2-tp2-sp"}), indirect=True)
def test_each_row_gets_its_own_budget_of_new_tokens(fresh_policy):
    """``data['max_new_tokens']`` (multi-turn rollouts set it): tests/row_budget_checks.py."""
    policy = fresh_policy.policy
    assert_rows_keep_their_own_budgets(policy.generate, limit=32, max_new=6, vocab=VOCAB)  # conftest's policy
