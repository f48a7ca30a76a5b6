"""No per-micro-batch FSDP work: gradients are reduce-scattered once per optimizer step, and
a train or get_logprobs call all-gathers each FSDP unit once, whatever the number of micro batches;
and the float32 matmul precision the workers applied follows ``policy.matmul_precision``.

Collectives are counted from the workers' own profiler traces (``start_gpu_profiling`` /
``stop_gpu_profiling``, the production diagnostics): every c10d all-gather and
reduce-scatter op a rank issued.  With dp layouts and no TP/CP these are FSDP's alone.
The tiny Llama has 2 transformer blocks, so FSDP holds 3 units (2 blocks + the root with
embeddings, final norm and lm_head).  Each rank runs 4 micro batches of 1 row.

The first step's loss and gradient norm at 4 accumulated micro batches must still match
the single-process full-batch reference at the tolerance of ``tests/backends/test_parity.py`` (1e-5).
"""

from __future__ import annotations

import math

import pytest

from core.data import BatchedDataDict
from core.distributed import RayVirtualCluster
from core.losses import ClippedPGLossFn
from core.policy import Policy
from core.testing.tiny_models import random_batch
from tests.hf_reference import PG_CFG, reference_loss_and_norm
from tests.torch_backends.conftest import SEQ, VOCAB, count_collectives, pg_batch, policy_config

UNITS = 3  # 2 blocks + root
MICRO = 4  # micro batches per rank: 8 rows, dp 2, 1 row each


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("torch_dtensor", None, "highest"), id="dtensor-dp2"),
        pytest.param(("torch_fsdp", "high", "high"), id="fsdp1-dp2-tf32-allowed"),
    ],
)
def case(request, ray_session, model_dirs, tokenizer):
    backend, matmul, applied = request.param
    cfg = policy_config(
        model_dirs["llama"],
        backend,
        train_global_batch_size=8,
        train_micro_batch_size=1,
        logprob_batch_size=1,
        matmul_precision=matmul,
    )
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, cfg, tokenizer)
    yield {"policy": policy, "backend": backend, "applied": applied, "model_dir": model_dirs["llama"]}
    policy.shutdown()
    cluster.shutdown()


def test_matmul_precision_applied_in_every_worker(case):
    info = case["policy"].get_gpu_info()
    assert [i["float32_matmul_precision"] for i in info] == [case["applied"]] * 2
    # cuDNN's TF32 switch follows: off for "highest" ("fp32 means fp32"), allowed for "high".
    assert [i["cudnn_allow_tf32"] for i in info] == [case["applied"] != "highest"] * 2
    # fp32 linears on oneDNN (backends.torch_common.cpu_linear): the train step below checks the
    # loss and gradient norm against plain HF at 1e-5 through it.
    assert [i["cpu_linear_path"] for i in info] == ["onednn"] * 2
    assert all(i["cpu_linear_modules"] > 0 for i in info)


def test_train_reduces_gradients_once_per_step(case):
    """One reduce-scatter per FSDP unit per optimizer step and one all-gather per unit (the
    gathered weights kept through the micro batches' forwards and backwards, not two gathers
    per micro batch), and the accumulated gradients are the full-batch ones: loss and norm
    equal the reference."""
    data = pg_batch(8, seed=80)
    loss_fn = ClippedPGLossFn(PG_CFG)
    results = []  # the step's TrainResult
    counts = count_collectives(case["policy"], lambda: results.append(case["policy"].train(data, loss_fn)))
    assert counts["reduce_scatter"] == UNITS, counts
    assert counts["all_gather"] <= UNITS, counts  # the root may still be gathered from the last call
    (out,) = results
    ref_loss, ref_norm = reference_loss_and_norm(case["model_dir"], data, loss_fn)
    assert math.isclose(float(out.loss[0]), ref_loss, rel_tol=1e-5, abs_tol=1e-6)
    assert math.isclose(float(out.grad_norm[0]), ref_norm, rel_tol=1e-5)
    # Every rank's micro batches are reported (read from the device once per step), and
    # their globally normalised losses add up to the step's loss.
    per_mb = out.all_mb_metrics["loss"]
    assert len(per_mb) == 2 * MICRO and math.isclose(sum(per_mb), float(out.loss[0]), rel_tol=1e-5)


def test_get_logprobs_gathers_each_unit_once(case):
    ids, lens = random_batch(8, SEQ, VOCAB, seed=81)
    data = BatchedDataDict(input_ids=ids, input_lengths=lens)
    counts = count_collectives(case["policy"], lambda: case["policy"].get_logprobs(data))
    assert counts["all_gather"] <= UNITS, counts  # the root may still be gathered from the last call
    assert counts["reduce_scatter"] == 0
