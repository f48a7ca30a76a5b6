"""Multi-turn rollouts: episodes of a multi-turn environment, generated turn by turn.

Each turn, every live episode's conversation so far is one row of ONE batched generate call;
each row's new tokens (kept exactly as sampled, never re-encoded) are decoded and stepped
through its environment; a continuing episode gets the observation's tokens appended
(:class:`~core.algorithms.observation_tokens.ObservationTokens`) and goes on.  An episode ends
when its environment says ``done``, after ``max_turns`` turns, or when the next observation
would not leave room for one more generated token within ``max_total_tokens``
(``policy.max_total_sequence_length``): it then ends *before* that observation, is marked
``truncated`` and counted; no token of it is appended, so nothing is ever mis-masked.

Per episode (:func:`episodes_to_rows`, the rows GRPO trains on): the whole conversation's ids,
``token_mask`` 1 exactly on the generated tokens of every assistant turn (stop token
included) and 0 on the prompt and the observations, ``logprobs`` the sampling logprobs on
those tokens (0 elsewhere), the reward (the SUM of the step rewards), the last step's info,
and counts (turns, tool calls, malformed calls, generated and observation tokens).

Seeds: turn t of rollout row r is sampled with ``SeedSequence([seed, step, stream, r, t])``,
so a CPU fp32 run repeats.  The episodes' states live in an executor
(:mod:`core.environments.episodes`): the Ray actors of an ``EpisodePool`` (``env.num_workers
>= 1``, each episode pinned to one actor, one call per actor and turn) or the driver itself
(``env.num_workers: 0``); either way each step has the ``env.timeout_s`` deadline and the
same outcome, and its result is checked here.  A step that raises, overruns or returns an
invalid result stops the run (``env.on_episode_error: fail``, an :class:`EpisodeError`
naming episode, turn and field) or ends its episode with the reward so far (``end_episode``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from core.algorithms.observation_tokens import ObservationTokens
from core.algorithms.rollouts import prompt_batch
from core.data import BatchedDataDict
from core.environments.episodes import EpisodeExecutor, InProcessEpisodes, Outcome
from core.environments.multi_turn import EpisodeError, MultiTurnEnvironment, StepResult, check_step_result

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "Episode",
    "EpisodeRunner",
    "GenerateFn",
    "episode_summaries",
    "episodes_to_rows",
    "multi_turn_metrics",
    "turn_seeds",
]

#: The engine's generate: (right-padded prompts with sample_seeds, greedy) -> GenerationOutputSpec.
GenerateFn = Callable[[BatchedDataDict, bool], BatchedDataDict]
#: ``with timer(phase): ...`` (core.algorithms.timing.StepTimer).
PhaseTimer = Callable[[str], AbstractContextManager[Any]]


def _untimed(phase: str) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


@dataclass
class Episode:
    """One conversation being generated (row ``row`` of the rollout batch)."""

    row: int
    prompt_length: int
    ids: list[int]
    state: Any = None  # the environment's own episode state (whatever its reset returned): opaque here
    logprobs: list[float] = field(default_factory=list)
    mask: list[float] = field(default_factory=list)
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    turns: int = 0
    tool_calls: int = 0
    malformed_tool_calls: int = 0
    generated_tokens: int = 0
    observation_tokens: int = 0
    ended: str | None = None
    """None while live; then done | max_turns | truncated | error."""

    def __post_init__(self) -> None:
        self.logprobs = [0.0] * len(self.ids)
        self.mask = [0.0] * len(self.ids)

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        """Generated tokens (with their logprobs, mask 1) or observation tokens (None: mask 0)."""
        self.ids.extend(ids)
        self.logprobs.extend([0.0] * len(ids) if logprobs is None else logprobs)
        self.mask.extend([0.0 if logprobs is None else 1.0] * len(ids))


def turn_seeds(seed: int, step: int, stream: int, rows: Sequence[int], turn: int) -> torch.Tensor:
    """Sampling seeds of one turn: row r's is a pure function of (seed, step, stream, r, turn)."""
    values = [
        int(np.random.SeedSequence([int(seed), int(step), int(stream), int(r), int(turn)]).generate_state(1)[0])
        for r in rows
    ]
    return torch.tensor(values, dtype=torch.int64)


