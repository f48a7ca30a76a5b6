"""The advantage estimators (core.algorithms.advantages) against hand computations, and the
config rules that tie ``grpo.advantage_estimator`` to the GRPO switches and the loss."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch

from core.algorithms.advantages import ESTIMATORS, compute_advantages
from core.algorithms.config import ESTIMATOR_SWITCHES, AdvantageEstimatorName, GRPORunConfig
from core.config import EMBEDDED_CONFIGS, ConfigError, load_config

GRPO_CONFIG = EMBEDDED_CONFIGS["grpo"]


def advantages(estimator, rewards, group, *, loo=False, normalize=False, tokens=None):
    counts = None if tokens is None else torch.tensor(tokens, dtype=torch.float32)
    out = compute_advantages(
        torch.tensor(rewards), group, estimator=estimator, leave_one_out=loo, normalize=normalize, token_counts=counts
    )
    return out.advantages.tolist()


def test_the_registry_the_config_names_and_the_switch_rules_agree():
    assert list(ESTIMATORS) == list(get_args(AdvantageEstimatorName)) == list(ESTIMATOR_SWITCHES)
    for name, fn in ESTIMATORS.items():
        assert fn.__doc__ and "20" in fn.__doc__, f"{name}: its docstring names its paper and year"


def test_grpo_hand_values():
    # group [1, 0, 0, 0]: mean 1/4, population std sqrt(3)/4; a tied group gets exact zeros
    s = math.sqrt(3) / 4
    expected = [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0, 0, 0, 0]
    assert advantages("grpo", [1, 0, 0, 0, 1, 1, 1, 1], 4, normalize=True) == pytest.approx(expected, abs=1e-6)
    assert advantages("grpo", [1, 0, 0, 0], 4) == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_rloo_hand_values():
    # each sample against the mean of the 3 others: [1 | 0 0 0] -> 1, -1/3 ...; [2 | 0 1 1] -> 2 - 2/3 ...
    got = advantages("rloo", [1, 0, 0, 0, 2, 0, 1, 1], 4, loo=True)
    assert got == pytest.approx([1, -1 / 3, -1 / 3, -1 / 3, 4 / 3, -4 / 3, 0, 0], abs=1e-6)


def test_dr_grpo_hand_values():
    # reward minus the group mean, no std: the same in a low-variance and a high-variance group
    got = advantages("dr_grpo", [1, 0, 0, 0, 2, 0, 1, 1], 4)
    assert got == pytest.approx([0.75, -0.25, -0.25, -0.25, 1, -1, 0, 0], abs=1e-6)


def test_reinforce_plus_plus_hand_values():
    # groups [1, 0] [1, 1], token counts [1, 3, 2, 2]: token-weighted mean 5/8, variance 15/64
    s = math.sqrt(15 / 64)
    got = advantages("reinforce_plus_plus", [1, 0, 1, 1], 2, tokens=[1, 3, 2, 2])
    assert got == pytest.approx([0.375 / s, -0.625 / s, 0.375 / s, 0.375 / s], abs=1e-6)
    # every sample weighing 1: mean 3/4, std sqrt(3)/4; the tied group is *not* zeroed
    s = math.sqrt(3) / 4
    got = advantages("reinforce_plus_plus", [1, 0, 1, 1], 2)
    assert got == pytest.approx([0.25 / s, -0.75 / s, 0.25 / s, 0.25 / s], abs=1e-6)


def test_reinforce_plus_plus_baseline_hand_values():
    # group means subtracted: [0.5, -0.5, 0, 0]; token-weighted (1, 3, 2, 2): mean -1/8, variance 7/64
    s = math.sqrt(7 / 64)
    got = advantages("reinforce_plus_plus_baseline", [1, 0, 1, 1], 2, tokens=[1, 3, 2, 2])
    assert got == pytest.approx([0.625 / s, -0.375 / s, 0.125 / s, 0.125 / s], abs=1e-6)


def test_a_sample_with_no_tokens_does_not_move_the_batch_statistics():
    with_masked = advantages("reinforce_plus_plus", [1, 0, 1, 1, 9, 0], 2, tokens=[1, 3, 2, 2, 0, 0])
    without = advantages("reinforce_plus_plus", [1, 0, 1, 1], 2, tokens=[1, 3, 2, 2])
    assert with_masked[:4] == pytest.approx(without, abs=1e-6)


def test_the_default_estimator_gives_exactly_the_grpo_numbers():
    """grpo is today's computation: same floats for every switch combination."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0, 2.0, 1.0])
    for loo in (False, True):
        for normalize in (False, True):
            a = compute_advantages(rewards, 4, estimator="grpo", leave_one_out=loo, normalize=normalize)
            counts = torch.arange(12.0)  # token counts are not read by grpo
            b = compute_advantages(
                rewards, 4, estimator="grpo", leave_one_out=loo, normalize=normalize, token_counts=counts
            )
            assert torch.equal(a.advantages, b.advantages)


