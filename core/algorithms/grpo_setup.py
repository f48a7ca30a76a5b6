"""Building a GRPO run from a config, running it, and what the researcher sees at the end.

Everything that can be checked without workers is checked first -- the config, the data
(missing file or column, over-long prompts), the model (a built-in one is built here), the
resume checkpoint (missing, partial, another model or backend) -- so a bad run fails in
seconds, before Ray starts anything.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from core.algorithms.grpo import grpo_step, grpo_validate
from core.algorithms.loop import TrainingLoop
from core.algorithms.run_setup import load_tokenizer, resolve_model, run_identity, seed_everything
from core.checkpointing import CheckpointManager, LoadedCheckpoint, restore_rng_state
from core.config import ConfigError, validate_master_config
from core.datasets import PromptLoader, build_prompt_datasets
from core.logging import (
    METRICS_FILENAME,
    PLOT_FILENAME,
    MetricsLogger,
    StepProgress,
    format_summary,
    plot_run,
    read_metrics,
)

GRPO_SECTIONS = ("grpo", "loss_fn", "data", "env", "logger", "checkpointing")


@dataclass
class GRPORun:
    """The live parts of a GRPO run (``close()`` stops the workers)."""

    cfg: dict[str, Any]  # as configured (built-in model names kept)
    resolved_cfg: dict[str, Any]  # policy.model_name resolved to a loadable path
    tokenizer: Any
    loader: PromptLoader
    val_dataset: Any
    loss_fn: Any
    checkpoints: CheckpointManager
    resumed: LoadedCheckpoint | None
    logger: MetricsLogger
    progress: StepProgress
    policy: Any = None
    rollouts: Any = None
    env: Any = None
    stop_token_ids: list[int] = field(default_factory=list)
    max_new_tokens: int = 0
    _exit: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def start_step(self) -> int:
        return self.resumed.step if self.resumed is not None else 0

    def close(self) -> None:
        self._exit.close()


def check_grpo_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    cfg = dict(validate_master_config(cfg))
    missing = [s for s in GRPO_SECTIONS if s not in cfg]
    if missing:
        raise ConfigError([f"{s}: missing section (dualrl grpo needs {', '.join(GRPO_SECTIONS)})" for s in missing])
    return cfg


def setup_grpo(cfg: Mapping[str, Any], log: Callable[[str], None] = print) -> GRPORun:
    """Everything a GRPO run needs, driver-side checks first, then the workers."""
    cfg = check_grpo_config(cfg)
    g = cfg["grpo"]
    seed_everything(g["seed"])
    tokenizer = load_tokenizer(cfg["policy"])
    train_set, val_set = build_prompt_datasets(cfg, tokenizer, num_val=g["max_val_samples"], seed=g["seed"])
    held_out = [val_set[i].metadata["raw_prompt"] for i in range(len(val_set))]
    resolved = resolve_model(cfg, held_out, log)
    checkpoints = CheckpointManager(cfg["checkpointing"], identity=run_identity("grpo", cfg, resolved))
    resumed = checkpoints.resume_point()
    loader = PromptLoader(train_set, g["num_prompts_per_step"], shuffle=cfg["data"].get("shuffle", True),
                          seed=g["seed"])
    if resumed is not None:
        loader.load_state_dict(resumed.train_state["loader"])
        restore_rng_state(resumed.rng_state)
    from core.losses import ClippedPGLossFn

    logger = MetricsLogger(cfg["logger"], resume=resumed is not None)
    if resumed is not None:
        logger.truncate_after(resumed.step)
    progress = StepProgress(g["max_num_steps"], initial=resumed.step if resumed else 0,
                            enabled=cfg["logger"].get("progress_bar", True), desc=f"grpo {cfg['policy']['backend']}")
    run = GRPORun(cfg, resolved, tokenizer, loader, val_set, ClippedPGLossFn(cfg["loss_fn"]), checkpoints, resumed,
                  logger, progress)
    run._exit.callback(logger.close)
    run._exit.callback(progress.close)
    try:
        _start_workers(run, log)
    except BaseException:
        run.close()
        raise
    return run


def _start_workers(run: GRPORun, log: Callable[[str], None]) -> None:
    from core.algorithms.placement import policy_cluster, start_ray
    from core.algorithms.rollout_engine import RolloutEngine
    from core.environments import EnvironmentPool
    from core.policy import Policy
    from core.policy.generation_args import resolve_generation_args

    cfg, seed = run.resolved_cfg, run.cfg["grpo"]["seed"]
    start = time.perf_counter()
    start_ray(cfg)
    run.env = EnvironmentPool(run.cfg["env"])
    run._exit.callback(run.env.shutdown)
    cluster = policy_cluster(cfg)
    run._exit.callback(cluster.shutdown)
    ckpt = run.resumed
    run.policy = Policy(cluster, cfg["policy"], run.tokenizer,
                        weights_path=None if ckpt is None else ckpt.policy_dir / "weights",
                        optimizer_path=None if ckpt is None else ckpt.policy_dir / "optimizer")
    run._exit.callback(run.policy.shutdown)
    run.rollouts = RolloutEngine(cfg, run.policy, run.tokenizer, cluster, seed)
    run._exit.callback(run.rollouts.shutdown)
    args = resolve_generation_args(cfg["policy"], run.tokenizer, run.policy.model_config.eos_token_id,
                                   cfg["data"]["max_input_seq_length"])
    run.stop_token_ids = list(args.eos_token_ids) + list(cfg["policy"]["generation"].get("stop_token_ids") or [])
    run.max_new_tokens = args.max_new_tokens
    log(f"workers up in {time.perf_counter() - start:.1f} s: {cfg['policy']['backend']} policy on "
        f"{cluster.world_size()} slot(s), {run.rollouts.kind} generation"
        + (f" ({run.rollouts.transport} refit)" if run.rollouts.kind == "vllm" else ""))


def grpo_train(run: GRPORun) -> int:
    """Run the steps left (from a resumed step if any); returns the last step."""
    g = run.cfg["grpo"]

    def write_policy(path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        run.policy.save_checkpoint(path / "weights", path / "optimizer", path / "tokenizer")

    def epochs_done() -> str | None:
        limit = g.get("max_num_epochs")
        return f"{limit} epoch(s) over the prompts" if limit and run.loader.epoch >= limit else None

    loop = TrainingLoop(
        algorithm="grpo", max_steps=g["max_num_steps"], step_fn=lambda step: grpo_step(run, step),
        validate_fn=lambda step: grpo_validate(run, step), write_policy=write_policy,
        train_state_fn=lambda: {"loader": run.loader.state_dict()}, logger=run.logger, progress=run.progress,
        checkpoints=run.checkpoints, config=run.cfg, val_period=g["val_period"], val_at_start=g["val_at_start"],
        val_at_end=g.get("val_at_end", True), should_stop=epochs_done)
    return loop.run(run.start_step)


def finish_report(run: GRPORun, wall_time_s: float) -> str:
    """The end-of-run plot (if enabled) and one screen of summary."""
    metrics_path = run.logger.log_dir / METRICS_FILENAME
    history = read_metrics(metrics_path) if metrics_path.is_file() else list(run.logger.history)
    if run.cfg["logger"].get("plot_enabled", True) and history:
        plot_run(history, run.logger.log_dir / PLOT_FILENAME,
                 title=f"GRPO {run.cfg['policy']['backend']} - {run.cfg['policy']['model_name']}")
    extra = {"backend": run.cfg["policy"]["backend"], "model": run.cfg["policy"]["model_name"],
             "generation": run.rollouts.kind if run.rollouts else "-"}
    return format_summary(history, wall_time_s=wall_time_s, run_dir=run.logger.log_dir, extra=extra)


def run_grpo(cfg: Mapping[str, Any], log: Callable[[str], None] = print) -> GRPORun:
    """Set up, train, report, shut down: what ``dualrl grpo`` does.  Returns the (closed) run."""
    start = time.perf_counter()
    run = setup_grpo(cfg, log)
    try:
        grpo_train(run)
        run.progress.close()
        log(finish_report(run, time.perf_counter() - start))
    finally:
        run.close()
    return run
