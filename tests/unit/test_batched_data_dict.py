"""Unit tests for core.data.BatchedDataDict (NeMo RL semantics) and dynamic batching."""

import pickle
import random
import subprocess
import sys
from pathlib import Path
from typing import TypedDict

import pytest
import torch
import torch.distributed as dist

from core.data import BatchedDataDict, DynamicBatchingArgs, SlicedDataDict
from core.data.dynamic_batching import (
    MissingKeyError,
    plan_lockstep_micro_batches,
    round_up,
    sort_and_deal,
)

# ---------------------------------------------------------------- fixtures


def make_batch(n=6, width=5):
    """Mixed batch: 2-D and 1-D tensors plus a list, row i identifiable by value i."""
    return BatchedDataDict(
        {
            "input_ids": torch.arange(n * width).view(n, width),
            "advantages": torch.arange(n, dtype=torch.float32),
            "text": [f"row{i}" for i in range(n)],
        }
    )


def make_seq_batch(lengths, width=None):
    """Batch of right-padded sequences with the given real lengths; ``row`` = original index."""
    width = width or max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(1, n + 1)
    return BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": torch.tensor(lengths),
            "row": list(range(len(lengths))),
        }
    )


def dyn_args(round_to=4, budget=32) -> DynamicBatchingArgs:
    return DynamicBatchingArgs(
        input_key="input_ids",
        input_lengths_key="input_lengths",
        sequence_length_round=round_to,
        max_tokens_per_microbatch=budget,
    )


def assert_same(a, b):
    """Same keys, same values (tensors compared exactly, with dtype)."""
    assert list(a.keys()) == list(b.keys())
    for key in a:
        if torch.is_tensor(a[key]):
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


# ------------------------------------------------------------------ basics


def test_importing_core_data_stays_light():
    code = "import sys, core.data; print(sorted({'jax', 'ray'} & set(sys.modules)))"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_size_empty_lists_and_tensors():
    assert BatchedDataDict().size == 0
    assert make_batch(6).size == 6


def test_size_mismatch_names_keys():
    batch = BatchedDataDict({"input_ids": torch.zeros(4, 2), "advantages": torch.zeros(3)})
    expected = "batch size mismatch: 'input_ids' has 4 rows, 'advantages' has 3"
    with pytest.raises(ValueError, match=expected):
        _ = batch.size


def test_size_rejects_unsupported_values():
    with pytest.raises(TypeError, match="'x' holds a tuple"):
        _ = BatchedDataDict({"x": (1, 2)}).size
    with pytest.raises(TypeError, match="0-dim"):
        _ = BatchedDataDict({"x": torch.tensor(1.0)}).size


def test_generic_subscription_and_subclass():
    class Sample(TypedDict):
        input_ids: torch.Tensor

    alias = BatchedDataDict[Sample]
    assert alias is not None
    assert issubclass(SlicedDataDict, BatchedDataDict)


def test_get_dict_is_plain_shallow_copy():
    batch = make_batch()
    plain = batch.get_dict()
    assert type(plain) is dict
    assert plain["input_ids"] is batch["input_ids"]
    plain["extra"] = [1]
    assert "extra" not in batch


def test_to_moves_in_place_and_returns_self():
    batch = make_batch()
    batch.micro_batch_indices, batch.micro_batch_lengths = [[(0, 6)]], [[5]]
    out = batch.to("cpu")
    assert out is batch
    assert batch.micro_batch_indices == [[(0, 6)]]
    assert batch["text"][0] == "row0"


def test_pickle_round_trip_keeps_plan_and_class():
    batch = make_seq_batch([3, 7, 2, 5])
    shards, _ = batch.shard_by_batch_size(2, dynamic_batching_args=dyn_args())
    restored = pickle.loads(pickle.dumps(shards[1]))
    assert type(restored) is SlicedDataDict
    assert_same(restored, shards[1])
    assert restored.micro_batch_indices == shards[1].micro_batch_indices
    assert restored.micro_batch_lengths == shards[1].micro_batch_lengths


