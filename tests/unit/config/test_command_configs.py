"""The run config of each command: sections and data keys of another command refused by name,
and each command's own rules."""

from __future__ import annotations

import pytest

from core.algorithms.config import (
    DPORunConfig,
    GRPORunConfig,
    SFTRunConfig,
)
from core.config import (
    DEFAULT_CONFIG_PATH,
)
from tests.unit.config.cases import (
    DPO,
    GRPO,
    REPO,
    SFT,
    load_errors,
)


# =============================================================================
# the run config of each command: sections and data keys refused by name
# =============================================================================
@pytest.mark.parametrize(
    "path, schema, overrides, expected",
    [
        (
            SFT,
            SFTRunConfig,
            ["env.name=arithmetic"],
            "env: not used by dualrl sft; remove the section (it reads policy, cluster, sft, data, logger, "
            "checkpointing) (from override 'env.name=arithmetic')",
        ),
        (
            DPO,
            DPORunConfig,
            ["loss_fn.ratio_clip_min=0.2"],
            "loss_fn: not used by dualrl dpo; remove the section (it reads policy, cluster, dpo, data, logger, "
            "checkpointing) (from override 'loss_fn.ratio_clip_min=0.2')",
        ),
        (
            GRPO,
            GRPORunConfig,
            ["sft.seed=1"],
            "sft: not used by dualrl grpo; remove the section (it reads policy, cluster, loss_fn, grpo, data, env, "
            "logger, checkpointing) (from override 'sft.seed=1')",
        ),
        (
            SFT,
            SFTRunConfig,
            ["data.answer_key=a"],
            "data.answer_key: not used by dualrl sft (a key of grpo); remove it (from override 'data.answer_key=a')",
        ),
        (
            GRPO,
            GRPORunConfig,
            ["data.on_long_sequence=filter"],
            "data.on_long_sequence: not used by dualrl grpo (a key of sft/dpo); remove it "
            "(from override 'data.on_long_sequence=filter')",
        ),
        (
            DPO,
            DPORunConfig,
            ["data.response_key=r"],
            "data.response_key: not used by dualrl dpo (a key of sft); remove it (from override 'data.response_key=r')",
        ),
        (
            SFT,
            SFTRunConfig,
            ["data.chosen_key=c"],
            "data.chosen_key: not used by dualrl sft (a key of dpo); remove it (from override 'data.chosen_key=c')",
        ),
        (
            SFT,
            SFTRunConfig,
            ["logger.num_val_samples_to_print=1"],
            "logger.num_val_samples_to_print: not used by dualrl sft (it prints GRPO's validation completions); "
            "remove it (from override 'logger.num_val_samples_to_print=1')",
        ),
        (
            DPO,
            DPORunConfig,
            ["policy.generation={backend: hf, max_new_tokens: 4}"],
            "policy.generation: not used by dualrl dpo, which never generates (and its temperature would scale the "
            "logits the loss trains on); set policy.generation: null "
            "(from override 'policy.generation={backend: hf, max_new_tokens: 4}')",
        ),
    ],
)
def test_a_key_of_another_command_is_refused_by_name(path, schema, overrides, expected):
    assert load_errors(path, *overrides, schema=schema) == [expected]


def test_a_refused_section_is_not_checked_further():
    """What lies below a refused key is not listed too (only the refusal)."""
    errs = load_errors(SFT, "env.num_workers=zero", schema=SFTRunConfig)
    assert errs == [
        "env: not used by dualrl sft; remove the section (it reads policy, cluster, sft, data, logger, "
        "checkpointing) (from override 'env.num_workers=zero')"
    ]


def test_a_command_lists_the_sections_it_misses():
    errs = load_errors(DEFAULT_CONFIG_PATH, schema=GRPORunConfig)
    need = "(dualrl grpo needs policy, cluster, loss_fn, grpo, data, env, logger, checkpointing)"
    assert errs == [f"{s}: missing section {need}" for s in ("grpo", "data", "env", "logger", "checkpointing")]


def test_the_embedded_config_of_one_command_is_refused_by_another(monkeypatch):
    monkeypatch.chdir(REPO)
    errs = load_errors(GRPO, schema=SFTRunConfig)
    assert "sft: missing section (dualrl sft needs policy, cluster, sft, data, logger, checkpointing)" in errs
    for refused in ("loss_fn", "grpo", "env"):
        assert any(e.startswith(f"{refused}: not used by dualrl sft") for e in errs), errs
    assert all(e.endswith("(from core/configs/grpo_arithmetic.yaml)") for e in errs if "not used" in e), errs


@pytest.mark.parametrize(
    "path, schema, overrides, expected",
    [
        (
            GRPO,
            GRPORunConfig,
            ["grpo.num_generations_per_prompt=1"],
            "grpo.num_generations_per_prompt: must be >= 2, got 1: GRPO's baseline",
        ),
        (
            GRPO,
            GRPORunConfig,
            ["grpo.num_prompts_per_step=3"],
            "grpo.num_prompts_per_step: 3 prompts x 4 generations = 12 samples per step is not divisible by "
            "policy.train_global_batch_size (512)",
        ),
        (
            GRPO,
            GRPORunConfig,
            ["data.max_input_seq_length=32"],
            "data.max_input_seq_length: 32 leaves no room for a response within policy.max_total_sequence_length (32)",
        ),
        (
            GRPO,
            GRPORunConfig,
            ["data.max_input_seq_length=null"],
            "data.max_input_seq_length: missing (dualrl grpo needs the longest prompt in tokens)",
        ),
        (GRPO, GRPORunConfig, ["policy.generation=null"], "policy.generation: missing; dualrl grpo samples"),
        (
            SFT,
            SFTRunConfig,
            ["sft.val_micro_batch_size=3"],
            "sft.val_global_batch_size: 128 is not divisible by val_micro_batch_size (3)",
        ),
        (
            DPO,
            DPORunConfig,
            ["dpo.val_micro_batch_size=3"],
            "dpo.val_micro_batch_size: must be even, got 3: DPO rows come in (chosen, rejected) pairs",
        ),
        (
            DPO,
            DPORunConfig,
            ["policy.train_micro_batch_size=3", "policy.train_global_batch_size=12"],
            "policy.train_micro_batch_size: must be even for DPO, got 3",
        ),
        (
            DPO,
            DPORunConfig,
            ["policy.sequence_packing.enabled=true"],
            "policy.sequence_packing.enabled: not supported by DPO",
        ),
        (
            SFT,
            SFTRunConfig,
            ["data.dataset_name=rows.jsonl"],
            "data.arithmetic: not used: data.dataset_name is not a built-in arithmetic task",
        ),
        (GRPO, GRPORunConfig, ["checkpointing.checkpoint_dir=null"], "checkpointing.checkpoint_dir: required when"),
    ],
)
def test_the_rules_of_each_command(path, schema, overrides, expected):
    errs = load_errors(path, *overrides, schema=schema)
    assert any(e.startswith(expected) for e in errs), errs