class EpisodeRunner:
    """Runs episodes of one multi-turn environment (the settings of a run, bound once).

    ``env`` is where the episodes live: an :class:`EpisodeExecutor` (e.g. the Ray
    :class:`~core.environments.episode_pool.EpisodePool`), or the environment itself, then
    stepped in-process (:class:`InProcessEpisodes`, under ``step_timeout_s``)."""

    def __init__(
        self,
        env: MultiTurnEnvironment | EpisodeExecutor,
        tokenizer: PreTrainedTokenizerBase,
        observations: ObservationTokens,
        *,
        max_turns: int,
        max_total_tokens: int,
        step_timeout_s: float | None = None,
        on_error: str = "fail",
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"grpo.max_rollout_turns must be >= 1, got {max_turns}")
        if on_error not in ("fail", "end_episode"):
            raise ValueError(f"env.on_episode_error must be fail or end_episode, got {on_error!r}")
        if not isinstance(env, EpisodeExecutor):
            if step_timeout_s is None:
                raise ValueError(
                    "EpisodeRunner: an environment stepped in-process needs step_timeout_s (env.timeout_s)"
                )
            env = InProcessEpisodes(env, step_timeout_s)
        self.executor, self.tokenizer, self.observations = env, tokenizer, observations
        self.max_turns, self.max_total_tokens, self.on_error = max_turns, max_total_tokens, on_error

    def run(
        self,
        prompt_ids: Sequence[Sequence[int]],
        metadata: Sequence[dict[str, Any]],
        generate: GenerateFn,
        *,
        greedy: bool,
        seed: int,
        step: int,
        stream: int = 0,
        row_offset: int = 0,
        timer: PhaseTimer | None = None,
    ) -> list[Episode]:
        """One episode per prompt, played to the end (see the module docstring).  ``timer``
        (GRPO's StepTimer) gets the generate calls as ``generation`` and the environment's
        reset / step calls as ``reward``."""
        timer = timer or _untimed
        episodes = [Episode(row_offset + i, len(ids), list(ids)) for i, ids in enumerate(prompt_ids)]
        for ep in episodes:
            if len(ep.ids) >= self.max_total_tokens:
                raise ValueError(
                    f"episode {ep.row}: prompt of {len(ep.ids)} tokens leaves no room within "
                    f"policy.max_total_sequence_length={self.max_total_tokens}"
                )
        try:
            with timer("reward"):
                outcomes = self.executor.reset_episodes([ep.row for ep in episodes], list(metadata))
            for ep, outcome in zip(episodes, outcomes, strict=True):
                self._checked(ep, 0, outcome, "reset")
            for turn in range(self.max_turns):
                live = [ep for ep in episodes if ep.ended is None]
                if not live:
                    break
                batch = prompt_batch([ep.ids for ep in live], 1, self.tokenizer.pad_token_id)
                # each conversation's own room: the longest one must not cut a short one's turn
                batch["max_new_tokens"] = torch.tensor([self.max_total_tokens - len(ep.ids) for ep in live])
                if not greedy:
                    batch["sample_seeds"] = turn_seeds(seed, step, stream, [ep.row for ep in live], turn)
                with timer("generation"):
                    out = generate(batch, greedy)
                self._play_turn(live, out, turn, timer)
        finally:
            self.executor.end_rollout()
        for ep in episodes:
            if ep.ended is None:
                ep.ended = "max_turns"
        return episodes

    def _play_turn(self, live: list[Episode], out: BatchedDataDict, turn: int, timer: PhaseTimer) -> None:
        """Append each live episode's new tokens, step them all in one executor call, then
        take each result and append its observation."""
        turns = [_turn_tokens(out, j, ep, turn) for j, ep in enumerate(live)]
        messages = []
        for ep, (new, logprobs) in zip(live, turns, strict=True):
            ep.append(new, logprobs)
            ep.turns += 1
            ep.generated_tokens += len(new)
            messages.append(str(self.tokenizer.decode(new, skip_special_tokens=True)))
        with timer("reward"):
            outcomes = self.executor.step_episodes([ep.row for ep in live], messages)
        for ep, (new, _), outcome in zip(live, turns, outcomes, strict=True):
            result = self._checked(ep, turn, outcome, "step")
            if result is not None:
                self._take_result(ep, result)
                self._observe(ep, result, new, turn)

    def _observe(self, ep: Episode, result: StepResult, new: list[int], turn: int) -> None:
        if ep.ended is not None or turn == self.max_turns - 1:
            return
        obs = self.observations.tokens(result.observation or "", new)
        if len(ep.ids) + len(obs) >= self.max_total_tokens:  # no room for the observation and one more token
            ep.ended = "truncated"
            return
        ep.append(obs, None)
        ep.observation_tokens += len(obs)

    def _take_result(self, ep: Episode, result: StepResult) -> None:
        ep.reward += result.reward
        ep.info = dict(result.info)
        ep.tool_calls += int(result.info.get("tool_calls", 0))
        ep.malformed_tool_calls += int(result.info.get("malformed_tool_calls", 0))
        if result.done:
            ep.ended = "done"

    def _checked(self, ep: Episode, turn: int, outcome: Outcome, what: str) -> StepResult | None:
        """A step's checked result (reset: None); on a failure: raise, or end the episode
        (``env.on_episode_error``) and return None."""
        name = self.executor.name
        try:
            if outcome.error is not None:
                raise EpisodeError(f"environment {name!r}: episode {ep.row}, turn {turn}: {outcome.error}")
            if what == "reset":
                return None
            return check_step_result(outcome.value, ep.row, turn, name)
        except EpisodeError as err:
            if self.on_error == "fail":
                if outcome.cause is not None:
                    raise err from outcome.cause
                raise
            ep.ended, ep.info = "error", {**ep.info, "error": str(err)}
            return None


