"""A profiled training step on every layout.

The workers' own profiler (``start_gpu_profiling`` / ``stop_gpu_profiling``) around what a run
does in a step -- the driver's placement calls (``prepare_for_training``, ``prepare_for_lp_inference``),
a train call, a logprob pass -- writes one trace per worker and leaves the step's numbers
exactly those of the same step unprofiled.  The placement calls move nothing when the weights
are already where they go: on a torch layout ``Module.to`` would otherwise swap every DTensor
parameter for a new tensor, which the running profiler's references make fail.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch

from core.losses import ClippedPGLossFn
from tests.backends.conftest import ragged
from tests.hf_reference import PG_CFG
from tests.torch_backends.conftest import pg_batch


def _step(policy, loss_fn, data, probe):
    policy.prepare_for_training()
    out = policy.train(data, loss_fn)
    policy.prepare_for_lp_inference()
    return out, policy.get_logprobs(probe)["logprobs"]


def test_a_profiled_step_is_traced_on_every_worker_and_changes_nothing(fresh_policy):
    policy = fresh_policy.policy
    loss_fn, data, probe = ClippedPGLossFn(PG_CFG), pg_batch(4, seed=14), ragged(4, seed=24)
    expected, expected_lp = _step(policy, loss_fn, data, probe)
    fresh_policy.reset()

    policy.start_gpu_profiling()
    try:
        got, got_lp = _step(policy, loss_fn, data, probe)
    finally:
        paths = policy.stop_gpu_profiling()
    try:
        assert paths and len(set(paths)) == len(paths), f"one trace per worker: {paths}"
        for path in paths:
            trace = Path(path)
            assert trace.exists() and (trace.is_file() or any(trace.rglob("*"))), f"empty trace {path}"
    finally:
        for path in paths or []:
            shutil.rmtree(path, ignore_errors=True) if Path(path).is_dir() else Path(path).unlink(missing_ok=True)
    assert math.isclose(float(got.loss[0]), float(expected.loss[0]), rel_tol=0, abs_tol=0)
    assert math.isclose(float(got.grad_norm[0]), float(expected.grad_norm[0]), rel_tol=0, abs_tol=0)
    assert torch.equal(got_lp, expected_lp)
