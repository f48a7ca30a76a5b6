"""From our generation config to vLLM requests, and from vLLM outputs to ``GenerationOutputSpec``.

Pure functions (vLLM's ``SamplingParams`` is imported only where it is built) so that the
rules -- what greedy means, which tokens stop a row, where logprobs go -- are shared with
the other engines and unit-tested without an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from core.policy.generation_args import row_stop_strings, stop_string_ends_row, stop_window, top_k_or_off
from core.policy.generation_config import GenerationConfig
from core.reporting import get_logger, warn_once

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = get_logger(__name__)


def logprobs_mode(gen_cfg: GenerationConfig) -> str:
    """vLLM reports logprobs of the raw logits unless told otherwise; ``get_logprobs``
    divides the logits by ``temperature``.  At temperature 1 the raw values are exact; at
    any other temperature the sampler's processed logprobs (after temperature) are."""
    return "raw_logprobs" if gen_cfg.temperature == 1.0 else "processed_logprobs"


def stop_token_ids(gen_cfg: GenerationConfig, eos_token_ids: Sequence[int]) -> list[int]:
    ids = [int(t) for t in (gen_cfg.stop_token_ids or [])] + [int(t) for t in eos_token_ids]
    return list(dict.fromkeys(ids))


def sampling_kwargs(
    gen_cfg: GenerationConfig,
    *,
    greedy: bool,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    seed: int | None = None,
    min_new_tokens: int = 0,
) -> dict[str, Any]:
    """Arguments of ``vllm.SamplingParams`` for one request.  ``min_new_tokens`` (already cut to
    ``max_new_tokens``) is vLLM's ``min_tokens``: the eos and stop token ids are masked until a
    row has that many tokens.  vLLM's raw logprobs (temperature 1) are taken before that mask,
    its processed ones (any other temperature) after it."""
    temperature = gen_cfg.temperature
    if temperature <= 0:
        raise ValueError(f"generation.temperature must be > 0 (ask for argmax with greedy=True), got {temperature}")
    if not 0 <= min_new_tokens <= max_new_tokens:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens={max_new_tokens}], got {min_new_tokens}")
    if greedy and temperature != 1.0:
        warn_once(
            logger,
            f"greedy vLLM generation reports logprobs at temperature 1.0, not generation.temperature="
            f"{temperature}: vLLM's greedy path skips temperature; token_mult_prob_error against "
            "get_logprobs is only meaningful for sampled rollouts here",
        )
    # vLLM spells "no top-k" -1; the shared rule also refuses 0 and values below -1.
    top_k = -1 if greedy else (top_k_or_off(gen_cfg.top_k) or -1)
    kwargs = dict(
        n=1,
        temperature=0.0 if greedy else temperature,
        top_p=1.0 if greedy else gen_cfg.top_p,
        top_k=top_k,
        max_tokens=int(max_new_tokens),
        min_tokens=int(min_new_tokens),
        logprobs=0,  # the sampled token's own logprob
        stop_token_ids=stop_token_ids(gen_cfg, eos_token_ids),
        detokenize=False,
        skip_special_tokens=False,
    )
    if seed is not None and not greedy:
        kwargs["seed"] = int(seed)
    return kwargs


def first_stop_string_hit(
    tokenizer: PreTrainedTokenizerBase | None,
    tokens: Sequence[int],
    strings: Sequence[str],
    min_new_tokens: int = 0,
) -> int | None:
    """Number of generated tokens up to and including the one that completes a stop string
    in the decoded generated text (the HF and JAX engines' rule, ``stop_string_ends_row``:
    none before ``min_new_tokens``), or None."""
    if not strings:
        return None
    if tokenizer is None:
        raise ValueError("stop strings are configured but there is no tokenizer to decode the generated tokens")
    window = stop_window([strings])
    for count in range(min_new_tokens + 1, len(tokens) + 1):
        if stop_string_ends_row(tokenizer, tokens[max(0, count - window) : count], strings, count, min_new_tokens):
            return count
    return None


