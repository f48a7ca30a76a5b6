"""DAPO's loop parts without workers: the overlong penalty and filtering against hand values,
dynamic sampling's group selection, and ``generate_rollout`` on a real run whose engine and
environment are scripted (seeds, the groups trained on, the shortfall policies, the async loop)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import core.algorithms.async_grpo as async_grpo
from core.algorithms.config import GRPOConfig, GRPORunConfig
from core.algorithms.dynamic_sampling import DynamicSamplingError, informative_groups, select_groups
from core.algorithms.grpo import generate_rollout, train_on_rollout
from core.algorithms.response_length import overlong_penalty, shape_response_lengths
from core.algorithms.rollouts import sample_seeds
from core.algorithms.timing import StepTimer
from core.config import EMBEDDED_CONFIGS, ConfigError, load_config, load_raw_config
from core.data import BatchedDataDict
from core.datasets import PromptDatum
from core.environments import EnvironmentReturn
from tests.grpo_runs import SMALL, grpo_run

GRPO_CONFIG = EMBEDDED_CONFIGS["grpo"]
EOS, PAD, MAX_NEW = 2, 0, 4


# ----------------------------------------------------------------------------- overlong
def test_overlong_penalty_is_dapo_eq_13():
    # L_max 6, buffer 2: no penalty up to 4 tokens, then a linear ramp to the whole penalty at 6 and beyond
    lengths = torch.tensor([3, 4, 5, 6, 7])
    assert overlong_penalty(lengths, 6, 2, 0.5).tolist() == pytest.approx([0, 0, -0.25, -0.5, -0.5])
    assert overlong_penalty(lengths, 6, 4, 1.0).tolist() == pytest.approx([-0.25, -0.5, -0.75, -1, -1])
    with pytest.raises(ValueError, match="must be in \\(0, 6\\)"):
        overlong_penalty(lengths, 6, 6, 1.0)


def grpo_cfg(**overrides) -> GRPOConfig:
    raw = load_raw_config(GRPO_CONFIG)["grpo"]
    return GRPOConfig.model_validate({**raw, **overrides})


def test_overlong_filtering_and_shaping_with_their_metrics():
    cfg = grpo_cfg(overlong_filtering=True, reward_shaping={"enabled": True, "overlong_buffer_length": 2})
    rewards, lengths = torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([3, 5, 6, 6])
    truncated = torch.tensor([False, False, True, False])  # the last row ended on its stop token at L_max
    out = shape_response_lengths(rewards, lengths, truncated, cfg, 6)
    assert out.rewards.tolist() == pytest.approx([1.0, 0.5, -1.0, -1.0])
    assert out.sample_mask.tolist() == [1, 1, 0, 1]
    assert out.metrics(cfg) == {
        "truncated_samples": 1.0,
        "overlong_filtered_samples": 1.0,
        "overlong_penalty_mean": pytest.approx(-0.625),
        "overlong_penalized_samples": 3.0,
    }
    off = shape_response_lengths(rewards, lengths, truncated, grpo_cfg(), 6)
    assert torch.equal(off.rewards, rewards) and off.sample_mask.tolist() == [1] * 4 and off.metrics(grpo_cfg()) == {}


@pytest.mark.parametrize(
    "override, message",
    [
        ("grpo.dynamic_sampling_max_gen_batches=0", "grpo.dynamic_sampling_max_gen_batches: must be >= 1, got 0"),
        (
            "grpo.dynamic_sampling_on_shortfall=retry",
            "grpo.dynamic_sampling_on_shortfall: expected one of 'train', 'skip', 'error', got 'retry'",
        ),
        (
            "grpo.reward_shaping={enabled: true}",
            "grpo.reward_shaping.overlong_buffer_length: required when reward_shaping.enabled is true",
        ),
        (
            "grpo.reward_shaping={enabled: true, overlong_buffer_length: 6}",
            "grpo.reward_shaping.overlong_buffer_length: 6 must be < the longest response, 6 tokens",
        ),
        (
            "grpo.reward_shaping={enabled: true, overlong_buffer_length: 2, overlong_buffer_penalty: -1}",
            "grpo.reward_shaping.overlong_buffer_penalty: must be >= 0.0, got -1",
        ),
    ],
)
def test_bad_dapo_settings_name_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(GRPO_CONFIG, [override], schema=GRPORunConfig)
    assert message in str(err.value)


# ----------------------------------------------------------------------------- group selection
def test_informative_groups_and_the_selection_keep_generation_order():
    flags = informative_groups(torch.tensor([1.0, 1, 0, 1, 0, 0, 1, 0, 0.5, 0.5]), 2)
    assert flags.tolist() == [False, True, False, True, False]
    sel = select_groups(flags, 2, target_groups=2, gen_batches=3, batch_multiple=4)
    assert sel.rows.tolist() == [2, 3, 6, 7] and sel.trained.tolist() == [1] * 4 and sel.train_rows == 4
    assert (sel.informative, sel.dropped, sel.surplus, sel.cap_hit) == (2, 3, 0, False)
    # 2 informative of 3 wanted, one global batch of 6 rows: one masked filler group
    short = select_groups(flags, 2, target_groups=3, gen_batches=3, batch_multiple=6)
    assert short.rows.tolist() == [2, 3, 6, 7, 0, 1] and short.trained.tolist() == [1, 1, 1, 1, 0, 0]
    assert short.cap_hit and short.metrics()["dynamic_sampling/cap_hit"] == 1.0
    assert select_groups(flags, 2, target_groups=1, gen_batches=1, batch_multiple=2).surplus == 1


def test_a_short_selection_fills_only_the_last_global_batch():
    """Several optimizer steps per batch: fewer informative rows make fewer whole global batches,
    each with informative rows, never a step on filler alone."""
    flags = torch.tensor([False, True, False, True, True, False, False, False])
    sel = select_groups(flags, 2, target_groups=6, gen_batches=2, batch_multiple=4)  # 12 rows = 3 steps
    assert sel.train_rows == 8 and sel.rows.tolist() == [2, 3, 6, 7, 8, 9, 0, 1]  # 6 informative + 2 filler
    assert sel.trained.tolist() == [1] * 6 + [0] * 2
    # global batches of 7 rows: 6 informative rows + 1 row of a filler group (the step trains on 7)
    odd = select_groups(flags, 2, target_groups=7, gen_batches=2, batch_multiple=7)
    assert odd.train_rows == 7 and len(odd.rows) == 8 and odd.trained[:7].tolist() == [1] * 6 + [0]
    none = select_groups(torch.zeros(6, dtype=torch.bool), 2, target_groups=6, gen_batches=1, batch_multiple=4)
    assert none.train_rows == 4 and none.informative == 0 and none.trained.sum() == 0


# ----------------------------------------------------------------------------- the loop on stand-ins
class ScriptedEngine:
    """Generates for prompt token ``p``: ``1 + row % 2`` tokens then eos, or ``MAX_NEW`` tokens
    without one (truncated) when p >= 50; records each call's seeds; versions like RolloutEngine."""

    def __init__(self) -> None:
        self.seeds: list[list[int]] = []
        self.version = self.policy_version = 0
        self.loaded, self.allow_stale, self.lock = True, False, threading.Lock()

    def generate_tagged(self, batch, greedy):
        self.seeds.append(batch["sample_seeds"].tolist())
        rows, lengths = [], []
        for b, (ids, n) in enumerate(zip(batch["input_ids"].tolist(), batch["input_lengths"].tolist(), strict=True)):
            new = [7] * MAX_NEW if ids[n - 1] >= 50 else [7] * (1 + b % 2) + [EOS]
            rows.append(ids[:n] + new)
            lengths.append(len(new))
        width = max(map(len, rows))
        out = torch.full((len(rows), width), PAD)
        for b, row in enumerate(rows):
            out[b, : len(row)] = torch.tensor(row)
        unpadded = torch.tensor([len(r) for r in rows])
        result = BatchedDataDict(
            output_ids=out,
            logprobs=torch.full(out.shape, -0.5),
            generation_lengths=torch.tensor(lengths),
            unpadded_sequence_lengths=unpadded,
        )
        return result, self.version

    def sync_weights(self):
        self.version = self.policy_version
        return {}

    def mark_stale(self):
        self.policy_version += 1


