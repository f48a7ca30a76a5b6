"""``dualrl parity --exact``: every layout in exact mode (``policy.numerics: exact``), held to 0.

With ``--exact`` each layout's policy runs the exact layers and samples with its own exact
sampler (``policy.generation.backend: hf``), and two checks are bitwise:

* ``exact_batch_invariance`` (per layout): ``batch_invariance``'s variants, the width change
  included, at 0 (``batch_invariance`` itself keeps its 1e-5, which ``hf`` is held to);
* ``exact_sampler`` (per layout): the policy samples ``EXACT_PROMPTS`` ragged prompts, seeded
  per row, ``EXACT_GENERATION_ROWS`` rows per generate call; ``get_logprobs`` scores the
  sequences ``EXACT_LOGPROB_ROWS`` rows per micro batch (another size), and the prompts are
  sampled once more one row at a time.  The value is the largest of: ``max |lp_sampler -
  lp_policy|`` over the sampled tokens, the same for the rows sampled alone against the batch,
  and 1 where a row sampled alone got other tokens.  Pass: 0 -- a one-bit difference fails.

``hf`` (plain transformers) is the reference of the pairwise checks as always, at their usual
tolerances: exact mode computes the same model to rounding.  Layouts exact mode refuses
(tensor / context parallelism, packing, LoRA) get the refusal as their ERROR line.
"""

from __future__ import annotations

from typing import Any

EXACT_PROMPTS = 8
EXACT_PROMPT_WIDTH = 10
EXACT_NEW_TOKENS = 8
EXACT_GENERATION_ROWS = 4
EXACT_LOGPROB_ROWS = 3
EXACT_SEED = 4242


def exact_settings(cfg: dict) -> dict:
    """The policy section in exact mode: the exact layers, the policy's own sampler."""
    cfg["numerics"] = "exact"
    cfg["generation_batch_size"] = EXACT_GENERATION_ROWS
    cfg["generation"].update(backend="hf", vllm_cfg=None, max_new_tokens=EXACT_NEW_TOKENS, temperature=1.0)
    return cfg


def exact_prompts(vocab: int):
    """Ragged random prompts with per-row sample seeds."""
    import torch

    from core.data import BatchedDataDict
    from core.testing.tiny_models import random_batch

    ids, lengths = random_batch(EXACT_PROMPTS, EXACT_PROMPT_WIDTH, vocab, seed=EXACT_SEED, min_len=2)
    return BatchedDataDict(input_ids=ids, input_lengths=lengths, sample_seeds=torch.arange(EXACT_PROMPTS) + EXACT_SEED)


def exact_sampler_check(policy, prompts) -> dict[str, Any]:
    """The ``exact_sampler`` measurement of one layout (see the module doc)."""
    import torch

    from core.algorithms.rollouts import generation_mask
    from core.data import BatchedDataDict

    out = policy.generate(prompts, greedy=False)
    mask = generation_mask(out, prompts["input_lengths"]) > 0
    scored = policy.get_logprobs(
        BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"]),
        micro_batch_size=EXACT_LOGPROB_ROWS,
    )["logprobs"]
    sampled = out["logprobs"].double()
    vs_policy = float((sampled - scored.double())[mask].abs().max())
    vs_alone, other_tokens = 0.0, 0
    for row in range(len(prompts["input_ids"])):
        alone = policy.generate(prompts.slice(row, row + 1), greedy=False)
        n = int(out["unpadded_sequence_lengths"][row])
        other_tokens += int(not torch.equal(alone["output_ids"][0, :n], out["output_ids"][row, :n]))
        vs_alone = max(vs_alone, float((alone["logprobs"][0].double() - sampled[row]).abs().max()))
    return {
        "value": max(vs_policy, vs_alone, float(other_tokens > 0)),
        "max_abs_vs_policy": vs_policy,
        "max_abs_alone_vs_batch": vs_alone,
        "rows_with_other_tokens_alone": other_tokens,
        "tokens": int(mask.sum()),
    }


def exact_checks(name: str, measured: dict, record) -> list[dict]:
    """The layout's bitwise checks (``record(check, value=, **details)`` makes one), if it ran in exact mode."""
    if "exact" not in measured:
        return []
    inv = measured["invariance"]
    exact = measured["exact"]
    return [
        record("exact_batch_invariance", value=max(inv.values()), variants=dict(inv)),
        record("exact_sampler", value=exact["value"], **{k: v for k, v in exact.items() if k != "value"}),
    ]


def exact_table(checks: list[dict]) -> list[str]:
    """The report's lines for the exact-mode checks (none without ``--exact``)."""
    rows = [c for c in checks if c["check"] in ("exact_batch_invariance", "exact_sampler")]
    if not rows:
        return []
    lines = [
        f"exact mode (policy.numerics exact; pass: 0, bit for bit): batch invariance over every variant; "
        f"sampler vs get_logprobs ({EXACT_PROMPTS} prompts, {EXACT_GENERATION_ROWS} rows per generate call, "
        f"{EXACT_LOGPROB_ROWS} per logprob micro batch) and each row sampled alone vs in the batch"
    ]
    for c in rows:
        detail = (
            f"{c['tokens']} tokens, max |sampler - policy| {c['max_abs_vs_policy']:.1e}, alone vs batch "
            f"{c['max_abs_alone_vs_batch']:.1e}, rows with other tokens alone {c['rows_with_other_tokens_alone']}"
            if c["check"] == "exact_sampler"
            else ", ".join(f"{k} {v:.1e}" for k, v in c["variants"].items())
        )
        lines.append(f"  {c['a']}  {c['check']}: {c['value']:.1e}{'' if c['pass'] else ' FAIL'}  ({detail})")
    return lines + [""]
