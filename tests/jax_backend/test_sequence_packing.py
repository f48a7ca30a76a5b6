"""Sequence packing in the JAX backend: bins of the packing plan become packed rows.

Every bin (sequences whose lengths sum to at most the token budget) is one row: positions
restart at 0 for each sequence, segment ids confine attention to it; ``fsdp`` consecutive
bins form one micro batch of ``fsdp`` rows.  The packed logprobs are unpacked to the plain
``[rows, width - 1]`` layout before the shared loss, so packing on and off must give the
same logprobs, loss and gradient norm -- on very uneven lengths, with and without context
parallelism.  Workers run in-process; one test goes through Ray and ``Policy`` (driver-side
plan, rows reordered and restored).
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from backends.jax_pjit import steps, widths
from core.data.sequence_packing import SequencePackingArgs
from core.losses import ClippedPGLossFn, NLLLoss
from tests.jax_backend.test_context_parallel import check_jax_policy_against_hf_and_torch, jax_worker
from tests.torch_backends.conftest import hf_logprobs, policy_config, uneven_pg_batch
from tests.unit.test_losses import BASE_CFG

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) jax devices")

WIDTH = 30
#: Very uneven: a full row, near-empty rows (a single token: no prediction at all), mid sizes.
LENGTHS = [30, 2, 5, 17, 3, 28, 9, 1]
BUDGET = 32


def uneven_batch(lengths, seed, width=WIDTH):
    return uneven_pg_batch(lengths, width, seed)


def packing(enabled=True, budget=BUDGET):
    return {
        "enabled": enabled,
        "train_mb_tokens": budget,
        "logprob_mb_tokens": budget,
        "algorithm": "modified_first_fit_decreasing",
    }


def driver_plan(data, budget: int, shared_prompts: bool = False):
    """``(the one shard, row order)`` of the driver's packing plan for one worker."""
    (shard,), order = data.shard_by_batch_size(
        1,
        sequence_packing_args=SequencePackingArgs(
            input_key="input_ids",
            input_lengths_key="input_lengths",
            max_tokens_per_microbatch=budget,
            algorithm="modified_first_fit_decreasing",
            shared_prompts=shared_prompts,
        ),
    )
    return shard, order


