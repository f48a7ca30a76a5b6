"""The parity run's fixed settings: layouts, steps, seeds and the tolerances of every check."""

from __future__ import annotations

HF = "hf"
#: The reference of the ``-lora`` layouts: the same HF model with the same seeded adapters.
HF_LORA = "hf-lora"
#: ``policy.lora`` of every ``-lora`` layout (and of ``hf-lora``): every linear but lm_head
#: adapted, so a wrong shard of any adapter shows; rank 4 divides every tp of the grammar's
#: tiny models' dimensions.  B = 0 at init: the adapted model starts as the base model.
LORA = {"rank": 4, "alpha": 8.0, "target_modules": "all-linear", "init_seed": 0}
DEFAULT_LAYOUTS = ["fsdp1-dp2", "dtensor-dp2", "dtensor-tp2", "jax-fsdp2", "jax-tp2"]
#: The torch layouts the benchmarks' help texts list (any other by ``benchmarks.lib.layouts.grammar()``).
TORCH_LAYOUTS = ("fsdp1-dp1", "dtensor-dp1", "fsdp1-dp2", "dtensor-dp2", "dtensor-tp2", "dtensor-tp2-sp")
STEPS = 3
LEARNING_RATE = 1e-3
#: Seed of the companion rows of the ``mixed`` variant (the batch itself uses benchmarks.lib.workload.SEED).
OTHER_SEED = 1
#: GRPO step 0: optimizer steps of the one ``train`` call, seed of the advantages.
GRPO_STEPS = 2
GRPO_SEED = 2
#: The estimator rows (``benchmarks.lib.parity.estimators``): check -> (measurement key,
#: ``grpo.advantage_estimator``, ``loss_fn`` overrides of ``core/configs/default.yaml``'s).  Dr.
#: GRPO's constant normaliser divides by valid sequences x budget, a count each backend must
#: gather over its ranks and micro batches; RLOO keeps the default per-token normaliser.
ESTIMATOR_ROWS: dict[str, tuple[str, str, dict]] = {
    "grpo_dr_grpo_step": ("grpo_dr_grpo", "dr_grpo", {"token_normalizer": "constant"}),
    "grpo_rloo_step": ("grpo_rloo", "rloo", {}),
}
#: Seed of the estimator rows' rewards; their group size (``estimators.group_size``: the batch's gcd with it).
ESTIMATOR_SEED = 4
ESTIMATOR_GROUP_SIZE = 4
#: What ``grpo_step0`` compares besides the gradient norms (``ClippedPGLossFn`` metrics).
#: ``moe_aux_loss``: the router's load-balancing loss, reported by a mixture-of-experts model only
#: (``core.losses.router_aux``; HF's value from its own ``load_balancing_loss_func``).
GRPO_METRICS = ("loss", "actor_loss", "kl_penalty", "clip_fraction", "probs_ratio", "moe_aux_loss")
#: The engine check: prompts x width, tokens sampled per prompt, seed of the prompts and samples.
ENGINE_PROMPTS = 4
ENGINE_PROMPT_WIDTH = 8
ENGINE_NEW_TOKENS = 8
ENGINE_SEED = 3
ENGINE_TRANSPORTS = ("ipc", "collective")