# -------------------------------------------------------------- from_batches


def test_from_batches_concatenates_lists_and_tensors():
    a, b = make_batch(2), make_batch(3)
    merged = BatchedDataDict.from_batches([a, b])
    assert merged.size == 5
    assert merged["text"] == ["row0", "row1", "row0", "row1", "row2"]
    assert torch.equal(merged["advantages"], torch.tensor([0.0, 1, 0, 1, 2]))
    assert torch.equal(merged["input_ids"][2:], b["input_ids"])


def test_from_batches_pads_dim1_with_per_key_values():
    a = {"ids": torch.ones(1, 2, dtype=torch.long), "mask": torch.ones(1, 2)}
    b = {"ids": torch.ones(2, 4, dtype=torch.long), "mask": torch.ones(2, 4)}
    merged = BatchedDataDict.from_batches([a, b], pad_value_dict={"ids": -100})
    assert torch.equal(merged["ids"][0], torch.tensor([1, 1, -100, -100]))
    assert torch.equal(merged["mask"][0], torch.tensor([1.0, 1, 0, 0]))  # default pad 0
    assert merged["ids"].shape == (3, 4)


def test_from_batches_pads_only_dim1_of_3d_tensors():
    a = {"topk": torch.ones(1, 2, 3)}
    b = {"topk": torch.ones(1, 4, 3)}
    merged = BatchedDataDict.from_batches([a, b], pad_value_dict={"topk": 7.0})
    assert merged["topk"].shape == (2, 4, 3)
    assert torch.all(merged["topk"][0, 2:] == 7.0)


def test_from_batches_keeps_class_and_handles_empty():
    assert type(SlicedDataDict.from_batches([make_batch(1)])) is SlicedDataDict
    assert BatchedDataDict.from_batches([]).size == 0


@pytest.mark.parametrize(
    "a, b, error, match",
    [
        ({"x": [1], "y": [2]}, {"x": [3]}, MissingKeyError, "'y' is missing from batch 1"),
        ({"x": [1]}, {"x": [3], "z": [4]}, ValueError, "'z' is missing from batch 0"),
        ({"x": [1]}, {"x": torch.ones(1)}, ValueError, "'x' mixes value types"),
        ({"x": torch.ones(1, 2, 3)}, {"x": torch.ones(1, 2, 4)}, ValueError, r"'x'.*\(1, 2, 3\)"),
        ({"x": torch.ones(1, 2)}, {"x": torch.ones(1)}, ValueError, "'x': cannot concatenate"),
        ({"x": torch.ones(1)}, {"x": torch.ones(1, dtype=torch.long)}, ValueError, "'x'.*dtypes"),
    ],
)
def test_from_batches_errors_name_the_key(a, b, error, match):
    with pytest.raises(error, match=match):
        BatchedDataDict.from_batches([a, b])


# ---------------------------------------------------------------- all_gather


def test_all_gather_single_rank_gloo():
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed without an existing default process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        batch = make_batch(3)
        gathered = batch.all_gather(dist.new_group([0]))
        assert_same(gathered, batch)
    finally:
        dist.destroy_process_group()


def test_all_gather_merges_ranks_in_order_with_padding(monkeypatch):
    """Simulate rank 0 of 2: the peer holds wider, fewer rows."""
    peer = {"ids": torch.full((1, 4), 9), "text": ["peer"]}

    def fake_all_gather_object(out, obj, group=None):
        out[0], out[1] = obj, peer

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", fake_all_gather_object)
    local = BatchedDataDict({"ids": torch.ones(2, 2, dtype=torch.long), "text": ["a", "b"]})
    gathered = local.all_gather(None)
    assert gathered["text"] == ["a", "b", "peer"]
    assert torch.equal(gathered["ids"], torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [9, 9, 9, 9]]))


# ----------------------------------------------------------- row selection


