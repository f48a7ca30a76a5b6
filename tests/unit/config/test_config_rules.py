"""The cross-field rules of the policy, cluster and loss sections."""

from __future__ import annotations

import copy
import re

import pytest

from core.algorithms.config import (
    MasterConfig,
)
from core.config import (
    ConfigError,
    validate,
)
from core.losses.config import ClippedPGLossConfig, DPOLossConfig
from core.policy.config import PolicyConfig
from tests.unit.config.cases import (
    errors_of,
    layout_errors,
)


# =============================================================================
# cross-field rules
# =============================================================================
def test_scheduler_milestones_consistency(cfg):
    sched = cfg["policy"]["scheduler"]
    cfg["policy"]["scheduler"] = sched[:2]
    with pytest.raises(ConfigError, match=r"policy\.scheduler: 2 schedulers .* need a 'milestones' entry with 1 step"):
        validate(MasterConfig, cfg)
    cfg["policy"]["scheduler"] = sched[:2] + [{"milestones": [5, 10]}]
    with pytest.raises(
        ConfigError, match=r"policy\.scheduler\[2\]\.milestones: expected 1 milestone\(s\) for 2 schedulers, got 2"
    ):
        validate(MasterConfig, cfg)
    cfg["policy"]["scheduler"] = sched[:2] + [sched[0], {"milestones": [10, 5]}]
    with pytest.raises(
        ConfigError, match=r"policy\.scheduler\[3\]\.milestones: must be strictly increasing, got \[10, 5\]"
    ):
        validate(MasterConfig, cfg)
    cfg["policy"]["scheduler"] = sched[:2] + [sched[0], {"milestones": [-1, 5]}]
    assert "policy.scheduler[3].milestones: must be >= 0, got [-1, 5]" in errors_of(cfg)
    cfg["policy"]["scheduler"] = sched[:2] + [{"milestones": [5]}, {"milestones": [6]}]
    assert errors_of(cfg) == ["policy.scheduler: at most one milestones entry allowed, found 2 (at indices 2, 3)"]
    cfg["policy"]["scheduler"] = [{"name": "a.B", "milestones": [3]}]
    assert errors_of(cfg) == ["policy.scheduler[0]: expected a scheduler {name, kwargs} or a {milestones: [...]} entry"]
    cfg["policy"]["scheduler"] = [{"milestones": [3]}]
    assert errors_of(cfg) == [
        "policy.scheduler: only a milestones entry: no scheduler to run; use null for a constant learning rate, "
        "or list the schedulers (e.g. torch.optim.lr_scheduler.LinearLR)"
    ]
    cfg["policy"]["scheduler"] = []
    (line,) = errors_of(cfg)
    assert line.startswith("policy.scheduler: []: no scheduler to run; use null")
    cfg["policy"]["scheduler"] = [sched[0]]  # a single scheduler needs no milestones
    validate(MasterConfig, cfg)


def test_dynamic_batching_requires_token_fields(cfg):
    db = cfg["policy"]["dynamic_batching"]
    db["enabled"] = True
    validate(MasterConfig, cfg)
    del db["train_mb_tokens"], db["sequence_length_round"]
    assert errors_of(cfg) == [
        "policy.dynamic_batching.train_mb_tokens: required when dynamic_batching.enabled is true",
        "policy.dynamic_batching.sequence_length_round: required when dynamic_batching.enabled is true",
    ]


def test_sequence_packing_requires_token_fields_that_hold_a_sequence(cfg):
    sp = cfg["policy"]["sequence_packing"]
    sp["enabled"] = True
    validate(MasterConfig, cfg)
    sp["train_mb_tokens"] = 100
    del sp["logprob_mb_tokens"]
    assert errors_of(cfg) == [
        "policy.sequence_packing.logprob_mb_tokens: required when sequence_packing.enabled is true",
        "policy.sequence_packing.train_mb_tokens: 100 is smaller than max_total_sequence_length (512): a sequence "
        "of the allowed length would fit no packed row",
    ]


