"""The ``grpo`` section (NeMo RL's names) and its sub-sections: async GRPO, DAPO's reward
shaping, on-policy distillation.  (:mod:`core.algorithms.config` re-exports them.)"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import Field, field_validator

from core.algorithms.advantages import ESTIMATORS
from core.config import ConfigModel, Problem


class AsyncGRPOConfig(ConfigModel):
    """Async GRPO (``grpo.async_grpo``, NeMo RL's names): the engines, on their own cluster,
    generate the rollouts of the next steps while the policy trains (core.algorithms.async_grpo)."""

    enabled: bool = False
    """Generate the next steps' rollouts while the policy trains (vLLM engines of their own)."""
    max_trajectory_age_steps: int = Field(1, ge=0)
    """How many training steps older than the trained policy a rollout's weights may be: the
    rollouts of step k are generated with the weights of step k - 1 - max_trajectory_age_steps
    (or later ones at the start of a run); 0 is the synchronous schedule."""
    allow_uncorrected_off_policy: bool = False
    """Train on stale rollouts without loss_fn.use_importance_sampling_correction (refused
    otherwise: the off-policy gap would go uncorrected)."""


class RewardShapingConfig(ConfigModel):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; NeMo RL's ``grpo.reward_shaping``):
    a response whose length |y| enters the last ``overlong_buffer_length`` tokens before the
    longest allowed response L_max (the generation's max_new_tokens, as cut to fit
    max_total_sequence_length) loses ``overlong_buffer_penalty x (|y| - (L_max - buffer)) / buffer``
    of its reward, linearly up to the whole penalty at L_max."""

    enabled: bool = False
    """Add the length penalty to the environment's rewards before the advantages."""
    overlong_buffer_length: int | None = Field(None, ge=1)
    """The buffer L_cache, in tokens (required when enabled; < the generation's max_new_tokens)."""
    overlong_buffer_penalty: float = Field(1.0, ge=0)
    """The penalty at L_max (DAPO: 1, the size of its correct/incorrect reward gap)."""


#: What the distillation term does: ``reward``, a dense per-token advantage; ``loss``, the loss's
#: KL term against the teacher (core.algorithms.distillation has both formulas).
DistillationMode = Literal["reward", "loss"]


class DistillationConfig(ConfigModel):
    """On-policy distillation (``grpo.distillation``; Agarwal et al. 2024, "On-Policy
    Distillation of Language Models" (GKD); Thinking Machines 2025, "On-Policy Distillation"):
    a frozen teacher -- a second ``Policy`` without an optimizer, on the student's backend and
    layout -- scores the student's own samples, and the per-token reverse KL to it trains the
    student (core.algorithms.distillation).  The teacher must share the student's tokenizer."""

    enabled: bool = False
    """Load the teacher and add the distillation term to every step."""
    teacher_model_name: str | None = None
    """The teacher: HF hub id, local path or built-in model (builtin:...); required when
    enabled.  Its tokenizer must equal the student's (checked before any worker starts)."""
    mode: DistillationMode = "reward"
    """reward: per-token advantage coef x (log p_teacher - log p_student) on each sampled token,
    no discounting (Thinking Machines' recipe); loss: coef x the reverse KL to the teacher as
    the loss's KL term (the teacher takes the reference's place; loss_fn.reference_policy_kl_type
    must be k2, whose gradient is the reverse KL's, and loss_fn.kl_output_clamp_value null)."""
    coef: float = Field(1.0, gt=0)
    """Weight of the distillation term (reward: the advantage's scale; loss: the KL coefficient)."""
    task_advantages: bool = True
    """Keep GRPO's group advantages from the environment's rewards next to the distillation
    term; false trains on the teacher alone (pure on-policy distillation: the rewards are
    still computed and logged, but move nothing)."""

    def check(self) -> Iterable[Problem]:
        if self.enabled and not self.teacher_model_name:
            yield "teacher_model_name", "required when distillation.enabled is true (the teacher model to distil)"


class GRPOConfig(ConfigModel):
    """The GRPO loop (NeMo RL's ``grpo`` section)."""

    num_prompts_per_step: int = Field(ge=1)
    """Distinct prompts per step."""
    num_generations_per_prompt: int
    """Samples per prompt (the group); >= 2 for a group baseline."""
    max_num_steps: int = Field(ge=1)
    """Training steps of the run (one rollout batch each)."""
    max_num_epochs: int | None = Field(None, ge=1)
    """Stop after this many passes over a finite prompt set; null = no limit."""
    advantage_estimator: str = "grpo"
    """How rewards become advantages: a name of core.algorithms.advantages.ESTIMATORS -- grpo
    (group mean baseline, the two switches below), rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline, dr_grpo.  An estimator implies the settings it needs (rloo:
    the leave-one-out baseline, no std; dr_grpo: no std, loss_fn.token_normalizer: constant):
    left out, they are set for it; set to another value, they are refused naming it."""
    normalize_rewards: bool = True
    """Divide advantages by the group's reward std (groups with std 0 are left as is).  grpo's
    option; the other estimators imply false (reinforce_plus_plus* normalise by the batch's std
    themselves)."""
    use_leave_one_out_baseline: bool = False
    """Baseline = mean reward of the *other* samples of the group.  grpo's option; rloo implies
    true, the other estimators false."""
    overlong_filtering: bool = False
    """Mask out of the loss (sample_mask 0) every response that reached max_new_tokens without a
    stop token (DAPO's overlong filtering): a truncated answer is not judged on an unfinished
    text.  Its reward still counts in its group's baseline."""
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    use_dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop the groups whose rewards (the environment's, before reward
    shaping) are all equal, and generate from further prompts until the step has
    num_prompts_per_step groups that are not, or dynamic_sampling_max_gen_batches is reached."""
    dynamic_sampling_max_gen_batches: int = Field(10, ge=1)
    """Most generate calls (of num_prompts_per_step prompts each) one step may make."""
    dynamic_sampling_on_shortfall: Literal["train", "skip", "error"] = "train"
    """At the cap with fewer informative groups than num_prompts_per_step: train (on those,
    padded to whole policy.train_global_batch_size batches with rows of dropped groups whose
    sample_mask is 0), skip (no update this step), or error (stop the run, as NeMo RL does).
    Every case warns; a step with no informative group at all is skipped under train too."""
    val_period: int = Field(ge=0)
    """Validate every N steps; 0 = never (except val_at_start / the end)."""
    val_at_start: bool
    """Validate before the first step."""
    val_at_end: bool = True
    """Validate after the last step."""
    max_val_samples: int = Field(ge=1)
    """Held-out prompts per validation (greedy, one sample each; val_pass_at_k adds a sampled pass)."""
    val_batch_size: int | None = Field(None, ge=1)
    """Prompts per validation generate call; null = all at once."""
    val_pass_at_k: list[int] | None = None
    """Also estimate pass@k, maj@k and mean@k for these k's at every validation (and in dualrl
    eval, whose --k sets it), from val_num_samples samples per held-out prompt drawn at
    policy.generation's temperature, seeded the same at every validation; null = the greedy
    accuracy only (docs/evaluation.md)."""
    val_num_samples: int | None = Field(None, ge=1)
    """Samples per held-out prompt of that sampled pass, >= every k (dualrl eval: --num-samples);
    null = max(val_pass_at_k)."""
    seed: int
    """Data order, sampling seeds, task generation: a CPU fp32 run is repeatable."""
    fuse_old_logprobs: bool = True
    """When a step's samples are one global batch (one optimizer step), take the old policy's
    logprobs from the training forward itself instead of a separate pass (exact: the same
    weights); false forces the separate pass (an ablation)."""
    max_rollout_turns: int | None = Field(None, ge=1)
    """Most assistant turns of one episode of a multi-turn environment (env.name: tool_arithmetic
    or a user class with reset/step; docs/multi-turn.md): required with one, refused with a
    single-turn environment (whose episodes are one completion)."""
    async_grpo: AsyncGRPOConfig = Field(default_factory=AsyncGRPOConfig)
    distillation: DistillationConfig = Field(default_factory=DistillationConfig)

    @property
    def val_samples_per_prompt(self) -> int:
        """Samples per held-out prompt of the sampled validation pass (0: none)."""
        if not self.val_pass_at_k:
            return 0
        return self.val_num_samples or max(self.val_pass_at_k)

    def check(self) -> Iterable[Problem]:
        yield from self._pass_at_k_problems()
        if self.num_generations_per_prompt < 2:
            yield (
                "num_generations_per_prompt",
                f"must be >= 2, got {self.num_generations_per_prompt}: GRPO's baseline is the mean reward of a "
                "prompt's group, so a group of one sample has advantage 0 everywhere and nothing is learned",
            )
        if self.reward_shaping.enabled and self.reward_shaping.overlong_buffer_length is None:
            yield "reward_shaping.overlong_buffer_length", "required when reward_shaping.enabled is true"

    @field_validator("advantage_estimator")
    @classmethod
    def _registered(cls, name: str) -> str:
        if name not in ESTIMATORS:
            raise ValueError(f"expected one of {', '.join(map(repr, ESTIMATORS))}, got {name!r}")
        return name

    def _pass_at_k_problems(self) -> Iterable[Problem]:
        ks, flags = self.val_pass_at_k, "(dualrl eval: --k / --num-samples)"
        if ks is None:
            if self.val_num_samples is not None:
                yield (
                    "val_num_samples",
                    "set without val_pass_at_k, which the sampled validation pass estimates; remove it",
                )
            return
        if not ks or min(ks) < 1 or len(set(ks)) != len(ks):
            yield "val_pass_at_k", f"must be distinct k's >= 1 (or null for the greedy accuracy only), got {ks} {flags}"
        elif max(ks) > self.val_samples_per_prompt:
            yield (
                "val_pass_at_k",
                f"pass@{max(ks)} needs at least {max(ks)} samples per prompt, but val_num_samples is "
                f"{self.val_num_samples}; raise val_num_samples or drop the k {flags}",
            )
