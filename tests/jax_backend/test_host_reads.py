"""The JAX worker reads results on the host once per call / optimizer step, never per micro batch.

A host read waits for the device; inside a micro-batch loop it would leave the device idle
while the host copies the result and prepares the next micro batch.  The worker runs
in-process; its jitted steps and its host reads are wrapped to record the order in which
they happen: every micro batch's step must be queued before the first read.
"""

from __future__ import annotations

import jax
import pytest

import backends.jax_pjit.worker as worker_module
import core.policy.worker_training as worker_training
from core.data import BatchedDataDict
from core.losses import ClippedPGLossFn
from core.policy.config import PolicyConfig
from core.testing.tiny_models import random_batch
from tests.torch_backends.conftest import SEQ, VOCAB, pg_batch, policy_config
from tests.unit.test_losses import BASE_CFG

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) jax devices")


@pytest.fixture(scope="module")
def worker(model_dirs, tokenizer):
    from backends.jax_pjit.worker import JaxPolicyWorker

    cfg = policy_config(model_dirs["llama"], "jax_pjit", train_micro_batch_size=1, logprob_batch_size=1)
    cfg["parallel"].update(fsdp_size=4, tensor_parallel_size=2)
    return JaxPolicyWorker(PolicyConfig.checked(cfg), tokenizer, init_reference_model=False)


def _recording(events: list[str], name: str, fn):
    def call(*args, **kwargs):
        events.append(name)
        return fn(*args, **kwargs)

    return call


def test_get_logprobs_queues_every_micro_batch_before_reading(worker, monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(worker, "_logprob_step", _recording(events, "step", worker._logprob_step))
    monkeypatch.setattr(worker_module.jax, "device_get", _recording(events, "read", jax.device_get))
    # a micro batch: one row on each of the 4 fsdp devices
    data = BatchedDataDict(zip(("input_ids", "input_lengths"), random_batch(16, SEQ, VOCAB, seed=3), strict=True))
    out = worker.get_logprobs(data)
    assert events == ["step"] * 4 + ["read"]
    assert tuple(out["logprobs"].shape) == (16, SEQ)


def test_train_reads_once_per_optimizer_step(worker, monkeypatch):
    events: list[str] = []
    loss_fn = ClippedPGLossFn(BASE_CFG)
    grad_step = worker._grad_step(loss_fn)
    monkeypatch.setattr(worker, "_grad_step", lambda _: _recording(events, "micro batch", grad_step))
    monkeypatch.setattr(worker, "_apply_updates", _recording(events, "update", worker._apply_updates))
    monkeypatch.setattr(worker_training, "read_once", _recording(events, "read", worker_training.read_once))
    # one global batch of 16 rows, micro batches of 1 row on each of the 4 fsdp devices
    out = worker.train(pg_batch(16, seed=1), loss_fn, gbs=16)
    assert events == ["micro batch"] * 4 + ["update", "read"]
    assert len(out.all_mb_metrics["loss"]) == 4 and out.grad_norm[0] > 0