def test_shared_prompts_need_packing(cfg):
    sp = cfg["policy"]["sequence_packing"]
    assert validate(MasterConfig, cfg).policy.sequence_packing.shared_prompts is False  # the default
    sp["shared_prompts"] = True
    assert errors_of(cfg) == [
        "policy.sequence_packing.shared_prompts: true needs sequence_packing.enabled: shared prompts are a way of "
        "packing rows"
    ]
    sp.update(enabled=True, train_mb_tokens=512, logprob_mb_tokens=512)
    assert validate(MasterConfig, cfg).policy.sequence_packing.shared_prompts is True


def test_dynamic_batching_and_packing_exclusive(cfg):
    cfg["policy"]["dynamic_batching"]["enabled"] = True
    cfg["policy"]["sequence_packing"]["enabled"] = True
    with pytest.raises(ConfigError, match=r"policy\.sequence_packing\.enabled: .*cannot both be enabled"):
        validate(MasterConfig, cfg)


@pytest.mark.parametrize("key", ["call_timeout_s", "startup_timeout_s"])
@pytest.mark.parametrize("bad", [0, -5.0])
def test_vllm_timeouts_are_positive_config_keys(cfg, key, bad):
    from core.policy.generation_config import VllmConfig

    assert VllmConfig.model_fields[key].default == 3600.0  # the default lives in the class
    cfg["policy"]["generation"]["vllm_cfg"][key] = 120
    assert getattr(validate(MasterConfig, cfg).policy.generation.vllm_cfg, key) == 120.0
    cfg["policy"]["generation"]["vllm_cfg"][key] = bad
    (line,) = errors_of(cfg)
    assert line == f"policy.generation.vllm_cfg.{key}: must be > 0.0, got {bad}"


def test_vllm_generation_needs_vllm_cfg(cfg):
    del cfg["policy"]["generation"]["vllm_cfg"]
    assert errors_of(cfg) == ["policy.generation.vllm_cfg: required when generation.backend is 'vllm'"]
    cfg["policy"]["generation"]["backend"] = "hf"
    validate(MasterConfig, cfg)


def test_fsdp1_refuses_a_vocabulary_multiple(cfg):
    cfg["policy"]["make_vocab_size_divisible_by"] = 64
    validate(MasterConfig, cfg)  # torch_dtensor pads
    cfg["policy"]["backend"] = "torch_fsdp"
    (line,) = errors_of(cfg)
    assert line.startswith(
        "policy.make_vocab_size_divisible_by: 64: the torch_fsdp backend does not support vocabulary padding (FSDP1 "
        "has no tensor parallelism"
    )


def test_max_grad_norm_must_be_positive_or_null(cfg):
    cfg["policy"]["max_grad_norm"] = 0
    assert errors_of(cfg) == ["policy.max_grad_norm: must be > 0 (or null for no clipping), got 0.0"]


def test_divisibility_error(cfg):
    cfg["policy"]["train_global_batch_size"] = 30
    cfg["policy"]["train_micro_batch_size"] = 4
    assert errors_of(cfg) == [
        "policy.train_global_batch_size: 30 is not divisible by train_micro_batch_size (4) x data parallel size (2) = 8"
    ]


def test_dtensor_dp_comes_from_tp(cfg):
    p = cfg["policy"]
    p["backend"] = "torch_dtensor"
    p["parallel"]["tensor_parallel_size"] = 2
    p["train_global_batch_size"] = 4
    p["train_micro_batch_size"] = 2
    cfg["cluster"] = {"gpus_per_node": 4, "num_nodes": 1}
    validate(MasterConfig, cfg)  # dp = 4 / 2 = 2, 4 % (2 * 2) == 0
    assert layout_errors(p, 4) == []
    p["train_global_batch_size"] = 6
    assert layout_errors(p, 4) == [
        "policy.train_global_batch_size: 6 is not divisible by train_micro_batch_size (2) x data parallel size (2) = 4"
    ]
    # FSDP1 uses every rank for data: dp = 4, so 8 % (2 * 4) == 0 but 4 % 8 != 0
    p["backend"], p["parallel"]["tensor_parallel_size"] = "torch_fsdp", 1
    p["train_global_batch_size"] = 8
    assert layout_errors(p, 4) == []
    p["train_global_batch_size"] = 4
    (line,) = layout_errors(p, 4)
    assert line.endswith("data parallel size (4) = 8")