def test_slice_returns_sliced_views():
    batch = make_batch(6)
    part = batch.slice(2, 4)
    assert type(part) is SlicedDataDict
    assert part["text"] == ["row2", "row3"]
    assert part["input_ids"].data_ptr() == batch["input_ids"][2].data_ptr()
    assert batch.slice(3, 3).size == 0
    with pytest.raises(IndexError, match=r"slice \[4, 7\) is out of range for a batch of 6"):
        batch.slice(4, 7)


def test_select_indices_gathers_rows_in_order():
    batch = make_batch(6)
    for indices in ([4, 0, 4], torch.tensor([4, 0, 4])):
        picked = batch.select_indices(indices)
        assert picked["text"] == ["row4", "row0", "row4"]
        assert torch.equal(picked["advantages"], torch.tensor([4.0, 0, 4]))
        assert torch.equal(picked["input_ids"][1], batch["input_ids"][0])
    with pytest.raises(IndexError, match=r"\[6\] out of range"):
        batch.select_indices([0, 6])
    with pytest.raises(TypeError, match="integer tensor"):
        batch.select_indices(torch.ones(6, dtype=torch.bool))


def test_reorder_data_scatters_and_returns_new_dict():
    batch = make_batch(4)
    reordered = batch.reorder_data([2, 0, 3, 1])  # row i moves to position indices[i]
    assert reordered["text"] == ["row1", "row3", "row0", "row2"]
    assert torch.equal(reordered["advantages"], torch.tensor([1.0, 3, 0, 2]))
    assert batch["text"] == ["row0", "row1", "row2", "row3"]  # self untouched
    # Inverse of select_indices.
    assert_same(batch.select_indices([2, 0, 3, 1]).reorder_data([2, 0, 3, 1]), batch)
    with pytest.raises(ValueError, match=r"permutation of range\(4\)"):
        batch.reorder_data([0, 0, 1, 2])


def test_chunk_contiguous_and_errors():
    batch = make_batch(6)
    assert batch.chunk(1, 3)["text"] == ["row2", "row3"]
    with pytest.raises(ValueError, match="batch size 6 is not divisible by chunks=4"):
        batch.chunk(0, 4)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\)"):
        batch.chunk(3, 3)
    with pytest.raises(ValueError, match="chunks must be positive"):
        batch.chunk(0, 0)


def test_get_batch_without_plan():
    batch = make_batch(6)
    assert batch.get_batch(1, 2)["text"] == ["row2", "row3"]
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        batch.get_batch(0)
    with pytest.raises(IndexError):
        batch.get_batch(3, 2)


# ---------------------------------------------------------------- transforms


def test_repeat_interleave_tensors_and_lists():
    batch = BatchedDataDict({"x": torch.tensor([1, 2]), "msgs": [[{"r": "a"}], [{"r": "b"}]]})
    repeated = batch.repeat_interleave(2)
    assert torch.equal(repeated["x"], torch.tensor([1, 1, 2, 2]))
    assert repeated["msgs"] == [[{"r": "a"}], [{"r": "a"}], [{"r": "b"}], [{"r": "b"}]]
    assert repeated["msgs"][0] is not repeated["msgs"][1]  # deep copies, no aliasing
    with pytest.raises(ValueError, match="num_repeats must be positive"):
        batch.repeat_interleave(0)


def test_truncate_tensors_in_place():
    batch = BatchedDataDict({"ids": torch.ones(2, 5), "adv": torch.ones(2), "t": ["a", "b"]})
    assert batch.truncate_tensors(dim=1, truncated_len=3) is batch
    assert batch["ids"].shape == (2, 3)
    assert batch["adv"].shape == (2,)  # too few dims: untouched
    batch.truncate_tensors(dim=1, truncated_len=10)  # longer than width: kept
    assert batch["ids"].shape == (2, 3)
    with pytest.raises(ValueError, match="non-negative"):
        batch.truncate_tensors(dim=1, truncated_len=-1)


