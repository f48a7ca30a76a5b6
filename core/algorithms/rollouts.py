"""From prompts to a GRPO training batch: the tensors between generation and ``Policy.train``.

Layout (the ``get_logprobs`` convention of ``core.interfaces``): a rollout row is the
prompt's tokens followed directly by the generated tokens, right-padded.  ``token_mask``
is 1 exactly on the generated tokens (the stop token included: the policy must learn to
stop), so the loss never trains on the prompt or the padding.  Multi-turn rows
(core.algorithms.multi_turn) interleave turns and observations and bring their own mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from core.data import BatchedDataDict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def prompt_batch(input_ids: Sequence[Sequence[int]], repeats: int, pad_token_id: int) -> BatchedDataDict:
    """Right-padded ``input_ids`` / ``input_lengths`` with every prompt repeated ``repeats``
    times in a row (rows ``g * repeats ... (g + 1) * repeats - 1`` form prompt g's group)."""
    if not input_ids:
        raise ValueError("prompt_batch: no prompts")
    width = max(len(ids) for ids in input_ids)
    ids = torch.full((len(input_ids), width), pad_token_id, dtype=torch.long)
    for i, row in enumerate(input_ids):
        ids[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
    lengths = torch.tensor([len(row) for row in input_ids], dtype=torch.long)
    return BatchedDataDict(
        input_ids=ids.repeat_interleave(repeats, 0), input_lengths=lengths.repeat_interleave(repeats, 0)
    )


def sample_seeds(seed: int, step: int, count: int, stream: int = 0) -> torch.Tensor:
    """Per-row sampling seeds, a pure function of (run seed, step, stream): a resumed run and
    every backend draw the same rollouts for the same step (``stream`` separates uses)."""
    state = np.random.SeedSequence([int(seed), int(step), int(stream)]).generate_state(count, dtype=np.uint32)
    return torch.from_numpy(state.astype(np.int64))


def generated_tokens(out: BatchedDataDict, prompt_lengths: torch.Tensor) -> list[list[int]]:
    """Each row's generated token ids (stop token included)."""
    rows = []
    for b, start in enumerate(prompt_lengths.tolist()):
        n = int(out["generation_lengths"][b])
        rows.append(out["output_ids"][b, start : start + n].tolist())
    return rows


def decode_completions(
    tokenizer: PreTrainedTokenizerBase, out: BatchedDataDict, prompt_lengths: torch.Tensor
) -> list[str]:
    """The generated text of each row, special tokens (the stop token) removed."""
    return tokenizer.batch_decode(generated_tokens(out, prompt_lengths), skip_special_tokens=True)


def generation_mask(out: BatchedDataDict, prompt_lengths: torch.Tensor) -> torch.Tensor:
    """[B, S'] float: 1 on the generated positions of each row; multi-turn rows
    (core.algorithms.multi_turn) carry their own ``token_mask`` (observations between the
    turns are not generated), which is returned as is."""
    if "token_mask" in out:
        return out["token_mask"].float()
    cols = torch.arange(out["output_ids"].shape[1])[None]
    return ((cols >= prompt_lengths[:, None]) & (cols < out["unpadded_sequence_lengths"][:, None])).float()


def training_batch(
    out: BatchedDataDict,
    prompt_lengths: torch.Tensor,
    advantages: torch.Tensor,
    sample_mask: torch.Tensor | None = None,
) -> BatchedDataDict:
    """The rollouts as ``ClippedPGLossFn`` input (``prev_logprobs`` and
    ``reference_policy_logprobs`` are added by the loop once the policy computed them).
    ``sample_mask`` [B] (default all 1) takes rows out of the loss.

    Columns past the longest rollout are dropped: they are padding in every row.
    """
    width = int(out["unpadded_sequence_lengths"].max())
    mask = generation_mask(out, prompt_lengths)[:, :width]
    return BatchedDataDict(
        input_ids=out["output_ids"][:, :width].clone(),
        input_lengths=out["unpadded_sequence_lengths"].clone(),
        token_mask=mask,
        sample_mask=torch.ones(mask.shape[0]) if sample_mask is None else sample_mask.float().clone(),
        advantages=advantages[:, None].float() * mask,
        generation_logprobs=out["logprobs"][:, :width].float() * mask,
    )


def rollout_metrics(
    out: BatchedDataDict, mask: torch.Tensor, rewards: torch.Tensor, stop_ids: Sequence[int], max_new_tokens: int
) -> dict[str, float]:
    """What a researcher watches about the rollouts themselves."""
    lengths = out["generation_lengths"].float()
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "truncated_fraction": float(truncated_rows(out, stop_ids, max_new_tokens).float().mean()),
        "generated_tokens": float(mask.sum()),
    }


def truncated_rows(out: BatchedDataDict, stop_ids: Sequence[int], max_new_tokens: int) -> torch.Tensor:
    """[B] bool: the rows that reached ``max_new_tokens`` without ending on a stop token
    (multi-turn rows: the episodes cut by the sequence limit, their own ``truncated``)."""
    if "truncated" in out:
        return out["truncated"].bool()
    lengths = out["generation_lengths"]
    last = out["output_ids"].gather(1, (out["unpadded_sequence_lengths"] - 1).clamp_min(0)[:, None])[:, 0]
    stopped = torch.isin(last, torch.tensor(list(stop_ids), dtype=last.dtype)) & (lengths > 0)
    return (lengths >= max_new_tokens) & ~stopped
