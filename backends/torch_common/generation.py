"""HF ``generate`` for the torch policy workers, returning ``GenerationOutputSpec``.

The protocol's sequences are right-padded; a batched decoder-only ``generate`` needs the
prompts left-padded (so every row's next token is written at the same column), so the
prompts are moved to the right edge with an attention mask, generated, and the results
put back into the protocol's right-padded layout:

* ``output_ids`` [B, S + max_new_tokens]: the row's valid prompt tokens, then its
  generated tokens, then ``pad_token_id``.  The width depends only on the input width and
  the configured ``max_new_tokens`` (not on when rows stopped), so every data-parallel
  rank returns the same width for the same input width.
* ``generation_lengths`` [B]: generated tokens up to and including the one that met a
  stop condition -- a stop token id, or a stop string completed in the row's generated
  text (``StopStringCriterion``) -- else ``max_new_tokens``.  Taken from the stop
  conditions, never from the ids: HF pads finished rows with ``pad_token_id``, which may
  be a real token.
* ``logprobs`` [B, S + max_new_tokens] float32, ``get_logprobs`` layout: on a generated
  position, ``log_softmax(raw_logits / temperature)[token]``, i.e. the distribution
  *before* top-k/top-p filtering, at the configured temperature (also for ``greedy``,
  which decodes by argmax but scores with the same temperature) -- what ``get_logprobs``
  computes for the returned sequence.  0 on prompt and padding positions.

Sampling draws from torch's global RNG (one ``torch.multinomial`` for the whole batch),
unless ``data['sample_seeds']`` is given: then every row draws from its own generator
(``SeededRowSampler``), so a row's sample does not depend on the rows beside it, on the
data-parallel shard it landed on, or on what used the RNG before.

HF fills unset fields of the ``GenerationConfig`` passed to ``generate`` from the model's
``generation_config`` (checkpoint defaults like ``top_k=20, repetition_penalty=1.05``) and
then from global defaults (``top_k=50``).  Every field that changes the sampled
distribution or the stopping is therefore set explicitly here, to its neutral value when
the policy config does not ask for it; the few fields whose only "off" value is ``None``
are reported by a warning when the model's config would fill them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from backends.torch_common.seeded_sampling import SeededRowSampler, row_sample_seeds
from core.data import BatchedDataDict
from core.generation.sampling import assemble_padded
from core.kernels.logprobs import apply_temperature, logprobs_from_logits
from core.policy.generation_args import (
    check_prompt_rows,
    effective_min_new_tokens,
    row_chunks,
    row_stop_strings,
    stop_string_ends_row,
    stop_window,
    top_k_or_off,
)
from core.policy.generation_config import GenerationConfig as GenerationSection
from core.reporting import get_logger, warn_once

if TYPE_CHECKING:
    import numpy as np
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

logger = get_logger(__name__)

__all__ = [
    "SeededRowSampler",
    "StopStringCriterion",
    "build_hf_generation_config",
    "generation_lengths",
    "hf_generate",
    "right_to_left_padding",
]

# GenerationConfig fields that alter decoding but have no neutral value besides ``None``
# (which means "unset", so HF fills them from the model's generation_config).
_ONLY_NONE_IS_OFF = (
    "stop_strings",
    "max_time",
    "min_p",
    "top_h",
    "bad_words_ids",
    "sequence_bias",
    "suppress_tokens",
    "begin_suppress_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "exponential_decay_length_penalty",
    "watermarking_config",
)


def hf_generate(
    model,
    data: BatchedDataDict,
    gen_cfg: GenerationSection | Mapping[str, Any],
    *,
    greedy: bool,
    pad_token_id: int,
    eos_token_ids: Sequence[int] = (),
    tokenizer=None,
    synced_gpus: bool = False,
    max_new_tokens: int | None = None,
    device: torch.device | str | None = None,
    batch_size: int | None = None,
    min_new_tokens: int | None = None,
    row_budgets: np.ndarray | None = None,
) -> BatchedDataDict:
    """Continue right-padded prompts with ``model.generate``; returns ``GenerationOutputSpec`` on CPU.

    Args:
        model: an HF causal LM, or a wrapper whose ``generate`` reaches one (an FSDP2
            module; for FSDP1 the caller makes the full parameters available).
        data: ``input_ids`` [B, S] right-padded, ``input_lengths`` [B]; optional
            ``stop_strings`` (per row: a list of extra stop strings, or None) and
            ``sample_seeds`` ([B] int: row b samples from its own generator seeded with
            ``sample_seeds[b]``; ignored when ``greedy``).
        gen_cfg: the ``GenerationConfig`` block (temperature, top_p, top_k, max_new_tokens,
            stop_token_ids, stop_strings).
        greedy: argmax decoding; logprobs still use ``gen_cfg.temperature``.
        pad_token_id: fills padding in ``output_ids`` and HF's finished rows.
        eos_token_ids: stop tokens added to ``gen_cfg.stop_token_ids``.
        tokenizer: required when any stop string is configured (generated tokens are decoded).
        synced_gpus: keep stepping after this rank's rows are done until every rank is;
            needed when the forward pass has collectives (FSDP), else ranks deadlock.
        max_new_tokens: overrides ``gen_cfg.max_new_tokens``.
        row_budgets: [B] each row's own limit of new tokens (<= ``max_new_tokens``;
            ``core.policy.generation_args.with_row_budgets``): rows are cut there.
        min_new_tokens: overrides ``gen_cfg.min_new_tokens`` (both cut to the max): until a row
            has that many tokens its stop token ids are masked (HF's ``min_new_tokens``) and
            its stop strings do not end it; logprobs stay the unmasked ones.
        device: where to run; default the device of ``data['input_ids']``.
        batch_size: at most this many rows per ``model.generate`` call
            (``policy.generation_batch_size``); None = all rows in one call.  Greedy and
            seeded (``sample_seeds``) results do not depend on it; unseeded sampling draws
            from the global RNG chunk after chunk (same distribution, other draws).  With
            ``synced_gpus`` every rank must then hold as many chunks as the others.

    Returns:
        ``output_ids`` [B, S + N] int64, ``logprobs`` [B, S + N] float32,
        ``generation_lengths`` [B] and ``unpadded_sequence_lengths`` [B] int64, where
        N = max_new_tokens.  All tensors on CPU.
    """
    gen_cfg = GenerationSection.coerce(gen_cfg, "policy.generation")
    input_ids, input_lengths = _checked_inputs(data)
    batch = input_ids.shape[0]
    new_tokens = _resolve_max_new_tokens(gen_cfg, max_new_tokens)
    min_new = effective_min_new_tokens(gen_cfg, new_tokens, min_new_tokens)
    temperature = _check_temperature(gen_cfg)
    stop_token_ids = _stop_token_ids(gen_cfg, eos_token_ids)
    row_strings = _row_stop_strings(data, gen_cfg, batch)
    if any(row_strings) and tokenizer is None:
        raise ValueError(
            "stop strings are configured (generation.stop_strings or data['stop_strings']) but no tokenizer "
            "was given: pass tokenizer= so generated tokens can be decoded and matched"
        )
    config = functools.partial(
        build_hf_generation_config,
        gen_cfg,
        max_new_tokens=new_tokens,
        min_new_tokens=min_new,
        stop_token_ids=stop_token_ids,
        pad_token_id=pad_token_id,
    )
    call = _GenerateCall(
        model=model,
        config=config,
        greedy=greedy,
        stop_token_ids=stop_token_ids,
        temperature=temperature,
        tokenizer=tokenizer,
        synced_gpus=synced_gpus,
        new_tokens=new_tokens,
        min_new_tokens=min_new,
        pad_token_id=pad_token_id,
        device=torch.device(device) if device is not None else input_ids.device,
        # Every chunk is left-padded to the whole batch's prompt width, so a row sees the same
        # columns (and the same kernels' shapes along the sequence) whichever chunk it is in.
        prompt_width=int(input_lengths.max()),
    )
    _warn_inherited_fields(model, config(greedy=greedy))
    seeds = None if greedy else row_sample_seeds(data, batch)
    pieces = [
        call.rows(input_ids[rows], input_lengths[rows], row_strings[rows], None if seeds is None else seeds[rows])
        for rows in row_chunks(batch, batch_size)
    ]
    generated, token_logprobs, lengths = (torch.cat(parts) for parts in zip(*pieces, strict=True))
    return _assemble_output(
        input_ids, input_lengths, generated, token_logprobs, lengths, new_tokens, pad_token_id, row_budgets
    )


class GenerationReplica:
    """An unsharded copy of a worker's current weights in the compute dtype, for HF ``generate``.

    Why a replica rather than the sharded module: HF ``generate`` calls the inner HF
    module, which bypasses FSDP1's root unshard, and under TP/SP the KV-cache decode
    steps (sequence length 1) cannot be sequence-sharded.  HF generation is the
    evaluation/debug path (vLLM is the rollout engine), so one full copy per rank during
    the call is an acceptable price for one code path that is right on every layout.
    The replica's structure is built on the first :meth:`load`; each call only reloads the weights.
    """

    def __init__(
        self,
        model_config: PreTrainedConfig,
        device: torch.device,
        dtype: torch.dtype,
        prepare: Callable[[torch.nn.Module], Any] | None = None,
    ) -> None:
        self.model_config, self.device, self.dtype = model_config, device, dtype
        self._prepare = prepare  # applied to the built replica (policy.numerics exact: its exact layers)
        self._module: torch.nn.Module | None = None

    def load(self, full_weights: Iterable[tuple[str, torch.Tensor]]) -> torch.nn.Module:
        """The replica with ``full_weights`` (``(hf_name, full tensor)`` pairs, every weight) loaded."""
        from transformers import AutoModelForCausalLM

        if self._module is None:
            # Built on the device directly (not meta): non-persistent buffers such as RoPE's
            # inv_freq are computed by the constructor and are not in the state dict.
            with torch.device(self.device):
                replica = AutoModelForCausalLM.from_config(self.model_config, dtype=self.dtype)
            replica.config.use_cache = True
            if self._prepare is not None:
                self._prepare(replica)
            self._module = replica.eval()
        self._module.load_state_dict(dict(full_weights), strict=True)
        return self._module


@dataclasses.dataclass(frozen=True)
class _GenerateCall:
    """What every chunk of one ``hf_generate`` call shares; ``rows`` runs one chunk."""

    model: torch.nn.Module
    config: Callable[..., GenerationConfig]  # greedy -> transformers.GenerationConfig
    greedy: bool
    stop_token_ids: list[int]
    temperature: float
    tokenizer: PreTrainedTokenizerBase | None
    synced_gpus: bool
    new_tokens: int
    min_new_tokens: int
    pad_token_id: int
    device: torch.device
    prompt_width: int

    def rows(self, input_ids, input_lengths, row_strings, seeds):
        """One ``model.generate`` over these rows: (generated [b, N], token logprobs [b, N],
        generation lengths [b]) on CPU, padded to N = new_tokens columns (HF stops early
        when all of a chunk's rows are done; the columns past a row's length are never read)."""
        left_ids, attention_mask = right_to_left_padding(
            input_ids, input_lengths, self.pad_token_id, width=self.prompt_width
        )
        left_ids, attention_mask = left_ids.to(self.device), attention_mask.to(self.device)
        sampler = None if seeds is None else SeededRowSampler(self.config(greedy=False), seeds, self.device)
        # With per-row seeds the sampler draws and HF only takes its argmax (see SeededRowSampler).
        hf_cfg = self.config(greedy=self.greedy or sampler is not None)
        criterion = (
            StopStringCriterion(self.tokenizer, row_strings, self.prompt_width, self.min_new_tokens)
            if any(row_strings)
            else None
        )
        out = _run_generate(self.model, left_ids, attention_mask, hf_cfg, criterion, self.synced_gpus, sampler)
        generated = out.sequences[:, self.prompt_width :]  # [b, T], T <= new_tokens
        with torch.no_grad():
            token_logprobs = _generated_logprobs(out.logits, generated, self.temperature).cpu()
        lengths = generation_lengths(
            generated, self.stop_token_ids, None if criterion is None else criterion.stopped_at
        )
        fill = self.new_tokens - generated.shape[1]
        generated = torch.nn.functional.pad(generated.cpu(), (0, fill), value=self.pad_token_id)
        return generated, torch.nn.functional.pad(token_logprobs, (0, fill)), lengths


# ----------------------------------------------------------------------------- inputs


def _checked_inputs(data: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` [B, S] and ``input_lengths`` [B] (int64, on the ids' device), validated."""
    input_ids, input_lengths = data["input_ids"], data["input_lengths"]
    if not torch.is_tensor(input_ids):
        raise ValueError(f"input_ids must be a torch tensor, got {type(input_ids).__name__}")
    check_prompt_rows(input_ids, input_lengths)
    return input_ids.long(), torch.as_tensor(input_lengths).to(device=input_ids.device, dtype=torch.long)


def _resolve_max_new_tokens(gen_cfg: GenerationSection, override: int | None) -> int:
    value = gen_cfg.max_new_tokens if override is None else override
    if value is None or int(value) <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {value!r}")
    return int(value)


def _check_temperature(gen_cfg: GenerationSection) -> float:
    # Logprobs divide by the temperature, so 0 ("greedy" in vLLM's convention) is refused:
    # greedy decoding is asked for with greedy=True and keeps a positive temperature.
    temperature = float(gen_cfg.temperature)
    if temperature <= 0:
        raise ValueError(f"generation temperature must be > 0 (use greedy=True for argmax), got {temperature}")
    return temperature


def _stop_token_ids(gen_cfg: GenerationSection, eos_token_ids: Sequence[int]) -> list[int]:
    """gen_cfg stop_token_ids + eos_token_ids, de-duplicated in order."""
    ids = [int(t) for t in (gen_cfg.stop_token_ids or [])] + [int(t) for t in eos_token_ids]
    return list(dict.fromkeys(ids))


def right_to_left_padding(
    input_ids: torch.Tensor, input_lengths: torch.Tensor, pad_token_id: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, S] -> left-padded [B, P] ids and attention mask, P = ``width``
    (default max(input_lengths); at most S).

    Row b's valid tokens end up in columns [P - len_b, P); the rest hold ``pad_token_id``
    with mask 0 (HF derives position ids from the mask, so positions still start at 0).
    """
    width = int(input_lengths.max()) if width is None else int(width)
    cols = torch.arange(width, device=input_ids.device)[None, :]
    shift = (width - input_lengths)[:, None]  # how far each row moves right
    src = (cols - shift).clamp(min=0)  # the right-padded column each left-padded column reads
    mask = cols >= shift
    left = torch.where(mask, input_ids.gather(1, src), torch.full_like(src, pad_token_id))
    return left, mask.long()


# ----------------------------------------------------------------------------- HF config


def build_hf_generation_config(
    gen_cfg: GenerationSection,
    *,
    greedy: bool,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    min_new_tokens: int = 0,
):
    """A ``transformers.GenerationConfig`` with every decoding-relevant field explicit.

    Unset (None) fields would be filled from the model's generation_config and HF's global
    defaults (top_k=50!), so sampling knobs and penalties get explicit neutral values:
    top_k=0 and top_p=1.0 are "off" in HF.  Greedy sets temperature=1, top_p=1, top_k=50:
    HF applies them only when sampling, and these are the values its validation accepts
    with do_sample=False (inherited sampling values would make it log a warning).  Stop
    strings are not HF's (see ``StopStringCriterion``); stop token ids become ``eos_token_id``,
    which HF's ``min_new_tokens`` masks (in the scores it samples from, before any sampler of
    ours; ``output_logits`` stay raw) until a row has that many tokens.
    """
    fields: dict[str, Any] = dict(
        # An explicit min_new_tokens (0 = off) overrides any inherited min_length (HF derives
        # min_length from it).
        max_new_tokens=max_new_tokens,
        min_new_tokens=int(min_new_tokens),
        num_beams=1,
        num_return_sequences=1,
        use_cache=True,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        guidance_scale=1.0,
        renormalize_logits=False,
        remove_invalid_values=False,
        # An empty list (not None) so the model's own eos ids are not inherited.
        eos_token_id=list(stop_token_ids),
        pad_token_id=int(pad_token_id),
        # Raw logits (before processors), the ones get_logprobs reproduces.
        return_dict_in_generate=True,
        output_logits=True,
        output_scores=False,
        do_sample=not greedy,
    )
    if greedy:
        fields.update(temperature=1.0, top_p=1.0, top_k=50)
    else:
        top_k, top_p = top_k_or_off(gen_cfg.top_k), float(gen_cfg.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        fields.update(temperature=_check_temperature(gen_cfg), top_k=top_k, top_p=top_p)
    return GenerationConfig(**fields)


def _warn_inherited_fields(model, hf_cfg) -> None:
    """Warn about decoding fields the model's generation_config would fill in (see module doc)."""
    model_cfg = getattr(model, "generation_config", None)
    if model_cfg is None:
        return
    inherited = [
        name
        for name in _ONLY_NONE_IS_OFF
        if getattr(hf_cfg, name, None) is None and getattr(model_cfg, name, None) is not None
    ]
    if inherited:
        warn_once(
            logger,
            f"hf_generate: the model's generation_config sets {inherited}, which HF applies because the policy "
            "config has no neutral value for them; clear them on model.generation_config to turn them off",
        )