def test_make_microbatch_iterator_last_is_shorter():
    batch = make_batch(5)
    micro = list(batch.make_microbatch_iterator(2))
    assert [m.size for m in micro] == [2, 2, 1]
    assert [m["text"][0] for m in micro] == ["row0", "row2", "row4"]
    assert list(BatchedDataDict().make_microbatch_iterator(2)) == []
    with pytest.raises(ValueError, match="microbatch_size must be positive, got 0"):
        batch.make_microbatch_iterator(0)


# ------------------------------------------------------------------ sharding


def test_shard_whole_batch_contiguous():
    batch = BatchedDataDict({"problem_id": [0, 0, 1, 1, 2, 2, 3, 3], "x": torch.arange(8)})
    shards = batch.shard_by_batch_size(shards=2)
    assert all(type(s) is SlicedDataDict for s in shards)
    assert [s["problem_id"] for s in shards] == [[0, 0, 1, 1], [2, 2, 3, 3]]
    assert torch.equal(shards[1]["x"], torch.tensor([4, 5, 6, 7]))
    assert shards[0].micro_batch_indices is None


def test_shard_with_batch_size_interleaves_chunks():
    batch = BatchedDataDict({"problem_id": [0, 0, 1, 1, 2, 2, 3, 3], "x": torch.arange(8)})
    shards = batch.shard_by_batch_size(shards=2, batch_size=4)
    assert [s["problem_id"] for s in shards] == [[0, 0, 2, 2], [1, 1, 3, 3]]
    assert torch.equal(shards[0]["x"], torch.tensor([0, 1, 4, 5]))


def test_shard_uneven():
    batch = BatchedDataDict({"problem_id": [0, 1, 2, 3, 4]})
    shards = batch.shard_by_batch_size(shards=2, allow_uneven_shards=True)
    assert [s["problem_id"] for s in shards] == [[0, 1, 2], [3, 4]]
    shards = batch.shard_by_batch_size(shards=4, allow_uneven_shards=True)
    assert [s["problem_id"] for s in shards] == [[0, 1], [2, 3], [4], []]
    with pytest.raises(ValueError, match=r"5 is not divisible by shards=2.*allow_uneven_shards"):
        batch.shard_by_batch_size(shards=2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(shards=2, batch_size=4, allow_uneven_shards=True), "requires batch_size=None"),
        (dict(shards=2, batch_size=3), "total batch size 8 is not divisible by batch_size 3"),
        (dict(shards=0), "shards must be positive, got 0"),
        (dict(shards=-1), "shards must be positive"),
        (dict(shards=3, batch_size=4), "batch size 4 is not divisible by shards=3"),
        (dict(shards=2, batch_size=0), "batch_size must be positive"),
    ],
)
def test_shard_argument_errors(kwargs, match):
    batch = BatchedDataDict({"problem_id": list(range(8))})
    with pytest.raises(ValueError, match=match):
        batch.shard_by_batch_size(**kwargs)


def test_shard_empty_batch():
    shards = BatchedDataDict({"x": torch.zeros(0, 3), "t": []}).shard_by_batch_size(2)
    assert [s.size for s in shards] == [0, 0]
    assert shards[0]["x"].shape == (0, 3)


# ------------------------------------------------------------ dynamic batching


def test_sort_and_deal_descending_round_robin():
    # sorted (longest first, stable): rows 1(9), 3(9), 0(5), 2(1)
    assert sort_and_deal([5, 9, 1, 9], 2) == [[1, 0], [3, 2]]


def test_planner_budget_and_oversized_row():
    plan = plan_lockstep_micro_batches([[10, 3, 3, 3, 1]], 4, max_tokens_per_microbatch=8)
    # 10 -> 12 exceeds the budget alone: own micro batch; then 4+4 = 8 fits, a third 4 does not.
    assert plan.indices == [(0, 1), (1, 3), (3, 5)]
    assert plan.lengths == [12, 4, 4]