def test_layout_needs_a_positive_world_size(cfg):
    with pytest.raises(ValueError, match="world_size"):
        layout_errors(cfg["policy"], 0)


def test_dtensor_tp_cp_must_fit_world(cfg):
    p = cfg["policy"]
    p["parallel"]["tensor_parallel_size"] = 3
    assert layout_errors(p, 4) == [
        "policy.parallel.tensor_parallel_size: tensor_parallel_size (3) does not divide the world size (4)"
    ]
    p["parallel"]["tensor_parallel_size"] = 2
    p["parallel"]["context_parallel_size"] = 4
    assert layout_errors(p, 4) == [
        "policy.parallel.context_parallel_size: tensor_parallel_size (2) x context_parallel_size (4) = 8 "
        "does not divide the world size (4)"
    ]
    p["parallel"]["context_parallel_size"] = 0  # positivity needs no world size
    assert errors_of(p, PolicyConfig, "policy") == ["policy.parallel.context_parallel_size: must be >= 1, got 0"]


def test_the_run_config_checks_the_layout_against_the_cluster(cfg):
    cfg["policy"]["parallel"]["tensor_parallel_size"] = 4
    assert errors_of(cfg) == [
        "policy.parallel.tensor_parallel_size: tensor_parallel_size (4) does not divide the world size (2)"
    ]
    cfg["cluster"]["gpus_per_node"] = 4
    validate(MasterConfig, cfg)


def test_one_parallel_key_is_read_by_every_backend(cfg):
    """``policy.parallel`` means the same on every backend: the same sizes give the same mesh,
    and a backend without an axis refuses it by name, before any world size is known."""
    p = cfg["policy"]
    p["parallel"]["tensor_parallel_size"] = 2
    meshes = set()
    for backend in ("torch_dtensor", "jax_pjit"):
        d = PolicyConfig.coerce({**p, "backend": backend}, "policy").parallel_dims(4)
        meshes.add((d.fsdp, d.cp, d.tp))
    assert meshes == {(2, 1, 2)}
    (line,) = errors_of({**p, "backend": "torch_fsdp"}, PolicyConfig, "policy")
    assert line.startswith("policy.parallel.tensor_parallel_size: 2: the torch_fsdp backend does not support tensor")


def test_jax_mesh_gives_dp(cfg):
    p = cfg["policy"]
    p["backend"] = "jax_pjit"
    p["parallel"].update(fsdp_size=-1, tensor_parallel_size=2)
    p["train_global_batch_size"], p["train_micro_batch_size"] = 8, 2
    assert layout_errors(p, 8) == []  # dp = 4, 8 % 8 == 0
    p["train_global_batch_size"] = 12
    assert layout_errors(p, 8) == [
        "policy.train_global_batch_size: 12 is not divisible by train_micro_batch_size (2) x data parallel size (4) = 8"
    ]
    p["parallel"]["fsdp_size"] = 3  # dp = 3 (explicit), 12 % 6 == 0
    assert layout_errors(p, 6) == []
    assert layout_errors(p, 8) == [
        "policy.parallel.fsdp_size: fsdp_size (3) x tensor_parallel_size (2) = 6 does not equal the world size (8); "
        "use -1 to fill in"
    ]
    p["parallel"]["tensor_parallel_size"] = 3
    assert layout_errors(p, 8) == [
        "policy.parallel.tensor_parallel_size: tensor_parallel_size (3) does not divide the world size (8)"
    ]
    p["parallel"]["fsdp_size"] = 0
    (line,) = errors_of(p, PolicyConfig, "policy")
    assert line.startswith("policy.parallel.fsdp_size: must be >= 1, or -1 to use the remaining devices, got 0")


def test_global_batch_must_split_into_micro_batches(cfg):
    """Without a device count (a policy on its own) nothing can be said about dp; the
    smallest layout, one device, already needs gbs % mbs == 0."""
    p = cfg["policy"]
    p["train_global_batch_size"], p["train_micro_batch_size"] = 7, 2
    PolicyConfig.coerce(p, "policy")  # the section alone is well formed
    assert layout_errors(p, 1) == [
        "policy.train_global_batch_size: 7 is not divisible by train_micro_batch_size (2) x data parallel size (1) = 2"
    ]


