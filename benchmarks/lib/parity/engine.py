"""The vLLM check: a layout's weights refit into one engine, ``token_mult_prob_error`` over both transports."""

from __future__ import annotations

from benchmarks.lib.layouts import Layout
from benchmarks.lib.parity.measure import policy_logprobs
from benchmarks.lib.parity.settings import (
    ENGINE_NEW_TOKENS,
    ENGINE_PROMPT_WIDTH,
    ENGINE_PROMPTS,
    ENGINE_SEED,
    ENGINE_TRANSPORTS,
)
from benchmarks.lib.refit import Engine
from benchmarks.lib.workload import policy_config


def engine_prompts(vocab: int, bos_id: int | None):
    """The engine check's prompts: ragged random ids (BOS first), seeded per-row sampling."""
    from core.algorithms.rollouts import sample_seeds
    from core.data import BatchedDataDict
    from core.testing.tiny_models import random_batch

    ids, lengths = random_batch(ENGINE_PROMPTS, ENGINE_PROMPT_WIDTH, vocab, seed=ENGINE_SEED, min_len=3)
    if bos_id is not None:
        ids[:, 0] = bos_id
    return BatchedDataDict(
        input_ids=ids, input_lengths=lengths, sample_seeds=sample_seeds(ENGINE_SEED, 0, ENGINE_PROMPTS)
    )


def parity_engine(model_path: str, tokenizer_path: str, tokenizer, args):
    """One vLLM engine (``benchmarks.lib.refit.Engine``: ``VllmGeneration``, tensor parallel 1, a one-bundle
    cluster of ``--threads`` CPUs) with the run's policy section, fp32, ``ENGINE_NEW_TOKENS`` sampled
    tokens at temperature 1."""
    cfg = policy_config(
        model_path, tokenizer_path, Layout("engine", "torch_fsdp"), args.batch, args.seq, args.precision
    )
    cfg["generation"].update(backend="vllm", max_new_tokens=ENGINE_NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=None)
    cfg["generation"]["vllm_cfg"].update(max_model_len=args.seq, precision=args.precision)
    return Engine(model_path, tokenizer_path, tokenizer, args, cfg=cfg, name="parity-vllm")


def engine_check(policy, generation, prompts, transports=ENGINE_TRANSPORTS) -> dict:
    """Per transport: refit ``generation`` from ``policy``, sample, and compare the engine's
    logprobs of the sampled tokens with ``policy.get_logprobs`` of the sequences."""
    from core.algorithms.rollouts import generation_mask
    from core.kernels import generation_policy_kl, token_mult_prob_error
    from core.refit import refit_policy_generation

    per = {}
    for transport in transports:
        stats = refit_policy_generation(policy, generation, transport)
        out = generation.generate(prompts, greedy=False)
        lp = policy_logprobs(policy, out["output_ids"], out["unpadded_sequence_lengths"])
        mask = generation_mask(out, prompts["input_lengths"])
        if not int(mask.sum()):
            raise RuntimeError(f"the engine generated no tokens after the {transport} refit")
        gen = out["logprobs"].float()
        per[transport] = {
            "token_mult_prob_error": float(token_mult_prob_error(gen, lp, mask)),
            "max_abs_diff": float(((gen.double() - lp.double()).abs() * mask).max()),
            "gen_kl_error": float(generation_policy_kl(gen, lp, mask)),
            "tokens": int(mask.sum()),
            "refit_s": stats.seconds,
        }
    worst = max(per, key=lambda t: per[t]["token_mult_prob_error"])
    return {"token_mult_prob_error": per[worst]["token_mult_prob_error"], "transports": per}