def test_planner_uses_max_over_shards():
    plan = plan_lockstep_micro_batches([[4, 4], [8, 1]], 1, max_tokens_per_microbatch=8)
    assert plan.indices == [(0, 1), (1, 2)]
    assert plan.lengths == [8, 4]
    with pytest.raises(ValueError, match="same number of rows"):
        plan_lockstep_micro_batches([[1, 2], [1]], 1, 8)


def random_lengths(n, seed, width=64):
    rng = random.Random(seed)
    return [rng.randint(1, width) for _ in range(n)]


@pytest.mark.parametrize("shards, batch_size", [(2, None), (4, 16), (3, 12), (1, 8)])
def test_dynamic_plan_respects_budget_and_lockstep(shards, batch_size):
    lengths = random_lengths(48, seed=shards)
    args = dyn_args(round_to=8, budget=160)
    result, _ = make_seq_batch(lengths).shard_by_batch_size(shards, batch_size=batch_size, dynamic_batching_args=args)
    counts = {s.get_microbatch_iterator_dynamic_shapes_len() for s in result}
    assert len(counts) == 1, "every shard must run the same number of micro batches"
    plan = result[0].micro_batch_indices
    assert len(plan) == 48 // (batch_size or 48)
    for shard in result:
        assert shard.micro_batch_indices == plan
        chunks = zip(shard.micro_batch_indices, shard.micro_batch_lengths, strict=True)
        for chunk, (ranges, lens) in enumerate(chunks):
            offset = chunk * ranges[-1][1]
            for (start, end), padded in zip(ranges, lens, strict=True):
                assert (end - start) * padded <= 160 or end - start == 1
                assert padded % 8 == 0
                rows = [lengths[r] for s in result for r in s["row"][offset + start : offset + end]]
                assert padded == round_up(max(rows), 8)  # max over ALL shards' rows


def test_dynamic_sorted_indices_round_trip_multiple_chunks():
    batch = make_seq_batch(random_lengths(24, seed=7, width=20))
    shards, sorted_indices = batch.shard_by_batch_size(3, batch_size=12, dynamic_batching_args=dyn_args())
    merged = BatchedDataDict.from_batches(shards)
    assert merged["row"] == sorted_indices
    assert_same(merged.reorder_data(sorted_indices), batch)


def test_dynamic_keeps_chunks_and_sorts_descending():
    lengths = [1, 2, 3, 4, 8, 7, 6, 5]
    shards, _ = make_seq_batch(lengths).shard_by_batch_size(
        2, batch_size=4, dynamic_batching_args=dyn_args(round_to=1, budget=100)
    )
    # Chunk 0 = rows 0-3, chunk 1 = rows 4-7; each sorted longest first, dealt round-robin.
    assert shards[0]["row"] == [3, 1, 4, 6]
    assert shards[1]["row"] == [2, 0, 5, 7]


def test_dynamic_iterator_truncates_to_padded_length():
    lengths = [3, 7, 2, 5, 1, 1]
    shards, _ = make_seq_batch(lengths, width=9).shard_by_batch_size(
        2, dynamic_batching_args=dyn_args(round_to=4, budget=16)
    )
    # Sorted: rows 1(7) 3(5) 0(3) 2(2) 4(1) 5(1) -> shard 0 gets 1, 0, 4; shard 1 gets 3, 2, 5.
    # Positions need round_up(7)=8, round_up(3)=4, round_up(1)=4: 2 rows * 8 = 16 fits the
    # budget, a third row (3 * 8 = 24) does not.
    shard = shards[0]
    micro = list(shard.make_microbatch_iterator_with_dynamic_shapes())
    assert [m["row"] for m in micro] == [[1, 0], [4]]
    assert shard.micro_batch_lengths == [[8, 4]]
    # The 9-wide tensor is cut to the padded length; 1-D tensors and lists are untouched.
    assert [m["input_ids"].shape[1] for m in micro] == [8, 4]
    for m in micro:
        assert int(m["input_lengths"].max()) <= m["input_ids"].shape[1]
        assert m["input_lengths"].shape == (m.size,)


