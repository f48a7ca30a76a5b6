"""Shared-prompt packing in the JAX backend: a group's rows hold one copy of their prompt.

The logprobs, loss and gradients must be those of plain packing (and of HF) on a GRPO-shaped
batch -- prompts repeated over their samples, completions of different lengths -- with the
plan made here or by the driver, with and without context parallelism; and the packed rows
must be shorter."""

from __future__ import annotations

import math

import jax
import pytest
import torch
from transformers import AutoModelForCausalLM

from backends.jax_pjit import steps
from core.losses import ClippedPGLossFn
from tests.jax_backend.test_context_parallel import jax_worker
from tests.jax_backend.test_sequence_packing import driver_plan
from tests.torch_backends.conftest import hf_logprobs, shared_prompt_pg_batch
from tests.unit.test_losses import BASE_CFG

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) jax devices")

WIDTH = 32
#: (prompt length, row lengths): three groups of different sizes, one row with nothing generated.
GROUPS = [(12, [15, 20, 13, 12]), (20, [24, 22, 27]), (6, [9])]
BUDGET = 48


def packing(shared: bool):
    return {"enabled": True, "train_mb_tokens": BUDGET, "logprob_mb_tokens": BUDGET, "shared_prompts": shared}


@pytest.fixture(scope="module")
def plain_packed(model_dirs, tokenizer):
    worker = jax_worker(model_dirs["qwen2"], tokenizer, 4, 1, 2, sequence_packing=packing(False))
    data = shared_prompt_pg_batch(GROUPS, WIDTH, seed=3)
    return data, worker.get_logprobs(data)["logprobs"], worker.train(data, ClippedPGLossFn(BASE_CFG))


@pytest.mark.parametrize("mesh", [pytest.param((4, 1, 2), id="fsdp4-tp2"), pytest.param((2, 2, 2), id="fsdp2-cp2-tp2")])
def test_shared_prompts_equal_plain_packing_and_hf(model_dirs, tokenizer, plain_packed, mesh):
    data, ref, ref_result = plain_packed
    worker = jax_worker(model_dirs["qwen2"], tokenizer, *mesh, sequence_packing=packing(True))
    got = worker.get_logprobs(data)["logprobs"]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    hf = AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"]).eval()
    torch.testing.assert_close(got, hf_logprobs(hf, data["input_ids"], data["input_lengths"]), rtol=0, atol=1e-5)
    # the driver's plan: whole groups per micro batch, rows restored afterwards
    shard, order = driver_plan(data, BUDGET, shared_prompts=True)
    torch.testing.assert_close(worker.get_logprobs(shard).reorder_data(order)["logprobs"], ref, rtol=0, atol=1e-5)
    result = worker.train(data, ClippedPGLossFn(BASE_CFG))
    for step in range(len(result.loss)):
        assert math.isclose(float(result.loss[step]), float(ref_result.loss[step]), rel_tol=1e-5)
        assert math.isclose(float(result.grad_norm[step]), float(ref_result.grad_norm[step]), rel_tol=1e-5)


def test_shared_rows_are_shorter():
    data = shared_prompt_pg_batch(GROUPS, WIDTH, seed=3)
    ids, lengths, mask = (data[k].numpy() for k in ("input_ids", "input_lengths", "token_mask"))
    rows, packs = steps.packed_micro_batch(ids, lengths, [(0, 4), (4, 8)], rows=2, width=96, token_mask=mask)
    # prompt but its last token once, then each row's last prompt token and completion
    assert [p.tokens for p in packs] == [11 + (4 + 9 + 2 + 1), 19 + (5 + 3 + 8) + 9]  # plain: 60, 82
    assert (rows["prefix_segments"] != rows["segments"]).any()
    plain, plain_packs = steps.packed_micro_batch(ids, lengths, [(0, 4), (4, 8)], rows=2, width=96)
    assert (plain["prefix_segments"] == plain["segments"]).all() and [p.tokens for p in plain_packs] == [60, 82]