def test_contradictory_switches_and_unknown_names_are_refused_by_the_function():
    with pytest.raises(ValueError, match="'rloo' needs use_leave_one_out_baseline=True"):
        compute_advantages(torch.zeros(4), 2, estimator="rloo", leave_one_out=False, normalize=False)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; known: grpo, rloo"):
        compute_advantages(torch.zeros(4), 2, estimator="ppo", leave_one_out=False, normalize=False)


# ----------------------------------------------------------------------------- config rules
def config_errors(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(GRPO_CONFIG, list(overrides), schema=GRPORunConfig)
    return info.value.errors


def test_an_unknown_estimator_lists_the_known_ones():
    assert config_errors("grpo.advantage_estimator=ppo") == [
        "grpo.advantage_estimator: expected one of 'grpo', 'rloo', 'reinforce_plus_plus', "
        "'reinforce_plus_plus_baseline', 'dr_grpo', got 'ppo' (from override 'grpo.advantage_estimator=ppo')"
    ]


def test_an_estimator_that_contradicts_the_switches_names_each_switch():
    errors = config_errors("grpo.advantage_estimator=rloo")  # the embedded default normalises, no loo
    assert [e.split(":")[0] for e in errors] == ["grpo.normalize_rewards", "grpo.use_leave_one_out_baseline"]
    assert "must be false with advantage_estimator: rloo (RLOO's baseline is the mean of the other" in errors[0]
    ok = ["grpo.advantage_estimator=rloo", "grpo.normalize_rewards=false", "grpo.use_leave_one_out_baseline=true"]
    assert load_config(GRPO_CONFIG, ok, schema=GRPORunConfig).grpo.advantage_estimator == "rloo"
    errors = config_errors("grpo.advantage_estimator=reinforce_plus_plus")
    assert errors[0].startswith("grpo.normalize_rewards: must be false with advantage_estimator: reinforce_plus_plus")


def test_dr_grpo_needs_the_constant_token_normaliser_and_a_token_level_loss():
    base = ["grpo.advantage_estimator=dr_grpo", "grpo.normalize_rewards=false"]
    errors = config_errors(*base)
    assert errors == [
        "loss_fn.token_normalizer: must be constant with grpo.advantage_estimator: dr_grpo, got 'global_tokens' "
        "(Dr. GRPO sums each response's token losses over a constant token budget, with no length normaliser) "
        "(from core/configs/default.yaml)"
    ]
    errors = config_errors(*base, "loss_fn.token_normalizer=constant", "loss_fn.token_level_loss=false")
    assert {e.split(":")[0] for e in errors} == {"loss_fn.token_level_loss", "loss_fn.token_normalizer"}
    assert any("a sequence-level loss divides each sequence by its own length" in e for e in errors)
    cfg = load_config(GRPO_CONFIG, [*base, "loss_fn.token_normalizer=constant"], schema=GRPORunConfig)
    assert cfg.response_token_limit() == 6  # the embedded default's max_new_tokens


def test_dr_grpo_loss_budget_defaults_to_the_longest_response():
    from core.algorithms.grpo_setup import grpo_loss_fn

    base = ["grpo.advantage_estimator=dr_grpo", "grpo.normalize_rewards=false", "loss_fn.token_normalizer=constant"]
    cfg = load_config(GRPO_CONFIG, base, schema=GRPORunConfig)
    assert grpo_loss_fn(cfg).cfg.constant_token_budget == 6
    cfg = load_config(GRPO_CONFIG, [*base, "loss_fn.constant_token_budget=16"], schema=GRPORunConfig)
    assert grpo_loss_fn(cfg).cfg.constant_token_budget == 16