def scripted_prompts(groups: list[list[list[float]]], first_id: int = 10) -> list[PromptDatum]:
    """Prompts in draw order: batch k's prompts have token ids ``first_id + 10 (k + 1) + j`` and
    carry the rewards their group gets in their metadata."""
    return [
        PromptDatum(f"p{pid}", (1, pid), {"rewards": rewards})
        for k, batch in enumerate(groups)
        for pid, rewards in enumerate(batch, start=first_id + 10 * (k + 1))
    ]


class ScriptedEnv:
    name = "scripted"

    def score(self, texts, completions, metadata):
        rewards = [m["rewards"][i % len(m["rewards"])] for i, m in enumerate(metadata)]
        return EnvironmentReturn(rewards=rewards, infos=[{"correct": r > 0} for r in rewards])


#: The run's settings the scripted groups assume: 2 prompts x 2 samples, one optimizer step per
#: rollout batch (a global batch of 4), raw rewards as advantages' inputs.
BASE = (*SMALL, "grpo.normalize_rewards=false", "grpo.seed=42")


@pytest.fixture
def make_run(tmp_path):
    """``make_run(batches, *overrides, first_id=10)``: a real GRPO run over the scripted prompts,
    with the scripted engine and environment where the workers' would be."""
    runs = []

    def make(batches, *overrides, first_id=10):
        run = grpo_run(tmp_path / f"run{len(runs)}", scripted_prompts(batches, first_id), *BASE, *overrides)
        runs.append(run)
        run.rollouts = ScriptedEngine()
        run.env = ScriptedEnv()
        run.stop_token_ids, run.max_new_tokens = [EOS], MAX_NEW
        return run

    yield make
    for run in runs:
        run.close()


