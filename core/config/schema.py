"""Typed description of the dualrl configuration (NeMo RL field names).

Configs stay plain ``dict``s at run time -- code reads ``config["policy"]["backend"]`` --
and these ``TypedDict``s only describe them: for type checkers, for readers, and for the
generic validator in :mod:`core.config.validate`, which walks the annotations below.
Keys marked ``NotRequired`` may be left out of a YAML file; every other key must be
present (``null`` is only allowed where the type says ``| None``).

Nothing here imports torch, jax or ray.
"""

from typing import Any, Literal, NotRequired, TypedDict

__all__ = [
    "BACKENDS",
    "PRECISIONS",
    "GENERATION_BACKENDS",
    "Backend",
    "Precision",
    "MATMUL_PRECISIONS",
    "MatmulPrecision",
    "TokenizerConfig",
    "DTensorConfig",
    "JaxConfig",
    "DynamicBatchingConfig",
    "SequencePackingConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "SchedulerMilestones",
    "VllmConfig",
    "ColocationResources",
    "ColocationConfig",
    "GenerationConfig",
    "PolicyConfig",
    "ClusterConfig",
    "ClippedPGLossConfig",
    "DPOLossConfig",
    "GRPOConfig",
    "DataConfig",
    "ArithmeticTaskConfig",
    "MathEnvConfig",
    "EnvConfig",
    "LoggerConfig",
    "CheckpointingConfig",
    "MasterConfig",
]

#: The training backends ``policy.backend`` may name (the CLI's ``--backend``).
BACKENDS = ("torch_fsdp", "torch_dtensor", "jax_pjit")
#: The values ``policy.precision`` may take.
PRECISIONS = ("float32", "bfloat16", "float16")
#: The values ``policy.generation.backend`` may take.
GENERATION_BACKENDS = ("vllm", "hf")

Backend = Literal["torch_fsdp", "torch_dtensor", "jax_pjit"]
Precision = Literal["float32", "bfloat16", "float16"]
#: The values ``policy.matmul_precision`` may take (JAX's names; torch maps them onto its
#: float32 matmul precision, see ``core.policy.matmul_precision``).
MATMUL_PRECISIONS = ("highest", "high", "default")
MatmulPrecision = Literal["highest", "high", "default"]
#: What ``Policy.train`` does after a skipped (non-finite / all-masked) optimizer step.
NonFiniteStep = Literal["skip", "error"]
#: core.data.sequence_packing.pack_bins algorithms (NeMo RL's names).
PackingAlgorithm = Literal["modified_first_fit_decreasing", "first_fit_decreasing", "concatenative"]


class TokenizerConfig(TypedDict):
    """Which tokenizer to load (usually the model's own)."""

    name: str  # HF hub id or local path
    chat_template: NotRequired[str | None]  # Jinja template; None = the tokenizer's own


class DTensorConfig(TypedDict):
    """Settings of the ``torch_dtensor`` backend (FSDP2 + TP/SP/CP)."""

    cpu_offload: bool  # FSDP2 CPUOffloadPolicy for parameters/gradients/optimizer state
    sequence_parallel: bool  # shard norms/dropouts over the TP group along the sequence
    activation_checkpointing: bool  # recompute transformer-block activations in backward
    tensor_parallel_size: int  # TP degree (mesh axis "tp")
    context_parallel_size: int  # CP degree (mesh axis "cp"); splits the sequence
    custom_parallel_plan: NotRequired[str | None]  # "module.path.PLAN" overriding the built-in TP plan
    # torch.compile each transformer block (torchtitan order: TP -> AC -> compile -> FSDP); default false
    compile: NotRequired[bool]


class JaxConfig(TypedDict):
    """Settings of the ``jax_pjit`` backend: a (fsdp, cp, tp) device mesh."""

    fsdp_size: int  # size of the "fsdp" mesh axis; -1 = fill with the remaining devices
    tensor_parallel_size: int  # size of the "tp" mesh axis
    context_parallel_size: NotRequired[int]  # size of the "cp" mesh axis (splits the sequence); default 1
    activation_checkpointing: bool  # jax.checkpoint (remat) around every transformer block


