"""Semantic checks of a run's product sections: ``grpo``, ``sft``, ``dpo``, ``data``, ``env``,
``logger``, ``checkpointing``, the rules that tie them to ``policy``, and what each
algorithm accepts (``algorithm_errors``: a section or data key another algorithm uses is
refused, not silently ignored).

The type walk (unknown keys, wrong types) is :func:`core.config.validate.validate_typed`;
these add what a type cannot say (positivity, divisibility, a group needs two samples).
Every message starts with the dotted path of the field at fault, like the rest of the
validator, so ``dualrl config`` and ``dualrl grpo`` reject a bad run before any worker starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.config.schema import (
    CheckpointingConfig,
    DataConfig,
    DPOConfig,
    EnvConfig,
    GRPOConfig,
    LoggerConfig,
    SFTConfig,
)
from core.config.validate import _Checker, validate_typed


def _section_errors(cfg: Any, schema: Any, path: str, semantics) -> list[str]:
    errors = validate_typed(cfg, schema, path)
    if isinstance(cfg, Mapping):
        c = _Checker(cfg, path)
        semantics(c, cfg)
        errors.extend(c.errors)
    return errors


def _at_least(c: _Checker, cfg: Mapping[str, Any], key: str, low: int) -> None:
    v = c.int_of(cfg, key)
    if v is not None and v < low:
        c.err(c.p(key), f"must be >= {low}, got {v}")


def _grpo_semantics(c: _Checker, cfg: Mapping[str, Any]) -> None:
    for key in ("num_prompts_per_step", "max_num_steps", "max_val_samples", "val_batch_size", "max_num_epochs"):
        _at_least(c, cfg, key, 1)
    _at_least(c, cfg, "val_period", 0)
    n = c.int_of(cfg, "num_generations_per_prompt")
    if n is not None and n < 2:
        c.err(
            c.p("num_generations_per_prompt"),
            f"must be >= 2, got {n}: GRPO's baseline is the mean reward of a prompt's group, so a group "
            "of one sample has advantage 0 everywhere and nothing is learned",
        )


def _sft_semantics(c: _Checker, cfg: Mapping[str, Any]) -> None:
    for key in ("max_num_steps", "max_num_epochs", "val_global_batch_size", "val_micro_batch_size"):
        _at_least(c, cfg, key, 1)
    for key in ("val_period", "val_batches"):
        _at_least(c, cfg, key, 0)
    gbs, mbs = c.int_of(cfg, "val_global_batch_size"), c.int_of(cfg, "val_micro_batch_size")
    if gbs and mbs and gbs % mbs:
        c.err(c.p("val_global_batch_size"), f"{gbs} is not divisible by val_micro_batch_size ({mbs})")


def _dpo_semantics(c: _Checker, cfg: Mapping[str, Any]) -> None:
    _sft_semantics(c, cfg)
    c.positive(cfg, "reference_policy_kl_penalty")
    for key in ("preference_loss_weight", "sft_loss_weight"):
        c.non_negative(cfg, key)
    for key in ("val_global_batch_size", "val_micro_batch_size"):
        v = c.int_of(cfg, key)
        if v is not None and v % 2:
            c.err(c.p(key), f"must be even, got {v}: DPO rows come in (chosen, rejected) pairs")


def _data_semantics(c: _Checker, cfg: Mapping[str, Any]) -> None:
    _at_least(c, cfg, "max_input_seq_length", 1)
    template = cfg.get("prompt_template")
    if isinstance(template, str) and "{prompt}" not in template:
        c.err(c.p("prompt_template"), f"must contain '{{prompt}}', got {template!r}")


#: core.environments.registry.BUILTIN_ENVIRONMENTS (named here: the config layer imports no environment).
BUILTIN_ENVIRONMENT_NAMES = ("arithmetic", "math")


def _env_semantics(c: _Checker, cfg: Mapping[str, Any]) -> None:
    _at_least(c, cfg, "num_workers", 1)
    name = cfg.get("name")
    # A user's class gets the whole section and may read anything; a built-in reads its own keys.
    if name in BUILTIN_ENVIRONMENT_NAMES and cfg.get("kwargs"):
        c.err(
            c.p("kwargs"),
            f"{cfg['kwargs']!r}: not read by the built-in environment {name!r} (it is for a "
            "user's own class, env.name: package.module:ClassName); remove it",
        )
    if name == "arithmetic" and cfg.get("math") is not None:
        c.err(
            c.p("math"),
            f"{cfg['math']!r}: not read by env.name 'arithmetic' (these are the math verifier's settings); remove it",
        )
    c.positive(cfg, "timeout_s")
    arith = c.sub("arithmetic")
    lo, hi = c.int_of(arith, "min_value"), c.int_of(arith, "max_value")
    if lo is not None and hi is not None and lo > hi:
        c.err(c.p("arithmetic", "min_value"), f"{lo} is greater than max_value ({hi})")
    _at_least(c, arith, "num_operands", 2) if arith else None


def _logger_semantics(c: _Checker, cfg: Mapping[str, Any]) -> None:
    _at_least(c, cfg, "num_val_samples_to_print", 0)


def _checkpointing_semantics(c: _Checker, cfg: Mapping[str, Any]) -> None:
    _at_least(c, cfg, "save_period", 1)
    _at_least(c, cfg, "keep_top_k", 1)


SECTION_CHECKS = {
    GRPOConfig: _grpo_semantics,
    SFTConfig: _sft_semantics,
    DPOConfig: _dpo_semantics,
    DataConfig: _data_semantics,
    EnvConfig: _env_semantics,
    LoggerConfig: _logger_semantics,
    CheckpointingConfig: _checkpointing_semantics,
}


def section_handlers() -> dict[Any, Any]:
    """``validate_typed`` handlers for the product sections (type walk + semantics)."""
    return {schema: (lambda v, p, s=schema, f=fn: _section_errors(v, s, p, f)) for schema, fn in SECTION_CHECKS.items()}


def cross_section_errors(cfg: Mapping[str, Any]) -> list[str]:
    """Rules between sections, checked once each section is well-typed."""
    errors: list[str] = []
    policy, grpo, data = cfg.get("policy"), cfg.get("grpo"), cfg.get("data")
    if not isinstance(policy, Mapping):
        return errors
    if isinstance(grpo, Mapping):
        n_p, n_g = grpo.get("num_prompts_per_step"), grpo.get("num_generations_per_prompt")
        gbs = policy.get("train_global_batch_size")
        if all(isinstance(v, int) and v > 0 for v in (n_p, n_g, gbs)) and (n_p * n_g) % gbs:
            errors.append(
                f"grpo.num_prompts_per_step: {n_p} prompts x {n_g} generations = {n_p * n_g} samples per step "
                f"is not divisible by policy.train_global_batch_size ({gbs}); each step trains on whole global batches"
            )
    if isinstance(data, Mapping):
        limit, total = data.get("max_input_seq_length"), policy.get("max_total_sequence_length")
        if isinstance(limit, int) and isinstance(total, int) and limit >= total:
            errors.append(
                f"data.max_input_seq_length: {limit} leaves no room for a response within "
                f"policy.max_total_sequence_length ({total})"
            )
    return errors


# The sections and data keys each algorithm reads; anything else is refused by name.
ALGORITHM_SECTIONS = {
    "grpo": ("policy", "cluster", "grpo", "loss_fn", "data", "env", "logger", "checkpointing"),
    "sft": ("policy", "cluster", "sft", "data", "logger", "checkpointing"),
    "dpo": ("policy", "cluster", "dpo", "data", "logger", "checkpointing"),
}
_COMMON_DATA_KEYS = (
    "dataset_name",
    "dataset_config",
    "split",
    "val_dataset_name",
    "val_split",
    "prompt_template",
    "system_prompt",
    "use_chat_template",
    "shuffle",
)
ALGORITHM_DATA_KEYS = {
    "grpo": _COMMON_DATA_KEYS + ("prompt_key", "answer_key", "max_input_seq_length", "on_long_prompt"),
    "sft": _COMMON_DATA_KEYS + ("prompt_key", "response_key", "messages_key", "on_long_sequence", "arithmetic"),
    "dpo": _COMMON_DATA_KEYS + ("prompt_key", "chosen_key", "rejected_key", "on_long_sequence", "arithmetic"),
}


def algorithm_errors(cfg: Mapping[str, Any], algorithm: str) -> list[str]:
    """What ``dualrl <algorithm>`` cannot run with: missing sections, and sections or data
    keys it would not read (a GRPO key in an SFT run is a mistake, not a no-op)."""
    sections = ALGORITHM_SECTIONS[algorithm]
    errors = [
        f"{s}: missing section (dualrl {algorithm} needs {', '.join(sections)})" for s in sections if s not in cfg
    ]
    errors += [
        f"{s}: not used by dualrl {algorithm}; remove the section (it reads {', '.join(sections)})"
        for s in cfg
        if s not in sections
    ]
    data = cfg.get("data")
    if isinstance(data, Mapping):
        allowed = ALGORITHM_DATA_KEYS[algorithm]
        for key in data:
            if key not in allowed:
                users = [a for a, keys in ALGORITHM_DATA_KEYS.items() if key in keys]
                errors.append(f"data.{key}: not used by dualrl {algorithm} (a key of {'/'.join(users)}); remove it")
        if data.get("arithmetic") is not None and not _uses_builtin_task(cfg):
            errors.append(
                "data.arithmetic: not used: data.dataset_name is not a built-in task and "
                "policy.model_name is not a warm-started built-in model; set it to null"
            )
        if algorithm == "grpo" and "max_input_seq_length" not in data:
            errors.append("data.max_input_seq_length: missing (dualrl grpo needs the longest prompt in tokens)")
    logger = cfg.get("logger")
    if algorithm != "grpo" and isinstance(logger, Mapping) and "num_val_samples_to_print" in logger:
        errors.append(
            f"logger.num_val_samples_to_print: not used by dualrl {algorithm} (it prints GRPO's "
            "validation completions); remove it"
        )
    errors += _algorithm_policy_errors(cfg, algorithm)
    return errors


def _uses_builtin_task(cfg: Mapping[str, Any]) -> bool:
    """Whether the built-in task's knobs matter: built-in data, or a built-in model (whose warm
    start trains on the task)."""
    from core.datasets.sources import is_builtin as builtin_data
    from core.models.builtin import is_warm_started

    data, policy = (cfg.get(k) if isinstance(cfg.get(k), Mapping) else {} for k in ("data", "policy"))
    names = (data.get("dataset_name"), data.get("val_dataset_name"))
    return any(isinstance(n, str) and builtin_data(n) for n in names) or is_warm_started(policy.get("model_name"))


def _algorithm_policy_errors(cfg: Mapping[str, Any], algorithm: str) -> list[str]:
    policy = cfg.get("policy")
    if not isinstance(policy, Mapping):
        return []
    errors = _generation_section_errors(policy, algorithm)
    if algorithm != "dpo":
        return errors
    for key in ("train_global_batch_size", "train_micro_batch_size"):
        value = policy.get(key)
        if isinstance(value, int) and value % 2:
            errors.append(
                f"policy.{key}: must be even for DPO, got {value}: every batch holds whole (chosen, rejected) pairs"
            )
    for key in ("dynamic_batching", "sequence_packing"):
        section = policy.get(key)
        if isinstance(section, Mapping) and section.get("enabled"):
            errors.append(
                f"policy.{key}.enabled: not supported by DPO, which needs (chosen, rejected) rows "
                "adjacent in every micro batch; set it to false"
            )
    return errors


def _generation_section_errors(policy: Mapping[str, Any], algorithm: str) -> list[str]:
    """GRPO samples from ``policy.generation``; SFT and DPO never generate, and the section's
    ``temperature`` would still divide the logits their losses train on (the workers apply
    generation's temperature to every logprob, so that GRPO's training matches its sampling)."""
    gen = policy.get("generation")
    if algorithm == "grpo" and gen is None:
        return [
            "policy.generation: missing; dualrl grpo samples its rollouts with these settings "
            "(see core/configs/policy.yaml)"
        ]
    if algorithm != "grpo" and gen is not None:
        return [
            f"policy.generation: not used by dualrl {algorithm}, which never generates (and its "
            "temperature would scale the logits the loss trains on); set policy.generation: null"
        ]
    return []