TIED, SPLIT, SPLIT_BACK = [1.0, 1.0], [0.0, 1.0], [1.0, 0.0]


GRPO_LOG = "dualrl.core.algorithms.grpo"


def test_dynamic_sampling_generates_until_enough_groups_are_informative(make_run, caplog):
    run = make_run([[TIED, SPLIT], [[0.0, 0.0], SPLIT_BACK], [SPLIT, SPLIT]], "grpo.use_dynamic_sampling=true")
    with caplog.at_level(logging.WARNING, logger=GRPO_LOG):
        rollout = generate_rollout(run, step=3)
    # call 0 had one informative group, call 1 the second: two calls, the third batch never drawn
    assert run.loader.position == 4 and rollout.loader_state == run.loader.state_dict()
    assert run.engine.seeds == [sample_seeds(42, 3, 4, stream=c).tolist() for c in (0, 1)]
    assert run.engine.seeds[0] != run.engine.seeds[1]
    prompts = rollout.data["input_ids"][:, 1].tolist()
    assert prompts == [21, 21, 31, 31]  # the informative groups, in generation order
    assert rollout.data["sample_mask"].tolist() == [1, 1, 1, 1]
    assert rollout.data["advantages"].amax(1).tolist() == [0, 0.5, 0.5, 0]  # r - group mean: -0.5 / +0.5
    m = rollout.metrics
    assert (m["dynamic_sampling/gen_batches"], m["dynamic_sampling/dropped_groups"]) == (2, 2)
    assert (m["dynamic_sampling/cap_hit"], m["dynamic_sampling/skipped_step"]) == (0, 0)
    assert m["reward_mean"] == pytest.approx(4 / 8)  # every generated sample, dropped groups included
    assert not rollout.skipped and caplog.records == []


def test_without_dynamic_sampling_one_call_trains_on_every_group(make_run):
    run = make_run([[TIED, SPLIT]])
    rollout = generate_rollout(run, step=1)
    assert run.loader.position == 2 and run.engine.seeds == [sample_seeds(42, 1, 4).tolist()]
    assert rollout.data["sample_mask"].tolist() == [1] * 4
    assert not any(k.startswith("dynamic_sampling/") for k in rollout.metrics)


CAP2 = ("grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=2")


def test_at_the_cap_train_masks_the_filler_groups(make_run, caplog):
    run = make_run([[TIED, TIED], [SPLIT, TIED]], *CAP2)
    with caplog.at_level(logging.WARNING, logger=GRPO_LOG):
        rollout = generate_rollout(run, step=1)
    assert rollout.data["input_ids"][:, 1].tolist() == [30, 30, 20, 20]  # informative, then the first dropped
    assert rollout.data["sample_mask"].tolist() == [1, 1, 0, 0]
    assert rollout.data["advantages"][2:].abs().sum() == 0
    assert rollout.metrics["dynamic_sampling/cap_hit"] == 1 and not rollout.skipped
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "found 1 informative group(s) of the 2 wanted in 2 generate call(s)" in record.getMessage()


