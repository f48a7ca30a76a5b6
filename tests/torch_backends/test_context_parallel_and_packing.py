"""Context parallelism (DTensor) and sequence packing (FSDP1 and DTensor) against the plain path.

Every layout runs the same three checks on one batch of very uneven lengths:
``get_logprobs`` against single-process HF (1e-5), the first ClippedPG step's loss and
global gradient norm against a plain one-worker DTensor policy (1e-5: the gradients agree,
or the norm would not), three AdamW steps' losses (1e-4) and the logprobs after them (1e-4).
Before its steps every such layout refuses a logits-only loss (no ``loss_from_logprobs``) by
name on the driver, and the same policy then trains those steps.
``make test`` runs cp2 and tp2-packed on Llama; the others (Qwen2, FSDP1 packing, the
4-worker dp2 x cp2 and cp2 x tp2 with and without sequence parallelism, cp2 + packing) are
``slow`` (``make test-all``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.config import ConfigError
from core.data.sequence_packing import PackedRow, check_packing_budget, pack_bins, plan_packed_micro_batches
from core.distributed import RayVirtualCluster
from core.losses import ClippedPGLossFn
from core.losses.contract import LossContractError
from core.policy import Policy
from core.policy.config import PolicyConfig
from tests.backends.conftest import LogitsOnlyNLL
from tests.torch_backends.conftest import hf_logprobs, policy_config, uneven_pg_batch
from tests.unit.test_losses import BASE_CFG

WIDTH = 32
# Very uneven: most rows are a few tokens, two fill the width (padded fraction ~55%).
LENGTHS = [32, 3, 5, 2, 30, 4, 9, 3]
PACKING = {"enabled": True, "train_mb_tokens": 48, "logprob_mb_tokens": 48}


def uneven_batch(seed: int = 0):
    return uneven_pg_batch(LENGTHS, WIDTH, seed)


def _layout_cfg(model_dir, backend, workers, cp=1, tp=1, sp=False, packing=None, multiple=1):
    cfg = policy_config(
        model_dir,
        backend,
        tp=tp,
        sp=sp,
        train_global_batch_size=8,
        train_micro_batch_size=8 // workers * tp * cp if workers > 1 else 4,
    )
    cfg["parallel"]["context_parallel_size"] = cp
    cfg["make_sequence_length_divisible_by"] = multiple
    # AdamW's first step moves a weight by lr x g / (|g| + eps): an element whose gradient is
    # about eps moves by lr / (4 eps) times its rounding difference (2.5e5 at this file's lr
    # 1e-2 and eps 1e-8), so three steps turn rounding into logprob differences.  Measured
    # (2026-11-27; one SGD step of lr 1 moves each weight by its gradient): the plain path's
    # gradients are bitwise the same at micro batch 4 and 8, and qwen3's DTensor CP ones equal
    # them to 7.5e-9 (3e-7 of the largest, 2.4e-2) -- which at eps 1e-8 became 1.26e-4 in the
    # logprobs after three steps (llama 6.2e-6), and 2.1e-5 at eps 1e-6.  eps 1e-6 keeps that
    # amplification at 2.5e3, below this file's 1e-4 bound.
    cfg["optimizer"]["kwargs"]["eps"] = 1e-6
    if packing:
        cfg["sequence_packing"] = {**cfg["sequence_packing"], **packing}
    return cfg


def _run(cfg, workers, tokenizer, steps=3, logits_only_refused=False):
    """(logprobs before, [(loss, grad norm)] per step, logprobs after) of a fresh policy;
    ``logits_only_refused``: first check that a logits-only loss is refused on the driver."""
    data = uneven_batch()
    cluster = RayVirtualCluster([workers], use_gpus=False)
    policy = Policy(cluster, cfg, tokenizer)
    try:
        if logits_only_refused:
            with pytest.raises(
                LossContractError,
                match=r"^loss LogitsOnlyNLL has no loss_from_logprobs: with sequence packing or context parallelism",
            ):
                policy.train(data, LogitsOnlyNLL())
        before = policy.get_logprobs(data)["logprobs"]
        trace = []
        for _ in range(steps):
            out = policy.train(data, ClippedPGLossFn(BASE_CFG))
            trace.append((float(out.loss[0]), float(out.grad_norm[0])))
        after = policy.get_logprobs(data)["logprobs"]
    finally:
        policy.shutdown()
        cluster.shutdown()
    return before, trace, after


@pytest.fixture(scope="module")
def plain_runs(ray_session, model_dirs, tokenizer):
    """The plain path (one DTensor worker, no packing, cp=1) per model, computed once."""
    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = _run(_layout_cfg(model_dirs[model], "torch_dtensor", 1), 1, tokenizer)
        return cache[model]

    return get


LAYOUTS = [
    # make test: one CP and one packed layout (one plain reference); the rest is slow
    pytest.param(("torch_dtensor", "llama", 2, dict(cp=2, multiple=4)), id="dtensor-cp2-llama"),
    pytest.param(("torch_dtensor", "llama", 2, dict(tp=2, packing=PACKING)), id="dtensor-tp2-packed-llama"),
    pytest.param(("torch_dtensor", "qwen2", 2, dict(cp=2, multiple=4)), id="dtensor-cp2-qwen2", marks=pytest.mark.slow),
    pytest.param(
        ("torch_fsdp", "llama", 2, dict(packing=PACKING)), id="fsdp1-dp2-packed-llama", marks=pytest.mark.slow
    ),
    pytest.param(
        ("torch_dtensor", "qwen2", 2, dict(tp=2, packing=PACKING)),
        id="dtensor-tp2-packed-qwen2",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        ("torch_dtensor", "llama", 4, dict(cp=2, multiple=4)), id="dtensor-dp2-cp2-llama", marks=pytest.mark.slow
    ),
    pytest.param(
        ("torch_dtensor", "llama", 4, dict(cp=2, tp=2, multiple=4)), id="dtensor-cp2-tp2-llama", marks=pytest.mark.slow
    ),
    pytest.param(
        ("torch_dtensor", "qwen2", 4, dict(cp=2, tp=2, sp=True, multiple=8)),
        id="dtensor-cp2-tp2-sp-qwen2",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        ("torch_dtensor", "llama", 2, dict(cp=2, multiple=4, packing=PACKING)),
        id="dtensor-cp2-packed-llama",
        marks=pytest.mark.slow,
    ),
    # Qwen3's per-head q/k norms under CP (sharded sequence) and packing (position ids restart)
    pytest.param(("torch_dtensor", "qwen3", 2, dict(cp=2, multiple=4)), id="dtensor-cp2-qwen3", marks=pytest.mark.slow),
    pytest.param(
        ("torch_dtensor", "qwen3", 2, dict(tp=2, packing=PACKING)),
        id="dtensor-tp2-packed-qwen3",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_plain_path(layout, plain_runs, model_dirs, tokenizer):
    backend, model, workers, kw = layout
    cfg = _layout_cfg(model_dirs[model], backend, workers, **kw)
    before, trace, after = _run(cfg, workers, tokenizer, logits_only_refused=True)
    ref_before, ref_trace, ref_after = plain_runs(model)
    data = uneven_batch()
    hf = AutoModelForCausalLM.from_pretrained(model_dirs[model]).float()
    assert (before - hf_logprobs(hf, data["input_ids"], data["input_lengths"])).abs().max() < 1e-5
    assert (before - ref_before).abs().max() < 1e-5
    (loss, norm), (ref_loss, ref_norm) = trace[0], ref_trace[0]
    assert abs(loss - ref_loss) < 1e-5 and abs(norm - ref_norm) < 1e-5, (trace[0], ref_trace[0])
    for (loss, _), (ref_loss, _) in zip(trace, ref_trace, strict=True):
        assert abs(loss - ref_loss) < 1e-4, (trace, ref_trace)
    assert (after - ref_after).abs().max() < 1e-4
    assert not torch.equal(after, before)  # the steps did train


# ------------------------------------------------------------------ layout arithmetic (no Ray)
def test_packed_row_round_trip():
    data = uneven_batch()
    row = PackedRow.build(LENGTHS, WIDTH, multiple=8)  # 88 tokens: no padding tail needed
    assert PackedRow.build(LENGTHS, WIDTH, multiple=64).width == 128
    packed = row.pack(data["input_ids"])
    assert packed.shape == (1, 88) and row.width == 88 and int(row.valid.sum()) == sum(LENGTHS)
    for i, (start, n) in enumerate(zip(row.starts, LENGTHS, strict=True)):
        assert torch.equal(packed[0, start : start + n], data["input_ids"][i, :n])
        assert row.positions[start : start + n].tolist() == list(range(n))
    # Unpacking puts packed column start_i + t at (i, t) for t < len_i - 1, zero elsewhere.
    unpacked = row.unpack_next_logprobs(torch.arange(87.0)[None])
    assert unpacked[0, :31].tolist() == list(range(31)) and unpacked[1, :2].tolist() == [32.0, 33.0]
    assert unpacked[1, 2:].abs().sum() == 0


@pytest.mark.parametrize("algorithm", ["modified_first_fit_decreasing", "first_fit_decreasing", "concatenative"])
def test_bins_respect_the_budget_and_keep_every_row(algorithm):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 60, (200,), generator=g).tolist()
    bins = pack_bins(lengths, 64, algorithm)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    plans = plan_packed_micro_batches([lengths[:100], lengths[100:]], 64, algorithm)
    assert len(plans[0][1]) == len(plans[1][1])  # lockstep: same number of micro batches per rank
    assert all(sorted(order) == list(range(100)) for order, _ in plans)


def test_modified_ffd_packs_no_worse_than_ffd_on_long_and_mid_mixes():
    lengths = [60, 33, 31, 30, 27, 26, 12, 11, 10, 9, 5, 3] * 5
    mffd = pack_bins(lengths, 64, "modified_first_fit_decreasing")
    assert len(mffd) <= len(pack_bins(lengths, 64, "first_fit_decreasing"))


def test_bad_cp_and_packing_settings_name_the_field(model_dirs):
    # The row padding context parallelism needs (2 x cp chunks, x tp with sequence parallelism)
    # is derived by the torch_dtensor worker, not demanded of make_sequence_length_divisible_by.
    cfg = _layout_cfg(model_dirs["llama"], "torch_dtensor", 2, cp=2, multiple=1)
    assert PolicyConfig.checked(cfg, 2).make_sequence_length_divisible_by == 1
    sp = _layout_cfg(model_dirs["llama"], "torch_dtensor", 4, cp=2, tp=2, sp=True, multiple=4)
    assert PolicyConfig.checked(sp, 4).parallel.sequence_parallel
    with pytest.raises(ConfigError, match=r"context_parallel_size: .* does not divide the world size \(3\)"):
        PolicyConfig.checked(_layout_cfg(model_dirs["llama"], "torch_dtensor", 2, cp=2, multiple=4), 3)
    small = _layout_cfg(model_dirs["llama"], "torch_fsdp", 2, packing={**PACKING, "train_mb_tokens": 16})
    with pytest.raises(ConfigError, match=r"sequence_packing.train_mb_tokens: 16 is smaller than max_total_sequence"):
        PolicyConfig.checked(small, 2)
    algo = copy.deepcopy(small)
    algo["sequence_packing"].update(train_mb_tokens=48, algorithm="best_fit")
    with pytest.raises(ConfigError, match=r"sequence_packing.algorithm: expected one of"):
        PolicyConfig.checked(algo, 2)
    with pytest.raises(
        ValueError,
        match=r"policy.sequence_packing.train_mb_tokens=16 is smaller than sequence 0 "
        r"\(length 32\)",
    ):
        check_packing_budget(LENGTHS, 16, "policy.sequence_packing.train_mb_tokens")
