"""The exact sampler of the torch backends (``policy.numerics: exact``): KV-cache decoding by
the policy's own exact model (``exact_ops``), returning ``GenerationOutputSpec``.

HF ``generate`` cannot be exact: it left-pads the prompts, so a key's cache column is not
its position and the key blocks of a decode step are not those of the training forward.
Here the prompts stay right-padded and every key sits at the column of its position
(``ExactKVCache``): row b's prompt fills columns 0..L_b-1 (a prefill of the batch's width;
the padding columns are overwritten before any query may read them), and its k-th new
token is fed at position L_b + k.  With the exact layers a token's logits are then the
bits the training forward computes for it, and its reported logprob is the trainer's
kernel (``apply_temperature`` + ``logprobs_from_logits``) on those logits.

Each token is drawn from those very logits: the temperature-scaled logits whose logprob is
reported, filtered by top-k / top-p (HF's warpers), one ``torch.multinomial`` per row on the
row's own generator when ``sample_seeds`` are given (one draw per row per step, finished rows
too, so the t-th draw depends on the seed and t only), so a row gets the same tokens alone
or in a batch.  Without seeds the batch draws from the global RNG (as ``hf_generate``).
Stop tokens, stop strings, ``min_new_tokens``, row budgets and the output layout are
``hf_generate``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

from backends.torch_common.exact_ops import ExactKVCache
from backends.torch_common.generation import StopStringCriterion, generation_lengths, row_chunks
from backends.torch_common.seeded_sampling import row_sample_seeds
from core.data import BatchedDataDict
from core.generation.sampling import assemble_padded, stop_token_ids
from core.kernels.logprobs import apply_temperature, logprobs_from_logits
from core.policy.generation_args import effective_min_new_tokens, row_stop_strings, top_k_or_off
from core.policy.generation_config import GenerationConfig as GenerationSection


def exact_generate(
    model: torch.nn.Module,
    data: BatchedDataDict,
    gen_cfg: GenerationSection,
    *,
    greedy: bool,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
    tokenizer: Any,
    max_new_tokens: int,
    min_new_tokens: int | None = None,
    row_budgets: Any = None,
    batch_size: int | None = None,
) -> BatchedDataDict:
    """Continue right-padded prompts with an exact HF causal LM (``apply_exact_numerics``).

    Same arguments and result as ``generation.hf_generate`` (``input_ids`` [B, S],
    ``input_lengths`` [B], optional ``sample_seeds`` / ``stop_strings`` in ``data``); all
    tensors of the result on the CPU.
    """
    input_ids, input_lengths = data["input_ids"].long(), torch.as_tensor(data["input_lengths"]).long()
    batch = input_ids.shape[0]
    min_new = effective_min_new_tokens(gen_cfg, max_new_tokens, min_new_tokens)
    row_strings = row_stop_strings(gen_cfg, data.get("stop_strings"), batch)
    if any(row_strings) and tokenizer is None:
        raise ValueError("stop strings are configured but no tokenizer was given to decode the generated tokens")
    seeds = None if greedy else row_sample_seeds(data, batch)
    decoder = _ExactDecoder(
        model=model,
        gen_cfg=gen_cfg,
        greedy=greedy,
        stops=stop_token_ids(gen_cfg, eos_token_ids),
        new_tokens=max_new_tokens,
        min_new=min_new,
        pad_token_id=pad_token_id,
        tokenizer=tokenizer,
    )
    pieces = [
        decoder.rows(input_ids[rows], input_lengths[rows], row_strings[rows], None if seeds is None else seeds[rows])
        for rows in row_chunks(batch, batch_size)
    ]
    tokens, logprobs, lengths = (torch.cat(parts) for parts in zip(*pieces, strict=True))
    out = assemble_padded(
        input_ids.cpu().numpy(),
        input_lengths.cpu().numpy(),
        tokens.numpy(),
        logprobs.numpy(),
        lengths.numpy(),
        max_new_tokens,
        pad_token_id,
        row_budgets,
    )
    return BatchedDataDict({k: torch.from_numpy(v) for k, v in out.items()})


class _RowDraws:
    """Top-k / top-p filtering and one draw per row, from the row's generator when seeded."""

    def __init__(self, gen_cfg: GenerationSection, seeds: Sequence[int] | None, device: torch.device) -> None:
        warpers: list[LogitsProcessor] = []
        top_k = top_k_or_off(gen_cfg.top_k)
        if top_k:
            warpers.append(TopKLogitsWarper(top_k=top_k))
        if gen_cfg.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=float(gen_cfg.top_p)))
        self.warpers = LogitsProcessorList(warpers)
        self.generators = None if seeds is None else [torch.Generator(device).manual_seed(int(s)) for s in seeds]

    def __call__(self, scaled: torch.Tensor, banned: torch.Tensor | None) -> torch.Tensor:
        """[b, V] temperature-scaled logits -> [b] tokens."""
        scores = scaled.float()
        if banned is not None:
            scores = scores.masked_fill(banned, -float("inf"))
        probs = torch.softmax(self.warpers(None, scores), dim=-1)  # type: ignore[arg-type]
        if self.generators is None:
            return torch.multinomial(probs, 1)[:, 0]
        return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(self.generators)])


