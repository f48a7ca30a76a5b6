"""GRPO (NeMo RL's ``grpo_train``) on any training backend.

One step::

    prompts (num_prompts_per_step) x num_generations_per_prompt
      -> refit the engines if the policy changed        timing/refit_s
      -> sample rollouts (seeded per row)               timing/generation_s   } generate_rollout
      -> rewards from the environment pool              timing/reward_s       }
         (dynamic sampling: more prompts until enough                         }
         groups are informative, core.algorithms.dynamic_sampling)           }
      -> overlong filtering / penalty (response_length)                       }
      -> advantages (core.algorithms.advantages)                              }
      -> with grpo.distillation: the teacher's logprobs  timing/teacher_s     }
         on the batch, as dense advantages or as the                          }
         KL term's reference (core.algorithms.distillation)                   }
      -> prev_logprobs (unless the training forward's   timing/logprobs_s     } train_on_rollout
         own are exact) and reference logprobs (with                          }
         a KL term), one call to the workers                                  }
      -> policy.train(batch, ClippedPGLossFn)           timing/train_s        }

The async loop (``core.algorithms.async_grpo``) runs the same two halves on two threads.

The loop around it (validation, logging, checkpoints, resume) is
:class:`core.algorithms.loop.TrainingLoop`; set-up is :mod:`core.algorithms.grpo_setup`, the
run's parts :class:`core.algorithms.grpo_run.GRPORun`.  Everything here runs on the driver and
talks to the backend only through ``Policy``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from core.algorithms.advantages import compute_advantages
from core.algorithms.distillation import apply_teacher, teacher_is_reference
from core.algorithms.dynamic_sampling import DynamicSamplingError, GroupSelection, sample_until_informative
from core.algorithms.evaluation import EvalPlan, evaluate
from core.algorithms.multi_turn import EpisodeRunner, episodes_to_rows, multi_turn_metrics
from core.algorithms.response_length import shape_response_lengths
from core.algorithms.rollouts import (
    decode_completions,
    generation_mask,
    prompt_batch,
    rollout_metrics,
    sample_seeds,
    training_batch,
    truncated_rows,
)
from core.algorithms.timing import StepTimer
from core.algorithms.training_run import report_skipped_steps, train_metrics
from core.data import BatchedDataDict
from core.logging import format_val_samples
from core.reporting import get_logger

if TYPE_CHECKING:
    from core.algorithms.config import GRPOConfig, GRPORunConfig
    from core.algorithms.grpo_run import GRPORun
    from core.datasets import PromptDatum
    from core.losses import ClippedPGLossFn

logger = get_logger(__name__)


@dataclass
class Rollout:
    """One step's rollouts, scored and turned into a training batch: what generation hands to
    training (in the async loop across threads, tagged with the weights that generated it)."""

    step: int
    """The training step the rollouts are for (their prompts and sampling seeds are that step's)."""
    data: BatchedDataDict
    """``ClippedPGLossFn`` input without the old / reference logprobs (added before training)."""
    metrics: dict[str, float]
    """Rollout, advantage and accuracy metrics, and the generation / reward seconds."""
    version: int = 0
    """The training step whose weights generated them (0: the initial weights)."""
    loader_state: dict[str, Any] | None = None
    """The prompt loader's position right after this step's prompts (what a checkpoint saves)."""
    skipped: bool = False
    """No update this step: dynamic sampling found no informative group, or too few under
    ``grpo.dynamic_sampling_on_shortfall: skip``."""


@dataclass
class ScoredBatch:
    """One generate call's rollouts, scored: ``rows`` holds the engine's output
    (``GenerationOutputSpec``) plus ``prompt_lengths``, ``rewards`` (the environment's) and
    ``infos`` per row, group by group."""

    rows: BatchedDataDict
    version: int
    """The training step whose weights generated them."""

    @property
    def rewards(self) -> torch.Tensor:
        return self.rows["rewards"]


def grpo_step(run: GRPORun, step: int) -> dict[str, float]:
    """One synchronous GRPO step on ``run``: refit, rollouts, training; its metrics."""
    timer = StepTimer()
    with timer("refit"):
        refit = run.engine.sync_weights()
    rollout = generate_rollout(run, step)
    metrics = {**rollout.metrics, **refit, **train_on_rollout(run, rollout, step, timer)}
    run.trained_loader_state = rollout.loader_state
    metrics.update(timer.metrics())
    return metrics


@dataclass
class SyncSchedule:
    """The synchronous schedule (:class:`core.algorithms.grpo_run.StepSchedule`): each step
    refits the engines, then generates and trains on its own rollouts."""

    run: GRPORun

    def step(self, step: int) -> dict[str, float]:
        return grpo_step(self.run, step)

    def sync_weights(self) -> dict[str, float]:
        return self.run.engine.sync_weights()


def generate_rollout(run: GRPORun, step: int) -> Rollout:
    """Step ``step``'s prompts -> sampled rollouts (seeded per row) -> rewards (with dynamic
    sampling: more prompts until enough groups are informative) -> overlong rules ->
    advantages -> the training batch.  Draws the prompts from ``run.loader``."""
    timer = StepTimer()
    batches, selection = _sample_groups(run, step, timer)
    loader_state = run.loader.state_dict()
    generated: BatchedDataDict = BatchedDataDict.from_batches(
        [b.rows for b in batches], pad_value_dict={"output_ids": run.tokenizer.pad_token_id}
    )
    # What the policy produced this step (every generate call), then what it trains on.
    mask = generation_mask(generated, generated["prompt_lengths"])
    metrics = rollout_metrics(generated, mask, generated["rewards"], run.stop_token_ids, run.max_new_tokens)
    chosen = generated if selection is None else generated.select_indices(selection.rows)
    trained = torch.ones(chosen.size) if selection is None else selection.trained
    data, batch_metrics = training_data(run.cfg.grpo, chosen, trained, run.stop_token_ids, run.max_new_tokens)
    if selection is not None and selection.train_rows < data.size:  # whole global batches only
        data = data.select_indices(list(range(selection.train_rows)))
    metrics.update(batch_metrics)
    metrics.update(_accuracy(generated["infos"]))
    if run.episodes is not None:
        metrics.update(multi_turn_metrics(generated))
    skipped = False
    if selection is not None:
        skipped = _shortfall(run, step, selection)
        metrics.update({**selection.metrics(), "dynamic_sampling/skipped_step": float(skipped)})
    metrics.update({k: v for k, v in timer.metrics().items() if k.startswith("timing/")})
    version = min(b.version for b in batches)  # one version in practice: refits wait for the step
    return Rollout(step, data, metrics, version, loader_state, skipped)


def sample_batch(run: GRPORun, step: int, call: int, timer: StepTimer) -> ScoredBatch:
    """Generate call ``call`` of step ``step``: the loader's next prompts, each sampled
    ``num_generations_per_prompt`` times with the seeds of stream ``call``, scored."""
    g = run.cfg.grpo
    group = g.num_generations_per_prompt
    prompts = run.loader.next_batch()
    if run.episodes is not None:
        return _sample_episodes(run, run.episodes, step, call, timer, prompts)
    batch = prompt_batch([p.input_ids for p in prompts], group, run.tokenizer.pad_token_id)
    batch["sample_seeds"] = sample_seeds(g.seed, step, batch.size, stream=call)
    texts = [p.prompt for p in prompts for _ in range(group)]
    metadata = [p.metadata for p in prompts for _ in range(group)]
    with timer("generation"):
        out, version = run.engine.generate_tagged(batch, greedy=False)
    completions = decode_completions(run.tokenizer, out, batch["input_lengths"])
    with timer("reward"):
        scored = run.scorer.score(texts, completions, metadata)
    rows: BatchedDataDict = BatchedDataDict(out)
    rows["prompt_lengths"] = batch["input_lengths"]
    rows["rewards"] = torch.tensor(scored.rewards, dtype=torch.float32)
    rows["infos"] = list(scored.infos)
    return ScoredBatch(rows, version)


def _sample_episodes(
    run: GRPORun, episodes: EpisodeRunner, step: int, call: int, timer: StepTimer, prompts: Sequence[PromptDatum]
) -> ScoredBatch:
    """:func:`sample_batch` for a multi-turn environment: every prompt's group played as
    episodes (core.algorithms.multi_turn), their rows carrying an explicit ``token_mask``.
    ``timing/generation_s`` is the generate calls of every turn, ``timing/reward_s`` the
    environment's reset / step calls (as for a single-turn environment's scoring)."""
    group = run.cfg.grpo.num_generations_per_prompt
    versions: list[int] = []

    def generate(batch: BatchedDataDict, greedy: bool) -> BatchedDataDict:
        out, version = run.engine.generate_tagged(batch, greedy=greedy)
        versions.append(version)
        return out

    played = episodes.run(
        [p.input_ids for p in prompts for _ in range(group)],
        [p.metadata for p in prompts for _ in range(group)],
        generate,
        greedy=False,
        seed=run.cfg.grpo.seed,
        step=step,
        stream=call,
        timer=timer,
    )
    # No generate call at all when every episode ended at reset (env.on_episode_error: end_episode).
    version = min(versions, default=run.engine.version)
    return ScoredBatch(episodes_to_rows(played, run.tokenizer.pad_token_id), version)


def _sample_groups(run: GRPORun, step: int, timer: StepTimer) -> tuple[list[ScoredBatch], GroupSelection | None]:
    """One generate call, or with dynamic sampling as many as it takes (None: train on all)."""
    g = run.cfg.grpo

    def sample(call: int) -> ScoredBatch:
        return sample_batch(run, step, call, timer)

    if not g.use_dynamic_sampling:
        return [sample(0)], None
    return sample_until_informative(
        sample,
        g.num_generations_per_prompt,
        g.num_prompts_per_step,
        g.dynamic_sampling_max_gen_batches,
        run.cfg.policy.train_global_batch_size,
    )


def training_data(
    g: GRPOConfig, rows: BatchedDataDict, trained: torch.Tensor, stop_token_ids: Sequence[int], max_new_tokens: int
) -> tuple[BatchedDataDict, dict[str, float]]:
    """The loss input of the rows a step trains on (``trained`` 0: masked filler rows), with the
    overlong rules of the ``grpo`` section ``g`` (a row that ends without one of
    ``stop_token_ids`` within ``max_new_tokens`` is truncated) and the advantage metrics
    (``dualrl parity``'s multi-turn row calls this too)."""
    truncated = truncated_rows(rows, stop_token_ids, max_new_tokens)
    shaped = shape_response_lengths(rows["rewards"], rows["generation_lengths"], truncated, g, max_new_tokens)
    sample_mask = trained * shaped.sample_mask
    adv = compute_advantages(
        shaped.rewards,
        g.num_generations_per_prompt,
        estimator=g.advantage_estimator,
        leave_one_out=g.use_leave_one_out_baseline,
        normalize=g.normalize_rewards,
        token_counts=rows["generation_lengths"] * sample_mask,
    )
    # Masked rows train on nothing; a 0 keeps them out of the advantage metrics' signal too.
    adv.advantages = torch.where(sample_mask > 0, adv.advantages, 0.0)
    data = training_batch(rows, rows["prompt_lengths"], adv.advantages, sample_mask)
    return data, {**adv.metrics(), **shaped.metrics(g)}


def _shortfall(run: GRPORun, step: int, selection: GroupSelection) -> bool:
    """At the cap with too few informative groups: warn, then skip (True), train, or raise."""
    if not selection.cap_hit:
        return False
    g = run.cfg.grpo
    what = (
        f"step {step}: dynamic sampling found {selection.informative} informative group(s) of the "
        f"{g.num_prompts_per_step} wanted in {selection.gen_batches} generate call(s) "
        "(grpo.dynamic_sampling_max_gen_batches)"
    )
    if g.dynamic_sampling_on_shortfall == "error":
        raise DynamicSamplingError(f"{what}; grpo.dynamic_sampling_on_shortfall is error")
    skip = g.dynamic_sampling_on_shortfall == "skip" or selection.informative == 0
    action = "skipping the step (no update)" if skip else "training on those (the rest of the batch masked out)"
    logger.warning("%s: %s", what, action)
    return skip


def train_on_rollout(run: GRPORun, rollout: Rollout, step: int, timer: StepTimer) -> dict[str, float]:
    """The old / reference logprobs the loss needs, then ``Policy.train``: the step's train metrics."""
    if rollout.skipped:
        # No update, but the step still counts as one of the weights' versions: the async
        # schedule numbers versions by step (the engines refit the same weights once).
        run.engine.mark_stale()
        return {}
    data = rollout.data
    distilled: dict[str, float] = {}
    if run.teacher is not None:  # before the reference pass: in loss mode the teacher is the reference
        distilled = apply_teacher(run.cfg.grpo.distillation, run.teacher, data, timer)
    old_and_reference_logprobs(run, data, timer)
    run.policy.prepare_for_training()
    with timer("train"):
        result = run.policy.train(data, run.loss_fn)
    run.policy.finish_training()
    report_skipped_steps(step, result)
    run.engine.mark_stale()
    metrics = train_metrics(result)
    metrics["old_logprobs_fused"] = float(run.loss_fn.old_logprobs == "forward")
    return {**metrics, **distilled}


def old_and_reference_logprobs(run: GRPORun, data: BatchedDataDict, timer: StepTimer) -> None:
    """What the loss needs besides the training forward, in one call to the workers: the old
    policy's logprobs (``prev_logprobs``; none when the loss takes them from its own forward,
    see ``old_logprobs_source``) and the reference's (``reference_policy_logprobs``; none
    without a KL term, or with the distillation teacher in the reference's place).
    ``timing/logprobs_s`` covers the call, reference pass included (``timing/reference_s``
    when only the reference's are needed)."""
    need_old, need_ref = logprob_passes(run.loss_fn, run.cfg)
    if not (need_old or need_ref):
        return
    run.policy.prepare_for_lp_inference()
    out: Mapping[str, torch.Tensor] = {}
    with timer("logprobs" if need_old else "reference"):
        if need_old and need_ref:
            out = run.policy.get_logprobs_and_reference(data)
            data["prev_logprobs"], data["reference_policy_logprobs"] = out["logprobs"], out["reference_logprobs"]
        elif need_old:
            out = run.policy.get_logprobs(data)
            data["prev_logprobs"] = out["logprobs"]
        else:
            data["reference_policy_logprobs"] = run.policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    if "routed_experts" in out:  # policy.moe: the old policy's experts (agreement, replay)
        data["routed_experts"] = out["routed_experts"]


def logprob_passes(loss_fn: ClippedPGLossFn, cfg: GRPORunConfig) -> tuple[bool, bool]:
    """Whether a step needs the old policy's logprobs from a pass of their own (not when the
    loss takes them from its training forward), and the reference's (not without a KL term,
    nor with the distillation teacher in the reference's place)."""
    return loss_fn.old_logprobs == "batch", loss_fn.uses_reference and not teacher_is_reference(cfg)


def grpo_validate(run: GRPORun, step: int, sync_weights: Callable[[], dict[str, float]]) -> dict[str, float]:
    """:func:`core.algorithms.evaluation.evaluate` of the held-out prompts on the policy's
    current weights (``sync_weights``: the run's schedule's, which moves the engines to them):
    greedy accuracy, reward and response length, and with ``grpo.val_pass_at_k`` the sampled
    pass's pass@k, maj@k and mean@k."""
    sync_weights()
    prompts = [run.val_dataset[i] for i in range(len(run.val_dataset))]
    # A multi-turn run plays validation episodes (an async run in an executor of their own).
    episodes = run.val_episodes or run.episodes
    scorer = run.scorer if episodes is None else episodes
    evaluation = evaluate(run.engine, scorer, run.tokenizer, prompts, EvalPlan.of_grpo(run.cfg.grpo, len(prompts)))
    _print_samples(run, step, prompts, evaluation.greedy.completions, evaluation.greedy.rewards)
    return evaluation.metrics()


def _accuracy(infos: list[dict[str, Any]]) -> dict[str, float]:
    """Share of samples the environment marked ``correct`` (environments that do not say
    whether an answer is correct report rewards only)."""
    flags = [info["correct"] for info in infos if "correct" in info]
    return {"accuracy": sum(map(bool, flags)) / len(flags)} if flags and len(flags) == len(infos) else {}


def _print_samples(
    run: GRPORun, step: int, items: Sequence[PromptDatum], completions: list[str], rewards: list[float]
) -> None:
    n = run.cfg.logger.num_val_samples_to_print
    if n <= 0:
        return
    samples = [
        {"prompt": p.prompt, "completion": c, "reward": r, "ground_truth": p.metadata.get("ground_truth")}
        for p, c, r in zip(items[:n], completions, rewards, strict=False)
    ]
    run.progress.write(f"validation at step {step}:\n{format_val_samples(samples, n)}")
