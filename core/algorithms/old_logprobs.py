"""Where a GRPO step's old-policy log-probs come from: the run config decides, the loop and the
config check read it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.algorithms.config import GRPORunConfig

from core.interfaces import OldLogprobsSource


def old_logprobs_source(cfg: GRPORunConfig) -> OldLogprobsSource:
    """``"forward"`` when a rollout batch gets exactly one optimizer step (its samples are one
    global batch) and ``grpo.fuse_old_logprobs`` allows it: the old policy is then the one being
    trained, and its logprobs are the training forward's own (detached); else ``"batch"``, a
    separate pass before training (several optimizer steps move the weights in between)."""
    samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    one_step = samples == cfg.policy.train_global_batch_size
    return "forward" if cfg.grpo.fuse_old_logprobs and one_step else "batch"
