"""The multi-turn GRPO row's environment (``dualrl bench --grpo-multi-turn N``): scripted turns.

A random-weight bench model would almost never write a valid tool call, so against the
built-in ``tool_arithmetic`` environment its episodes would end after one turn and the row
would time a single-turn step.  This environment makes the workload deterministic: every
episode lasts exactly ``env.kwargs.turns`` assistant turns; each turn but the last gets the
same fixed observation (:data:`OBSERVATION`, characters of the built-in character tokenizer),
and the last turn's message is checked exactly against the prompt's ``ground_truth`` (reward
1 / 0), so every episode costs the same number of generate calls, observation tokens and
environment steps.  It runs where ``dualrl grpo`` runs any user environment (named
``env.name: benchmarks.lib.multi_turn_env:ScriptedTurnsEnv``, built in the EpisodePool's actors).
"""

from __future__ import annotations

from typing import Any

from core.environments.multi_turn import StepResult

__all__ = ["ENV_NAME", "OBSERVATION", "OBSERVATION_TOKENS", "ScriptedTurnsEnv"]

ENV_NAME = "benchmarks.lib.multi_turn_env:ScriptedTurnsEnv"
#: What the model sees between turns: 12 tokens of the character tokenizer (like a short tool result).
OBSERVATION = " = 1234567 ="
#: Its length in tokens (one per character; the sequence limit of the row counts on it).
OBSERVATION_TOKENS = len(OBSERVATION)


class ScriptedTurnsEnv:
    """Exactly ``turns`` turns per episode (module docstring); ``env.kwargs``: ``turns`` (>= 1)."""

    name = "scripted_turns"

    def __init__(self, cfg: Any) -> None:
        turns = cfg.kwargs.get("turns")
        if not isinstance(turns, int) or isinstance(turns, bool) or turns < 1:
            raise ValueError(f"env.kwargs.turns: the scripted episodes' turn count, an int >= 1; got {turns!r}")
        self.turns = turns

    def reset(self, metadata: dict[str, Any]) -> dict[str, Any]:
        return {"turn": 0, "ground_truth": str(metadata.get("ground_truth", ""))}

    def step(self, state: dict[str, Any], assistant_message: str) -> StepResult:
        state["turn"] += 1
        if state["turn"] < self.turns:
            return StepResult(OBSERVATION, 0.0, False, {})
        correct = assistant_message.strip() == state["ground_truth"]
        return StepResult(None, float(correct), True, {"correct": correct, "answer": assistant_message.strip()})