def test_dynamic_iterator_keeps_width_when_padded_length_is_wider():
    shards, _ = make_seq_batch([5, 5], width=5).shard_by_batch_size(
        1, dynamic_batching_args=dyn_args(round_to=4, budget=100)
    )
    assert shards[0].micro_batch_lengths == [[8]]
    (micro,) = shards[0].make_microbatch_iterator_with_dynamic_shapes()
    assert micro["input_ids"].shape == (2, 5)


def test_get_batch_carries_plan_and_survives_pickle():
    batch = make_seq_batch(random_lengths(16, seed=3, width=30))
    shards, _ = batch.shard_by_batch_size(2, batch_size=8, dynamic_batching_args=dyn_args(budget=40))
    shard = pickle.loads(pickle.dumps(shards[1]))
    second = shard.get_batch(1)  # batch_size taken from the plan: 8 // 2 = 4 rows
    assert second["row"] == shard["row"][4:]
    assert second.micro_batch_indices == [shard.micro_batch_indices[1]]
    assert second.micro_batch_lengths == [shard.micro_batch_lengths[1]]
    assert shard.get_batch(1, 4).micro_batch_indices == second.micro_batch_indices
    from_whole = list(shard.make_microbatch_iterator_with_dynamic_shapes(batch_idx=1))
    second_copy = pickle.loads(pickle.dumps(second))
    from_batch = list(second_copy.make_microbatch_iterator_with_dynamic_shapes())
    assert [m["row"] for m in from_whole] == [m["row"] for m in from_batch]
    assert second.get_microbatch_iterator_dynamic_shapes_len() == len(from_batch)
    total = sum(len(ranges) for ranges in shard.micro_batch_indices)
    assert shard.get_microbatch_iterator_dynamic_shapes_len() == total
    with pytest.raises(ValueError, match="batch_size=3 does not match"):
        shard.get_batch(0, 3)


def test_dynamic_iterator_without_plan_errors():
    with pytest.raises(ValueError, match="no dynamic-batching plan"):
        make_batch().make_microbatch_iterator_with_dynamic_shapes()
    with pytest.raises(ValueError, match="no dynamic-batching plan"):
        make_batch().get_microbatch_iterator_dynamic_shapes_len()


@pytest.mark.parametrize(
    "override, error, match",
    [
        (dict(input_lengths_key="seq_lens"), KeyError, "input_lengths_key 'seq_lens' is not in"),
        (dict(input_lengths_key="seq_lens"), ValueError, "'seq_lens'"),
        (dict(input_key="tokens"), ValueError, "input_key 'tokens'"),
        (dict(sequence_length_round=0), ValueError, "'sequence_length_round'.*got 0"),
        (dict(max_tokens_per_microbatch=-5), ValueError, "'max_tokens_per_microbatch'.*got -5"),
    ],
)
def test_dynamic_argument_errors(override, error, match):
    args = {**dyn_args(), **override}
    with pytest.raises(error, match=match):
        make_seq_batch([1, 2]).shard_by_batch_size(2, dynamic_batching_args=args)


def test_dynamic_rejects_missing_field_bad_lengths_and_uneven():
    args = dyn_args()
    del args["sequence_length_round"]
    with pytest.raises(ValueError, match="missing the field 'sequence_length_round'"):
        make_seq_batch([1, 2]).shard_by_batch_size(2, dynamic_batching_args=args)
    too_long = make_seq_batch([1, 2], width=2)
    too_long["input_lengths"] = torch.tensor([1, 3])
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\]"):
        too_long.shard_by_batch_size(2, dynamic_batching_args=dyn_args())
    with pytest.raises(ValueError, match="cannot be combined with dynamic_batching_args"):
        make_seq_batch([1, 2, 3]).shard_by_batch_size(2, allow_uneven_shards=True, dynamic_batching_args=dyn_args())