def test_at_the_cap_train_makes_fewer_optimizer_steps_rather_than_masked_ones(make_run):
    run = make_run([[TIED, TIED], [SPLIT, TIED]], *CAP2, "policy.train_global_batch_size=2")  # 2 steps per batch
    rollout = generate_rollout(run, step=1)
    assert rollout.data.size == 2 and rollout.data["input_ids"][:, 1].tolist() == [30, 30]
    assert rollout.data["sample_mask"].tolist() == [1, 1]


@pytest.mark.parametrize("policy", ["skip", "train"])
def test_at_the_cap_skip_trains_on_nothing(make_run, caplog, policy):
    batches = [[TIED, SPLIT]] if policy == "skip" else [[TIED, TIED]]  # train: no informative group at all
    run = make_run(
        batches,
        "grpo.use_dynamic_sampling=true",
        "grpo.dynamic_sampling_max_gen_batches=1",
        f"grpo.dynamic_sampling_on_shortfall={policy}",
    )
    with caplog.at_level(logging.WARNING, logger=GRPO_LOG):
        rollout = generate_rollout(run, step=1)
    assert rollout.skipped and rollout.metrics["dynamic_sampling/skipped_step"] == 1
    assert "skipping the step (no update)" in caplog.records[0].getMessage()
    assert train_on_rollout(run, rollout, 1, StepTimer()) == {}  # no policy started: nothing was trained
    assert run.engine.policy_version == 1  # the step still counts as a weights version


def test_at_the_cap_error_stops_the_run(make_run):
    run = make_run(
        [[TIED, SPLIT]],
        "grpo.use_dynamic_sampling=true",
        "grpo.dynamic_sampling_max_gen_batches=1",
        "grpo.dynamic_sampling_on_shortfall=error",
    )
    with pytest.raises(DynamicSamplingError, match="dynamic_sampling_on_shortfall is error"):
        generate_rollout(run, step=1)


def test_overlong_rows_are_masked_and_penalised_in_the_loop(make_run):
    run = make_run(
        [[SPLIT, SPLIT]],
        "grpo.overlong_filtering=true",
        "grpo.reward_shaping={enabled: true, overlong_buffer_length: 2}",
        first_id=40,  # prompt ids 50, 51: every row runs to MAX_NEW without eos
    )
    rollout = generate_rollout(run, step=1)
    assert rollout.data["sample_mask"].tolist() == [0, 0, 0, 0]
    m = rollout.metrics
    assert m["truncated_samples"] == 4 and m["overlong_filtered_samples"] == 4
    assert m["overlong_penalty_mean"] == pytest.approx(-1.0)  # 4 tokens = L_max: the whole penalty
    assert m["truncated_fraction"] == 1.0


def test_dynamic_sampling_runs_in_the_async_loop(make_run, monkeypatch):
    """The producer thread runs the real generate_rollout: every step gets its informative groups."""
    batches = [[TIED, SPLIT], [SPLIT_BACK, TIED]] * 3
    run = make_run(batches, "grpo.use_dynamic_sampling=true", "grpo.async_grpo.max_trajectory_age_steps=1")
    trained = []

    def train(run_, rollout, step, timer):
        trained.append(rollout)
        run_.engine.mark_stale()
        return {}

    monkeypatch.setattr(async_grpo, "train_on_rollout", train)
    monkeypatch.setattr(async_grpo, "_POLL_S", 0.01)
    scheduler = async_grpo.AsyncGRPO(run, 1, 3, 1)
    scheduler.start()
    try:
        rows = [scheduler.step(step) for step in (1, 2, 3)]
    finally:
        scheduler.stop()
    assert [r.data["input_ids"][:, 1].tolist() for r in trained] == [
        [21, 21, 30, 30],
        [41, 41, 50, 50],
        [61, 61, 70, 70],
    ]
    assert all(m["async/trajectory_age_max"] <= 1 and m["dynamic_sampling/gen_batches"] == 2 for m in rows)