def assemble_output(
    input_ids: np.ndarray,
    input_lengths: np.ndarray,
    rows_tokens: Sequence[Sequence[int]],
    rows_logprobs: Sequence[Sequence[float]],
    max_new_tokens: int,
    pad_token_id: int,
) -> dict[str, np.ndarray]:
    """``GenerationOutputSpec`` arrays from ragged per-row generations (vLLM's form, which
    already ends each row at its own budget); tokens beyond ``max_new_tokens`` are dropped.
    See ``assemble_padded``."""
    batch = len(rows_tokens)
    lengths = np.array([min(len(r), max_new_tokens) for r in rows_tokens], np.int64)
    tokens = np.zeros((batch, max_new_tokens), np.int64)
    logprobs = np.zeros((batch, max_new_tokens), np.float32)
    for b in range(batch):
        tokens[b, : lengths[b]] = list(rows_tokens[b])[: lengths[b]]
        logprobs[b, : lengths[b]] = list(rows_logprobs[b])[: lengths[b]]
    return assemble_padded(input_ids, input_lengths, tokens, logprobs, lengths, max_new_tokens, pad_token_id)


def assemble_padded(
    input_ids: np.ndarray,
    input_lengths: np.ndarray,
    tokens: np.ndarray,
    token_logprobs: np.ndarray,
    gen_lengths: np.ndarray,
    max_new_tokens: int,
    pad_token_id: int,
    row_budgets: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The one ``GenerationOutputSpec`` layout every engine (HF, JAX, vLLM) returns.

    ``row_budgets`` ([B], ``GenerationArgs.row_budgets``) cuts each row at its own budget:
    HF and JAX decode the whole batch for the largest one, and a row's tokens up to its budget
    do not depend on whether the others go on.

    ``tokens`` / ``token_logprobs`` [B, T] with T <= ``max_new_tokens``; row b's first
    ``gen_lengths[b]`` go right after its own prompt.  ``output_ids`` [B, S + N]: prompt,
    generated tokens, then ``pad_token_id``; ``logprobs`` [B, S + N]: 0 on prompt and
    padding, each sampled token's logprob at the token's own position (the ``get_logprobs``
    layout); ``generation_lengths`` and ``unpadded_sequence_lengths`` [B] int64.
    """
    input_ids, input_lengths = np.asarray(input_ids), np.asarray(input_lengths).astype(np.int64)
    gen_lengths = np.asarray(gen_lengths).astype(np.int64)
    if row_budgets is not None:
        gen_lengths = np.minimum(gen_lengths, np.asarray(row_budgets, np.int64))
    batch, seq = input_ids.shape
    width = seq + max_new_tokens
    cols = np.arange(width)[None, :]
    output_ids = np.full((batch, width), pad_token_id, np.int64)
    output_ids[:, :seq] = np.where(cols[:, :seq] < input_lengths[:, None], input_ids, pad_token_id)
    logprobs = np.zeros((batch, width), np.float32)
    step = np.arange(tokens.shape[1])[None, :]
    keep = step < gen_lengths[:, None]  # [B, T]: generated before (or at) the stop
    rows = np.broadcast_to(np.arange(batch)[:, None], keep.shape)[keep]
    dest = (input_lengths[:, None] + step)[keep]
    output_ids[rows, dest] = np.asarray(tokens)[keep]
    logprobs[rows, dest] = np.asarray(token_logprobs)[keep]
    return dict(
        output_ids=output_ids,
        logprobs=logprobs,
        generation_lengths=gen_lengths,
        unpadded_sequence_lengths=input_lengths + gen_lengths,
    )


def rows_stop_strings(gen_cfg: GenerationConfig, data_stop_strings: Any, batch: int) -> list[tuple[str, ...]]:
    return row_stop_strings(gen_cfg, data_stop_strings, batch)
