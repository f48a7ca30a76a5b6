"""Shared-prompt packing's index arithmetic (core.data.shared_prompts, PackedRow groups).

A group's rows hold one copy of their prompt but its last token; each row's own segment
starts with that last token, reads the prompt's segment, and continues its positions.  The
unpacked next-token logprobs of every row must come from the same packed columns as if the
row had been packed alone -- checked here on the index maps, with the model replaced by a
function of (token, position, the tokens it may read)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.data import BatchedDataDict
from core.data.context_parallel import attention_allowed
from core.data.sequence_packing import PackedRow, SequencePackingArgs
from core.data.shared_prompts import (
    PromptGroup,
    packed_tokens,
    packing_units,
    plan_shared_prompt_micro_batches,
    prompt_groups,
    prompt_lengths,
)

IDS = np.array(
    [
        [1, 2, 3, 4, 5, 0],  # prompt [1 2 3 4], completion [5]
        [1, 2, 3, 4, 6, 7],  # same prompt
        [1, 2, 3, 4, 0, 0],  # same prompt, nothing generated
        [9, 8, 7, 6, 5, 4],  # another prompt [9 8]
        [9, 8, 1, 0, 0, 0],  # the same as row 3
    ]
)
LENGTHS = np.array([5, 6, 4, 6, 3])
MASK = np.zeros_like(IDS)
MASK[0, 4], MASK[1, 4:6], MASK[3, 2:6], MASK[4, 2] = 1, 1, 1, 1


def test_prompt_groups_are_runs_of_the_same_prompt():
    np.testing.assert_array_equal(prompt_lengths(LENGTHS, MASK), [4, 4, 4, 2, 2])
    assert prompt_groups(IDS, LENGTHS, MASK) == [PromptGroup(0, 3, 3), PromptGroup(3, 5, 1)]
    # a one-token prompt shares nothing; different prompts of one length do not group
    other = IDS.copy()
    other[1, 0] = 99
    assert prompt_groups(other, LENGTHS, MASK) == [PromptGroup(3, 5, 1)]
    assert prompt_groups(torch.from_numpy(IDS), torch.from_numpy(LENGTHS), torch.from_numpy(MASK))[0].end == 3
    with pytest.raises(ValueError, match="token_mask of shape"):
        prompt_lengths(LENGTHS, MASK[:2])


def test_shared_layout_holds_each_prompt_once():
    groups = prompt_groups(IDS, LENGTHS, MASK)
    row = PackedRow.build(LENGTHS, IDS.shape[1], multiple=4, groups=groups)
    assert row.tokens == packed_tokens(LENGTHS[:3], 3) + packed_tokens(LENGTHS[3:], 1) == 3 + 2 + 3 + 1 + 1 + 5 + 2
    np.testing.assert_array_equal(row.pack(IDS)[0][: row.tokens], [1, 2, 3, 4, 5, 4, 6, 7, 4, 9, 8, 7, 6, 5, 4, 8, 1])
    np.testing.assert_array_equal(row.positions[: row.tokens], [0, 1, 2, 3, 4, 3, 4, 5, 3, 0, 1, 2, 3, 4, 5, 1, 2])
    np.testing.assert_array_equal(row.segments[: row.tokens], [0, 0, 0, 1, 1, 2, 2, 2, 3, 4, 5, 5, 5, 5, 5, 6, 6])
    np.testing.assert_array_equal(
        row.prefix_segments[: row.tokens], [0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4]
    )
    assert row.width == 20 and (row.segments[row.tokens :] == 7).all()  # the padding tail: a segment of its own
    # without groups: exactly the plain packed layout
    plain = PackedRow.build(LENGTHS, IDS.shape[1])
    assert plain.tokens == LENGTHS.sum() and (plain.prefix_segments == plain.segments).all()
    np.testing.assert_array_equal(plain.segments, np.repeat(np.arange(5), LENGTHS))


def _toy_logits(tokens, positions, allowed):
    """A stand-in model: each column's output depends on its token, position and (order-free)
    on every token it may read -- so equal outputs mean equal attention contexts."""
    reads = np.where(allowed[0], tokens[None, :], 0)
    context = (reads * 7919 % 104729).sum(axis=1) + (allowed[0].sum(axis=1) * 31)
    return tokens * 1000003 + positions * 101 + context


@pytest.mark.parametrize("shared", [False, True])
def test_every_row_reads_what_it_would_read_alone(shared):
    """The value at each row's unpacked column equals the row packed alone: same token,
    position and readable tokens at every prediction a loss can see."""
    groups = prompt_groups(IDS, LENGTHS, MASK) if shared else ()
    row = PackedRow.build(LENGTHS, IDS.shape[1], multiple=4, groups=groups)
    cols = np.arange(row.width)
    allowed = attention_allowed(cols, cols, row.segments[None], row.prefix_segments[None])
    packed = _toy_logits(row.pack(IDS)[0], row.positions, allowed)
    got = row.unpack_next_logprobs(packed[None, :-1].astype(float))
    targets = row.pack(IDS)[0][1:][row.unpack_index()[0]]  # the token each unpacked column scores
    for i, n in enumerate(LENGTHS):
        alone = PackedRow.build([n], IDS.shape[1])
        c = np.arange(alone.width)
        ref = _toy_logits(alone.pack(IDS[i : i + 1])[0], alone.positions, attention_allowed(c, c, alone.segments[None]))
        np.testing.assert_array_equal(got[i, : n - 1], ref[: n - 1])
        np.testing.assert_array_equal(targets[i, : n - 1], IDS[i, 1:n])


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match=r"group of rows \[0, 2\) sharing 5 tokens does not fit"):
        PackedRow.build(LENGTHS, 6, groups=[PromptGroup(0, 2, 5)])
    with pytest.raises(ValueError, match="overlaps another group"):
        PackedRow.build(LENGTHS, 6, groups=[PromptGroup(0, 2, 1), PromptGroup(1, 3, 1)])


def test_units_cut_groups_to_the_budget_and_keep_row_order():
    lengths = [10, 12, 11, 9, 7]
    units = packing_units(lengths, [PromptGroup(0, 4, 8)], capacity=14)
    # 8 shared + (2 + 4) fits 14; + 3 would not
    assert [(u.start, u.end, u.shared, u.tokens) for u in units] == [(0, 2, 8, 14), (2, 4, 8, 12), (4, 5, 0, 7)]
    assert [(u.start, u.end) for u in packing_units(lengths, [PromptGroup(0, 4, 8)], capacity=11)] == [
        (0, 1), (1, 2), (2, 3), (3, 4), (4, 5)
    ]  # fmt: skip


def test_plan_keeps_groups_in_one_micro_batch():
    lengths = [20, 22, 21, 23, 9, 8, 30]
    groups = [PromptGroup(0, 4, 18), PromptGroup(4, 6, 5)]
    ((order, bins),) = plan_shared_prompt_micro_batches([(lengths, groups)], 32, "first_fit_decreasing")
    assert sorted(order) == list(range(7))
    spans = [order[a:b] for a, b in bins]
    for group in groups:
        members = set(range(group.start, group.end))
        assert sum(bool(members & set(s)) for s in spans) == 1, spans
    for a, b in bins:
        rows = sorted(order[a:b])
        assert rows == order[a:b]


def test_driver_deals_whole_groups_over_shards():
    """GRPO's batch: 4 prompts x 3 samples over 2 shards -- each shard gets whole groups,
    every micro batch holds whole groups, and shards have equally many micro batches."""
    rng = np.random.default_rng(0)
    rows, masks, lengths = [], [], []
    for g in range(4):
        prompt = rng.integers(3, 50, 6 + g)
        for _ in range(3):
            n = len(prompt) + int(rng.integers(1, 5))
            row = np.zeros(16, np.int64)
            row[: len(prompt)], row[len(prompt) : n] = prompt, rng.integers(3, 50, n - len(prompt))
            mask = np.zeros(16)
            mask[len(prompt) : n] = 1
            rows.append(row), masks.append(mask), lengths.append(n)
    data = BatchedDataDict(
        input_ids=torch.tensor(np.stack(rows)),
        input_lengths=torch.tensor(lengths),
        token_mask=torch.tensor(np.stack(masks)),
    )
    args = SequencePackingArgs(
        input_key="input_ids",
        input_lengths_key="input_lengths",
        max_tokens_per_microbatch=32,
        algorithm="modified_first_fit_decreasing",
        shared_prompts=True,
    )
    shards, order = data.shard_by_batch_size(2, sequence_packing_args=args)
    assert sorted(order) == list(range(12))
    counts = []
    for shard in shards:
        ranges = shard.micro_batch_indices[0]
        counts.append(len(ranges))
        for a, b in ranges:
            ids = shard["input_ids"][a:b]
            groups = prompt_groups(ids, shard["input_lengths"][a:b], shard["token_mask"][a:b])
            assert sum(g.end - g.start for g in groups) == b - a  # every row of the bin in a group
            layout = PackedRow.build(shard["input_lengths"][a:b].tolist(), 16, groups=groups)
            assert layout.tokens <= 32
    assert counts[0] == counts[1]
    # a budget that cuts groups: still every row once, equally many micro batches per shard
    shards, order = data.shard_by_batch_size(2, sequence_packing_args={**args, "max_tokens_per_microbatch": 16})
    assert sorted(order) == list(range(12))
    assert len({len(shard.micro_batch_indices[0]) for shard in shards}) == 1