@dataclasses.dataclass(frozen=True)
class _ExactDecoder:
    """What every chunk of one ``exact_generate`` call shares; ``rows`` decodes one chunk."""

    model: Any  # an HF causal LM in exact form (its .model, .lm_head and .config are read)
    gen_cfg: GenerationSection
    greedy: bool
    stops: list[int]
    new_tokens: int
    min_new: int
    pad_token_id: int
    tokenizer: Any

    def rows(self, input_ids, input_lengths, row_strings, seeds):
        """Prefill + steps: (tokens [b, N], logprobs [b, N] float32, lengths [b]) on the CPU."""
        model, b = self.model, input_ids.shape[0]
        device = next(model.parameters()).device
        ids, lengths = input_ids.to(device), input_lengths.to(device)
        width = int(lengths.max())
        cache = _cache_for(model, b, width + self.new_tokens, device)
        draws = None if self.greedy else _RowDraws(self.gen_cfg, seeds, device)
        banned = torch.zeros(model.config.vocab_size, dtype=torch.bool, device=device)
        banned[[t for t in self.stops if 0 <= t < banned.numel()]] = True
        criterion = StopStringCriterion(self.tokenizer, row_strings, 0, self.min_new) if any(row_strings) else None
        tokens = torch.full((b, self.new_tokens), self.pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((b, self.new_tokens), dtype=torch.float32, device=device)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                positions = torch.arange(width, device=device)[None].expand(b, width)
                hidden = self._hidden(ids[:, :width], positions, cache)
                logits = model.lm_head(hidden[torch.arange(b, device=device), lengths - 1][:, None])
                steps = self._decode(logits, lengths, cache, draws, banned, criterion, tokens, logprobs, done)
        finally:
            model.train(was_training)
        lengths_out = generation_lengths(
            tokens[:, :steps], self.stops, None if criterion is None else criterion.stopped_at
        )
        return tokens.cpu(), logprobs.cpu(), lengths_out

    def _hidden(self, ids, positions, cache):
        return self.model.model(input_ids=ids, position_ids=positions, exact_cache=cache, use_cache=False)[0]

    def _decode(self, logits, lengths, cache, draws, banned, criterion, tokens, logprobs, done) -> int:
        """Sample token t from ``logits`` [b, 1, V], feed it back; returns the steps taken."""
        for t in range(self.new_tokens):
            scaled = apply_temperature(logits, float(self.gen_cfg.temperature))  # as get_logprobs
            token = self._draw(logits[:, 0], scaled[:, 0], banned if t < self.min_new else None, draws)
            lp = logprobs_from_logits(scaled, token[:, None])[:, 0].float()
            tokens[:, t] = torch.where(done, self.pad_token_id, token)
            logprobs[:, t] = torch.where(done, 0.0, lp)
            done |= torch.isin(token, banned.nonzero()[:, 0]) & (t >= self.min_new)
            if criterion is not None:
                done |= criterion(tokens[:, : t + 1]).to(done.device)
            if bool(done.all()) or t + 1 == self.new_tokens:
                return t + 1
            positions = (lengths + t)[:, None]
            logits = self.model.lm_head(self._hidden(tokens[:, t : t + 1], positions, cache))
        return self.new_tokens

    def _draw(self, raw, scaled, banned, draws):
        if draws is not None:
            return draws(scaled, banned)
        return (raw if banned is None else raw.masked_fill(banned, -float("inf"))).argmax(-1)


def _cache_for(model: Any, batch: int, length: int, device) -> ExactKVCache:
    config: Any = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    return ExactKVCache(config.num_hidden_layers, batch, config.num_key_value_heads, length, head_dim, dtype, device)
