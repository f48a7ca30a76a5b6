"""The per-row budget of new tokens (``data['max_new_tokens']``), checked the same way on every
engine: ``Policy.generate`` of each layout (tests/backends/test_generation.py) and a vLLM
engine (tests/generation/test_sample_seeds.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from core.data import BatchedDataDict
from core.testing.tiny_models import random_batch


def assert_rows_keep_their_own_budgets(
    generate: Callable[[BatchedDataDict], BatchedDataDict], limit: int, max_new: int, vocab: int
) -> None:
    """Row b generates at most min(its limit, max_new, limit - its OWN length), however wide the
    other rows are, and its tokens are what it samples with no limit of its own (seeded).
    (Without the key the widest row's room is every row's: ``with_row_budgets``.)  ``limit`` is
    the engine's ``max_total_sequence_length``, ``max_new`` its ``generation.max_new_tokens``."""
    ids, lengths = random_batch(4, limit - 2, vocab, seed=53, min_len=3)  # row 0 leaves room for 2
    lengths[1:] = torch.tensor([3, 4, 5])
    seeds = torch.tensor([5, 6, 7, 8])

    def call(row_limits: list[int]) -> BatchedDataDict:
        data = BatchedDataDict(input_ids=ids.clone(), input_lengths=lengths.clone(), sample_seeds=seeds.clone())
        data["max_new_tokens"] = torch.tensor(row_limits)
        return generate(data)

    free = call([limit] * 4)  # each row's own room: 2 for row 0, max_new for the others
    cut = call([limit, 3, 1, limit])
    assert int(free["generation_lengths"][1:].max()) > 2, "the short rows did not get their own room"
    for b, budget in enumerate([2, 3, 1, max_new]):
        n = int(cut["generation_lengths"][b])
        assert n == min(budget, int(free["generation_lengths"][b])), (b, n, budget)
        start = int(lengths[b])
        assert torch.equal(cut["output_ids"][b, start : start + n], free["output_ids"][b, start : start + n]), b
        kept = torch.arange(cut["logprobs"].shape[1]) < start + n
        torch.testing.assert_close(cut["logprobs"][b], free["logprobs"][b, : kept.numel()] * kept, rtol=0, atol=1e-5)
