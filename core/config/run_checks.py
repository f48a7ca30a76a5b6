"""Semantic checks of a run's product sections: ``grpo``, ``data``, ``env``, ``logger``,
``checkpointing``, and the rules that tie them to ``policy``.

The type walk (unknown keys, wrong types) is :func:`core.config.validate.validate_typed`;
these add what a type cannot say (positivity, divisibility, a group needs two samples).
Every message starts with the dotted path of the field at fault, like the rest of the
validator, so ``dualrl config`` and ``dualrl grpo`` reject a bad run before any worker starts.
"""

from __future__ import annotations

from typing import Any, Mapping

from core.config.schema import CheckpointingConfig, DataConfig, EnvConfig, GRPOConfig, LoggerConfig
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
        c.err(c.p("num_generations_per_prompt"),
              f"must be >= 2, got {n}: GRPO's baseline is the mean reward of a prompt's group, so a group "
              "of one sample has advantage 0 everywhere and nothing is learned")


def _data_semantics(c: _Checker, cfg: Mapping[str, Any]) -> None:
    _at_least(c, cfg, "max_input_seq_length", 1)
    template = cfg.get("prompt_template")
    if isinstance(template, str) and "{prompt}" not in template:
        c.err(c.p("prompt_template"), f"must contain '{{prompt}}', got {template!r}")


def _env_semantics(c: _Checker, cfg: Mapping[str, Any]) -> None:
    _at_least(c, cfg, "num_workers", 1)
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
                f"is not divisible by policy.train_global_batch_size ({gbs}); each step trains on whole global batches")
    if isinstance(data, Mapping):
        limit, total = data.get("max_input_seq_length"), policy.get("max_total_sequence_length")
        if isinstance(limit, int) and isinstance(total, int) and limit >= total:
            errors.append(
                f"data.max_input_seq_length: {limit} leaves no room for a response within "
                f"policy.max_total_sequence_length ({total})")
    return errors
