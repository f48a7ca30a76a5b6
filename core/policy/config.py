"""The ``policy`` section (NeMo RL's ``PolicyConfig`` field names): the model, batch sizes,
precision, optimizer, parallelism, and the options every backend spells the same way.

The backend is named, never branched on: ``policy.backend`` selects a registered
:class:`~core.policy.backend_spec.BackendSpec` (:mod:`core.policy.registry`), which says which
options it implements (the others are refused by name, :mod:`core.policy.options`), how
``policy.parallel`` becomes its mesh, and its own rules; a backend's settings that no other
backend has live in its block, ``policy.<its config_key>`` (:mod:`core.policy.backend_blocks`).

``PolicyConfig.check`` holds the rules that need no device count; :meth:`PolicyConfig.
layout_problems` the ones that do (the run config calls it with ``cluster``'s world size,
``Policy`` with its workers').  One config means the same on every backend: what a backend
can derive (the row padding context parallelism needs) it derives, and is not asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypeVar

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from core.config import ConfigError, ConfigModel, Problem, join_path
from core.parallel_dims import ParallelDims
from core.policy.backend_blocks import block_models, errors_of, renamed_key_problems, split_blocks
from core.policy.backend_spec import BackendSpec
from core.policy.exact_numerics import Numerics, exact_numerics_problems
from core.policy.generation_config import GenerationConfig
from core.policy.options import OPTIONS
from core.policy.registry import BackendNotFound, backend_spec
from core.policy.sections import (
    LORA_TARGETS,
    VLLM_LORA_RANKS,
    DynamicBatchingConfig,
    LoRAConfig,
    MoEConfig,
    OptimizerConfig,
    SchedulerEntry,
    SequencePackingConfig,
    scheduler_chain,
    scheduler_problems,
    vllm_max_lora_rank,
)

__all__ = [
    "LORA_TARGETS",
    "VLLM_LORA_RANKS",
    "DynamicBatchingConfig",
    "LoRAConfig",
    "MoEConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PolicyConfig",
    "SchedulerEntry",
    "SequencePackingConfig",
    "TokenizerConfig",
    "scheduler_chain",
    "scheduler_problems",
    "vllm_max_lora_rank",
]

#: The values ``policy.precision`` may take.
PRECISIONS = ("float32", "bfloat16", "float16")
Precision = Literal["float32", "bfloat16", "float16"]
#: The values ``policy.matmul_precision`` may take (JAX's names; see core.policy.matmul_precision).
MATMUL_PRECISIONS = ("highest", "high", "default")
MatmulPrecision = Literal["highest", "high", "default"]
B = TypeVar("B", bound=ConfigModel)


class TokenizerConfig(ConfigModel):
    """Which tokenizer to load (usually the model's own)."""

    name: str
    """HF hub id, local path or built-in name."""
    chat_template: str | None = None
    """Jinja template; null = the tokenizer's own."""


class ParallelConfig(ConfigModel):
    """How the devices split the work (``core.parallel_dims``: fsdp x cp x tp = world size),
    with NeMo RL's names; a backend that lacks one of them refuses it when it is above 1."""

    fsdp_size: int = -1
    """Data-parallel ranks sharding parameters, gradients and optimizer state; -1 = the devices
    tensor_parallel_size x context_parallel_size leave."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Tensor parallelism: weight matrices split over this many devices (mesh axis "tp")."""
    context_parallel_size: int = Field(1, ge=1)
    """Context parallelism: each sequence split over this many devices (mesh axis "cp"; rows
    padded to multiples of 2 x cp, load-balanced head + tail chunks)."""
    sequence_parallel: bool = False
    """Shard norms / dropouts over the tensor-parallel group along the sequence (needs
    tensor_parallel_size >= 2)."""
    expert_parallel_size: int = Field(1, ge=1)
    """Expert parallelism of a mixture of experts (docs/moe.md): 1, or the fsdp size -- each rank
    runs only its own experts, on every rank's tokens.  Must divide num_experts; refused on a
    dense model."""

    def check(self) -> Iterable[Problem]:
        if self.fsdp_size < 1 and self.fsdp_size != -1:
            yield "fsdp_size", f"must be >= 1, or -1 to use the remaining devices, got {self.fsdp_size}"
        if self.sequence_parallel and self.tensor_parallel_size < 2:
            yield (
                "sequence_parallel",
                f"true needs tensor_parallel_size >= 2 (it shards over the tensor-parallel group), got "
                f"{self.tensor_parallel_size}",
            )


class PolicyConfig(ConfigModel):
    """The trained policy: model, batch sizes, precision, parallelism, and the backends' own blocks."""

    # Extra keys are the backends' blocks, checked by the validator below (anything else is refused).
    model_config = ConfigDict(**{**ConfigModel.model_config, "extra": "allow"})

    backend: str
    """Which training backend runs the policy (the CLI's --backend): a registered backend's
    name (core.policy.registry; `dualrl --help` lists them)."""
    model_name: str
    """HF hub id, local path or built-in model (builtin:...)."""
    tokenizer: TokenizerConfig
    train_global_batch_size: int = Field(gt=0)
    """Sequences per optimizer step, over all data-parallel ranks."""
    train_micro_batch_size: int = Field(gt=0)
    """Sequences per forward/backward on one data-parallel rank (a device of the data axis,
    on every backend: a worker that owns several runs that many on each)."""
    logprob_batch_size: int = Field(gt=0)
    """Sequences per forward, on one data-parallel rank, when only log-probs are needed."""
    generation_batch_size: int | None = Field(None, gt=0)
    """hf generation: rows per model generate call (per worker); null = all rows at once."""
    max_total_sequence_length: int = Field(gt=0)
    """Prompt + response, in tokens."""
    make_sequence_length_divisible_by: int = Field(1, gt=0)
    """Pad sequence lengths to a multiple of this (each backend adds what its layout needs)."""
    make_vocab_size_divisible_by: int = Field(1, gt=0)
    """Pad the training copy of the vocabulary (embedding, lm_head rows; zeros, logits masked,
    never exported) to a multiple of this and of the tensor-parallel size (Megatron style);
    a backend without tensor parallelism refuses values > 1."""
    precision: Precision
    """Parameter/compute dtype of training."""
    matmul_precision: MatmulPrecision | None = None
    """Precision of float32 matmuls on every backend: "highest" = true fp32 (no TF32 on GPU),
    "high"/"default" = the device's fast path.  null = "highest" when precision is float32,
    else "default" (core.policy.matmul_precision)."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """The device mesh: fsdp, tensor, context, sequence and expert parallelism."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward (torch: HF's per-block
    checkpointing; JAX: jax.checkpoint around every decoder layer)."""
    cpu_offload: bool = False
    """Keep parameters (and their gradients and optimizer state) in host memory between uses
    (torch FSDP's CPU offload); no effect on CPU workers, said so at start."""
    compile: bool = False
    """torch.compile each transformer block (torchtitan order: TP -> AC -> compile -> FSDP)."""
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    sequence_packing: SequencePackingConfig = Field(default_factory=SequencePackingConfig)
    optimizer: OptimizerConfig | None = None
    """null: an inference-only policy (e.g. a reference model)."""
    scheduler: list[SchedulerEntry] | None = None
    """SequentialLR form; null = a constant learning rate ([] is refused)."""
    max_grad_norm: float | None
    """Gradient clipping; null = no clipping."""
    non_finite_step: Literal["skip", "error"] = "skip"
    """An optimizer step whose global loss / grad norm is NaN or inf, or whose global batch has
    no valid token, is always skipped on every rank (weights, optimizer state and the LR
    schedule unchanged).  "skip": reported (skipped_steps, a warning) and the run goes on;
    "error": Policy.train then raises on the driver naming the step and the value."""
    generation: GenerationConfig | None = None
    """How rollouts are sampled (GRPO); null for SFT / DPO, which never generate."""
    refit_buffer_size_gb: float = Field(4.0, gt=0)
    """Staging buffer for policy -> generation weight refit."""
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    """Low-rank adapters (``enabled: false`` = full fine-tuning)."""
    moe: MoEConfig = Field(default_factory=MoEConfig)
    """Mixture-of-experts options (read only for a model with a router)."""
    numerics: Numerics = "default"
    """"exact": batch-invariant numerics -- a sequence's forward gives the same bits whatever its
    batch, micro batch, padding or KV-cache decoding, so the sampler (generation.backend hf)
    reports the trainer's logprobs bit for bit (core.kernels.exact; refusals in
    core.policy.exact_numerics).  "default": the engines' own kernels."""

    # ------------------------------------------------------------------ the backend
    @field_validator("backend")
    @classmethod
    def _registered(cls, name: str) -> str:
        backend_spec(name)  # BackendNotFound (a ValueError) names the known backends
        return name

    @model_validator(mode="wrap")
    @classmethod
    def _with_backend_blocks(cls, data: Any, handler: Any) -> Any:
        """The section's own keys by its fields, each backend block by its backend's model."""
        if not isinstance(data, Mapping):
            return handler(data)
        chosen = _spec_or_none(data.get("backend"))
        rest, blocks, errors = split_blocks(data, cls.model_fields, chosen.config_key if chosen else None)
        try:
            model = handler({**rest, **blocks})
        except ValidationError as err:
            errors = errors_of(err) + errors
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return model

    @classmethod
    def refusals(cls, raw: Mapping[str, Any]) -> Iterable[Problem]:
        return renamed_key_problems(raw)

    @classmethod
    def extra_sections(cls) -> dict[str, type[ConfigModel]]:
        return block_models()

    @property
    def spec(self) -> BackendSpec:
        """The chosen backend's spec."""
        return backend_spec(self.backend)

    def block(self, spec: BackendSpec, model: type[B]) -> B:
        """``spec``'s block of this section (``policy.<spec.config_key>``), its defaults where
        the config has none: how a backend reads its own settings."""
        value = (self.model_extra or {}).get(spec.config_key or "")
        if value is None:
            return model()
        if not isinstance(value, model):
            raise TypeError(f"policy.{spec.config_key} is a {type(value).__name__}, not {model.__name__}")
        return value

    # ------------------------------------------------------------------ checks
    def check(self) -> Iterable[Problem]:
        spec = self.spec
        yield from self._option_refusals(spec)
        yield from spec.checks(self)
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            yield "max_grad_norm", f"must be > 0 (or null for no clipping), got {self.max_grad_norm!r}"
        yield from self._batching_problems()
        if self.scheduler is not None:
            yield from ((join_path("scheduler", p), m) for p, m in scheduler_problems(self.scheduler))
        if self.generation is not None:
            yield from self._engine_length_problems(self.generation)
        if self.lora.refit == "adapter" and self.lora.enabled:
            blocker = self._adapter_refit_blocker()
            if blocker is not None:
                yield "lora.refit", f"'adapter' is not possible: {blocker}; use 'merged' or 'auto'"
        elif self.lora.refit == "adapter":
            yield "lora.refit", "'adapter' needs policy.lora.enabled (there is no adapter to refit)"
        yield from self._routing_problems()
        yield from exact_numerics_problems(self)

    def _option_refusals(self, spec: BackendSpec) -> Iterable[Problem]:
        """Every option asked for that the backend does not implement, by name."""
        for opt in OPTIONS:
            if opt.key not in spec.supports and opt.asked(self):
                why = spec.why_not.get(opt.key)
                yield (
                    opt.key,
                    f"{_yaml(opt.value(self))}: the {spec.name} backend does not support {opt.what}"
                    + (f" ({why})" if why else "")
                    + f"; set it to {opt.off}",
                )

    def _routing_problems(self) -> Iterable[Problem]:
        """Expert choices are recorded and replayed on plain rows only (docs/moe.md)."""
        if not self.moe.records_routing:
            return
        cp = self.parallel.context_parallel_size
        if self.sequence_packing.enabled or cp > 1:
            layout = (
                "policy.sequence_packing.enabled"
                if self.sequence_packing.enabled
                else f"policy.parallel.context_parallel_size={cp}"
            )
            yield (
                f"moe.{self.moe.routing_field}",
                f"true with {layout}: expert choices are recorded and replayed on plain rows only",
            )

    def _adapter_refit_blocker(self) -> str | None:
        """Why this section cannot refit adapters only (None: it can, as far as the config
        tells; the engine checks that vLLM has LoRA for the model)."""
        gen = self.generation
        if not self.lora.enabled:
            return "policy.lora.enabled is false"
        if gen is None or gen.backend != "vllm" or gen.vllm_cfg is None:
            backend = None if gen is None else gen.backend
            return f"generation.backend is {backend!r} (only a vLLM engine is refit; hf generates with the policy)"
        if gen.vllm_cfg.world_size > 1:
            return (
                f"generation.vllm_cfg tensor_parallel_size x pipeline_parallel_size = {gen.vllm_cfg.world_size}: "
                "adapter-only refit is implemented and tested for one-worker engines only"
            )
        if self.lora.rank > VLLM_LORA_RANKS[-1]:
            return f"lora.rank {self.lora.rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})"
        return None

    def lora_refit_mode(self) -> tuple[Literal["merged", "adapter"], str]:
        """``(mode, why)`` as far as the config decides (``policy.lora.refit``, "auto" resolved);
        the engine may still fall back from "auto" to "merged" (vLLM without LoRA for the model)."""
        if self.lora.refit == "merged" or not self.lora.enabled:
            return "merged", "policy.lora.refit is 'merged'" if self.lora.enabled else "policy.lora is off"
        blocker = self._adapter_refit_blocker()
        return ("merged", blocker) if blocker is not None else ("adapter", f"policy.lora.refit is {self.lora.refit!r}")

    def _batching_problems(self) -> Iterable[Problem]:
        packing = self.sequence_packing
        if not packing.enabled:
            return
        if self.dynamic_batching.enabled:
            yield "sequence_packing.enabled", "sequence packing and dynamic batching cannot both be enabled"
        limit = self.max_total_sequence_length
        for key in ("train_mb_tokens", "logprob_mb_tokens"):
            budget = getattr(packing, key)
            if budget is not None and budget < limit:
                yield (
                    f"sequence_packing.{key}",
                    f"{budget} is smaller than max_total_sequence_length ({limit}): a sequence of the "
                    "allowed length would fit no packed row",
                )

    def _engine_length_problems(self, gen: GenerationConfig) -> Iterable[Problem]:
        total = self.max_total_sequence_length
        if gen.backend == "vllm" and gen.vllm_cfg is not None and gen.vllm_cfg.max_model_len < total:
            # The engine refuses (VllmGeneration) or truncates what the policy would train on.
            yield (
                "generation.vllm_cfg.max_model_len",
                f"{gen.vllm_cfg.max_model_len} is below policy.max_total_sequence_length ({total}): a rollout "
                "of the allowed length would not fit the engine; set it to at least that",
            )

    @property
    def generation_dtype(self) -> str:
        """The dtype the engine serves and a refit casts the weights to:
        ``generation.vllm_cfg.precision``, else ``precision`` (training in fp32 and generating
        in bf16 is common)."""
        vllm = self.generation.vllm_cfg if self.generation is not None else None
        return vllm.precision if vllm is not None and vllm.precision else self.precision

    # ------------------------------------------------------------------ the device layout
    @classmethod
    def checked(cls, raw: PolicyConfig | Mapping[str, Any], world_size: int | None = None) -> PolicyConfig:
        """``raw`` as a ``PolicyConfig`` and, given ``world_size``, its layout checked against
        that many devices: :class:`ConfigError` (lines ``policy.<field>: ...``) otherwise."""
        cfg = cls.coerce(raw, path="policy")
        found = [f"{join_path('policy', p)}: {m}" for p, m in cfg.layout_problems(world_size)] if world_size else []
        if found:
            raise ConfigError(found)
        return cfg

    def layout_problems(self, world_size: int) -> Iterable[Problem]:
        """Whether the parallel sizes fit ``world_size`` devices (the shared rules, then the
        backend's own), and whether the global batch splits into whole micro batches on every
        data-parallel rank."""
        problem = _mesh_problem(self.parallel, world_size)
        if problem is not None:
            yield problem
            return
        own = list(self.spec.layout_checks(self, world_size))
        if own:
            yield from own
            return
        dp, gbs, mbs = self.parallel_dims(world_size).dp, self.train_global_batch_size, self.train_micro_batch_size
        if gbs % (mbs * dp):
            yield (
                "train_global_batch_size",
                f"{gbs} is not divisible by train_micro_batch_size ({mbs}) x data parallel size ({dp}) = {mbs * dp}",
            )

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """The mesh this config asks for on ``world_size`` devices (the backend's derivation of
        ``policy.parallel``: tp and cp as given, fsdp the rest, unless it says otherwise)."""
        return self.spec.parallel_dims(self, world_size)


def _spec_or_none(name: Any) -> BackendSpec | None:
    try:
        return backend_spec(name) if isinstance(name, str) else None
    except BackendNotFound:
        return None  # reported by the backend field's own validator


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _mesh_problem(p: ParallelConfig, ws: int) -> Problem | None:
    """tp, then tp x cp, must divide the world size, and an explicit fsdp size fill it exactly;
    the problem names the field at fault."""
    fsdp, cp, tp = p.fsdp_size, p.context_parallel_size, p.tensor_parallel_size
    if ws % tp:
        return "parallel.tensor_parallel_size", f"tensor_parallel_size ({tp}) does not divide the world size ({ws})"
    if ws % (tp * cp):
        return (
            "parallel.context_parallel_size",
            f"tensor_parallel_size ({tp}) x context_parallel_size ({cp}) = {tp * cp} does not divide the world size "
            f"({ws})",
        )
    if fsdp != -1 and fsdp * cp * tp != ws:
        sizes = f"fsdp_size ({fsdp}) x " + (f"context_parallel_size ({cp}) x " if cp != 1 else "")
        return (
            "parallel.fsdp_size",
            f"{sizes}tensor_parallel_size ({tp}) = {fsdp * cp * tp} does not equal the world size ({ws}); "
            "use -1 to fill in",
        )
    return None
