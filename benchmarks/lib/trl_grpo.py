"""TRL's ``GRPOTrainer`` as the baseline of dualrl's full GRPO step (``dualrl bench``'s ×TRL).

:class:`TRLGRPORunner` runs a ``trl.GRPOTrainer`` in a child process of its own
(:mod:`benchmarks.lib.trl_grpo_child`, as
:mod:`benchmarks.lib.trl_compare` runs ``SFTTrainer`` / ``DPOTrainer``, see :mod:`benchmarks.lib.trl`:
``torch.set_num_threads(threads)`` there, one ``step`` line per optimizer step from the driver,
one reply back).
:func:`spec_from_dualrl` builds its spec from a resolved dualrl GRPO config, so that one TRL
step does the work of one dualrl :func:`core.algorithms.grpo.grpo_step`:

    prompts_per_step prompts x group_size samples, generated at once -> rewards -> group
    advantages -> reference log-probs -> old-policy log-probs -> ONE optimizer step on all
    prompts_per_step x group_size completions (forward + backward per micro batch, clip, AdamW)

trl is optional (``pip install -e .[bench]``): this module imports without it (nothing but the
standard library at import time) and :func:`trl_version` says ``None`` then.

Spec (a JSON-able dict; :func:`check_spec` fills the optional keys and refuses bad ones):

* required: ``model_path``, ``tokenizer_path``, ``prompts`` (already formatted prompt strings),
  ``answers`` (same length: the ground truth, rewarded by dualrl's own environment),
  ``prompts_per_step``, ``group_size``, ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``
  (``-1`` / ``None`` = off), ``learning_rate``, ``betas``, ``eps``, ``weight_decay``,
  ``max_grad_norm`` (``None`` = no clipping), ``kl_beta``, ``epsilon``, ``seed``, ``precision``
  (``float32`` | ``bfloat16``).
* optional (default): ``epsilon_high`` (``epsilon``); ``micro_batch_size`` (the whole batch:
  rows per forward/backward, = dualrl's ``train_micro_batch_size``); ``loss_type`` (``dapo``);
  ``scale_rewards`` (``group``); ``importance_sampling_level`` (``token``); ``env`` (dualrl's
  ``env`` section, ``{"name": "arithmetic"}``); ``use_chat_template`` (``auto``, dualrl's
  ``data.use_chat_template``); ``old_logprobs_pass`` (``True``, see below); ``foreach`` / ``fused``
  (AdamW's, ``None`` = torch's default); ``gradient_checkpointing`` (``False``);
  ``min_new_tokens`` (0: dualrl's ``policy.generation.min_new_tokens``); ``metadata`` (``None``: a
  list of JSON-able dicts, one per prompt, that the reward's environment gets besides the
  ``ground_truth``: a reasoning-gym row's task columns).

The GRPOConfig (:func:`grpo_config_kwargs`):

* one optimizer step per generation batch: ``per_device_train_batch_size = micro``,
  ``gradient_accumulation_steps = steps_per_generation = B / micro`` with ``B =
  prompts_per_step x group_size`` (so ``generation_batch_size = B``), ``num_iterations=1``,
  ``num_generations = group_size``, ``shuffle_dataset=False`` (the prompts are used in order,
  ``prompts_per_step`` per step, cycling: the dataset is the prompt list repeated until its
  length is a multiple of ``prompts_per_step``);
* sampling: ``use_vllm=False`` (HF ``generate``), ``max_completion_length = max_new_tokens``,
  ``temperature``, ``top_p``, ``top_k`` (0 = off), nothing else (no min_p, repetition penalty 1);
  ``min_new_tokens`` > 0 goes in ``generation_kwargs`` (TRL 1.16 passes them to HF's
  ``GenerationConfig``: its eos ids are masked until a completion has that many tokens, as
  dualrl's engines do), so ``min_new_tokens = max_new_tokens`` makes both sides generate
  exactly that many tokens per sample;
* loss: ``beta = kl_beta`` (k3 KL against a reference model), ``epsilon`` / ``epsilon_high`` =
  dualrl's ``ratio_clip_min`` / ``ratio_clip_max``, ``loss_type="dapo"`` = dualrl's
  ``token_level_loss: true`` (the sum over all completion tokens of the generation batch divided
  by their number, micro batches and all) or ``"grpo"`` = ``token_level_loss: false`` (per-sequence
  token mean, then the mean over sequences), ``scale_rewards="group"`` = ``grpo.normalize_rewards``
  (``"none"`` otherwise), ``importance_sampling_level="sequence"`` =
  ``loss_fn.sequence_level_importance_ratios`` (GSPO, both ``exp(mean log ratio)``);
* optimizer: ``torch.optim.AdamW(model.parameters(), lr, betas, eps, weight_decay[, foreach,
  fused])`` passed in with ``LambdaLR(1.0)`` (constant LR, no warm-up; TRL's own optimizer would
  exempt biases and norms from weight decay), ``max_grad_norm`` (0 = off), the same values in the
  config's ``learning_rate`` / ``adam_*`` / ``weight_decay``;
* ``use_cpu=True``, ``bf16 = precision == "bfloat16"`` (TRL's default is ``True``!), ``fp16=False``,
  ``gradient_checkpointing=False`` (TRL's default is ``True``), ``seed``, ``report_to=[]``, no
  logging / saving / eval, no tqdm, ``dataloader_num_workers=0``, ``log_completions=False``,
  ``max_steps`` large (the driver decides when to stop).

Reward: a TRL reward function that calls dualrl's environment (``core.environments.make_environment``
on the spec's ``env``, the built-in ``arithmetic`` exact-answer check by default) with
``metadata = {"ground_truth": answer}`` (plus the spec's ``metadata`` of the prompt), on the completion text TRL decodes
(``skip_special_tokens=True``, up to and including the first EOS: the text dualrl's
``decode_completions`` gives its environment), and checks its return with
``check_environment_return`` as dualrl's pool does.

Two patches on TRL (a subclass, private methods, as ``benchmarks.lib.trl_compare``'s DPO child):

* prompt tokens: TRL tokenizes string prompts with ``add_special_tokens=True``; dualrl's
  ``core.datasets.prompts.tokenize_prompt`` adds them only when no chat template was applied.
  The child applies dualrl's rule (``chat_template_used`` on the spec's ``use_chat_template``).
* ``old_logprobs_pass`` (default on; :func:`spec_from_dualrl` sets it as dualrl's step does:
  off when dualrl takes the old log-probs from its training forward, ``grpo.fuse_old_logprobs``
  with one optimizer step per step): stock TRL skips the old-policy log-prob pass when the
  samples are on-policy (one optimizer step per generation, ``num_iterations=1``: it uses
  ``per_token_logps.detach()`` as the old log-probs), while dualrl's unfused step runs
  ``policy.get_logprobs`` for ``prev_logprobs``.  With it on, the child runs the pass TRL runs
  in its off-policy case (``_get_per_token_logps_and_entropies`` of the policy, no grad, micro-batch
  chunks) and hands it to the loss as ``old_per_token_logps`` (equal to the detached values, so
  the update is the same).  It is timed on its own (``old_logprobs_s``):
  ``seconds - old_logprobs_s`` is stock TRL's step.

step() returns ``seconds`` (``on_step_begin`` -> ``on_step_end`` of a callback: generation,
rewards, advantages, reference and old log-prob passes, every micro batch's forward + backward,
clip, AdamW, scheduler, ``zero_grad`` and TRL's per-step metrics; the prompt fetch before
``on_step_begin`` and the waits for the driver excluded), ``loop_s`` (driver's go ->
``on_step_end``), ``generation_s`` (TRL's ``_generate_single_turn``: HF ``generate`` + EOS
masking), ``reference_s`` (the reference model's log-prob pass), ``old_logprobs_s``,
``rollout_s`` (all of ``_generate_and_score_completions``: generation, decoding, rewards,
advantages, the two log-prob passes), ``train_s`` (``seconds - rollout_s``), ``loss`` (summed over
the micro batches: the step's loss), ``grad_norm`` (pre-clip), ``reward_mean``, ``reward_std``,
``frac_reward_zero_std``, ``completion_length_mean``, ``kl``, ``entropy``, ``clip_ratio`` (TRL's
own metrics of the step; ``None`` where TRL computed none).

Differences from dualrl's step that remain (work first, then numerics):

* Generation engine: HF ``generate`` on the training model itself (one call for the whole
  batch, left-padded prompts, KV cache, global torch RNG seeded once with ``seed``, no per-token
  log-probs returned).  dualrl generates with ``policy.generation.backend`` (vLLM in
  ``grpo_arithmetic.yaml``; ``hf`` = HF generate on its workers in ``generation_batch_size``
  chunks), seeds every row (``sample_seeds``) and gets the sampled tokens' log-probs from the
  engine.  So the samples differ even from the same weights, and so do completion lengths.
* No refit: dualrl copies the weights into its generation engine at the start of every step
  (``timing/refit_s``); TRL generates with the weights it trains.
* Reference: TRL keeps a second full model in its process and runs it (no grad) inside the
  rollout phase; dualrl puts the reference weights into the policy workers for a separate
  ``get_reference_policy_logprobs`` call (swap in, forward, swap back; a Ray round trip).  With
  ``kl_beta == 0`` TRL loads no reference model and skips the pass; dualrl's step runs it anyway.
* Log-prob pass chunks: TRL's reference / old-policy passes use ``per_device_train_batch_size``
  rows per forward; dualrl's use ``policy.logprob_batch_size``.
* Micro batches: TRL shuffles the generation batch before splitting it into micro batches and
  pads each micro batch to its own longest completion; dualrl slices its padded batch in order.
* Training forward: TRL patches a fused LM head onto the model (log-probs computed from the
  last hidden states in chunks, never the full ``[B, S, V]`` logits) and computes each token's
  entropy in every training forward (``compute_entropy=True``, not switchable), plus a few
  ``.item()`` metric syncs per micro batch; dualrl's workers build the logits and take
  ``log_softmax``.  Negligible for a small vocabulary, favours TRL's memory with a large one.
* In-process environment: TRL calls the reward function in its own process; dualrl scores in
  ``env.num_workers`` Ray actors (``EnvironmentPool``) and moves every batch through Ray.
* bfloat16: TRL's ``bf16=True`` is CPU autocast (fp32 weights, fp32 AdamW state): accelerate
  wraps the model's ``forward`` in it, so generation, log-prob passes and the training forward all
  run under it (``ready["autocast_forward"]`` says whether the wrap happened); the reference
  model's forwards run under TRL's explicit ``accelerator.autocast()``.  dualrl's torch workers
  compute in bf16 under FSDP mixed precision (fp32 master weights) and generate with the
  engine's own precision (``vllm_cfg.precision`` for vLLM).
* Advantages: TRL ``(r - group mean) / (group std with Bessel's correction + 1e-4)``; dualrl
  divides by the population std only where it is > 0 and sets tied groups to exactly 0.  dualrl's
  ``grpo.use_leave_one_out_baseline`` has no TRL counterpart (the spec ignores it).
* KL: both k3, ``exp(ref - logp) - (ref - logp) - 1`` per token, times ``beta``, reduced like the
  policy loss; dualrl clamps its input to +-``kl_input_clamp_value`` and its output to
  +-``kl_output_clamp_value``, TRL does not.  Not mapped (TRL has no such option): dualrl's
  ``reference_policy_kl_type`` k1 / k2, ``use_on_policy_kl_approximation``,
  ``use_importance_sampling_correction`` / ``truncated_importance_sampling_*`` (dualrl's
  pi_old / pi_gen weights, 1 when off, the default), ``ratio_clip_c`` (dual clip; TRL's ``delta``
  is a different cap), ``disable_ppo_ratio``.
* Stops: TRL ends a completion at the tokenizer's / model's EOS ids only; dualrl's
  ``generation.stop_token_ids`` / ``stop_strings`` are not mapped.  Nor are dualrl's length limits
  (``max_total_sequence_length``, ``data.max_input_seq_length``): the prompts given are used as is.
* LR schedule: constant here; dualrl's config may warm up / decay (same work per step).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from benchmarks.lib.trl import TRLRunner, trl_version

__all__ = ["REQUIRED_KEYS", "TRLGRPORunner", "check_spec", "grpo_config_kwargs", "spec_from_dualrl", "trl_version"]

#: Spec keys the caller must give.
REQUIRED_KEYS = (
    "model_path",
    "tokenizer_path",
    "prompts",
    "answers",
    "prompts_per_step",
    "group_size",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "learning_rate",
    "betas",
    "eps",
    "weight_decay",
    "max_grad_norm",
    "kl_beta",
    "epsilon",
    "seed",
    "precision",
)
#: Optional spec keys and their defaults (``None`` for ``epsilon_high`` / ``micro_batch_size``:
#: ``epsilon`` / the whole batch).
OPTIONAL_DEFAULTS = {
    "epsilon_high": None,
    "micro_batch_size": None,
    "loss_type": "dapo",
    "scale_rewards": "group",
    "importance_sampling_level": "token",
    "env": {"name": "arithmetic"},
    "use_chat_template": "auto",
    "old_logprobs_pass": True,
    "foreach": None,
    "fused": None,
    "gradient_checkpointing": False,
    "min_new_tokens": 0,
    "metadata": None,
}
PRECISIONS = ("float32", "bfloat16")
#: TRL's metrics of one step reported by ``step()`` (our name: TRL's ``_metrics["train"]`` key).
METRICS = {
    "reward_mean": "reward",
    "reward_std": "reward_std",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "completion_length_mean": "completions/mean_length",
    "kl": "kl",
    "entropy": "entropy",
    "clip_ratio": "clip_ratio/region_mean",
}


# ----------------------------------------------------------------------------- spec


def spec_from_dualrl(
    cfg: dict,
    prompts: list[str],
    answers: list[str],
    model_path: str,
    tokenizer_path: str,
    metadata: list[dict] | None = None,
) -> dict:
    """The runner's spec from a resolved dualrl GRPO config (``core.config.load_config``'s dict):
    ``grpo`` (num_prompts_per_step, num_generations_per_prompt, seed, normalize_rewards),
    ``policy`` (generation sampling, optimizer kwargs, max_grad_norm, precision, micro batch),
    ``loss_fn`` (reference_policy_kl_penalty, ratio_clip_min / max, token_level_loss,
    sequence_level_importance_ratios), ``env`` and ``data.use_chat_template``.

    Raises ``ValueError`` when dualrl's step would be several optimizer steps
    (``policy.train_global_batch_size`` < prompts x generations): the baseline is one; or
    several generate calls (``grpo.use_dynamic_sampling``): the baseline makes one."""
    g, policy, loss = cfg["grpo"], cfg["policy"], cfg.get("loss_fn") or {}
    if g.get("use_dynamic_sampling"):
        raise ValueError(
            "grpo.use_dynamic_sampling: dualrl's step would make up to "
            f"{g.get('dynamic_sampling_max_gen_batches')} generate calls, the TRL baseline (no dynamic "
            "sampling) makes one per step; turn it off to compare the same work"
        )
    gen, opt = policy["generation"], (policy.get("optimizer") or {}).get("kwargs") or {}
    batch = g["num_prompts_per_step"] * g["num_generations_per_prompt"]
    gbs = policy.get("train_global_batch_size", batch)
    if gbs != batch:
        raise ValueError(
            f"policy.train_global_batch_size ({gbs}) != grpo.num_prompts_per_step x "
            f"num_generations_per_prompt ({batch}): dualrl's step would take {batch // gbs} optimizer "
            "steps, the TRL baseline times one optimizer step per generation batch"
        )
    micro = policy.get("train_micro_batch_size") or batch
    micro = micro if micro < batch and batch % micro == 0 else batch
    top_k = gen.get("top_k")
    spec = {
        "model_path": model_path,
        "tokenizer_path": tokenizer_path,
        "prompts": list(prompts),
        "answers": [str(a) for a in answers],
        "prompts_per_step": g["num_prompts_per_step"],
        "group_size": g["num_generations_per_prompt"],
        "max_new_tokens": gen["max_new_tokens"],
        "temperature": gen.get("temperature", 1.0),
        "top_p": gen.get("top_p", 1.0),
        "top_k": None if top_k is None or top_k < 0 else top_k,
        "learning_rate": opt["lr"],
        "betas": list(opt.get("betas", (0.9, 0.999))),
        "eps": opt.get("eps", 1e-8),
        "weight_decay": opt.get("weight_decay", 0.0),
        "max_grad_norm": policy.get("max_grad_norm"),
        "kl_beta": loss.get("reference_policy_kl_penalty", 0.0),
        "epsilon": loss.get("ratio_clip_min", 0.2),
        "epsilon_high": loss.get("ratio_clip_max", loss.get("ratio_clip_min", 0.2)),
        "seed": g.get("seed", 42),
        "precision": policy.get("precision", "float32"),
        "micro_batch_size": micro,
        "loss_type": "dapo" if loss.get("token_level_loss", True) else "grpo",
        "scale_rewards": "group" if g.get("normalize_rewards", True) else "none",
        "importance_sampling_level": "sequence" if loss.get("sequence_level_importance_ratios") else "token",
        "env": dict(cfg.get("env") or {"name": "arithmetic"}),
        "use_chat_template": (cfg.get("data") or {}).get("use_chat_template", "auto"),
        # dualrl's step runs a separate old-logprob pass only when it cannot fuse it into the
        # training forward (core.algorithms.old_logprobs.old_logprobs_source; one step per batch here)
        "old_logprobs_pass": not g.get("fuse_old_logprobs", True),
        "min_new_tokens": int(gen.get("min_new_tokens") or 0),
        "foreach": opt.get("foreach"),
        "fused": opt.get("fused"),
        "gradient_checkpointing": bool(policy.get("activation_checkpointing")),
        # the prompts' own columns (ground truth aside), JSON-able: the child gets the spec as JSON
        "metadata": None if metadata is None else [json.loads(json.dumps(m, default=str)) for m in metadata],
    }
    return check_spec(spec)


def check_spec(spec: dict) -> dict:
    """``spec`` with the optional keys filled in; ``ValueError`` naming what is missing or wrong."""
    missing = [k for k in REQUIRED_KEYS if k not in spec]
    if missing:
        raise ValueError(f"TRL GRPO spec: missing keys {missing}")
    unknown = sorted(set(spec) - set(REQUIRED_KEYS) - set(OPTIONAL_DEFAULTS))
    if unknown:
        raise ValueError(f"TRL GRPO spec: unknown keys {unknown}")
    out = {**OPTIONAL_DEFAULTS, **spec}
    if out["epsilon_high"] is None:
        out["epsilon_high"] = out["epsilon"]
    prompts, answers, metadata = out["prompts"], out["answers"], out["metadata"]
    if not prompts or len(prompts) != len(answers):
        raise ValueError(f"TRL GRPO spec: {len(prompts)} prompts and {len(answers)} answers (need as many, >= 1)")
    if metadata is not None and (len(metadata) != len(prompts) or not all(isinstance(m, dict) for m in metadata)):
        raise ValueError(f"TRL GRPO spec: metadata must be one dict per prompt ({len(prompts)}), got {len(metadata)}")
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError("TRL GRPO spec: prompts must be formatted prompt strings")
    for key in ("prompts_per_step", "max_new_tokens"):
        if not isinstance(out[key], int) or out[key] < 1:
            raise ValueError(f"TRL GRPO spec: {key} must be a positive int, got {out[key]!r}")
    if not isinstance(out["min_new_tokens"], int) or not 0 <= out["min_new_tokens"] <= out["max_new_tokens"]:
        raise ValueError(
            f"TRL GRPO spec: min_new_tokens must be an int in [0, max_new_tokens={out['max_new_tokens']}], "
            f"got {out['min_new_tokens']!r}"
        )
    if not isinstance(out["group_size"], int) or out["group_size"] < 2:
        raise ValueError(
            f"TRL GRPO spec: group_size must be an int >= 2 (TRL needs 2 samples per group), got {out['group_size']!r}"
        )
    if out["precision"] not in PRECISIONS:
        raise ValueError(f"TRL GRPO spec: precision {out['precision']!r} is not one of {PRECISIONS}")
    batch = out["prompts_per_step"] * out["group_size"]
    if out["micro_batch_size"] is None:
        out["micro_batch_size"] = batch
    if not isinstance(out["micro_batch_size"], int) or out["micro_batch_size"] < 1 or batch % out["micro_batch_size"]:
        raise ValueError(
            f"TRL GRPO spec: micro_batch_size {out['micro_batch_size']!r} must divide the {batch} completions of a step"
        )
    if out["loss_type"] not in ("dapo", "grpo"):
        raise ValueError(f"TRL GRPO spec: loss_type {out['loss_type']!r}: dapo (token-level) or grpo (sequence)")
    if out["scale_rewards"] not in ("group", "none"):
        raise ValueError(f"TRL GRPO spec: scale_rewards {out['scale_rewards']!r}: group or none")
    if out["importance_sampling_level"] not in ("token", "sequence"):
        raise ValueError(f"TRL GRPO spec: importance_sampling_level {out['importance_sampling_level']!r}")
    if len(out["betas"]) != 2:
        raise ValueError(f"TRL GRPO spec: betas must be two numbers, got {out['betas']!r}")
    return out


def grpo_config_kwargs(spec: dict, output_dir: str) -> dict:
    """The ``trl.GRPOConfig`` keyword arguments of a (checked) spec; no trl needed to build them."""
    spec = check_spec(spec)
    batch = spec["prompts_per_step"] * spec["group_size"]
    micro = spec["micro_batch_size"]
    top_k = spec["top_k"]
    return dict(
        output_dir=output_dir,
        # one optimizer step per generation batch of prompts_per_step x group_size completions
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        steps_per_generation=batch // micro,  # => generation_batch_size = micro x steps = batch
        num_iterations=1,
        num_generations=spec["group_size"],
        shuffle_dataset=False,
        max_steps=10**9,
        # sampling with HF generate
        use_vllm=False,
        max_completion_length=spec["max_new_tokens"],
        temperature=float(spec["temperature"]),
        top_p=float(spec["top_p"]),
        top_k=0 if top_k is None or top_k < 0 else int(top_k),
        # HF GenerationConfig fields on top of TRL's own (eos masked until this many tokens)
        generation_kwargs={"min_new_tokens": spec["min_new_tokens"]} if spec["min_new_tokens"] else None,
        # loss
        beta=float(spec["kl_beta"]),
        epsilon=float(spec["epsilon"]),
        epsilon_high=float(spec["epsilon_high"]),
        loss_type=spec["loss_type"],
        scale_rewards=spec["scale_rewards"],
        importance_sampling_level=spec["importance_sampling_level"],
        mask_truncated_completions=False,
        # optimizer (the AdamW itself is passed to the trainer) and clipping
        learning_rate=float(spec["learning_rate"]),
        weight_decay=float(spec["weight_decay"]),
        adam_beta1=float(spec["betas"][0]),
        adam_beta2=float(spec["betas"][1]),
        adam_epsilon=float(spec["eps"]),
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=0.0 if spec["max_grad_norm"] is None else float(spec["max_grad_norm"]),
        # machine, precision, seed
        use_cpu=True,
        bf16=spec["precision"] == "bfloat16",
        fp16=False,
        gradient_checkpointing=bool(spec["gradient_checkpointing"]),
        seed=int(spec["seed"]),
        # no logging, saving, evaluation
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
    )


def cycled_rows(
    prompts: list[str], answers: list[str], per_step: int, metadata: list[dict] | None = None
) -> list[dict]:
    """``{"prompt", "answer"}`` rows (with ``metadata``: and ``"metadata"``, each dict as JSON
    text, one column type whatever the keys): the lists repeated until their length is a
    multiple of ``per_step``, so that TRL's sampler (which drops an epoch's incomplete last
    batch) walks the prompts in order, ``per_step`` per step, cycling."""
    repeats = per_step // math.gcd(len(prompts), per_step)
    extra = [{"metadata": json.dumps(m)} for m in metadata] if metadata is not None else [{}] * len(prompts)
    rows = [{"prompt": p, "answer": a, **e} for p, a, e in zip(prompts, answers, extra, strict=True)]
    return [dict(row) for _ in range(repeats) for row in rows]


class TRLGRPORunner(TRLRunner):
    """``GRPOTrainer`` in a child process ; ``step()`` = one optimizer step
    (its answer: see the module docstring); ``ready``: the child's versions and resolved GRPOConfig
    (:func:`benchmarks.lib.trl_grpo_child.serve_trl_grpo`)."""

    def __init__(self, spec: dict, root: Path, threads: int) -> None:
        spec = check_spec(spec)
        # the trainer's output_dir: one per runner (several may share ``root``)
        output_dir = tempfile.mkdtemp(prefix="trl-grpo-", suffix=".out", dir=root)
        child_spec = {**spec, "threads": int(threads), "output_dir": output_dir}
        super().__init__("benchmarks.lib.trl_grpo_child:serve_trl_grpo", child_spec, threads)