class DynamicBatchingConfig(TypedDict):
    """Token-budget micro-batching (sort by length, fill up to N tokens)."""

    enabled: bool
    train_mb_tokens: NotRequired[int]  # token budget of a training micro-batch; required when enabled
    logprob_mb_tokens: NotRequired[int]  # token budget of a logprob micro-batch; required when enabled
    sequence_length_round: NotRequired[
        int
    ]  # pad each micro-batch's length to a multiple of this; required when enabled


class SequencePackingConfig(TypedDict):
    """Pack several sequences into one row (no padding between them)."""

    enabled: bool
    train_mb_tokens: NotRequired[int]  # tokens per packed training row; required when enabled
    logprob_mb_tokens: NotRequired[int]  # tokens per packed logprob row; required when enabled
    algorithm: NotRequired[PackingAlgorithm]  # how sequences are binned into packed rows


class OptimizerConfig(TypedDict):
    """An optimizer by import path plus its keyword arguments."""

    name: str  # e.g. "torch.optim.AdamW" (the JAX backend maps it onto optax)
    kwargs: dict[str, Any]  # passed to the constructor, e.g. {lr: 1.0e-6, weight_decay: 0.01}


class SchedulerConfig(TypedDict):
    """A learning-rate scheduler by import path plus its keyword arguments."""

    name: str  # e.g. "torch.optim.lr_scheduler.LinearLR"
    kwargs: dict[str, Any]


class SchedulerMilestones(TypedDict):
    """The step boundaries between chained schedulers (``SequentialLR``'s milestones)."""

    milestones: list[int]  # n_schedulers - 1 increasing step numbers


class VllmConfig(TypedDict):
    """vLLM engine settings for generation."""

    tensor_parallel_size: int
    pipeline_parallel_size: NotRequired[int]
    gpu_memory_utilization: float  # fraction of device memory vLLM may take (0, 1]
    max_model_len: int  # longest prompt + response the engine accepts; >= policy.max_total_sequence_length
    precision: NotRequired[str]  # dtype of the engine's weights, e.g. "bfloat16"
    enforce_eager: NotRequired[bool]  # no CUDA graphs
    async_engine: NotRequired[bool]  # must be false: dualrl has no async engine (true is refused)
    load_format: NotRequired[str]  # "dummy" when weights are refit from the policy
    skip_tokenizer_init: NotRequired[bool]


class ColocationResources(TypedDict):
    """Devices for a generation engine that is *not* colocated with training."""

    gpus_per_node: int | None
    num_nodes: int | None


class ColocationConfig(TypedDict):
    """Whether generation shares the training workers' devices."""

    enabled: bool
    resources: NotRequired[ColocationResources]  # used only when enabled is false


class GenerationConfig(TypedDict):
    """How rollouts are generated."""

    backend: Literal["vllm", "hf"]
    max_new_tokens: int
    temperature: float  # > 0; greedy decoding is a per-call switch (greedy=True), not temperature 0
    top_p: float
    top_k: int | None  # None or -1 = no top-k filtering; else >= 1 (0 is refused as a likely typo)
    model_name: NotRequired[str]  # vllm only (the engine's architecture); defaults to policy.model_name
    stop_token_ids: list[int] | None
    stop_strings: list[str] | None
    pad_token_id: NotRequired[int]  # filled in from the tokenizer when left out
    colocated: NotRequired[ColocationConfig]
    vllm_cfg: NotRequired[VllmConfig]  # required by backend "vllm" in practice


