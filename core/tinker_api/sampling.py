"""``asample`` requests -> the policy's ``generate`` (and ``get_logprobs`` for prompt logprobs).

A request is checked against what the policy's generation can do before it is queued: the
prompt (text tokens in the vocabulary, room left for a token), ``num_samples``, and the
sampling parameters.  The policy samples at ``policy.generation.temperature`` (1.0, the Tinker
API's) with its top-p / top-k; a request asking for another temperature (0 = greedy is
supported), top-p or top-k, for stop token ids other than the end-of-sequence ones, or for
top-k / target / alternative-token logprobs is refused by name.

Queued requests that follow one another are generated in one ``generate`` call (each row
keeps its own prompt, token budget, stop strings and seed), as the Tinker API's RL loops send
one request per prompt group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tinker import types

from core.data import BatchedDataDict
from core.tinker_api.errors import bad_request
from core.tinker_api.wire import SampledSequence

#: Seeds the generate path accepts (``core.interfaces.GenerationDatumSpec``: below 2**32).
SEED_SPACE = 2**32


@dataclass(frozen=True)
class SampleLimits:
    """What the policy's generation can do (from the server's config and tokenizer)."""

    vocab_size: int
    max_sequence_length: int
    max_new_tokens: int
    max_samples: int
    eos_ids: tuple[int, ...]


@dataclass(frozen=True)
class SampleJob:
    """A checked request: ``num_samples`` completions of ``prompt``."""

    prompt: np.ndarray
    num_samples: int
    max_tokens: int
    greedy: bool
    stop_strings: tuple[str, ...]
    seed: int | None
    prompt_logprobs: bool
    prompt_logprobs_last_n: int | None


def check_sample_request(req: types.SampleRequest, limits: SampleLimits) -> SampleJob:
    """The request as a :class:`SampleJob`, or a refusal naming the field."""
    prompt = _prompt_tokens(req.prompt, limits)
    room = limits.max_sequence_length - len(prompt)
    if not 0 < req.num_samples <= limits.max_samples:
        raise bad_request(
            f"sample: num_samples={req.num_samples}; 1 to {limits.max_samples} (serve.max_samples_per_request)"
        )
    params = req.sampling_params
    max_tokens = min(limits.max_new_tokens, room) if params.max_tokens is None else params.max_tokens
    if not 0 < max_tokens <= min(limits.max_new_tokens, room):
        raise bad_request(
            f"sample: sampling_params.max_tokens={params.max_tokens}; this prompt of {len(prompt)} tokens allows 1 to "
            f"{min(limits.max_new_tokens, room)} (policy.generation.max_new_tokens={limits.max_new_tokens}, "
            f"policy.max_total_sequence_length={limits.max_sequence_length})"
        )
    _check_unsupported(req, len(prompt))
    return SampleJob(
        prompt=prompt,
        num_samples=req.num_samples,
        max_tokens=max_tokens,
        greedy=_greedy(params),
        stop_strings=_stop_strings(params.stop, limits),
        seed=None if params.seed is None else int(params.seed) % SEED_SPACE,
        prompt_logprobs=bool(req.prompt_logprobs),
        prompt_logprobs_last_n=req.prompt_logprobs_last_n,
    )


def _prompt_tokens(prompt: types.ModelInput, limits: SampleLimits) -> np.ndarray:
    chunks = prompt.chunks
    for j, chunk in enumerate(chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise bad_request(
                f"sample: prompt.chunks[{j}] is a {chunk.type} chunk; dualrl serve samples from text tokens"
            )
    tokens = np.asarray([t for chunk in chunks for t in chunk.tokens], dtype=np.int64)  # type: ignore[union-attr]
    if tokens.size == 0:
        raise bad_request("sample: the prompt is empty")
    bad = np.flatnonzero((tokens < 0) | (tokens >= limits.vocab_size))
    if bad.size:
        raise bad_request(
            f"sample: prompt token [{bad[0]}] = {tokens[bad[0]]} is outside the vocabulary [0, {limits.vocab_size})"
        )
    if len(tokens) >= limits.max_sequence_length:
        raise bad_request(
            f"sample: the prompt has {len(tokens)} tokens; policy.max_total_sequence_length="
            f"{limits.max_sequence_length} leaves no room for a completion"
        )
    return tokens


def _greedy(params: Any) -> bool:
    """Temperature 0 is greedy decoding; 1 samples; anything else is refused."""
    if params.temperature == 0:
        return True
    if params.temperature != 1.0:
        raise bad_request(
            f"sample: sampling_params.temperature={params.temperature}; dualrl serve samples at temperature 1.0 "
            "(policy.generation.temperature, at which it also scores logprobs) or 0 (greedy)"
        )
    return False


def _stop_strings(stop: Any, limits: SampleLimits) -> tuple[str, ...]:
    """Stop strings of the request; stop token ids must be end-of-sequence ids (always on)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    stop = list(stop)
    if not stop:
        raise bad_request("sample: sampling_params.stop=[] (no stop, not even end-of-sequence) is not supported")
    if all(isinstance(s, str) for s in stop):
        return tuple(stop)
    others = [s for s in stop if s not in limits.eos_ids]
    if others:
        raise bad_request(
            f"sample: sampling_params.stop token ids {others} are not end-of-sequence ids {list(limits.eos_ids)}; "
            "dualrl serve stops at those and at stop strings (send the stop as text)"
        )
    return ()


