"""EnvironmentPool on the session's local Ray: ordering, and every failure the pool reports.

The faulty environments below are user environments built by import path in the pool's
actors (so this module must be importable there, as any user's environment must be).
Each pool has one or two actors (~1 s to start on 2 cores); the arithmetic pool is shared.
"""

from __future__ import annotations

import math
import os
import time

import pytest

from core.environments import (
    ArithmeticEnvironment,
    ArithmeticTask,
    EnvironmentPool,
    EnvironmentPoolError,
    EnvironmentReturn,
    RewardError,
)

MODULE = "tests.environments.test_environment_pool"


class UnbuildableEnv:
    """A user environment whose constructor fails (in the pool's workers)."""

    name = "unbuildable"

    def __init__(self, cfg):
        raise RuntimeError("cannot build")


class FaultyEnv:
    """Reward 1.0, except for the completions that trigger a failure:

    ``boom`` raises, ``nan`` returns NaN, ``slow`` sleeps ``env.kwargs.sleep_s``, ``die``
    kills the worker process, ``short`` drops the last reward; a chunk of more than one
    sample containing ``pair`` raises (no single sample does).
    """

    name = "faulty"

    def __init__(self, cfg):
        self.sleep_s = float(cfg.kwargs.get("sleep_s", 30.0))

    def score(self, prompts, completions, metadata):
        if "pair" in completions and len(completions) > 1:
            raise RuntimeError("batch-level failure")
        rewards = []
        for completion in completions:
            if completion == "boom":
                raise ValueError(f"cannot score {completion!r}")
            if completion == "slow":
                time.sleep(self.sleep_s)
            if completion == "die":
                os._exit(3)
            rewards.append(math.nan if completion == "nan" else 1.0)
        if "short" in completions:
            rewards.pop()
        return EnvironmentReturn(rewards, [{} for _ in rewards])


def _batch(completions):
    prompts = [f"p{i}" for i in range(len(completions))]
    return prompts, list(completions), [{} for _ in completions]


@pytest.fixture(scope="module")
def arithmetic_pool(ray_session):
    pool = EnvironmentPool({"name": "arithmetic", "num_workers": 2, "arithmetic": {"max_value": 50}})
    yield pool
    pool.shutdown()


@pytest.fixture
def faulty_pool(ray_session, request):
    """A FaultyEnv pool; ``@pytest.mark.parametrize("faulty_pool", [{...}], indirect=True)``
    overrides the env section's keys."""
    cfg = {"name": f"{MODULE}:FaultyEnv", "num_workers": 2, **getattr(request, "param", {})}
    pool = EnvironmentPool(cfg)
    yield pool
    pool.shutdown()


def test_pool_scores_a_batch_in_order_on_actors_that_take_no_cpu(ray_session, arithmetic_pool):
    problems = ArithmeticTask({"max_value": 50}).problems(seed=1, start=0, count=10)
    prompts = [p["prompt"] for p in problems]
    # Correct answers at even indices, wrong (answer + 1) at odd ones: the order shows.
    completions = [p["answer"] if i % 2 == 0 else str(int(p["answer"]) + 1) for i, p in enumerate(problems)]
    metadata = [{"ground_truth": p["answer"]} for p in problems]
    ret = arithmetic_pool.score(prompts, completions, metadata)
    assert ret.rewards == [1.0, 0.0] * 5
    assert [info["extracted"] for info in ret.infos] == completions
    assert ret == ArithmeticEnvironment({"arithmetic": {"max_value": 50}}).score(prompts, completions, metadata)
    assert ray_session.available_resources().get("CPU") == ray_session.cluster_resources().get("CPU")


def test_pool_handles_small_empty_and_mismatched_batches(arithmetic_pool):
    assert arithmetic_pool.score(["1+1="], [" 2 "], [{"ground_truth": "2"}]).rewards == [1.0]
    assert arithmetic_pool.score([], [], []) == EnvironmentReturn([], [])
    with pytest.raises(ValueError, match="prompts=2, completions=1, metadata=2"):
        arithmetic_pool.score(["1+1=", "2+2="], ["2"], [{}, {}])