class PolicyConfig(TypedDict):
    """The trained policy: model, batch sizes, precision and the backend-specific blocks."""

    backend: Backend  # which training backend runs the policy
    model_name: str  # HF hub id or local path
    tokenizer: TokenizerConfig
    train_global_batch_size: int  # sequences per optimizer step, over all data-parallel ranks
    train_micro_batch_size: int  # sequences per forward/backward on one data-parallel rank
    logprob_batch_size: int  # sequences per forward when only log-probs are needed
    generation_batch_size: NotRequired[int]  # hf generation: rows per model generate call (per worker)
    max_total_sequence_length: int  # prompt + response, in tokens
    make_sequence_length_divisible_by: NotRequired[int]  # pad sequence lengths to a multiple of this
    # Pad the training copy of the vocabulary (embedding, lm_head rows; zeros, logits masked, never
    # exported) to a multiple of this and of the tensor-parallel size (Megatron style); default 1.
    # torch_dtensor and jax_pjit pad; torch_fsdp (FSDP1) has no TP and refuses values > 1.
    make_vocab_size_divisible_by: NotRequired[int]
    precision: Precision  # parameter/compute dtype of training
    # Precision of float32 matmuls on every backend: "highest" = true fp32 (no TF32 on GPU),
    # "high"/"default" = the device's fast path (TF32 on NVIDIA GPUs; torch allows TF32, JAX
    # uses its default).  null / left out = "highest" when precision is float32, else "default".
    matmul_precision: NotRequired[MatmulPrecision | None]
    dtensor_cfg: DTensorConfig  # read by backend torch_dtensor
    jax_cfg: JaxConfig  # read by backend jax_pjit
    fsdp_offload_enabled: NotRequired[bool]  # torch_fsdp (FSDP1): CPUOffload(offload_params=True)
    activation_checkpointing_enabled: NotRequired[bool]  # torch_fsdp (FSDP1): checkpoint each block
    dynamic_batching: DynamicBatchingConfig
    sequence_packing: NotRequired[SequencePackingConfig]
    optimizer: NotRequired[OptimizerConfig | None]  # None: inference-only policy (e.g. reference model)
    # SequentialLR form; null = a constant learning rate ([] is refused)
    scheduler: NotRequired[list[SchedulerConfig | SchedulerMilestones] | None]
    max_grad_norm: float | None  # gradient clipping; None = no clipping
    # An optimizer step whose global loss / grad norm is NaN or inf, or whose global batch has
    # no valid token, is always skipped on every rank (weights, optimizer state and the LR
    # schedule unchanged). "skip" (default): reported (skipped_steps, a warning) and the run
    # goes on; "error": Policy.train then raises on the driver naming the step and the value.
    non_finite_step: NotRequired[NonFiniteStep]
    generation: NotRequired[GenerationConfig | None]
    refit_buffer_size_gb: NotRequired[float]  # staging buffer for policy -> generation weight refit


class ClusterConfig(TypedDict):
    """The devices the job runs on."""

    gpus_per_node: int  # on CPU machines: worker slots per node
    num_nodes: int


class ClippedPGLossConfig(TypedDict):
    """PPO/GRPO clipped policy-gradient loss (NeMo RL's ``ClippedPGLossFn``)."""

    reference_policy_kl_penalty: float  # KL(policy || reference) coefficient; 0 disables
    ratio_clip_min: float  # epsilon below 1 (ratio clipped to 1 - ratio_clip_min)
    ratio_clip_max: float  # epsilon above 1 (ratio clipped to 1 + ratio_clip_max)
    ratio_clip_c: float | None  # dual-clip constant (> 1); None disables dual clipping
    use_on_policy_kl_approximation: bool  # importance-weight the KL estimate
    use_importance_sampling_correction: bool  # correct for generation/training logprob mismatch
    token_level_loss: bool  # mean over tokens (True) or over sequences (False)
    disable_ppo_ratio: NotRequired[bool]  # REINFORCE: no ratio, no clipping
    reference_policy_kl_type: NotRequired[Literal["k1", "k2", "k3"]]  # KL estimator
    kl_input_clamp_value: NotRequired[float | None]  # clamp log-ratio fed into the KL estimator
    kl_output_clamp_value: NotRequired[float | None]  # clamp the per-token KL value
    truncated_importance_sampling_ratio: NotRequired[float | None]  # upper bound of the IS weight; None = no truncation
    truncated_importance_sampling_ratio_min: NotRequired[float | None]  # lower bound (icepop / seq-mask-tis)
    truncated_importance_sampling_type: NotRequired[Literal["tis", "icepop", "seq-mask-tis"]]
    sequence_level_importance_ratios: NotRequired[bool]  # GSPO: one ratio per sequence


