"""A policy evaluated on held-out prompts: GRPO's validation and ``dualrl eval``, one code path.

    evaluate(engine, env, tokenizer, prompts, plan) -> Evaluation
      greedy pass    one greedy sample per prompt: accuracy, reward_mean,
                     response_length_mean (what GRPO's validation always reported)
      sampled pass   with plan.ks: plan.num_samples samples per prompt at policy.generation's
                     temperature / top_p / top_k: pass@k, maj@k, mean@k for each k, and
                     sampled_response_length_mean (core.algorithms.estimators)

Every metric is the mean over prompts of a per-prompt value (``Evaluation.per_prompt``), so
the confidence interval of any of them is a bootstrap over prompts of the same values.

The sampled rows are seeded by (``grpo.seed``, row) on a stream of their own, whatever the
step: every validation of a run draws with the same seeds (two validations differ by the
weights, not by the draws), and ``dualrl eval`` with the run's config repeats the run's own
sampled validation of the same weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from core.algorithms.estimators import maj_at_k, mean_at_k, pass_at_k
from core.algorithms.multi_turn import EpisodeRunner, decode_conversations, episode_summaries, episodes_to_rows
from core.algorithms.rollouts import decode_completions, prompt_batch, sample_seeds

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from core.algorithms.config import GRPOConfig
    from core.data import BatchedDataDict
    from core.datasets import PromptDatum
    from core.environments import Environment


class Sampler(Protocol):
    """What is evaluated: an engine holding the weights
    (:class:`~core.algorithms.rollout_engine.RolloutEngine`), sampling right-padded prompts."""

    def generate(self, batch: BatchedDataDict, greedy: bool) -> BatchedDataDict: ...


#: ``sample_seeds`` stream of the sampled validation rows.  Training rollouts use streams
#: 0, 1, ... (one per generate call of a step under dynamic sampling), so validation takes one
#: far above any ``grpo.dynamic_sampling_max_gen_batches``.
VALIDATION_STREAM = 1 << 20


@dataclass(frozen=True)
class EvalPlan:
    """How a set of prompts is evaluated (from the ``grpo`` section: :meth:`of_grpo`)."""

    batch_size: int  # prompts per generate call
    seed: int  # of the sampled rows' seeds
    ks: tuple[int, ...] = ()  # the k's of the sampled pass; () = the greedy pass only
    num_samples: int = 0  # samples per prompt of the sampled pass

    @classmethod
    def of_grpo(cls, g: GRPOConfig, num_prompts: int) -> EvalPlan:
        """``grpo.val_batch_size`` (null: every prompt in one call), ``grpo.seed``,
        ``grpo.val_pass_at_k`` and ``grpo.val_num_samples``."""
        return cls(g.val_batch_size or num_prompts, g.seed, tuple(g.val_pass_at_k or ()), g.val_samples_per_prompt)


@dataclass
class Samples:
    """``num_samples`` scored samples of every prompt, prompt-major (row ``i * n + j``)."""

    num_samples: int
    completions: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    episodes: list[dict[str, float]] = field(default_factory=list)
    """Multi-turn only: each sample's :func:`~core.algorithms.multi_turn.episode_summaries`."""

    def by_prompt(self, values: Sequence[Any]) -> list[list[Any]]:
        n = self.num_samples
        return [list(values[i : i + n]) for i in range(0, len(values), n)]

    def info_values(self, key: str) -> list[Any] | None:
        """``info[key]`` of every sample, or None when some sample's environment did not say."""
        if not self.infos or any(key not in info for info in self.infos):
            return None
        return [info[key] for info in self.infos]


@dataclass
class Evaluation:
    """What :func:`evaluate` measured."""

    prompts: list[PromptDatum]
    greedy: Samples
    sampled: Samples | None = None
    ks: tuple[int, ...] = ()

    def per_prompt(self) -> dict[str, list[float]]:
        """Each metric's value per prompt (a metric is their mean): greedy ``reward_mean``,
        ``response_length_mean`` and ``accuracy`` (when the environment says which samples are
        correct), then the sampled pass's ``pass@k`` / ``maj@k`` (when it gives an
        ``answer``) / ``mean@k`` for each k and ``sampled_response_length_mean``."""
        greedy = self.greedy
        out = {"reward_mean": list(greedy.rewards), "response_length_mean": [float(n) for n in greedy.lengths]}
        correct = greedy.info_values("correct")
        if correct is not None:
            out["accuracy"] = [float(bool(c)) for c in correct]
        if greedy.episodes:  # multi-turn: how the greedy episodes used their tools
            for key in ("turns", "tool_calls", "malformed_tool_calls"):
                out[f"{key}_mean"] = [e[key] for e in greedy.episodes]
            for key in ("tool_use", "correct_with_tool"):
                out[f"{key}_rate"] = [e[key] for e in greedy.episodes]
        if self.sampled is not None:
            out.update(_sampled_scores(self.sampled, self.ks))
        return out

    def metrics(self) -> dict[str, float]:
        """The point estimates (what the training loop logs under ``val/``) and ``num_samples``,
        the number of prompts."""
        out = {name: _mean(values) for name, values in self.per_prompt().items()}
        out["num_samples"] = float(len(self.prompts))
        return out


