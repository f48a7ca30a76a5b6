"""Dynamic batching in the JAX backend: the driver's token-budget plan sets the micro batches.

With ``policy.dynamic_batching`` the driver sorts a shard's rows by length and cuts each global
batch into micro batches of at most ``train_mb_tokens`` padded tokens
(``core.data.dynamic_batching``).  The JAX worker runs exactly those micro batches, each padded
to its own planned width (not the batch's widest row) and its rows to a rung of a ladder that
the fsdp axis divides (``row_rung``), so short rows cost short programs.  The loss is
normalised by the global batch's valid sequences and tokens, so the plan changes nothing but
summation order: loss, gradient norm and the trained weights equal the fixed-micro-batch run.
"""

from __future__ import annotations

import math

import jax
import pytest
import torch

from backends.jax_pjit.row_layouts import row_rung
from core.data import BatchedDataDict
from core.data.dynamic_batching import DynamicBatchingArgs
from core.losses import ClippedPGLossFn
from tests.jax_backend.test_context_parallel import jax_worker
from tests.jax_backend.test_sequence_packing import LENGTHS, uneven_batch
from tests.unit.test_losses import BASE_CFG

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) jax devices")

BUDGET = 64
FSDP, TP = 4, 2
ROUND = 8


def dynamic(enabled: bool = True) -> dict:
    return {"enabled": enabled, "train_mb_tokens": BUDGET, "logprob_mb_tokens": BUDGET, "sequence_length_round": ROUND}


def planned_shard(data):
    """The driver's side: one shard, rows sorted by length, the plan attached."""
    args = DynamicBatchingArgs(
        input_key="input_ids",
        input_lengths_key="input_lengths",
        sequence_length_round=ROUND,
        max_tokens_per_microbatch=BUDGET,
    )
    (shard,), order = data.shard_by_batch_size(1, batch_size=len(LENGTHS) // 2, dynamic_batching_args=args)
    assert shard.micro_batch_indices is not None
    return shard, order


def test_the_rows_ladder_pads_at_most_a_quarter_above_sixteen_rows():
    assert [row_rung(r, 1) for r in (1, 3, 5, 9, 16, 17, 33, 65, 85, 128, 129, 170)] == [
        1, 4, 8, 16, 16, 20, 40, 80, 96, 128, 160, 192,
    ]  # fmt: skip
    assert [row_rung(r, 8) for r in (1, 5, 9, 17, 65, 85)] == [8, 8, 16, 24, 80, 96]
    assert row_rung(37, 3) == 42 and row_rung(37, 3) % 3 == 0  # a multiple of any fsdp axis
    for rows in range(17, 1025):
        rung = row_rung(rows, 2)
        assert rows <= rung <= rows * 1.25 + 2 and rung % 2 == 0


def test_micro_batches_follow_the_plan(model_dirs, tokenizer):
    """Each planned micro batch reaches the grad step at its own width (a multiple of the round,
    below the batch's widest row) with its rows padded to the ladder's rung of the fsdp axis."""
    worker = jax_worker(model_dirs["llama"], tokenizer, FSDP, 1, TP, dynamic_batching=dynamic())
    shard, _ = planned_shard(uneven_batch(LENGTHS, seed=3))
    chunks = worker.rows.dynamic_plan(shard, len(LENGTHS) // 2)
    assert chunks is not None and len(chunks) == 2
    host = {k: v.numpy() for k, v in shard.items() if hasattr(v, "numpy")}
    seen = []
    for g, chunk in enumerate(chunks):
        rows = {k: v[g * 4 : (g + 1) * 4] for k, v in host.items()}
        for (start, end), length, (batch,) in zip(
            chunk.ranges, chunk.lengths, worker.rows.train_micro_batches(rows, chunk, 4, 32), strict=True
        ):
            n, width = batch["input_ids"].shape
            assert width == length and width % ROUND == 0
            assert n == row_rung(end - start, FSDP) and n % FSDP == 0
            assert int(batch["sample_mask"][: end - start].sum()) == int(rows["sample_mask"][start:end].sum())
            assert int(batch["sample_mask"][end - start :].sum()) == 0
            seen.append(width)
    assert min(seen) < max(LENGTHS)  # the short rows' micro batches are narrower than the widest row


def test_dynamic_batching_on_equals_off(model_dirs, tokenizer):
    """Logprobs through the plan (each planned micro batch at its own width, the rows given back
    in the caller's order) and two optimizer steps through it: the same logprobs, loss,
    gradient norm and weights as fixed micro batches of the whole width."""
    data = uneven_batch(LENGTHS, seed=3)
    logprobs, results, after = [], [], []
    for enabled in (False, True):
        worker = jax_worker(model_dirs["llama"], tokenizer, FSDP, 1, TP, dynamic_batching=dynamic(enabled))
        batch, order = planned_shard(data) if enabled else (data, None)
        assert (worker.rows.dynamic_segments(batch) is not None) == enabled
        scored = BatchedDataDict(logprobs=worker.get_logprobs(batch)["logprobs"])
        logprobs.append(scored.reorder_data(order)["logprobs"] if order is not None else scored["logprobs"])
        results.append(worker.train(batch, ClippedPGLossFn(BASE_CFG), gbs=4, mbs=1))
        after.append(worker.get_logprobs(data)["logprobs"])
    torch.testing.assert_close(logprobs[1], logprobs[0], rtol=0, atol=1e-5)
    for step in range(2):
        assert math.isclose(float(results[1].loss[step]), float(results[0].loss[step]), rel_tol=1e-5)
        assert math.isclose(float(results[1].grad_norm[step]), float(results[0].grad_norm[step]), rel_tol=1e-5)
    torch.testing.assert_close(after[1], after[0], rtol=0, atol=1e-5)