class DPOLossConfig(TypedDict):
    """Direct preference optimisation loss (NeMo RL's ``DPOLossFn``)."""

    reference_policy_kl_penalty: float  # DPO beta
    preference_loss_weight: float
    sft_loss_weight: float  # weight of the NLL on the chosen response
    preference_average_log_probs: bool  # average (not sum) token log-probs in the preference term
    sft_average_log_probs: bool  # average (not sum) token log-probs in the SFT term


class GRPOConfig(TypedDict):
    """The GRPO loop (NeMo RL's ``grpo`` section)."""

    num_prompts_per_step: int  # distinct prompts per step
    num_generations_per_prompt: int  # samples per prompt (the group); >= 2 for a group baseline
    max_num_steps: int  # training steps of the run
    max_num_epochs: NotRequired[int]  # stop after this many passes over a finite prompt set
    normalize_rewards: bool  # divide advantages by the group's reward std (groups with std 0 are left as is)
    use_leave_one_out_baseline: bool  # baseline = mean reward of the *other* samples of the group
    val_period: int  # validate every N steps; 0 = never (except val_at_start / the end)
    val_at_start: bool  # validate before the first step
    val_at_end: NotRequired[bool]  # validate after the last step (default true)
    max_val_samples: int  # held-out prompts per validation (greedy, one sample each)
    val_batch_size: NotRequired[int]  # prompts per validation generate call (default: all)
    seed: int  # data order, sampling seeds, task generation: a CPU fp32 run is repeatable


class SFTConfig(TypedDict):
    """The SFT loop (NeMo RL's ``sft`` section)."""

    max_num_steps: int  # optimizer steps of the run (one policy.train_global_batch_size batch each)
    max_num_epochs: NotRequired[int]  # stop after this many passes over a finite dataset
    val_period: int  # validate every N steps; 0 = never (except val_at_start / the end)
    val_batches: int  # validation = val_batches x val_global_batch_size held-out examples; 0 = no validation
    val_global_batch_size: int
    val_micro_batch_size: int
    val_at_start: bool
    val_at_end: NotRequired[bool]  # default true
    seed: int  # data order and held-out split


class DPOConfig(SFTConfig, DPOLossConfig):
    """The DPO loop and its loss keys (NeMo RL's ``dpo`` section holds both, as here)."""


class ArithmeticTaskConfig(TypedDict):
    """Difficulty knobs of the built-in arithmetic task."""

    min_value: NotRequired[int]
    max_value: NotRequired[int]
    num_operands: NotRequired[int]
    operations: NotRequired[list[Literal["+", "-", "*"]]]
    allow_negative: NotRequired[bool]


