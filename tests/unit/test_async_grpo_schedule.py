"""The async GRPO schedule (core.algorithms.async_grpo), on its real threads and a real run
whose engine is a stand-in: the rollouts of step k come from exactly the weights of step max(start, k-1-m), no
trainer ever sees a rollout older than m steps, the trainer refits only once the rollouts
that need the older weights exist, a failing generation thread surfaces in the trainer, and
stop() ends the thread.  (A real async run on Ray and vLLM: tests/algorithms.)"""

from __future__ import annotations

import threading
import time

import pytest

import core.algorithms.async_grpo as async_grpo
from core.algorithms.async_grpo import AsyncGRPO, RolloutProducerError
from core.algorithms.grpo import Rollout
from core.datasets import PromptDatum
from tests.grpo_runs import SMALL, grpo_run


class FakeEngine:
    """RolloutEngine's version bookkeeping and lock, without engines."""

    def __init__(self, start: int) -> None:
        self.version = start
        self.policy_version = start
        self.loaded = False
        self.allow_stale = False
        self.lock = threading.Lock()
        self.refits: list[int] = []

    def sync_weights(self) -> dict[str, float]:
        with self.lock:
            self.loaded = True
            self.version = self.policy_version
            self.refits.append(self.version)
        return {"refit_s": 0.0}

    def mark_stale(self) -> None:
        self.policy_version += 1


@pytest.fixture
def make_run(tmp_path):
    """``make_run(start, max_age)``: a real GRPO run (its rollouts never drawn: the halves of a
    step are stand-ins here) on an engine whose weights are those of step ``start``."""
    runs = []
    prompts = [PromptDatum(f"p{i}", (1, i), {}) for i in range(4)]

    def make(start: int, max_age: int):
        run = grpo_run(
            tmp_path / f"run{len(runs)}",
            prompts,
            *SMALL,
            f"grpo.async_grpo.max_trajectory_age_steps={max_age}",
        )
        runs.append(run)
        run.rollouts = FakeEngine(start)
        return run

    yield make
    for run in runs:
        run.close()


#: (generation, training) seconds per step: the schedule must hold whichever side is slower.
SPEEDS = {"slow_generation": (0.03, 0.005), "slow_training": (0.005, 0.03)}


@pytest.fixture(params=sorted(SPEEDS))
def generated(request, monkeypatch):
    """Stand-ins for the two halves of a GRPO step; records which weights made which step."""
    made: dict[int, int] = {}
    generation_s, training_s = SPEEDS[request.param]

    def generate(run, step):
        with run.rollouts.lock:  # what RolloutEngine.generate_tagged does: the call holds the lock
            version = run.rollouts.version
            time.sleep(generation_s)
        made[step] = version
        return Rollout(step, data=None, metrics={"timing/generation_s": generation_s}, version=version)

    def train(run, rollout, step, timer):
        time.sleep(training_s)
        run.rollouts.mark_stale()  # one optimizer step: the policy is now at `step`
        return {"token_mult_prob_error": 1.0}

    monkeypatch.setattr(async_grpo, "generate_rollout", generate)
    monkeypatch.setattr(async_grpo, "train_on_rollout", train)
    monkeypatch.setattr(async_grpo, "_POLL_S", 0.01)
    return made


@pytest.mark.parametrize("max_age", [0, 1, 2])
@pytest.mark.parametrize("start", [0, 3])
def test_every_step_trains_on_the_weights_the_schedule_names(generated, make_run, max_age, start):
    run = make_run(start, max_age)
    last = start + 6
    scheduler = AsyncGRPO(run, start + 1, last, max_age)
    scheduler.start()
    try:
        rows = [scheduler.step(step) for step in range(start + 1, last + 1)]
    finally:
        scheduler.stop()
    for step, metrics in zip(range(start + 1, last + 1), rows, strict=True):
        expected = max(start, step - 1 - max_age)
        assert generated[step] == expected == metrics["async/weight_version"]
        assert metrics["async/trajectory_age_max"] == step - 1 - expected <= max_age
        assert metrics[f"token_mult_prob_error/age_{step - 1 - expected}"] == 1.0
    # the engines moved to each new version once, in order; at most max_age + 1 steps ahead
    assert run.rollouts.refits == list(range(start, last))
    assert max(m["async/buffer_fill"] for m in rows) <= max_age + 1


def test_a_failing_generation_thread_fails_the_trainer(generated, make_run, monkeypatch):
    def broken(run, step):
        raise RuntimeError("engine 0 died")

    monkeypatch.setattr(async_grpo, "generate_rollout", broken)
    scheduler = AsyncGRPO(make_run(0, 1), 1, 5, 1)
    scheduler.start()
    try:
        with pytest.raises(RolloutProducerError, match="engine 0 died") as info:
            scheduler.step(1)
        assert isinstance(info.value.__cause__, RuntimeError)
    finally:
        scheduler.stop()


def test_stop_ends_the_generation_thread_waiting_for_weights(generated, make_run):
    scheduler = AsyncGRPO(make_run(0, 0), 1, 5, 0)
    scheduler.start()  # no refit yet: the thread waits for the first weights
    scheduler.stop(timeout_s=5)
    assert not scheduler.producer._thread.is_alive()
