"""The algorithm sections (``grpo``, ``sft``, ``dpo``) and the run configs that hold them.

A run config is the top level of a YAML file as one command reads it: ``GRPORunConfig``
for ``dualrl grpo`` and so on, each with exactly the sections its command uses.  A section
or data key of another algorithm is refused by name (a GRPO key in an SFT run is a mistake,
not a no-op); rules between sections (batch divisibility over the cluster, prompt room) are
checked here too.  ``MasterConfig`` accepts every section: ``dualrl config`` uses it for a
file that belongs to no single command (e.g. core/configs/default.yaml).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from pydantic import Field, model_validator

from core.algorithms.advantages import ESTIMATORS
from core.algorithms.grpo_config import (
    AsyncGRPOConfig,
    DistillationConfig,
    DistillationMode,
    GRPOConfig,
    RewardShapingConfig,
)
from core.algorithms.old_logprobs import old_logprobs_source
from core.checkpointing.config import CheckpointingConfig
from core.config import ConfigModel, Problem, join_path
from core.datasets.config import DataConfig
from core.datasets.sources import is_arithmetic_source
from core.environments.config import EnvConfig
from core.logging.config import LoggerConfig
from core.losses.config import ClippedPGLossConfig, DPOLossConfig
from core.models.builtin import is_warm_started, warm_started_on_reasoning_gym
from core.policy.config import PolicyConfig
from core.policy.generation_args import new_token_limit

__all__ = [
    "AsyncGRPOConfig",
    "ClusterConfig",
    "DPOConfig",
    "DPORunConfig",
    "DistillationConfig",
    "DistillationMode",
    "GRPOConfig",
    "GRPORunConfig",
    "MasterConfig",
    "RUN_CONFIGS",
    "RewardShapingConfig",
    "SFTConfig",
    "SFTRunConfig",
    "run_config_class",
]


# ----------------------------------------------------------------------------- sections
class ClusterConfig(ConfigModel):
    """The devices the job runs on (read by :mod:`core.algorithms.placement`)."""

    gpus_per_node: int = Field(ge=1)
    """On CPU machines: worker slots per node."""
    num_nodes: int = Field(1, ge=1)
    """Nodes; world size = gpus_per_node x num_nodes."""
    cpus_per_slot: int = Field(1, ge=1)
    """CPUs Ray reserves with each slot.  On CPU machines they are the slot's compute threads:
    a torch worker's, a JAX host worker's (per device), and the vLLM engines colocated on the
    slot (one single-threaded engine per CPU); e.g. ``gpus_per_node=1 cpus_per_slot=8`` runs one
    torch worker on 8 cores.  A CPU run may ask for more than the machine's cores (the OS
    shares them); on an existing Ray cluster the slots must fit its CPUs."""

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.num_nodes


class SFTConfig(ConfigModel):
    """The SFT loop (NeMo RL's ``sft`` section)."""

    max_num_steps: int = Field(ge=1)
    """Optimizer steps of the run (one policy.train_global_batch_size batch each)."""
    max_num_epochs: int | None = Field(None, ge=1)
    """Stop after this many passes over a finite dataset; null = no limit."""
    val_period: int = Field(ge=0)
    """Validate every N steps; 0 = never (except val_at_start / the end)."""
    val_batches: int = Field(ge=0)
    """Validation = val_batches x val_global_batch_size held-out examples; 0 = no validation."""
    val_global_batch_size: int = Field(ge=1)
    """Held-out rows per validation batch (over all data-parallel ranks)."""
    val_micro_batch_size: int = Field(ge=1)
    """Rows per forward on one rank during validation."""
    val_at_start: bool
    """Validate before the first step."""
    val_at_end: bool = True
    """Validate after the last step."""
    seed: int
    """Data order and held-out split."""

    def check(self) -> Iterable[Problem]:
        if self.val_global_batch_size % self.val_micro_batch_size:
            yield (
                "val_global_batch_size",
                f"{self.val_global_batch_size} is not divisible by val_micro_batch_size ({self.val_micro_batch_size})",
            )


class DPOConfig(SFTConfig, DPOLossConfig):
    """The DPO loop and its loss keys (NeMo RL's ``dpo`` section holds both, as here)."""

    def check(self) -> Iterable[Problem]:
        yield from super().check()
        for key in ("val_global_batch_size", "val_micro_batch_size"):
            if getattr(self, key) % 2:
                yield key, f"must be even, got {getattr(self, key)}: DPO rows come in (chosen, rejected) pairs"


# ----------------------------------------------------------------------------- run configs
class MasterConfig(ConfigModel):
    """A whole config with every section optional but ``policy`` and ``cluster``."""

    missing_what: ClassVar[str] = "section"

    policy: PolicyConfig
    cluster: ClusterConfig
    loss_fn: ClippedPGLossConfig | None = None
    grpo: GRPOConfig | None = None
    sft: SFTConfig | None = None
    dpo: DPOConfig | None = None
    data: DataConfig | None = None
    env: EnvConfig | None = None
    logger: LoggerConfig | None = None
    checkpointing: CheckpointingConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _estimator_settings(cls, data: Any) -> Any:  # a "before" validator: the raw input, whatever it is
        """What ``grpo.advantage_estimator`` implies, filled in where the config leaves it out
        (an explicit other value stays, and :meth:`_estimator_problems` refuses it)."""
        return with_implied_settings(data) if isinstance(data, Mapping) else data

    @classmethod
    def refusals(cls, raw: Mapping[str, Any]) -> Iterable[Problem]:
        policy = raw.get("policy")
        if isinstance(policy, Mapping):
            yield from ((join_path("policy", p), m) for p, m in PolicyConfig.refusals(policy))

    def check(self) -> Iterable[Problem]:
        world = self.cluster.world_size
        yield from ((join_path("policy", p), m) for p, m in self.policy.layout_problems(world))
        yield from self._estimator_problems()
        grpo, data, gbs = self.grpo, self.data, self.policy.train_global_batch_size
        if grpo is not None and (grpo.num_prompts_per_step * grpo.num_generations_per_prompt) % gbs:
            n = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
            yield (
                "grpo.num_prompts_per_step",
                f"{grpo.num_prompts_per_step} prompts x {grpo.num_generations_per_prompt} generations = {n} samples "
                f"per step is not divisible by policy.train_global_batch_size ({gbs}); each step trains on whole "
                "global batches",
            )
        limit = data.max_input_seq_length if data is not None else None
        if limit is not None and limit >= self.policy.max_total_sequence_length:
            yield (
                "data.max_input_seq_length",
                f"{limit} leaves no room for a response within policy.max_total_sequence_length "
                f"({self.policy.max_total_sequence_length})",
            )
        if data is not None and data.arithmetic is not None and not self._uses_builtin_task():
            yield (
                "data.arithmetic",
                "not used: data.dataset_name is not a built-in arithmetic task and policy.model_name is not a "
                "built-in model warm-started on it; set it to null",
            )
        if warm_started_on_reasoning_gym(self.policy.model_name) and (data is None or data.reasoning_gym is None):
            yield (
                "policy.model_name",
                f"{self.policy.model_name} is warm-started on the run's reasoning-gym tasks, and this config has "
                "none: set data.dataset_name: reasoning_gym and data.reasoning_gym.tasks",
            )

    def _estimator_problems(self) -> Iterable[Problem]:
        """An explicit value that contradicts what the advantage estimator implies, by name."""
        if self.grpo is None:
            return
        name = self.grpo.advantage_estimator
        estimator = ESTIMATORS[name]
        for key, needed in estimator.implies.items():
            section, _, field = key.partition(".")
            owner = getattr(self, section)
            if owner is not None and getattr(owner, field) != needed:
                yield (
                    key,
                    f"{_literal(getattr(owner, field))} contradicts grpo.advantage_estimator: {name}, which needs "
                    f"{_literal(needed)} ({estimator.why}); leave the key out (the estimator sets it) or choose "
                    "another estimator",
                )

    def _uses_builtin_task(self) -> bool:
        """Built-in arithmetic data, or a built-in model whose warm start trains on that task."""
        names = (self.data.dataset_name, self.data.val_dataset_name) if self.data else ()
        return any(n is not None and is_arithmetic_source(n) for n in names) or is_warm_started(self.policy.model_name)


class _AlgorithmRunConfig(MasterConfig):
    """What one ``dualrl <algorithm>`` command reads; anything else is refused by name."""

    algorithm: ClassVar[str]
    data_keys: ClassVar[tuple[str, ...]]

    @classmethod
    def sections(cls) -> list[str]:
        return [name for name, field in cls.model_fields.items() if field.is_required()]

    @classmethod
    def missing_message(cls, key: str) -> str:
        return f"missing section (dualrl {cls.algorithm} needs {', '.join(cls.sections())})"

    @classmethod
    def refusals(cls, raw: Mapping[str, Any]) -> Iterable[Problem]:
        yield from super().refusals(raw)
        sections = cls.sections()
        for name, value in raw.items():  # a null section is the same as none
            if name in MasterConfig.model_fields and name not in sections and value is not None:
                yield name, f"not used by dualrl {cls.algorithm}; remove the section (it reads {', '.join(sections)})"
        data = raw.get("data")
        if isinstance(data, Mapping):
            for key in data:
                if key in DataConfig.model_fields and key not in cls.data_keys:
                    users = [a.algorithm for a in RUN_CONFIGS.values() if key in a.data_keys]
                    yield f"data.{key}", f"not used by dualrl {cls.algorithm} (a key of {'/'.join(users)}); remove it"

    def check(self) -> Iterable[Problem]:
        yield from super().check()
        yield from self.algorithm_problems()

    def to_dict(self) -> dict[str, Any]:
        """The sections and data keys this command reads, defaults filled in: what ``dualrl
        config`` prints, and what the command accepts back."""
        out = {name: value for name, value in super().to_dict().items() if name in self.sections()}
        out["data"] = {key: value for key, value in out["data"].items() if key in self.data_keys}
        return out

    def algorithm_problems(self) -> Iterable[Problem]:
        return ()


_COMMON_DATA_KEYS = ("dataset_name", "dataset_config", "split", "val_dataset_name", "val_split", "val_seed",
                     "prompt_template", "system_prompt", "use_chat_template", "shuffle")  # fmt: skip


class GRPORunConfig(_AlgorithmRunConfig):
    """``dualrl grpo``."""

    algorithm: ClassVar[str] = "grpo"
    data_keys: ClassVar[tuple[str, ...]] = (*_COMMON_DATA_KEYS, "prompt_key", "answer_key", "max_input_seq_length",
                                            "on_long_prompt", "reasoning_gym")  # fmt: skip

    grpo: GRPOConfig
    loss_fn: ClippedPGLossConfig
    data: DataConfig
    env: EnvConfig
    logger: LoggerConfig
    checkpointing: CheckpointingConfig

    def algorithm_problems(self) -> Iterable[Problem]:
        if self.policy.generation is None:
            yield (
                "policy.generation",
                "missing; dualrl grpo samples its rollouts with these settings (see core/configs/policy.yaml)",
            )
        if self.data.max_input_seq_length is None:
            yield "data.max_input_seq_length", "missing (dualrl grpo needs the longest prompt in tokens)"
        if self.grpo.async_grpo.enabled:
            yield from self._async_problems()
        if self.grpo.distillation.enabled:
            yield from self._distillation_problems()
        yield from self._response_length_problems()
        yield from self._multi_turn_problems()
        yield from self._routing_problems()

    def _routing_problems(self) -> Iterable[Problem]:
        """Agreement and replay (policy.moe) read the old-logprob pass, which a fused step skips."""
        moe = self.policy.moe
        if moe.records_routing and old_logprobs_source(self) == "forward":
            yield (
                f"policy.moe.{moe.routing_field}",
                "true, but this run's steps take the old logprobs from the training forward itself (one optimizer "
                f"step per batch of {self.policy.train_global_batch_size} samples), so there is no old-logprob pass "
                "whose experts to use (and none to disagree with); set grpo.fuse_old_logprobs=false for the pass",
            )

    def is_multi_turn(self) -> bool:
        """Whether env.name is a multi-turn environment (a ValueError naming env.name when
        its class cannot be imported)."""
        from core.environments.registry import environment_is_multi_turn

        return environment_is_multi_turn(self.env.name)

    def _multi_turn_problems(self) -> Iterable[Problem]:
        g, name = self.grpo, self.env.name
        try:
            multi_turn = self.is_multi_turn()
        except ValueError:  # an unimportable user class: the environment's start-up names the import error
            return
        if not multi_turn:
            if g.max_rollout_turns is not None:
                yield "grpo.max_rollout_turns", f"set, but env.name {name!r} is single-turn (score); remove it"
            if self.env.on_episode_error != "fail":  # a single-turn environment's errors always fail the step
                yield (
                    "env.on_episode_error",
                    f"end_episode is only supported by multi-turn environments; {name!r} is single-turn",
                )
            if self.env.num_workers == 0:  # the pool scores single-turn batches; 0 is for stepping episodes
                yield (
                    "env.num_workers",
                    f"0 (in-process) is only supported by multi-turn environments; {name!r} is scored by "
                    "the Ray pool: set it >= 1",
                )
            return
        if g.max_rollout_turns is None:
            yield "grpo.max_rollout_turns", f"required with the multi-turn environment {name!r} (e.g. 4)"
        refused = {
            "grpo.distillation.enabled": (g.distillation.enabled, "distillation on multi-turn rows is untested"),
            "grpo.overlong_filtering": (
                g.overlong_filtering,
                "it judges one response's length against max_new_tokens; a multi-turn episode has several "
                "(episodes cut by the sequence limit are counted in multi_turn/truncated instead)",
            ),
            "grpo.reward_shaping.enabled": (g.reward_shaping.enabled, "its length penalty is per single response"),
        }
        for key, (on, why) in refused.items():
            if on:
                yield key, f"not supported with the multi-turn environment {name!r}: {why}; set it to false"

    def response_token_limit(self) -> int | None:
        """The longest response a rollout may have (DAPO's L_max, Dr. GRPO's default token
        budget): policy.generation.max_new_tokens cut so that the longest prompt
        (data.max_input_seq_length) fits with it in policy.max_total_sequence_length, the rule
        the engines apply; None when a section it needs is missing."""
        gen, prompt = self.policy.generation, self.data.max_input_seq_length
        if gen is None or prompt is None:
            return None
        return new_token_limit(gen, self.policy.max_total_sequence_length, prompt)

    def _response_length_problems(self) -> Iterable[Problem]:
        shaping, limit = self.grpo.reward_shaping, self.response_token_limit()
        buffer = shaping.overlong_buffer_length
        if shaping.enabled and buffer is not None and limit is not None and buffer >= limit:
            yield (
                "grpo.reward_shaping.overlong_buffer_length",
                f"{buffer} must be < the longest response, {limit} tokens (policy.generation.max_new_tokens, cut to "
                "fit policy.max_total_sequence_length after data.max_input_seq_length): the penalty starts "
                "overlong_buffer_length tokens before it",
            )

    def _distillation_problems(self) -> Iterable[Problem]:
        where = "grpo.distillation"
        if self.grpo.async_grpo.enabled:
            yield (
                f"{where}.enabled",
                "not supported with grpo.async_grpo.enabled yet (the teacher's placement beside a policy whose "
                "engines have a cluster of their own is untested); use the synchronous loop",
            )
        if self.grpo.distillation.mode != "loss":
            return
        if self.loss_fn.reference_policy_kl_penalty != 0:
            yield (
                "loss_fn.reference_policy_kl_penalty",
                f"must be 0 with {where}.mode: loss: the teacher takes the reference's place in the KL term, "
                f"whose coefficient is {where}.coef",
            )
        if self.loss_fn.reference_policy_kl_type != "k2":
            yield (
                "loss_fn.reference_policy_kl_type",
                f"must be k2 with {where}.mode: loss, got {self.loss_fn.reference_policy_kl_type!r}: on the "
                "student's samples the gradient of k2 = (log p - log q)^2 / 2 is the reverse KL's; k3's is the "
                "forward KL's and k1's is zero in expectation",
            )
        clamp = self.loss_fn.kl_output_clamp_value
        if clamp is not None:
            yield (
                "loss_fn.kl_output_clamp_value",
                f"must be null with {where}.mode: loss, got {clamp!r}: a clamped k2 has no gradient on tokens whose "
                f"log-ratio to the teacher exceeds sqrt(2 x {clamp!r}) = {(2 * clamp) ** 0.5:.2f}, most tokens of a "
                "student far from its teacher (measured on core/configs/distill_arithmetic.yaml: at the default 10 "
                "the reverse KL did not fall in 150 steps)",
            )

    def _async_problems(self) -> Iterable[Problem]:
        gen, where = self.policy.generation, "grpo.async_grpo.enabled"
        if gen is not None and gen.backend != "vllm":
            yield (
                where,
                (
                    f"needs policy.generation.backend: vllm, got {gen.backend!r} (the policy's own generate "
                    "cannot run while the same workers train)"
                ),
            )
        if gen is not None and gen.colocated.enabled:
            yield (
                where,
                (
                    "needs policy.generation.colocated.enabled: false: the engines generate while the policy "
                    "trains, so they need devices of their own (colocated.resources; the embedded default set "
                    "up for async, which `dualrl grpo grpo.async_grpo.enabled=true` reads when no --config "
                    "is given: core/configs/grpo_arithmetic_async.yaml)"
                ),
            )
        if (
            not self.loss_fn.use_importance_sampling_correction
            and not self.grpo.async_grpo.allow_uncorrected_off_policy
        ):
            yield (
                where,
                (
                    "needs loss_fn.use_importance_sampling_correction: true: rollouts from older weights are "
                    "off-policy (set grpo.async_grpo.allow_uncorrected_off_policy: true to train without it)"
                ),
            )


class _TrainOnlyRunConfig(_AlgorithmRunConfig):
    """SFT and DPO never generate."""

    @classmethod
    def refusals(cls, raw: Mapping[str, Any]) -> Iterable[Problem]:
        yield from super().refusals(raw)
        policy, logger = raw.get("policy"), raw.get("logger")
        if isinstance(policy, Mapping) and policy.get("generation") is not None:
            # The workers apply generation's temperature to every logprob (so that GRPO trains on
            # the distribution it sampled): here it would silently rescale the loss's logits.
            yield (
                "policy.generation",
                f"not used by dualrl {cls.algorithm}, which never generates (and its temperature would scale "
                "the logits the loss trains on); set policy.generation: null",
            )
        if isinstance(logger, Mapping) and "num_val_samples_to_print" in logger:
            yield (
                "logger.num_val_samples_to_print",
                f"not used by dualrl {cls.algorithm} (it prints GRPO's validation completions); remove it",
            )

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["logger"].pop("num_val_samples_to_print", None)  # GRPO's alone (refused above)
        return out

    def check(self) -> Iterable[Problem]:
        yield from super().check()
        moe = self.policy.moe
        if moe.records_routing:
            yield (
                f"policy.moe.{moe.routing_field}",
                f"true, but dualrl {self.algorithm} has no old-policy logprob pass whose experts it would use; "
                "set it to false",
            )


_SUPERVISED_DATA_KEYS = (*_COMMON_DATA_KEYS, "prompt_key", "on_long_sequence", "arithmetic")


class SFTRunConfig(_TrainOnlyRunConfig):
    """``dualrl sft``."""

    algorithm: ClassVar[str] = "sft"
    data_keys: ClassVar[tuple[str, ...]] = (
        *_SUPERVISED_DATA_KEYS,
        "response_key",
        "messages_key",
        "tool_demo_fraction",
        "reasoning_gym",
    )

    sft: SFTConfig
    data: DataConfig
    logger: LoggerConfig
    checkpointing: CheckpointingConfig


class DPORunConfig(_TrainOnlyRunConfig):
    """``dualrl dpo``."""

    algorithm: ClassVar[str] = "dpo"
    data_keys: ClassVar[tuple[str, ...]] = (*_SUPERVISED_DATA_KEYS, "chosen_key", "rejected_key")

    dpo: DPOConfig
    data: DataConfig
    logger: LoggerConfig
    checkpointing: CheckpointingConfig

    def algorithm_problems(self) -> Iterable[Problem]:
        for key in ("train_global_batch_size", "train_micro_batch_size"):
            value = getattr(self.policy, key)
            if value % 2:
                yield (
                    f"policy.{key}",
                    f"must be even for DPO, got {value}: every batch holds whole (chosen, rejected) pairs",
                )
        for key in ("dynamic_batching", "sequence_packing"):
            if getattr(self.policy, key).enabled:
                yield (
                    f"policy.{key}.enabled",
                    "not supported by DPO, which needs (chosen, rejected) rows adjacent in every micro batch; "
                    "set it to false",
                )


#: The run config of each ``dualrl`` training command.
RUN_CONFIGS: dict[str, type[_AlgorithmRunConfig]] = {"grpo": GRPORunConfig, "sft": SFTRunConfig, "dpo": DPORunConfig}


def with_implied_settings(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a raw run config with the settings its ``grpo.advantage_estimator`` implies
    (``ESTIMATORS[...].implies``) set wherever the config has the section but not the key."""
    out = dict(raw)
    grpo = raw.get("grpo")
    name = grpo.get("advantage_estimator", "grpo") if isinstance(grpo, Mapping) else None
    if not isinstance(name, str) or name not in ESTIMATORS:
        return out  # no grpo section, or a name the field's validator refuses
    for key, value in ESTIMATORS[name].implies.items():
        section, _, field = key.partition(".")
        if isinstance(out.get(section), Mapping) and field not in out[section]:
            out[section] = {**out[section], field: value}
    return out


def _literal(value: Any) -> str:  # any config value, written as YAML would
    return str(value).lower() if isinstance(value, bool) else str(value)


def run_config_class(raw: Mapping[str, Any]) -> type[MasterConfig]:
    """The run config a loaded file belongs to: the command whose section it holds, else
    ``MasterConfig`` (no algorithm section, or several)."""
    algorithms = [name for name in RUN_CONFIGS if name in raw]
    return RUN_CONFIGS[algorithms[0]] if len(algorithms) == 1 else MasterConfig