def evaluate(
    engine: Sampler,
    env: Environment | EpisodeRunner,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[PromptDatum],
    plan: EvalPlan,
) -> Evaluation:
    """The greedy pass, then the sampled pass when ``plan.ks`` asks for one.  ``engine`` is a
    :class:`~core.algorithms.rollout_engine.RolloutEngine` holding the weights to evaluate,
    ``env`` scores (an :class:`~core.environments.EnvironmentPool`)."""
    if not prompts:
        raise ValueError("evaluate: no prompts")
    prompts = list(prompts)
    greedy = sample_and_score(engine, env, tokenizer, prompts, plan, num_samples=1, greedy=True)
    if not plan.ks:
        return Evaluation(prompts, greedy)
    sampled = sample_and_score(engine, env, tokenizer, prompts, plan, num_samples=plan.num_samples, greedy=False)
    return Evaluation(prompts, greedy, sampled, plan.ks)


def sample_and_score(
    engine: Sampler,
    env: Environment | EpisodeRunner,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[PromptDatum],
    plan: EvalPlan,
    *,
    num_samples: int,
    greedy: bool,
) -> Samples:
    """``num_samples`` samples of every prompt, ``plan.batch_size`` prompts per generate call,
    scored by ``env``; sampled rows seeded by (``plan.seed``, row index)."""
    n = num_samples
    if isinstance(env, EpisodeRunner):
        return _play_episodes(engine, env, tokenizer, prompts, plan, num_samples=n, greedy=greedy)
    seeds = None if greedy else sample_seeds(plan.seed, 0, len(prompts) * n, stream=VALIDATION_STREAM)
    out = Samples(n)
    for start in range(0, len(prompts), plan.batch_size):
        chunk = prompts[start : start + plan.batch_size]
        batch = prompt_batch([p.input_ids for p in chunk], n, tokenizer.pad_token_id)
        if seeds is not None:
            batch["sample_seeds"] = seeds[start * n : (start + len(chunk)) * n]
        generated = engine.generate(batch, greedy=greedy)
        texts = decode_completions(tokenizer, generated, batch["input_lengths"])
        repeat = [p for p in chunk for _ in range(n)]
        scored = env.score([p.prompt for p in repeat], texts, [p.metadata for p in repeat])
        out.completions += texts
        out.rewards += scored.rewards
        out.infos += scored.infos
        out.lengths += generated["generation_lengths"].tolist()
    return out


def _play_episodes(
    engine: Sampler,
    runner: EpisodeRunner,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[PromptDatum],
    plan: EvalPlan,
    *,
    num_samples: int,
    greedy: bool,
) -> Samples:
    """:func:`sample_and_score` for a multi-turn environment: each sample is a whole episode
    (its reward the sum of its steps', its length the generated tokens of all its turns);
    sampled turns seeded by (``plan.seed``, row, turn) on the validation stream."""
    n, out = num_samples, Samples(num_samples)
    for start in range(0, len(prompts), plan.batch_size):
        chunk = [p for p in prompts[start : start + plan.batch_size] for _ in range(n)]
        episodes = runner.run(
            [p.input_ids for p in chunk],
            [p.metadata for p in chunk],
            lambda batch, greedy: engine.generate(batch, greedy=greedy),
            greedy=greedy,
            seed=plan.seed,
            step=0,
            stream=VALIDATION_STREAM,
            row_offset=start * n,
        )
        rows = episodes_to_rows(episodes, tokenizer.pad_token_id)
        out.completions += decode_conversations(tokenizer, rows)
        out.rewards += rows["rewards"].tolist()
        out.infos += rows["infos"]
        out.lengths += rows["generation_lengths"].tolist()
        out.episodes += episode_summaries(rows)
    return out


def _sampled_scores(samples: Samples, ks: Sequence[int]) -> dict[str, list[float]]:
    correct = samples.info_values("correct")
    if correct is None:
        raise ValueError(
            "grpo.val_pass_at_k: the environment does not say which samples are correct (info['correct']), "
            "which pass@k, maj@k and mean@k count"
        )
    answers = samples.info_values("answer")  # maj@k votes on them; without them it is not reported
    flags = samples.by_prompt([bool(c) for c in correct])
    votes = samples.by_prompt(answers) if answers is not None else None
    n = samples.num_samples
    out: dict[str, list[float]] = {}
    for k in ks:
        out[f"pass@{k}"] = [pass_at_k(n, sum(f), k) for f in flags]
        if votes is not None:
            out[f"maj@{k}"] = [maj_at_k(v, f, k) for v, f in zip(votes, flags, strict=True)]
        out[f"mean@{k}"] = [mean_at_k(n, sum(f), k) for f in flags]
    out["sampled_response_length_mean"] = [_mean(lengths) for lengths in samples.by_prompt(samples.lengths)]
    return out


def _mean(values: Sequence[float]) -> float:
    # Python's left-to-right sum: the greedy metrics keep the exact values GRPO logged before.
    return sum(values) / len(values)
