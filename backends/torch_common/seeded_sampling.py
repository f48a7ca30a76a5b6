"""Per-row seeded sampling for HF ``generate``: row b's sample depends on ``sample_seeds[b]`` only.

HF samples the whole batch with one ``torch.multinomial`` on the global RNG, so a row's
sample depends on its neighbours and on every earlier use of the RNG.  GRPO needs a row's
rollout to be a function of (run seed, step, row) -- for resume and for backend-vs-backend
comparisons -- which ``SeededRowSampler`` provides inside HF's own decoding loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from core.policy.generation_args import checked_sample_seeds


def row_sample_seeds(data: Mapping[str, Any], batch: int) -> list[int] | None:
    """``data['sample_seeds']`` as one int per row (None when absent), checked by the rule
    every engine shares (``checked_sample_seeds``)."""
    seeds = data.get("sample_seeds")
    return None if seeds is None else checked_sample_seeds(seeds, batch).tolist()


def sampling_warpers(sampling_cfg: GenerationConfig) -> list[LogitsProcessor]:
    """The warpers HF's own sampling applies for this config, in HF's order: temperature,
    top-k, top-p (the only ones ``build_hf_generation_config`` leaves on)."""
    warpers: list[LogitsProcessor] = []
    if sampling_cfg.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling_cfg.temperature))
    if sampling_cfg.top_k:
        warpers.append(TopKLogitsWarper(top_k=sampling_cfg.top_k))
    if sampling_cfg.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=sampling_cfg.top_p))
    return warpers


class SeededRowSampler(LogitsProcessor):
    """Samples row b with its own ``torch.Generator`` seeded by ``seeds[b]``.

    HF samples the whole batch with one ``torch.multinomial`` on the global RNG, so a row's
    sample depends on the rows beside it and on every earlier use of the RNG.  Here HF
    decodes by argmax (``do_sample=False``) and this processor -- the last one, since HF
    adds no warpers when not sampling -- does the sampling: the warpers HF would have
    applied (``sampling_warpers``), one draw per row from that row's generator, and scores
    that are 0 at the drawn token and -inf elsewhere, so HF's argmax picks it.  A row's
    generator advances once per step (finished rows included), so its t-th draw depends
    on its seed and t only.  The returned logits (``output_logits``) stay the raw ones.
    Model-config sampling warpers that ``build_hf_generation_config`` cannot switch off
    (``min_p``, ``top_h``; warned about) apply only when HF itself samples.
    """

    def __init__(self, sampling_cfg: GenerationConfig, seeds: Sequence[int], device: torch.device):
        self.warpers = LogitsProcessorList(sampling_warpers(sampling_cfg))
        self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != len(self.generators):
            raise RuntimeError(f"SeededRowSampler has {len(self.generators)} row seeds for {scores.shape[0]} rows")
        # transformers annotates processors with torch.LongTensor / FloatTensor, which plain
        # tensors (what .float() returns) do not match in torch's stubs.
        probs = torch.softmax(self.warpers(input_ids, scores.float()), dim=-1)  # type: ignore[arg-type]
        tokens = torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(self.generators)])
        return torch.full_like(scores, -float("inf")).scatter_(1, tokens[:, None], 0.0)
