"""The train phase's overhead breakdown: the worker times its own ``train``
(``reports_worker_seconds``), the driver's ``CallTiming`` keeps the rest, and the run's metrics
carry both as ``train_call/*_s`` (outside ``timing/*``, whose phases add up to the step).
That ``Policy.train`` fills it on every backend: tests/backends/test_fused_old_logprobs.py."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from core.algorithms.training_run import train_metrics
from core.interfaces import CallTiming, TrainResult
from core.policy.worker_base import reports_worker_seconds


def _result() -> TrainResult:
    return TrainResult(loss=[0.5], grad_norm=[1.0], metrics={"loss": [0.5]}, skip_reasons=[None])


def test_the_worker_reports_its_seconds_and_keeps_the_signature():
    class Worker:
        @reports_worker_seconds
        def train(self, data, loss_fn, eval_mode=False):
            """Docstring kept."""
            time.sleep(0.05)
            return _result()

    out = Worker().train(None, None)
    assert 0.05 <= out.worker_s < 5 and out.loss == [0.5] and out.timing is None
    assert Worker.train.__doc__ == "Docstring kept." and Worker.train.__name__ == "train"


def test_dispatch_is_the_call_less_the_slowest_worker_and_never_negative():
    assert CallTiming(checks_s=0.1, shard_s=0.2, call_s=1.5, worker_s=1.0).dispatch_s == pytest.approx(0.5)
    assert CallTiming(checks_s=0.0, shard_s=0.0, call_s=1.0, worker_s=1.0 + 1e-9).dispatch_s == 0.0


def test_train_metrics_carry_the_breakdown_only_when_the_driver_measured_it():
    assert not any(k.startswith("train_call/") for k in train_metrics(_result()))
    timed = replace(_result(), worker_s=1.0, timing=CallTiming(0.1, 0.2, 1.5, 1.0))
    metrics = train_metrics(timed)
    assert {k: v for k, v in metrics.items() if k.startswith("train_call/")} == pytest.approx(
        {
            "train_call/checks_s": 0.1,
            "train_call/shard_s": 0.2,
            "train_call/dispatch_s": 0.5,
            "train_call/worker_s": 1.0,
        }
    )