# ------------------------------------------------------------------------- layout (no model)
def test_packed_micro_batch_layout():
    ids = np.array([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]], np.int32)
    lengths = np.array([3, 2, 4])
    rows, packs = steps.packed_micro_batch(ids, lengths, [(0, 2), (2, 3)], rows=3, width=8, unpack_rows=4)
    np.testing.assert_array_equal(rows["input_ids"], [[5, 6, 7, 8, 9, 0, 0, 0], [1, 2, 3, 4, 0, 0, 0, 0], [0] * 8])
    np.testing.assert_array_equal(
        rows["positions"], [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3], list(range(8))]
    )
    np.testing.assert_array_equal(rows["segments"], [[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 1, 1, 1, 1], [0] * 8])
    # unpack: row i, column t <- flat packed next-token logprob (row k of the micro batch: + k * 7)
    np.testing.assert_array_equal(rows["unpack_valid"], [[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    np.testing.assert_array_equal(
        np.where(rows["unpack_valid"], rows["unpack_index"], -1), [[0, 1, -1], [3, -1, -1], [7, 8, 9], [-1, -1, -1]]
    )
    assert [p.width for p in packs] == [8, 8]
    with pytest.raises(ValueError, match="exceeds the width"):
        steps.packed_micro_batch(ids, lengths, [(0, 3)], rows=1, width=8)


# ------------------------------------------------------------------------- numerics
@pytest.fixture(scope="module")
def unpacked(model_dirs, tokenizer):
    """Packing off (fsdp 4 x tp 2): logprobs, one train call (two optimizer steps of 4 rows),
    and the logprobs after it."""
    worker = jax_worker(model_dirs["qwen2"], tokenizer, 4, 1, 2, sequence_packing=packing(False))
    data = uneven_batch(LENGTHS, seed=3)
    before = worker.get_logprobs(data)["logprobs"]
    result = worker.train(data, ClippedPGLossFn(BASE_CFG))
    return data, before, result, worker.get_logprobs(data)["logprobs"]


@pytest.mark.parametrize("mesh", [pytest.param((4, 1, 2), id="fsdp4-tp2"), pytest.param((2, 2, 2), id="fsdp2-cp2-tp2")])
def test_packing_on_equals_off(model_dirs, tokenizer, unpacked, mesh):
    data, ref_before, ref_result, ref_after = unpacked
    worker = jax_worker(model_dirs["qwen2"], tokenizer, *mesh, sequence_packing=packing())
    before = worker.get_logprobs(data)["logprobs"]
    torch.testing.assert_close(before, ref_before, rtol=0, atol=1e-5)
    hf = hf_logprobs(
        AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"]).eval(), data["input_ids"], data["input_lengths"]
    )
    torch.testing.assert_close(before, hf, rtol=0, atol=1e-5)
    # A shard planned by the driver (rows reordered, bins attached) gives the same rows back.
    shard, order = driver_plan(data, BUDGET)
    assert shard.micro_batch_indices is not None and order != list(range(len(LENGTHS)))
    torch.testing.assert_close(worker.get_logprobs(shard).reorder_data(order)["logprobs"], before, rtol=0, atol=1e-5)
    result = worker.train(data, ClippedPGLossFn(BASE_CFG))
    for step in range(2):
        assert math.isclose(float(result.loss[step]), float(ref_result.loss[step]), rel_tol=1e-5)
        assert math.isclose(float(result.grad_norm[step]), float(ref_result.grad_norm[step]), rel_tol=1e-5)
    for key in ("num_valid_samples", "probs_ratio", "kl_penalty"):
        torch.testing.assert_close(result.metrics[key], ref_result.metrics[key], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(worker.get_logprobs(data)["logprobs"], ref_after, rtol=0, atol=1e-5)
    # One program per packed width: however the bins fall, at most the budget's ladder.
    worker.train(uneven_batch(LENGTHS[::-1], seed=4), ClippedPGLossFn(BASE_CFG))
    counts = worker.compile_counts
    ladder = len(widths.length_buckets(BUDGET))
    assert counts["logprobs"] == 0 and 1 <= counts["logprobs_layout"] <= ladder
    assert [v for k, v in counts.items() if k.startswith("grad")][0] <= ladder


def test_packed_nll_matches_unpacked(model_dirs, tokenizer):
    """Another loss through the same unpacking (token-level NLL, llama, fsdp 4 x tp 2)."""
    data = uneven_batch(LENGTHS[:4], seed=5)
    results = []
    for enabled in (False, True):
        worker = jax_worker(model_dirs["llama"], tokenizer, 4, 1, 2, sequence_packing=packing(enabled))
        results.append(worker.train(data, NLLLoss(), eval_mode=True))
    torch.testing.assert_close(results[1].loss, results[0].loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(results[1].metrics["num_unmasked_tokens"], results[0].metrics["num_unmasked_tokens"])


def test_packing_with_cp_needs_budget_widths_that_split(model_dirs, tokenizer):
    """Packed widths come from the budget's ladder (16, 32, 34 for a budget of 34): with
    cp = 2 each must be a multiple of 4, else the worker refuses, naming the field to set."""
    with pytest.raises(
        ValueError,
        match=r"sequence width 34 is not divisible by 4 .*"
        r"policy\.make_sequence_length_divisible_by.*sequence_packing\.train_mb_tokens=34",
    ):
        jax_worker(model_dirs["llama"], tokenizer, 2, 2, 2, sequence_packing=packing(budget=34))
    widths.check_cp_ladder(34, 2, 4, "policy.sequence_packing.train_mb_tokens")  # the fix: divisible_by 4


# ------------------------------------------------------------------------- through Ray
@pytest.mark.slow  # ~11 s through Ray; packing on == off in-process runs fast above
def test_policy_with_packing_matches_hf_and_torch_step(ray_session, model_dirs, tokenizer):
    """The driver plans the bins (rows reordered by length, restored afterwards)."""
    cfg = policy_config(model_dirs["qwen2"], "jax_pjit", sequence_packing=packing())
    cfg["parallel"].update(fsdp_size=-1, tensor_parallel_size=2)
    check_jax_policy_against_hf_and_torch(
        cfg,
        "jax_packed",
        model_dirs["qwen2"],
        tokenizer,
        uneven_batch(LENGTHS, seed=7),
        uneven_batch([29, 1, 12, 4], seed=8),
    )
