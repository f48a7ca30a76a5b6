"""What both sides of the TRL comparison train on, built once in the driver by the project's
own data path (the built-in arithmetic problems and preference pairs): the examples, their
ids and loss masks, dualrl's batch and TRL's examples of the same rows, and the settings both
sides share."""

from __future__ import annotations

ALGORITHMS = ("sft", "dpo")
DEFAULT_LAYOUTS = ["fsdp1-dp2", "dtensor-dp2", "jax-fsdp2", "dtensor-dp1"]
#: Problem stream and TRL's seed.
SEED = 0
#: dualrl's DPO loss = TRL's ``loss_type=["sigmoid"]`` with ``beta = reference_policy_kl_penalty``.
DPO_LOSS_CFG = {
    "reference_policy_kl_penalty": 0.1,
    "preference_loss_weight": 1.0,
    "sft_loss_weight": 0.0,
    "preference_average_log_probs": False,
    "sft_average_log_probs": False,
}
#: Relative tolerance of the step-1 loss / gradient-norm check.
CHECK_RTOL = 1e-4


def build_examples(tokenizer, algorithm: str, batch: int) -> list:
    """One step's examples, encoded by the project's own data path (the built-in sources and
    :mod:`core.datasets.examples`, as ``dualrl sft`` / ``dualrl dpo`` encode them): SFT ``batch``
    ``SequenceDatum``s of "arithmetic", DPO ``batch // 2`` ``PreferenceDatum``s of
    "arithmetic-preferences" (rejected = a plausible slip), problems 0.. of seed ``SEED``."""
    from core.datasets.config import DataConfig
    from core.datasets.examples import PreferenceEncoder, SFTEncoder
    from core.datasets.sources import builtin_task, problem_row

    if algorithm == "sft":
        data = DataConfig(dataset_name="arithmetic", response_key="answer")
        encoder, task, n = SFTEncoder(data, tokenizer, 1 << 16), "arithmetic", batch
    else:
        data = DataConfig(dataset_name="arithmetic-preferences")
        encoder, task, n = PreferenceEncoder(data, tokenizer, 1 << 16), "arithmetic-preferences", batch // 2
    source = builtin_task(task, None)
    return [encoder.encode(problem_row(source.problem(SEED, i)), i, f"built-in {task}") for i in range(n)]


def rows(algorithm: str, examples: list) -> list[tuple[list[int], list[int]]]:
    """``(ids, loss mask)`` per sequence, in dualrl's row order (DPO: chosen, rejected, ...)."""
    sides = examples if algorithm == "sft" else [s for pair in examples for s in (pair.chosen, pair.rejected)]
    return [(list(s.input_ids), list(s.token_mask)) for s in sides]


def trl_examples(algorithm: str, examples: list) -> list[dict]:
    """The same token ids in TRL's pre-tokenized fields: SFT ``input_ids`` + ``completion_mask``;
    DPO ``prompt_ids`` (the tokens before the loss mask) + ``chosen_ids`` / ``rejected_ids``."""
    if algorithm == "sft":
        return [{"input_ids": list(e.input_ids), "completion_mask": list(e.token_mask)} for e in examples]
    out = []
    for pair in examples:
        start = pair.chosen.token_mask.index(1)
        assert pair.rejected.input_ids[:start] == pair.chosen.input_ids[:start], "sides must share the prompt"
        out.append(
            {
                "prompt_ids": list(pair.chosen.input_ids[:start]),
                "chosen_ids": list(pair.chosen.input_ids[start:]),
                "rejected_ids": list(pair.rejected.input_ids[start:]),
            }
        )
    return out


def to_batch(algorithm: str, examples: list, pad_id: int):
    """Right-padded ``BatchedDataDict`` as the loops build it (``core.algorithms.sft`` / ``dpo``)."""
    from core.algorithms.dpo import preference_batch
    from core.algorithms.sft import sequence_batch

    return (sequence_batch if algorithm == "sft" else preference_batch)(examples, pad_id)


def batch_facts(seqs) -> dict:
    return {
        "rows": len(seqs),
        "width": max(len(ids) for ids, _ in seqs),
        "real_tokens": sum(len(ids) for ids, _ in seqs),
        "loss_tokens": sum(sum(m) for _, m in seqs),
    }
