"""Building a GRPO run from a config, running it, and what the researcher sees at the end.

Everything that can be checked without workers is checked first -- the config, the data
(missing file or column, over-long prompts), the model (a built-in one is built here), the
resume checkpoint (missing, partial, another model or backend) -- so a bad run fails in
seconds, before Ray starts anything.  The parts every algorithm shares (checkpoints, sinks,
the policy, the loop, the report) are :mod:`core.algorithms.training_run`'s.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from core.algorithms.async_grpo import async_grpo_loop
from core.algorithms.config import GRPORunConfig, old_logprobs_source
from core.algorithms.distillation import check_teacher, start_teacher, teacher_is_reference
from core.algorithms.grpo import SyncSchedule, grpo_validate
from core.algorithms.grpo_run import GRPORun, StepSchedule
from core.algorithms.run_setup import ModelResolver, load_tokenizer, seed_everything
from core.algorithms.training_run import check_run_config, needs_reference, open_run, start_policy, train_loop
from core.config import ConfigError
from core.datasets import BatchLoader, build_prompt_datasets
from core.reporting import get_logger

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from core.algorithms.multi_turn import EpisodeRunner
    from core.losses import ClippedPGLossFn

__all__ = [
    "GRPORun",
    "check_grpo_config",
    "episode_runner",
    "grpo_loss_fn",
    "grpo_schedule",
    "grpo_train",
    "setup_grpo",
]

logger = get_logger(__name__)


def check_grpo_config(cfg: GRPORunConfig | Mapping[str, Any]) -> GRPORunConfig:
    return check_run_config(cfg, "grpo")


def setup_grpo(cfg: GRPORunConfig | Mapping[str, Any], *, resolve: ModelResolver) -> GRPORun:
    """Everything a GRPO run needs, driver-side checks first, then the workers."""
    cfg = check_grpo_config(cfg)
    g = cfg.grpo
    seed_everything(g.seed)
    tokenizer = load_tokenizer(cfg.policy)
    check_teacher(cfg, tokenizer)
    task = cfg.env.arithmetic
    train_set, val_set = build_prompt_datasets(cfg.data, task, tokenizer, num_val=g.max_val_samples, seed=g.seed)
    held_out = [val_set[i].metadata["raw_prompt"] for i in range(len(val_set))]
    resolved = resolve(cfg, held_out)
    loader = BatchLoader(train_set, g.num_prompts_per_step, shuffle=cfg.data.shuffle, seed=g.seed)
    run = open_run(GRPORun, "grpo", cfg, resolved, tokenizer, loader, val_set, grpo_loss_fn(cfg))
    try:
        _start_workers(run)
    except BaseException:
        run.close(failed=True)
        raise
    return run


def grpo_loss_fn(cfg: GRPORunConfig) -> ClippedPGLossFn:
    """The run's ``ClippedPGLossFn``: the constant normaliser's null budget is the longest
    response the run generates (``GRPORunConfig.response_token_limit``); with
    ``grpo.distillation.mode: loss`` the KL coefficient is ``grpo.distillation.coef``."""
    from core.losses import ClippedPGLossFn

    loss_cfg = cfg.loss_fn
    if teacher_is_reference(cfg):  # the KL term against the teacher (mode loss; the config keeps the penalty 0)
        loss_cfg = loss_cfg.model_copy(update={"reference_policy_kl_penalty": cfg.grpo.distillation.coef})
    if loss_cfg.token_normalizer == "constant" and loss_cfg.constant_token_budget is None:
        loss_cfg = loss_cfg.model_copy(update={"constant_token_budget": cfg.response_token_limit()})
    return ClippedPGLossFn(loss_cfg, old_logprobs=old_logprobs_source(cfg))


def _start_workers(run: GRPORun) -> None:
    from core.algorithms.rollout_engine import RolloutEngine
    from core.environments import EnvironmentPool
    from core.policy.generation_args import resolve_generation_args

    cfg = run.resolved_cfg
    gen, max_prompt = cfg.policy.generation, cfg.data.max_input_seq_length
    if gen is None or max_prompt is None:  # GRPORunConfig.algorithm_problems refuses both
        raise ConfigError("dualrl grpo needs policy.generation and data.max_input_seq_length")
    start = time.perf_counter()
    # With the teacher in the reference's place the student keeps no reference weights.
    cluster = start_policy(run, reference=needs_reference(run) and not teacher_is_reference(cfg))
    teacher = cfg.grpo.distillation.teacher_model_name
    if cfg.grpo.distillation.enabled and teacher is not None:
        run.teacher = start_teacher(run, cluster, teacher)
    if cfg.is_multi_turn():
        runner = run.episodes = episode_runner(cfg, run.tokenizer, run.policy.model_config.eos_token_id)
        run._exit.callback(runner.executor.shutdown)
        if cfg.grpo.async_grpo.enabled:
            val = run.val_episodes = episode_runner(cfg, run.tokenizer, run.policy.model_config.eos_token_id)
            run._exit.callback(val.executor.shutdown)
    else:
        env = run.env = EnvironmentPool(run.cfg.env)
        run._exit.callback(env.shutdown)
    rollouts = run.rollouts = RolloutEngine(
        cfg, run.policy, run.tokenizer, cluster, run.cfg.grpo.seed, start_version=run.start_step
    )
    run._exit.callback(rollouts.shutdown)
    args = resolve_generation_args(cfg.policy, run.tokenizer, run.policy.model_config.eos_token_id, max_prompt)
    run.stop_token_ids = list(args.eos_token_ids) + list(gen.stop_token_ids or [])
    run.max_new_tokens = args.max_new_tokens
    logger.info(
        "workers up in %.1f s: %s policy on %d slot(s), %s generation%s",
        time.perf_counter() - start,
        cfg.policy.backend,
        cluster.world_size(),
        rollouts.kind,
        f" ({rollouts.transport} refit)" if rollouts.kind == "vllm" else "",
    )


def episode_runner(
    cfg: GRPORunConfig, tokenizer: PreTrainedTokenizerBase, model_eos: int | list[int] | None
) -> EpisodeRunner:
    """The multi-turn environment's episodes with the run's limits, stepped where
    ``env.num_workers`` says (:func:`~core.environments.episode_pool.episode_executor`: Ray
    actors, or 0: the driver); the caller shuts ``.executor`` down."""
    from core.algorithms.multi_turn import EpisodeRunner
    from core.algorithms.observation_tokens import ObservationTokens
    from core.datasets.prompts import chat_template_used
    from core.environments.episode_pool import episode_executor
    from core.policy.generation_args import resolve_generation_args

    turns = cfg.grpo.max_rollout_turns
    if turns is None:  # GRPORunConfig refuses it
        raise ConfigError("grpo.max_rollout_turns is required with a multi-turn environment")
    args = resolve_generation_args(cfg.policy, tokenizer, model_eos, 0)
    stops = list(args.eos_token_ids) + list(args.gen_cfg.stop_token_ids or [])
    observations = ObservationTokens(tokenizer, chat_template_used(cfg.data, tokenizer), stops)
    executor = episode_executor(cfg.env)
    try:
        return EpisodeRunner(
            executor,
            tokenizer,
            observations,
            max_turns=turns,
            max_total_tokens=cfg.policy.max_total_sequence_length,
            on_error=cfg.env.on_episode_error,
        )
    except BaseException:
        executor.shutdown()
        raise


def grpo_schedule(run: GRPORun) -> StepSchedule:
    """How ``run``'s steps run, chosen once: with ``grpo.async_grpo.enabled`` the engines
    generate the next steps' rollouts while the policy trains (:mod:`core.algorithms.async_grpo`,
    its producer started now, from the run's next step), else one step at a time."""
    if run.cfg.grpo.async_grpo.enabled:
        return async_grpo_loop(run, run.start_step + 1, run.cfg.grpo.max_num_steps)
    return SyncSchedule(run)


def grpo_train(run: GRPORun) -> int:
    """Run the steps left (from a resumed step if any) on the run's schedule; returns the last
    step.  Validation moves the engines to the policy's weights the schedule's way."""
    schedule = grpo_schedule(run)
    return train_loop(run, schedule.step, lambda step: grpo_validate(run, step, schedule.sync_weights))