def _run_generate(model, left_ids, attention_mask, hf_cfg, criterion, synced_gpus, sampler=None):
    """``model.generate`` in eval mode without gradients; restores ``model.training``."""
    kwargs: dict[str, Any] = {}
    if criterion is not None:
        kwargs["stopping_criteria"] = StoppingCriteriaList([criterion])
    if sampler is not None:
        kwargs["logits_processor"] = LogitsProcessorList([sampler])
    was_training = model.training
    model.eval()  # dropout off: the logprobs must be those get_logprobs computes
    try:
        with torch.no_grad():
            return model.generate(
                input_ids=left_ids,
                attention_mask=attention_mask,
                generation_config=hf_cfg,
                synced_gpus=synced_gpus,
                **kwargs,
            )
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------- stopping


class StopStringCriterion(StoppingCriteria):
    """Stops a row once its *generated* text contains one of the row's stop strings.

    HF's ``StopStringCriteria`` (``GenerationConfig.stop_strings``) is not used: it maps
    every vocabulary entry to its string by tokenizing a probe word, which fails for
    tokenizers that cannot spell the probe (the tiny word-level tokenizer raises), it
    matches across the prompt/generation boundary, and it applies one list to the whole
    batch.  Here each row has its own list (config strings + ``data['stop_strings']``) and
    the text is ``tokenizer.decode`` of the generated tokens only -- the rule vLLM applies.

    Only a tail of ``stop_window`` tokens is decoded each step (see
    ``core.policy.generation_args.STOP_WINDOW_SLACK``), so a step costs O(window), not O(T).

    ``stopped_at[b]`` records the number of generated tokens when row b first matched (0:
    never); HF evaluates criteria after appending each token, so the matching token is
    counted.  With ``min_new_tokens`` no row matches before it has more tokens than that
    (``stop_string_ends_row``).
    """

    def __init__(self, tokenizer, row_strings: Sequence[tuple[str, ...]], prompt_width: int, min_new_tokens: int = 0):
        self.tokenizer = tokenizer
        self.min_new_tokens = int(min_new_tokens)
        self.row_strings = [tuple(r) for r in row_strings]
        self.prompt_width = prompt_width
        self.window = stop_window(self.row_strings)
        self.stopped_at = torch.zeros(len(self.row_strings), dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        """[B, P + t] ids after step t -> [B] bool, True for rows that have matched by now."""
        generated = input_ids[:, self.prompt_width :]
        step = generated.shape[1]
        pending = [b for b, strings in enumerate(self.row_strings) if strings and self.stopped_at[b] == 0]
        if pending and step > self.min_new_tokens:
            tails = generated[pending, -self.window :].tolist()  # one device->host copy per step
            for b, tail in zip(pending, tails, strict=True):
                if stop_string_ends_row(self.tokenizer, tail, self.row_strings[b], step, self.min_new_tokens):
                    self.stopped_at[b] = step
        return (self.stopped_at > 0).to(input_ids.device)


def _row_stop_strings(data: Mapping[str, Any], gen_cfg: GenerationSection, batch: int) -> list[tuple[str, ...]]:
    """Each row's stop strings: ``gen_cfg.stop_strings`` + that row's ``data['stop_strings']``."""
    return row_stop_strings(gen_cfg, data.get("stop_strings"), batch)


def generation_lengths(
    generated: torch.Tensor, stop_token_ids: Sequence[int], stopped_at: torch.Tensor | None = None
) -> torch.Tensor:
    """Generated tokens per row: [B, T] ids -> [B] int64.

    The first step at which a stop condition held, counting the token that met it: the
    first stop token id (HF's ``EosTokenCriteria`` checks the newest token only), or the
    step recorded by ``StopStringCriterion.stopped_at`` (> 0), whichever is earlier; T
    when neither happened.  After that step HF writes ``pad_token_id``, which may be a
    real token (even a stop token), so the ids after a row's end cannot tell it apart.
    """
    steps = generated.shape[1]
    stop_ids = torch.tensor(list(stop_token_ids), dtype=generated.dtype, device=generated.device)
    hit = torch.isin(generated, stop_ids)  # [B, T]
    first = hit.int().argmax(dim=1) + 1  # argmax returns the first True (0 when none)
    lengths = torch.where(hit.any(dim=1), first, torch.full_like(first, steps)).cpu().long()
    if stopped_at is not None:
        stopped_at = stopped_at.cpu().long()
        lengths = torch.where(stopped_at > 0, torch.minimum(lengths, stopped_at), lengths)
    return lengths


# ----------------------------------------------------------------------------- outputs


def _generated_logprobs(step_logits: Sequence[torch.Tensor], generated: torch.Tensor, temperature: float):
    """log softmax(raw_logits_t / T)[token_t] per step: T x [B, V] and [B, T] -> [B, T] float32.

    One step at a time, so no [B, T, V] copy of the logits HF already holds is made.
    """
    if len(step_logits) != generated.shape[1]:
        raise RuntimeError(f"HF returned {len(step_logits)} logits for {generated.shape[1]} generated tokens")
    columns = [
        logprobs_from_logits(apply_temperature(logits[:, None, :], temperature), generated[:, t : t + 1])
        for t, logits in enumerate(step_logits)
    ]
    return torch.cat(columns, dim=1).float()


def _assemble_output(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    generated: torch.Tensor,
    token_logprobs: torch.Tensor,
    gen_lengths: torch.Tensor,
    max_new_tokens: int,
    pad_token_id: int,
    row_budgets: np.ndarray | None = None,
) -> BatchedDataDict:
    """The shared ``GenerationOutputSpec`` layout (``core.generation.sampling.assemble_padded``)
    as torch tensors; HF may stop before ``max_new_tokens`` when every row is done."""
    out = assemble_padded(
        input_ids.cpu().numpy(),
        input_lengths.cpu().numpy(),
        generated.cpu().numpy(),
        token_logprobs.cpu().float().numpy(),
        gen_lengths.cpu().numpy(),
        max_new_tokens,
        pad_token_id,
        row_budgets,
    )
    return BatchedDataDict({k: torch.from_numpy(v) for k, v in out.items()})