def _turn_tokens(out: BatchedDataDict, j: int, ep: Episode, turn: int) -> tuple[list[int], list[float]]:
    """Row ``j``'s newly generated ids and their logprobs; the engine must have kept the
    conversation so far as it was given (else the mask would be wrong: refused)."""
    start = len(ep.ids)
    n = int(out["generation_lengths"][j])
    kept = out["output_ids"][j, :start].tolist()
    if kept != ep.ids:
        raise EpisodeError(f"episode {ep.row}, turn {turn}: field 'output_ids': the engine changed the conversation")
    new = out["output_ids"][j, start : start + n].tolist()
    logprobs = out["logprobs"][j, start : start + n].float().tolist()
    return new, logprobs


def episodes_to_rows(episodes: Sequence[Episode], pad_token_id: int) -> BatchedDataDict:
    """The episodes as GRPO rows: the ``GenerationOutputSpec`` keys (``generation_lengths`` =
    generated tokens of all turns) plus the explicit ``token_mask`` that ``training_batch``
    uses, ``prompt_lengths``, ``rewards``, ``infos``, ``truncated`` and per-episode counts."""
    width = max(len(ep.ids) for ep in episodes)
    ids = torch.full((len(episodes), width), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros(len(episodes), width)
    mask = torch.zeros(len(episodes), width)
    for b, ep in enumerate(episodes):
        n = len(ep.ids)
        ids[b, :n] = torch.tensor(ep.ids, dtype=torch.long)
        logprobs[b, :n] = torch.tensor(ep.logprobs)
        mask[b, :n] = torch.tensor(ep.mask)

    def counts(name: str) -> torch.Tensor:
        return torch.tensor([getattr(ep, name) for ep in episodes], dtype=torch.long)

    infos = [{**ep.info, "turns": ep.turns, "ended": ep.ended} for ep in episodes]
    return BatchedDataDict(
        output_ids=ids,
        logprobs=logprobs,
        token_mask=mask,
        unpadded_sequence_lengths=torch.tensor([len(ep.ids) for ep in episodes], dtype=torch.long),
        generation_lengths=counts("generated_tokens"),
        prompt_lengths=counts("prompt_length"),
        rewards=torch.tensor([ep.reward for ep in episodes], dtype=torch.float32),
        infos=infos,
        truncated=torch.tensor([ep.ended == "truncated" for ep in episodes]),
        turns=counts("turns"),
        tool_calls=counts("tool_calls"),
        malformed_tool_calls=counts("malformed_tool_calls"),
        observation_tokens=counts("observation_tokens"),
        episode_errors=torch.tensor([ep.ended == "error" for ep in episodes]),
        max_turns_reached=torch.tensor([ep.ended == "max_turns" for ep in episodes]),
    )


def episode_summaries(rows: BatchedDataDict) -> list[dict[str, float]]:
    """Per episode: ``turns``, ``tool_calls``, ``malformed_tool_calls``, ``tool_use`` (1 when it
    made a call) and ``correct_with_tool`` (1 when it made a call and its final answer was right:
    the share of episodes the tool solved).  GRPO's step metrics and validation both read these."""
    out = []
    for b, info in enumerate(rows["infos"]):
        calls = int(rows["tool_calls"][b])
        used = float(calls > 0)
        out.append(
            {
                "turns": float(rows["turns"][b]),
                "tool_calls": float(calls),
                "malformed_tool_calls": float(rows["malformed_tool_calls"][b]),
                "tool_use": used,
                "correct_with_tool": used * float(bool(info.get("correct", False))),
            }
        )
    return out


def multi_turn_metrics(rows: BatchedDataDict) -> dict[str, float]:
    """What a researcher watches about multi-turn rollouts (``multi_turn/...``): per-episode
    means (turns, tool calls, malformed calls, generated and observation tokens), the shares
    of episodes that used a tool and that used one and were right, counts of episodes
    truncated / failed / cut at max_turns, and the mean reward of the episodes of each turn
    count (``reward_turns_<k>``)."""
    out = {
        f"multi_turn/{key}_mean": float(rows[key].float().mean())
        for key in ("turns", "tool_calls", "malformed_tool_calls", "observation_tokens")
    }
    # = the generate calls of one rollout (every live episode is in each turn's call)
    out["multi_turn/turns_max"] = float(rows["turns"].max())
    out["multi_turn/generated_tokens_mean"] = float(rows["generation_lengths"].float().mean())
    summaries = episode_summaries(rows)
    for key in ("tool_use", "correct_with_tool"):
        out[f"multi_turn/{key}_rate"] = sum(e[key] for e in summaries) / len(summaries)
    for key in ("truncated", "episode_errors", "max_turns_reached"):
        out[f"multi_turn/{key}"] = float(rows[key].sum())
    for turns in sorted(set(rows["turns"].tolist())):
        chosen = rows["turns"] == turns
        out[f"multi_turn/reward_turns_{turns}"] = float(rows["rewards"][chosen].mean())
    return out


def decode_conversations(tokenizer: PreTrainedTokenizerBase, rows: BatchedDataDict) -> list[str]:
    """Everything after each row's prompt (turns and observations), as text to print."""
    return [
        str(tokenizer.decode(rows["output_ids"][b, start:end].tolist(), skip_special_tokens=True))
        for b, (start, end) in enumerate(
            zip(rows["prompt_lengths"].tolist(), rows["unpadded_sequence_lengths"].tolist(), strict=True)
        )
    ]
