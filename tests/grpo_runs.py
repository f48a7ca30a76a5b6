"""A real :class:`~core.algorithms.grpo_run.GRPORun` without workers, for the GRPO loop's unit tests.

The run is built the way ``setup_grpo`` builds one, minus the workers: the embedded GRPO config
with the test's overrides (validated as ``dualrl grpo`` validates it), the built-in tokenizer,
a loader over the test's prompts in order, the test's validation prompts, the run's loss, and
its checkpoints / metrics sinks in a temporary directory.  What ``setup_grpo``'s worker start
would add -- the rollout engine, the reward environments, the stop tokens and the response
limit -- the test sets itself (a scripted engine on ``run.rollouts``, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from core.algorithms.config import GRPORunConfig
from core.algorithms.grpo_run import GRPORun
from core.algorithms.grpo_setup import grpo_loss_fn
from core.algorithms.run_setup import load_tokenizer
from core.algorithms.training_run import open_run
from core.config import EMBEDDED_CONFIGS, load_config
from core.datasets import BatchLoader, ListDataset, PromptDatum

#: What every such run overrides: no trackers or bar, sinks under the test's directory.
QUIET = ("logger.tensorboard_enabled=false", "logger.progress_bar=false", "logger.plot_enabled=false")
#: A step the size of a unit test: 2 prompts x 2 samples, one optimizer step (a global batch of 4).
SMALL = (
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "policy.train_global_batch_size=4",
    "policy.train_micro_batch_size=1",
)


def grpo_run(
    tmp_path: Path,
    prompts: Sequence[PromptDatum],
    *overrides: str,
    val_prompts: Sequence[PromptDatum] = (),
    config: Path = EMBEDDED_CONFIGS["grpo"],
) -> GRPORun:
    """A GRPO run over ``prompts`` (drawn in order, ``grpo.num_prompts_per_step`` at a time)
    with ``overrides`` on ``config``; close it with ``run.close()``."""
    cfg = load_config(
        config,
        [
            *QUIET,
            f"logger.log_dir={tmp_path / 'logs'}",
            f"checkpointing.checkpoint_dir={tmp_path / 'checkpoints'}",
            *overrides,
        ],
        schema=GRPORunConfig,
    )
    loader = BatchLoader(ListDataset(list(prompts)), cfg.grpo.num_prompts_per_step, shuffle=False, seed=cfg.grpo.seed)
    tokenizer = load_tokenizer(cfg.policy)
    return open_run(GRPORun, "grpo", cfg, cfg, tokenizer, loader, ListDataset(list(val_prompts)), grpo_loss_fn(cfg))