def test_a_raising_sample_is_named_and_the_pool_stays_usable(faulty_pool):
    completions = ["ok"] * 10
    completions[7] = "boom"
    with pytest.raises(RewardError) as caught:
        faulty_pool.score(*_batch(completions))
    message = str(caught.value)
    assert "environment 'faulty': sample 7 (prompt 'p7', completion 'boom')" in message
    assert "score() raised ValueError: cannot score 'boom'" in message
    assert faulty_pool.score(*_batch(["ok"] * 10)).rewards == [1.0] * 10


def test_a_chunk_that_raises_only_as_a_whole_is_named_by_its_range(faulty_pool):
    with pytest.raises(RewardError, match=r"samples 5\.\.9: score\(\) raised RuntimeError: batch-level failure"):
        faulty_pool.score(*_batch(["ok"] * 6 + ["pair"] * 4))


def test_nan_and_wrong_counts_are_reported_with_global_indices(faulty_pool):
    completions = ["ok"] * 8
    completions[6] = "nan"
    with pytest.raises(RewardError, match=r"sample 6 \(prompt 'p6', completion 'nan'\): reward is nan"):
        faulty_pool.score(*_batch(completions))
    completions[6] = "short"
    with pytest.raises(RewardError, match=r"expected 4 rewards \(one per sample, samples 4\.\.7\), got 3"):
        faulty_pool.score(*_batch(completions))


def test_bad_configs_fail_at_construction(ray_session):
    # Refused on the driver, before any actor starts (the section is validated there).
    with pytest.raises(ValueError, match=r"env\.arithmetic\.max_value: expected int, got str \('ten'\)"):
        EnvironmentPool({"name": "arithmetic", "arithmetic": {"max_value": "ten"}})
    with pytest.raises(ValueError, match=r"env\.name: unknown environment 'arith'"):
        EnvironmentPool({"name": "arith"})
    with pytest.raises(ValueError, match=r"env\.num_workers: must be >= 0, got -1"):
        EnvironmentPool({"name": "arithmetic", "num_workers": -1})
    # 0 steps a multi-turn environment's episodes in-process; a score() environment needs the pool
    with pytest.raises(ValueError, match=r"env\.num_workers: 0 runs a multi-turn environment in-process"):
        EnvironmentPool({"name": "arithmetic", "num_workers": 0})
    with pytest.raises(ValueError, match=r"env\.timeout_s: must be > 0\.0, got -1"):
        EnvironmentPool({"name": "arithmetic", "timeout_s": -1})
    # A user environment whose constructor raises fails in the workers, named with its cause.
    startup_failure = r"worker 0 of 1 could not build the environment: RuntimeError: cannot build"
    with pytest.raises(EnvironmentPoolError, match=startup_failure):
        EnvironmentPool({"name": f"{MODULE}:UnbuildableEnv", "num_workers": 1})


@pytest.mark.parametrize("faulty_pool", [{"timeout_s": 0.5, "num_workers": 1}], indirect=True)
def test_a_slow_chunk_times_out_and_its_worker_is_replaced(faulty_pool):
    started = time.monotonic()
    timed_out = r"chunk 0 \(samples 0\.\.2\) on worker 0 did not finish within 0\.5 s \(env\.timeout_s\)"
    with pytest.raises(RewardError, match=timed_out):
        faulty_pool.score(*_batch(["ok", "slow", "ok"]))
    assert time.monotonic() - started < 5.0
    # The pool has replaced the hung worker (and waited for it): the next batch scores.
    assert faulty_pool.score(*_batch(["ok", "ok"])).rewards == [1.0, 1.0]


@pytest.mark.parametrize("faulty_pool", [{"num_workers": 1}], indirect=True)
def test_a_dead_worker_makes_the_pool_unusable_with_a_clear_error(faulty_pool):
    with pytest.raises(EnvironmentPoolError, match=r"worker 0 died while scoring chunk 0 \(samples 0\.\.1\)"):
        faulty_pool.score(*_batch(["ok", "die"]))
    with pytest.raises(EnvironmentPoolError, match="(?s)the pool is unusable .*build a new EnvironmentPool"):
        faulty_pool.score(*_batch(["ok"]))