class DataConfig(TypedDict):
    """Training data: the built-in task, a local JSONL/parquet file, or a Hugging Face dataset.

    One section for every algorithm; each uses the keys of its data format and refuses the
    others (``core.config.run_checks.ALGORITHM_DATA_KEYS``): GRPO prompts, SFT
    prompt/response or chat ``messages``, DPO prompt/chosen/rejected.
    """

    dataset_name: str  # "arithmetic" / "arithmetic-preferences" (built-in), a .jsonl/.json/.parquet path, or a hub name
    dataset_config: NotRequired[str | None]  # hub subset, e.g. "main"
    split: NotRequired[str]
    val_dataset_name: NotRequired[str | None]  # null = hold validation rows out of dataset_name
    val_split: NotRequired[str | None]
    prompt_key: NotRequired[str | None]  # column with the prompt text (null with SFT's messages_key)
    answer_key: NotRequired[str | None]  # GRPO: column with the reference answer (-> the environment's ground truth)
    response_key: NotRequired[str | None]  # SFT: column with the response text (trained on); null with messages_key
    messages_key: NotRequired[
        str | None
    ]  # SFT: column with a chat conversation (list of {role, content}); loss on assistant turns
    chosen_key: NotRequired[str]  # DPO: the preferred response (text or messages)
    rejected_key: NotRequired[str]  # DPO: the dispreferred response
    prompt_template: NotRequired[str]  # str.format template around the prompt, e.g. "{prompt}"
    system_prompt: NotRequired[str | None]  # system message (chat template only)
    use_chat_template: NotRequired[bool | Literal["auto"]]  # auto = when the tokenizer has one
    max_input_seq_length: NotRequired[int]  # GRPO: longest prompt in tokens (required there)
    on_long_prompt: NotRequired[Literal["error", "filter"]]  # GRPO: what a longer prompt does
    on_long_sequence: NotRequired[
        Literal["truncate", "filter", "error"]
    ]  # SFT/DPO: a sequence over policy.max_total_sequence_length
    shuffle: NotRequired[bool]
    arithmetic: NotRequired[
        ArithmeticTaskConfig | None
    ]  # SFT/DPO: knobs of the built-in task (GRPO: env.arithmetic); null = none


class MathEnvConfig(TypedDict):
    """The math-answer verifier (last number / \\boxed{} extraction, numeric equality)."""

    rel_tol: NotRequired[float]


class EnvConfig(TypedDict):
    """The reward environment, run in a pool of Ray actors."""

    name: str  # "arithmetic" | "math" | "package.module:ClassName"
    num_workers: int  # reward actors
    timeout_s: NotRequired[float]  # per scoring call
    arithmetic: NotRequired[ArithmeticTaskConfig]
    math: NotRequired[MathEnvConfig]
    kwargs: NotRequired[dict[str, Any]]  # free-form settings of a user's own environment class


class LoggerConfig(TypedDict):
    """Where and how a run reports metrics."""

    log_dir: str  # metrics.jsonl, tensorboard/, curves.png
    jsonl_enabled: NotRequired[bool]
    tensorboard_enabled: NotRequired[bool]
    progress_bar: NotRequired[bool]  # tqdm over steps
    plot_enabled: NotRequired[bool]  # PNG of the curves at the end
    num_val_samples_to_print: NotRequired[int]


class CheckpointingConfig(TypedDict):
    """Run checkpoints: policy state + data position + RNG + config, written atomically."""

    enabled: bool
    checkpoint_dir: str
    save_period: int  # every N steps (and at the last step)
    keep_top_k: int | None  # complete checkpoints kept (null = all); the newest is always kept
    metric_name: NotRequired[str | None]  # keep the best by this metric (e.g. "val/accuracy"); null = the newest
    higher_is_better: NotRequired[bool]
    resume: NotRequired[bool]  # continue from the latest complete checkpoint (CLI: --resume)
    export_hf_dir: NotRequired[
        str | None
    ]  # at the end, the final policy as an HF model (+ tokenizer) here: the next stage's policy.model_name


class MasterConfig(TypedDict):
    """A whole run's configuration (the top level of a YAML file)."""

    policy: PolicyConfig
    cluster: ClusterConfig
    loss_fn: NotRequired[ClippedPGLossConfig]
    grpo: NotRequired[GRPOConfig]
    sft: NotRequired[SFTConfig]
    dpo: NotRequired[DPOConfig]
    data: NotRequired[DataConfig]
    env: NotRequired[EnvConfig]
    logger: NotRequired[LoggerConfig]
    checkpointing: NotRequired[CheckpointingConfig]