def test_parallel_dims_of_the_policy(cfg):
    p = validate(MasterConfig, cfg).policy
    p.parallel.tensor_parallel_size = 2
    d = p.parallel_dims(4)
    assert (d.fsdp, d.tp, d.cp, d.dp) == (2, 2, 1, 2)


# ---- losses
@pytest.fixture
def pg(default_raw):
    return copy.deepcopy(default_raw["loss_fn"])


def test_clipped_pg_ok(pg):
    loss = validate(ClippedPGLossConfig, pg, "loss_fn")
    # default.yaml spells out every key but token_normalizer (an advantage estimator may set it)
    assert loss.to_dict() == {**pg, "token_normalizer": "global_tokens"}


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"ratio_clip_min": -0.1}, "loss_fn.ratio_clip_min: must be >= 0.0, got -0.1"),
        ({"ratio_clip_max": -1}, "loss_fn.ratio_clip_max: must be >= 0.0, got -1"),
        ({"ratio_clip_c": 1.0}, "loss_fn.ratio_clip_c: must be > 1"),
        (
            {"truncated_importance_sampling_ratio": 2.0},
            "loss_fn.truncated_importance_sampling_ratio: is set (2.0) but use_importance_sampling_correction is false",
        ),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_ratio": 2.0,
                "truncated_importance_sampling_type": "icepop",
            },
            "loss_fn.truncated_importance_sampling_ratio_min: required when "
            "truncated_importance_sampling_type is 'icepop'",
        ),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_ratio": 2.0,
                "truncated_importance_sampling_ratio_min": 3.0,
                "truncated_importance_sampling_type": "seq-mask-tis",
            },
            "loss_fn.truncated_importance_sampling_ratio_min: 3.0 is greater than "
            "truncated_importance_sampling_ratio (2.0)",
        ),
        (
            {"sequence_level_importance_ratios": True},
            "loss_fn.sequence_level_importance_ratios: requires token_level_loss: false",
        ),
        ({"kl_input_clamp_value": 0.0}, "loss_fn.kl_input_clamp_value: must be > 0.0, got 0.0"),
        ({"kl_output_clamp_value": -1.0}, "loss_fn.kl_output_clamp_value: must be > 0.0, got -1.0"),
        (
            {"truncated_importance_sampling_type": "foo"},
            "loss_fn.truncated_importance_sampling_type: expected one of 'tis', 'icepop', 'seq-mask-tis', got 'foo'",
        ),
    ],
)
def test_clipped_pg_semantics(pg, changes, message):
    pg.update(changes)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(ClippedPGLossConfig, pg, "loss_fn")


def test_clipped_pg_valid_variants(pg):
    pg.update(
        ratio_clip_c=3.0,
        kl_input_clamp_value=None,
        kl_output_clamp_value=None,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_ratio=2.0,
        truncated_importance_sampling_ratio_min=0.5,
        truncated_importance_sampling_type="icepop",
    )
    validate(ClippedPGLossConfig, pg, "loss_fn")
    pg.update(sequence_level_importance_ratios=True, token_level_loss=False)  # GSPO
    validate(ClippedPGLossConfig, pg, "loss_fn")


def test_loss_semantics_also_run_from_the_run_config(cfg):
    cfg["loss_fn"]["ratio_clip_c"] = 0.5
    assert errors_of(cfg) == ["loss_fn.ratio_clip_c: must be > 1 (or null to disable dual clipping), got 0.5"]


def test_loss_custom_path(pg):
    del pg["token_level_loss"]
    with pytest.raises(ConfigError, match=r"^grpo\.loss\.token_level_loss: missing required key$"):
        validate(ClippedPGLossConfig, pg, "grpo.loss")


def test_dpo_loss():
    dpo = {
        "reference_policy_kl_penalty": 0.05,
        "preference_loss_weight": 1,
        "sft_loss_weight": 0.0,
        "preference_average_log_probs": False,
        "sft_average_log_probs": False,
    }
    validate(DPOLossConfig, dpo, "dpo")
    dpo["sft_loss_weight"] = -1.0
    assert errors_of(dpo, DPOLossConfig, "dpo") == ["dpo.sft_loss_weight: must be >= 0.0, got -1.0"]