def _check_unsupported(req: types.SampleRequest, prompt_len: int) -> None:
    params = req.sampling_params
    refused = {
        "sampling_params.top_p": params.top_p != 1.0,
        "sampling_params.top_k": params.top_k not in (-1, 0),
        "topk_prompt_logprobs": req.topk_prompt_logprobs > 0,
        "topk_sample_logprobs": req.topk_sample_logprobs > 0,
        "target_prompt_logprobs": req.target_prompt_logprobs is not None,
        "prompt_alt_tokens_k": req.prompt_alt_tokens_k > 0,
        "record_stability_info": bool(req.record_stability_info),
    }
    for name, asked in refused.items():
        if asked:
            raise bad_request(f"sample: {name} is not supported by dualrl serve (see docs/tinker.md)")
    last_n = req.prompt_logprobs_last_n
    if last_n is not None and not (req.prompt_logprobs and 1 <= last_n <= prompt_len - 1):
        raise bad_request(
            f"sample: prompt_logprobs_last_n={last_n} needs prompt_logprobs and 1 <= n <= {prompt_len - 1}"
        )


# ----------------------------------------------------------------------------- running


def run_sample_jobs(policy: Any, tokenizer: Any, jobs: Sequence[SampleJob], pad_id: int, eos_ids: Sequence[int]):
    """``[(sequences, prompt_logprobs or None)]`` per job: one ``generate`` call for every job's
    rows (all greedy or all sampled), one ``get_logprobs`` call for the prompts that asked."""
    if len({job.greedy for job in jobs}) > 1:
        raise ValueError("run_sample_jobs: greedy and sampled jobs go in separate calls")
    rows = [(job, i) for job in jobs for i in range(job.num_samples)]
    width = max(len(job.prompt) for job in jobs)
    ids = np.full((len(rows), width), pad_id, np.int64)
    for r, (job, _) in enumerate(rows):
        ids[r, : len(job.prompt)] = job.prompt
    data: BatchedDataDict[Any] = BatchedDataDict(
        input_ids=torch.from_numpy(ids),
        input_lengths=torch.tensor([len(job.prompt) for job, _ in rows], dtype=torch.int64),
        max_new_tokens=torch.tensor([job.max_tokens for job, _ in rows], dtype=torch.int64),
        stop_strings=[list(job.stop_strings) or None for job, _ in rows],
    )
    if any(job.seed is not None for job in jobs):
        fresh = np.random.default_rng()
        data["sample_seeds"] = torch.tensor(
            [_row_seed(job.seed, i) if job.seed is not None else int(fresh.integers(SEED_SPACE)) for job, i in rows],
            dtype=torch.int64,
        )
    out = policy.generate(data, greedy=jobs[0].greedy)
    sequences = [_sequence(out, r, job, tokenizer, eos_ids) for r, (job, _) in enumerate(rows)]
    prompt_lps = _prompt_logprobs(policy, jobs, pad_id)
    results, start = [], 0
    for k, job in enumerate(jobs):
        results.append((sequences[start : start + job.num_samples], prompt_lps[k]))
        start += job.num_samples
    return results


def _row_seed(seed: int, sample: int) -> int:
    """Sample ``sample`` of a seeded request: a distinct, reproducible seed per sample."""
    return (seed * 1_000_003 + sample) % SEED_SPACE


def _sequence(out: Any, row: int, job: SampleJob, tokenizer: Any, eos_ids: Sequence[int]) -> SampledSequence:
    start, n = len(job.prompt), int(out["generation_lengths"][row])
    tokens = out["output_ids"][row, start : start + n].numpy()
    logprobs = out["logprobs"][row, start : start + n].numpy()
    stopped = n < job.max_tokens or (n > 0 and int(tokens[-1]) in eos_ids)
    if not stopped and job.stop_strings and n > 0:
        text = tokenizer.decode(tokens.tolist())
        stopped = any(text.endswith(s) for s in job.stop_strings)
    return SampledSequence(tokens, logprobs, "stop" if stopped else "length")


def _prompt_logprobs(policy: Any, jobs: Sequence[SampleJob], pad_id: int) -> list[np.ndarray | None]:
    """One float per prompt token (NaN at position 0 and before ``prompt_logprobs_last_n``)."""
    asked = [k for k, job in enumerate(jobs) if job.prompt_logprobs]
    result: list[np.ndarray | None] = [None] * len(jobs)
    if not asked:
        return result
    width = max(len(jobs[k].prompt) for k in asked)
    ids = np.full((len(asked), width), pad_id, np.int64)
    for r, k in enumerate(asked):
        ids[r, : len(jobs[k].prompt)] = jobs[k].prompt
    lengths = torch.tensor([len(jobs[k].prompt) for k in asked], dtype=torch.int64)
    logprobs = policy.get_logprobs(BatchedDataDict(input_ids=torch.from_numpy(ids), input_lengths=lengths))
    for r, k in enumerate(asked):
        n = len(jobs[k].prompt)
        values = logprobs["logprobs"][r, :n].numpy().astype(np.float32)
        last_n = jobs[k].prompt_logprobs_last_n
        scored_from = 1 if last_n is None else n - last_n
        values[:scored_from] = np.nan
        result[k] = values
    return result
