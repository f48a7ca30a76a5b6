"""The generation arguments every backend's ``generate`` derives the same way from config."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple


class GenerationArgs(NamedTuple):
    gen_cfg: Mapping[str, Any]
    pad_token_id: int
    eos_token_ids: list[int]
    max_new_tokens: int


def resolve_generation_args(policy_cfg: Mapping[str, Any], tokenizer: Any, model_eos: Any,
                            prompt_width: int) -> GenerationArgs:
    """Stop ids (the tokenizer's eos, else the model config's), the pad id
    (``generation.pad_token_id``, else the tokenizer's, else the first eos, else 0) and the
    number of new tokens (``generation.max_new_tokens``, cut so prompt + generation fits
    ``max_total_sequence_length``)."""
    gen_cfg = policy_cfg.get("generation")
    if not gen_cfg:
        raise ValueError("generate() needs policy.generation in the config")
    eos = tokenizer.eos_token_id if tokenizer is not None else model_eos
    eos_ids = [e for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]
    pad = gen_cfg.get("pad_token_id", getattr(tokenizer, "pad_token_id", None))
    pad = pad if pad is not None else (eos_ids[0] if eos_ids else 0)
    limit = policy_cfg["max_total_sequence_length"]
    max_new = min(gen_cfg["max_new_tokens"], limit - prompt_width)
    if max_new <= 0:
        raise ValueError(
            f"prompts of width {prompt_width} leave no room for new tokens within "
            f"policy.max_total_sequence_length={limit}"
        )
    return GenerationArgs(gen_cfg, pad, eos_ids, max_new)