#: ``check -> (comparison, threshold)``; see the table in the ``benchmarks/parity.py`` docstring.
TOLERANCES: dict[str, tuple[str, float]] = {
    "logprobs": ("<=", 1e-5),
    "loss_step0": ("<=", 1e-5),
    "grad_norm_step0": ("<=", 1e-5),
    "loss_curve": ("<=", 1e-4),
    "trained_logprobs": ("<=", 1e-4),
    "batch_invariance": ("<=", 1e-5),
    "crossload": ("<=", 1e-5),
    "weights_moved": (">=", 1e-3),
    "dcp_crossload": ("<=", 1e-5),
    "dcp_resume": ("<=", 1e-4),
    "grpo_step0": ("<=", 1e-5),
    "grpo_fused": ("<=", 1e-5),
    "grpo_fused_vs_separate": ("<=", 1e-5),
    "token_mult_prob_error": ("<=", 1.0001),
    "lora_b0_is_base": ("<=", 1e-5),
    "grpo_multi_turn_step0": ("<=", 1e-5),
    "grpo_multi_turn_logprobs": ("<=", 1e-4),
    "multi_turn_episodes": ("<=", 0.0),
    **{check: ("<=", 1e-5) for check in ESTIMATOR_ROWS},
    # --exact (benchmarks.lib.parity.exact): bit for bit, in every precision
    "exact_batch_invariance": ("<=", 0.0),
    "exact_sampler": ("<=", 0.0),
}
#: ``--precision bfloat16`` (bf16 compute, fp32 master weights and AdamW state, HF reference under
#: CPU autocast).  What differs between layouts is where bf16 rounds a matmul's *inputs*
#: (relative 2**-9 ~ 2e-3 per operand; CPU kernels accumulate in fp32): FSDP casts the norms'
#: weights too while autocast keeps them fp32, TP rounds partial products of other shapes.
#: Measured maxima on the tiny Llama, 5 layouts: logprobs 3.0e-3, loss 4.8e-5, grad
#: norm 1.7e-3 (rel), 3-step curve 1.3e-4, trained logprobs 7.5e-3, GRPO metrics 2.9e-3, batch
#: invariance 9.7e-4, cross-loads 4.2e-3.  The bands are ~3-4x those maxima -- far below what a
#: real error does (a wrong shard, mask or position moves logprobs by tenths of a nat or more).
#: Measured on CPU; a GPU's bf16 GEMMs (other accumulation orders) may need their own bands.
BF16_TOLERANCES: dict[str, tuple[str, float]] = {
    **TOLERANCES,
    "logprobs": ("<=", 1e-2),
    "loss_step0": ("<=", 2e-4),
    "grad_norm_step0": ("<=", 5e-3),
    "loss_curve": ("<=", 5e-4),
    "trained_logprobs": ("<=", 3e-2),
    "batch_invariance": ("<=", 4e-3),
    "crossload": ("<=", 1.5e-2),
    "dcp_crossload": ("<=", 1.5e-2),
    "dcp_resume": ("<=", 1.5e-2),
    "grpo_step0": ("<=", 1e-2),
    "grpo_fused": ("<=", 1e-2),
    "grpo_fused_vs_separate": ("<=", 1e-2),
    "token_mult_prob_error": ("<=", 1.01),  # not measured in bf16 here (the engine is opt-in)
    "lora_b0_is_base": ("<=", 1e-2),  # a layout against base hf: the logprobs band
    "grpo_multi_turn_step0": ("<=", 1e-2),  # the GRPO band (its generation logprobs: the logprobs band)
    "grpo_multi_turn_logprobs": ("<=", 3e-2),  # the trained-logprobs band
    **{check: ("<=", 1e-2) for check in ESTIMATOR_ROWS},  # the GRPO band
}
#: Checks between two layouts (every pair of ``hf`` + layouts), the rest are per layout.
PAIRWISE = (
    "logprobs",
    "loss_step0",
    "grad_norm_step0",
    "loss_curve",
    "trained_logprobs",
    "grpo_step0",
    "grpo_fused",
    "grpo_multi_turn_step0",
    "grpo_multi_turn_logprobs",
    "multi_turn_episodes",
    *ESTIMATOR_ROWS,
)
#: The pairwise GRPO checks -> the measurement each compares (a ``grpo_summary``).
GRPO_CHECKS = {
    "grpo_step0": "grpo",
    "grpo_fused": "grpo_fused",
    **{check: key for check, (key, _, _) in ESTIMATOR_ROWS.items()},
}
#: The pairwise multi-turn checks (benchmarks.lib.parity.multi_turn) -> the measurement each compares.
MULTI_TURN_CHECKS = {
    "grpo_multi_turn_step0": "grpo_multi_turn",
    "grpo_multi_turn_logprobs": "multi_turn_logprobs",
    "multi_turn_episodes": "multi_turn_episodes",
}
VARIANTS = ("alone", "alone_trimmed", "reversed", "mixed")
