"""The advantage estimators (core.algorithms.advantages) against hand computations, and the
config rules that tie ``grpo.advantage_estimator`` to the GRPO switches and the loss: an
estimator sets what it implies, and only an explicit value that contradicts it is refused."""

from __future__ import annotations

import math

import pytest
import torch

from core.algorithms.advantages import ESTIMATORS, AdvantageEstimator, compute_advantages
from core.algorithms.config import GRPORunConfig
from core.config import EMBEDDED_CONFIGS, ConfigError, load_config

GRPO_CONFIG = EMBEDDED_CONFIGS["grpo"]


def advantages(estimator, rewards, group, *, loo=False, normalize=False, tokens=None):
    counts = None if tokens is None else torch.tensor(tokens, dtype=torch.float32)
    out = compute_advantages(
        torch.tensor(rewards), group, estimator=estimator, leave_one_out=loo, normalize=normalize, token_counts=counts
    )
    return out.advantages.tolist()


def test_one_registry_entry_per_estimator():
    assert list(ESTIMATORS) == ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "dr_grpo"]
    for name, entry in ESTIMATORS.items():
        assert isinstance(entry, AdvantageEstimator)
        assert entry.compute.__doc__ and "20" in entry.compute.__doc__, f"{name}: its docstring names its paper"
        assert not entry.implies or entry.why, f"{name}: what it implies says why"
        for key in entry.implies:
            section, _, field = key.partition(".")
            assert field in GRPORunConfig.model_fields[section].annotation.model_fields, key


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
    with pytest.raises(ValueError, match="'rloo' needs grpo.use_leave_one_out_baseline=True"):
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


def test_an_estimator_sets_the_switches_it_implies():
    """``grpo.advantage_estimator=rloo`` alone: the estimator sets the leave-one-out baseline
    and no std (the embedded default leaves both switches to the estimator)."""
    cfg = load_config(GRPO_CONFIG, ["grpo.advantage_estimator=rloo"], schema=GRPORunConfig)
    assert (cfg.grpo.normalize_rewards, cfg.grpo.use_leave_one_out_baseline) == (False, True)
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        cfg = load_config(GRPO_CONFIG, [f"grpo.advantage_estimator={name}"], schema=GRPORunConfig)
        assert (cfg.grpo.normalize_rewards, cfg.grpo.use_leave_one_out_baseline) == (False, False)
    cfg = load_config(GRPO_CONFIG, [], schema=GRPORunConfig)  # grpo implies nothing: its own defaults
    assert (cfg.grpo.normalize_rewards, cfg.grpo.use_leave_one_out_baseline) == (True, False)
    cfg = load_config(GRPO_CONFIG, ["grpo.use_leave_one_out_baseline=true"], schema=GRPORunConfig)
    assert cfg.grpo.use_leave_one_out_baseline  # grpo's option, set explicitly


def test_an_explicit_value_that_contradicts_the_estimator_is_refused_by_name():
    errors = config_errors("grpo.advantage_estimator=rloo", "grpo.normalize_rewards=true")
    assert errors == [
        "grpo.normalize_rewards: true contradicts grpo.advantage_estimator: rloo, which needs false (RLOO's "
        "baseline is the mean of the other samples, and it does not divide by a std); leave the key out (the "
        "estimator sets it) or choose another estimator (from override 'grpo.normalize_rewards=true')"
    ]
    errors = config_errors("grpo.advantage_estimator=reinforce_plus_plus", "grpo.use_leave_one_out_baseline=true")
    assert [e.split(":")[0] for e in errors] == ["grpo.use_leave_one_out_baseline"]
    # the value it implies, given explicitly, is no contradiction
    ok = ["grpo.advantage_estimator=rloo", "grpo.normalize_rewards=false", "grpo.use_leave_one_out_baseline=true"]
    assert load_config(GRPO_CONFIG, ok, schema=GRPORunConfig).grpo.advantage_estimator == "rloo"


def test_a_file_that_sets_a_switch_is_an_explicit_value(tmp_path):
    """The estimator fills only what the config leaves out: a recipe file that sets a switch
    contradicts another estimator, and the refusal names the file."""
    (tmp_path / "recipe.yaml").write_text(f"defaults: {GRPO_CONFIG}\ngrpo:\n  normalize_rewards: true\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "recipe.yaml", ["grpo.advantage_estimator=dr_grpo"], schema=GRPORunConfig)
    [line] = info.value.errors
    assert line.startswith("grpo.normalize_rewards: true contradicts grpo.advantage_estimator: dr_grpo")
    assert line.endswith(f"(from {tmp_path / 'recipe.yaml'})")


def test_dr_grpo_sets_the_constant_token_normaliser_and_needs_a_token_level_loss():
    cfg = load_config(GRPO_CONFIG, ["grpo.advantage_estimator=dr_grpo"], schema=GRPORunConfig)
    assert (cfg.loss_fn.token_normalizer, cfg.loss_fn.token_level_loss, cfg.grpo.normalize_rewards) == (
        "constant",
        True,
        False,
    )
    assert cfg.response_token_limit() == 6  # the embedded default's max_new_tokens
    errors = config_errors("grpo.advantage_estimator=dr_grpo", "loss_fn.token_normalizer=global_tokens")
    assert [e.split(":")[0] for e in errors] == ["loss_fn.token_normalizer"]
    assert "global_tokens contradicts grpo.advantage_estimator: dr_grpo, which needs constant" in errors[0]
    errors = config_errors("grpo.advantage_estimator=dr_grpo", "loss_fn.token_level_loss=false")
    assert "loss_fn.token_level_loss" in {e.split(":")[0] for e in errors}
    assert any("false contradicts grpo.advantage_estimator: dr_grpo, which needs true" in e for e in errors)


def test_dr_grpo_loss_budget_defaults_to_the_longest_response():
    from core.algorithms.grpo_setup import grpo_loss_fn

    base = ["grpo.advantage_estimator=dr_grpo"]
    cfg = load_config(GRPO_CONFIG, base, schema=GRPORunConfig)
    assert grpo_loss_fn(cfg).cfg.constant_token_budget == 6
    cfg = load_config(GRPO_CONFIG, [*base, "loss_fn.constant_token_budget=16"], schema=GRPORunConfig)
    assert grpo_loss_fn(cfg).cfg.constant_token_budget == 16
