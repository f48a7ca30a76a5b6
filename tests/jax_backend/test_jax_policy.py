"""What only the JAX worker has: compiled programs bounded by the shape buckets, its device
diagnostics and XLA profiles (in this process, on ``qwen2_worker``), the driver's check of
tp against the model's heads.

Parity with HF, training, checkpoints, generation, refit and offload through the Policy on
every layout: tests/backends; a mesh that does not fit the devices:
tests/distributed/test_startup_errors.py.
"""

from __future__ import annotations

import pathlib
import shutil

import pytest

from core.data import BatchedDataDict
from core.distributed import RayVirtualCluster
from core.losses import ClippedPGLossFn
from core.policy import Policy
from core.testing.tiny_models import random_batch
from tests.hf_reference import PG_CFG
from tests.torch_backends.conftest import SEQ, VOCAB, pg_batch, policy_config


def _ragged(batch, seed):
    return BatchedDataDict(zip(("input_ids", "input_lengths"), random_batch(batch, SEQ, VOCAB, seed=seed), strict=True))


def test_one_program_per_shape_bucket(qwen2_worker):
    """Calls within one length bucket reuse its program: logprobs of 5 rows then 3 rows, and
    three training steps (one grad program)."""
    before = qwen2_worker.get_compile_counts()
    qwen2_worker.get_logprobs(_ragged(5, seed=1))
    qwen2_worker.get_logprobs(_ragged(3, seed=2))  # same length bucket: no new program
    assert qwen2_worker.get_compile_counts()["logprobs"] - before["logprobs"] <= 1
    for i in range(3):
        qwen2_worker.train(pg_batch(4, seed=10 + i), ClippedPGLossFn(PG_CFG))
    after = qwen2_worker.get_compile_counts()
    grad_programs = [v - before.get(k, 0) for k, v in after.items() if k.startswith("grad")]
    assert sum(grad_programs) == 1  # three steps, one bucket, one program


def test_diagnostics_and_profiling(qwen2_worker, tmp_path, monkeypatch):
    info = qwen2_worker.get_gpu_info()
    assert info["device_type"] == "cpu" and info["local_devices"] == 8 and info["mesh"] == {"fsdp": 4, "cp": 1, "tp": 2}
    assert qwen2_worker.report_device_id().startswith("cpu:")
    monkeypatch.setenv("DUALRL_PROFILE_DIR", str(tmp_path))
    qwen2_worker.start_gpu_profiling()
    qwen2_worker.get_logprobs(_ragged(2, seed=60))
    trace_dir = qwen2_worker.stop_gpu_profiling()
    assert any(pathlib.Path(trace_dir).rglob("*.xplane.pb"))
    shutil.rmtree(trace_dir)


def test_tp_that_does_not_divide_kv_heads_is_refused_on_the_driver(ray_session, model_dirs, tokenizer):
    cfg = policy_config(model_dirs["llama"], "jax_pjit")
    cfg["parallel"].update(fsdp_size=2, tensor_parallel_size=4)
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=2)
    try:
        with pytest.raises(
            ValueError, match="policy.parallel.tensor_parallel_size=4 does not divide .*num_key_value_heads=2"
        ):
            Policy(cluster, cfg, tokenizer)
    finally:
        cluster.shutdown()


def test_a_global_batch_short_of_a_micro_batch_per_device_is_refused_on_the_driver(ray_session, model_dirs, tokenizer):
    """Batch sizes are per data-parallel device on JAX as on torch: 2 rows on each of fsdp 4
    devices is a micro batch of 8 rows, more than the global batch of 4 -- refused before the
    worker starts, naming the fields."""
    cfg = policy_config(model_dirs["llama"], "jax_pjit", train_global_batch_size=4, train_micro_batch_size=2)
    cfg["parallel"].update(fsdp_size=4, tensor_parallel_size=2)
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=2)
    try:
        with pytest.raises(
            ValueError,
            match=r"policy\.train_global_batch_size: 4 is not divisible by train_micro_batch_size \(2\) x data "
            r"parallel size \(4\) = 8",
        ):
            Policy(cluster, cfg, tokenizer)
    finally:
        cluster.shutdown()
