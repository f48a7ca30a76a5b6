"""Config schema, validator and loader."""

import copy
import re
from typing import Any, Literal

import pytest

from core.config import (
    BACKENDS,
    DEFAULT_CONFIG_PATH,
    ClippedPGLossConfig,
    ConfigError,
    DPOLossConfig,
    MasterConfig,
    PolicyConfig,
    apply_overrides,
    check_section,
    deep_merge,
    load_config,
    load_yaml,
    parse_override,
    validate_loss_config,
    validate_master_config,
    validate_policy_config,
    validate_typed,
)
from core.config.schema import NotRequired, TypedDict


@pytest.fixture(scope="module")
def default_raw():
    return load_yaml(DEFAULT_CONFIG_PATH)


@pytest.fixture
def cfg(default_raw):
    return copy.deepcopy(default_raw)


def errors_of(cfg):
    with pytest.raises(ConfigError) as ei:
        validate_master_config(cfg)
    return ei.value.errors


# =============================================================================
# the shipped default
# =============================================================================
def test_default_yaml_validates():
    cfg = load_config(DEFAULT_CONFIG_PATH)
    assert cfg["policy"]["backend"] in BACKENDS
    assert cfg["policy"]["model_name"] == "Qwen/Qwen2.5-0.5B"
    assert cfg["cluster"]["gpus_per_node"] * cfg["cluster"]["num_nodes"] == 2
    assert isinstance(cfg["policy"]["optimizer"]["kwargs"]["lr"], float)  # "5.0e-6"
    assert isinstance(cfg, dict)  # plain dicts at run time


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_yaml_validates_for_every_backend(backend):
    assert load_config(DEFAULT_CONFIG_PATH, backend=backend)["policy"]["backend"] == backend


def test_default_yaml_every_schema_key_known(default_raw):
    # The example is complete: it spells out every PolicyConfig key.
    assert set(default_raw["policy"]) == set(PolicyConfig.__annotations__)
    assert set(default_raw["loss_fn"]) == set(ClippedPGLossConfig.__annotations__)
    assert set(default_raw) == {"policy", "cluster", "loss_fn"}
    # The run sections are spelled out by the embedded defaults (one per algorithm, each with
    # exactly the sections its command reads), which inherit policy and cluster.
    from core.config import EMBEDDED_CONFIGS, load_yaml
    from core.config.run_checks import ALGORITHM_SECTIONS

    seen = set()
    for algorithm, path in EMBEDDED_CONFIGS.items():
        sections = set(load_yaml(path))
        assert sections == set(ALGORITHM_SECTIONS[algorithm]), algorithm
        seen |= sections
    assert seen == set(MasterConfig.__annotations__)


def test_validators_return_the_same_dict(cfg):
    assert validate_master_config(cfg) is cfg
    assert validate_policy_config(cfg["policy"], world_size=2) is cfg["policy"]
    assert validate_loss_config(cfg["loss_fn"], ClippedPGLossConfig) is cfg["loss_fn"]


# =============================================================================
# error classes
# =============================================================================
def test_unknown_key_with_suggestion(cfg):
    cfg["policy"]["dtensor_cfg"]["tensor_paralel_size"] = 2
    with pytest.raises(
        ConfigError,
        match=re.escape("policy.dtensor_cfg.tensor_paralel_size: unknown key (did you mean 'tensor_parallel_size'?)"),
    ):
        validate_master_config(cfg)


def test_unknown_key_without_close_match_lists_known_keys(cfg):
    cfg["cluster"]["zzz"] = 1
    with pytest.raises(ConfigError, match=r"cluster\.zzz: unknown key \(known keys: gpus_per_node, num_nodes\)"):
        validate_master_config(cfg)


def test_unknown_top_level_key(cfg):
    cfg["polcy"] = {}
    with pytest.raises(ConfigError, match=re.escape("polcy: unknown key (did you mean 'policy'?)")):
        validate_master_config(cfg)


def test_wrong_type(cfg):
    cfg["policy"]["train_micro_batch_size"] = "two"
    with pytest.raises(ConfigError, match=re.escape("policy.train_micro_batch_size: expected int, got str ('two')")):
        validate_master_config(cfg)


def test_bool_rejected_for_int(cfg):
    cfg["policy"]["logprob_batch_size"] = True
    with pytest.raises(ConfigError, match=re.escape("policy.logprob_batch_size: expected int, got bool (True)")):
        validate_master_config(cfg)


def test_int_accepted_for_float_but_bool_and_str_not(cfg):
    cfg["policy"]["max_grad_norm"] = 1
    cfg["loss_fn"]["ratio_clip_min"] = 0
    validate_master_config(cfg)
    cfg["policy"]["max_grad_norm"] = True
    with pytest.raises(ConfigError, match=re.escape("policy.max_grad_norm: expected float or None, got bool (True)")):
        validate_master_config(cfg)
    assert validate_typed("1.0", float, "x") == ["x: expected float, got str ('1.0')"]


def test_int_not_accepted_for_bool(cfg):
    cfg["policy"]["dtensor_cfg"]["cpu_offload"] = 1
    with pytest.raises(ConfigError, match=re.escape("policy.dtensor_cfg.cpu_offload: expected bool, got int (1)")):
        validate_master_config(cfg)


def test_unknown_backend(cfg):
    cfg["policy"]["backend"] = "jax"
    errs = errors_of(cfg)
    assert errs == ["policy.backend: unknown backend 'jax'; choose one of 'torch_fsdp', 'torch_dtensor', 'jax_pjit'"]


def test_literal(cfg):
    cfg["policy"]["precision"] = "fp32"
    with pytest.raises(
        ConfigError,
        match=re.escape("policy.precision: expected one of 'float32', 'bfloat16', 'float16', got 'fp32'"),
    ):
        validate_master_config(cfg)


def test_literal_in_optional_field_of_loss(cfg):
    cfg["loss_fn"]["reference_policy_kl_type"] = "k4"
    with pytest.raises(
        ConfigError, match=r"loss_fn\.reference_policy_kl_type: expected one of 'k1', 'k2', 'k3', got 'k4'"
    ):
        validate_master_config(cfg)


def test_missing_required_key(cfg):
    del cfg["policy"]["model_name"]
    with pytest.raises(ConfigError, match=re.escape("policy.model_name: missing required key")):
        validate_master_config(cfg)


def test_missing_not_required_key_is_fine(cfg):
    for key in ("generation", "optimizer", "scheduler", "sequence_packing", "refit_buffer_size_gb"):
        del cfg["policy"][key]
    del cfg["loss_fn"]
    validate_master_config(cfg)


def test_optional_accepts_none_only_where_declared(cfg):
    cfg["policy"]["optimizer"] = None
    cfg["policy"]["scheduler"] = None
    cfg["policy"]["max_grad_norm"] = None
    cfg["policy"]["generation"] = None
    validate_master_config(cfg)
    cfg["policy"]["model_name"] = None
    with pytest.raises(ConfigError, match=re.escape("policy.model_name: expected str, got None")):
        validate_master_config(cfg)


def test_section_of_wrong_type(cfg):
    cfg["policy"]["dtensor_cfg"] = [1, 2]
    with pytest.raises(ConfigError, match=r"policy\.dtensor_cfg: expected a mapping \(DTensorConfig\), got list"):
        validate_master_config(cfg)


def test_divisibility_error(cfg):
    cfg["policy"]["train_global_batch_size"] = 30
    cfg["policy"]["train_micro_batch_size"] = 4
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "policy.train_global_batch_size: 30 is not divisible by train_micro_batch_size (4) "
            "x data parallel size (2) = 8"
        ),
    ):
        validate_master_config(cfg)


def test_positive_sizes(cfg):
    cfg["policy"]["train_micro_batch_size"] = 0
    cfg["policy"]["logprob_batch_size"] = -1
    cfg["policy"]["max_total_sequence_length"] = 0
    cfg["policy"]["refit_buffer_size_gb"] = 0
    errs = errors_of(cfg)
    assert "policy.train_micro_batch_size: must be > 0, got 0" in errs
    assert "policy.logprob_batch_size: must be > 0, got -1" in errs
    assert "policy.max_total_sequence_length: must be > 0, got 0" in errs
    assert "policy.refit_buffer_size_gb: must be > 0, got 0" in errs


def test_several_errors_reported_together(cfg):
    cfg["policy"]["dtensor_cfg"]["tensor_paralel_size"] = 2
    cfg["policy"]["train_micro_batch_size"] = "two"
    cfg["policy"]["precision"] = "fp32"
    del cfg["policy"]["model_name"]
    cfg["cluster"]["num_nodes"] = "1"
    with pytest.raises(ConfigError) as ei:
        validate_master_config(cfg)
    errs = ei.value.errors
    assert len(errs) == 5, errs
    assert str(ei.value) == "\n".join(errs)  # one per line
    for prefix in (
        "policy.dtensor_cfg.tensor_paralel_size:",
        "policy.train_micro_batch_size:",
        "policy.precision:",
        "policy.model_name:",
        "cluster.num_nodes:",
    ):
        assert sum(e.startswith(prefix) for e in errs) == 1, (prefix, errs)


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)
    e = ConfigError("a.b: bad")
    assert e.errors == ["a.b: bad"] and str(e) == "a.b: bad"


def test_not_a_mapping_at_all():
    with pytest.raises(ConfigError, match=r"<config>: expected a mapping \(MasterConfig\), got list"):
        validate_master_config([])


# =============================================================================
# the generic walker on ad-hoc schemas
# =============================================================================
class _Inner(TypedDict):
    a: int
    b: NotRequired[str | None]


class _Outer(TypedDict):
    items: list[_Inner]
    mode: Literal["x", "y"]
    anything: Any
    table: dict[str, float]
    maybe: int | None
    either: int | str


def test_walker_nested_typeddict_in_list_and_containers():
    good = {
        "items": [{"a": 1}, {"a": 2, "b": None}],
        "mode": "x",
        "anything": object(),
        "table": {"k": 1, "l": 2.5},
        "maybe": None,
        "either": "s",
    }
    assert validate_typed(good, _Outer, "o") == []
    bad = {
        "items": [{"a": 1}, {"a": "1", "c": 0}, 3],
        "mode": "z",
        "anything": None,
        "table": {"k": "v", 3: 1.0},
        "maybe": 1.5,
        "either": 1.5,
    }
    assert validate_typed(bad, _Outer, "o") == [
        "o.items[1].c: unknown key (known keys: a, b)",
        "o.items[1].a: expected int, got str ('1')",
        "o.items[2]: expected a mapping (_Inner), got int (3)",
        "o.mode: expected one of 'x', 'y', got 'z'",
        "o.table.k: expected float, got str ('v')",
        "o.table: key 3 is not a str",
        "o.maybe: expected int or None, got float (1.5)",
        "o.either: expected int or str, got float (1.5)",
    ]


def test_check_section_raises():
    with pytest.raises(ConfigError, match=r"^x\.a: missing required key$"):
        check_section({}, _Inner, "x")
    assert check_section({"a": 1}, _Inner, "x") == {"a": 1}


def test_scheduler_entries_are_typed(cfg):
    cfg["policy"]["scheduler"][0]["kwarg"] = {}
    cfg["policy"]["scheduler"][2]["milestones"] = ["10"]
    errs = errors_of(cfg)
    assert "policy.scheduler[0].kwarg: unknown key (did you mean 'kwargs'?)" in errs
    assert "policy.scheduler[2].milestones[0]: expected int, got str ('10')" in errs


# =============================================================================
# semantic checks
# =============================================================================
def test_scheduler_milestones_consistency(cfg):
    sched = cfg["policy"]["scheduler"]
    cfg["policy"]["scheduler"] = sched[:2]
    with pytest.raises(ConfigError, match=r"policy\.scheduler: 2 schedulers .* need a 'milestones' entry with 1 step"):
        validate_master_config(cfg)
    cfg["policy"]["scheduler"] = sched[:2] + [{"milestones": [5, 10]}]
    with pytest.raises(
        ConfigError, match=r"policy\.scheduler\[2\]\.milestones: expected 1 milestone\(s\) for 2 schedulers, got 2"
    ):
        validate_master_config(cfg)
    cfg["policy"]["scheduler"] = sched[:2] + [sched[0], {"milestones": [10, 5]}]
    with pytest.raises(
        ConfigError, match=r"policy\.scheduler\[3\]\.milestones: must be strictly increasing, got \[10, 5\]"
    ):
        validate_master_config(cfg)
    cfg["policy"]["scheduler"] = [sched[0]]  # a single scheduler needs no milestones
    validate_master_config(cfg)


def test_dynamic_batching_requires_token_fields(cfg):
    db = cfg["policy"]["dynamic_batching"]
    db["enabled"] = True
    validate_master_config(cfg)
    del db["train_mb_tokens"], db["sequence_length_round"]
    errs = errors_of(cfg)
    assert errs == [
        "policy.dynamic_batching.train_mb_tokens: required when dynamic_batching.enabled is true",
        "policy.dynamic_batching.sequence_length_round: required when dynamic_batching.enabled is true",
    ]


def test_dynamic_batching_and_packing_exclusive(cfg):
    cfg["policy"]["dynamic_batching"]["enabled"] = True
    cfg["policy"]["sequence_packing"]["enabled"] = True
    with pytest.raises(ConfigError, match=r"policy\.sequence_packing\.enabled: .*cannot both be enabled"):
        validate_master_config(cfg)


def test_vllm_generation_needs_vllm_cfg(cfg):
    del cfg["policy"]["generation"]["vllm_cfg"]
    with pytest.raises(ConfigError, match=r"policy\.generation\.vllm_cfg: required when generation\.backend is 'vllm'"):
        validate_master_config(cfg)
    cfg["policy"]["generation"]["backend"] = "hf"
    validate_master_config(cfg)


def test_dtensor_dp_comes_from_tp(cfg):
    p = cfg["policy"]
    p["backend"] = "torch_dtensor"
    p["dtensor_cfg"]["tensor_parallel_size"] = 2
    p["train_global_batch_size"] = 4
    p["train_micro_batch_size"] = 2
    cfg["cluster"] = {"gpus_per_node": 4, "num_nodes": 1}
    validate_master_config(cfg)  # dp = 4 / 2 = 2, 4 % (2 * 2) == 0
    validate_policy_config(p, world_size=4)
    p["train_global_batch_size"] = 6
    with pytest.raises(
        ConfigError, match=re.escape("6 is not divisible by train_micro_batch_size (2) x data parallel size (2) = 4")
    ):
        validate_policy_config(p, world_size=4)
    # FSDP1 uses every rank for data: dp = 4, so 8 % (2 * 4) == 0 but 4 % 8 != 0
    p["backend"] = "torch_fsdp"
    p["train_global_batch_size"] = 8
    validate_policy_config(p, world_size=4)
    p["train_global_batch_size"] = 4
    with pytest.raises(ConfigError, match=re.escape("data parallel size (4) = 8")):
        validate_policy_config(p, world_size=4)


def test_world_size_argument_must_be_positive_int(cfg):
    with pytest.raises(ValueError, match="world_size"):
        validate_policy_config(cfg["policy"], world_size=0)


def test_dtensor_tp_cp_must_fit_world(cfg):
    p = cfg["policy"]
    p["dtensor_cfg"]["tensor_parallel_size"] = 3
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "policy.dtensor_cfg.tensor_parallel_size: tensor_parallel_size (3) does not divide the world size (4)"
        ),
    ):
        validate_policy_config(p, world_size=4)
    p["dtensor_cfg"]["tensor_parallel_size"] = 2
    p["dtensor_cfg"]["context_parallel_size"] = 4
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "policy.dtensor_cfg.context_parallel_size: tensor_parallel_size (2) x context_parallel_size (4) = 8 "
            "does not divide the world size (4)"
        ),
    ):
        validate_policy_config(p, world_size=4)
    p["dtensor_cfg"]["context_parallel_size"] = 0
    with pytest.raises(ConfigError, match=re.escape("policy.dtensor_cfg.context_parallel_size: must be >= 1, got 0")):
        validate_policy_config(p)  # positivity is checked even without a world size


def test_inactive_backend_sizes_not_checked_against_world(cfg):
    p = cfg["policy"]
    p["backend"] = "jax_pjit"
    p["dtensor_cfg"]["tensor_parallel_size"] = 3  # irrelevant for jax_pjit
    validate_policy_config(p, world_size=2)


def test_jax_mesh_gives_dp(cfg):
    p = cfg["policy"]
    p["backend"] = "jax_pjit"
    p["jax_cfg"].update(fsdp_size=-1, tensor_parallel_size=2)
    p["train_global_batch_size"], p["train_micro_batch_size"] = 8, 2
    validate_policy_config(p, world_size=8)  # dp = 4, 8 % 8 == 0
    p["train_global_batch_size"] = 12
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "policy.train_global_batch_size: 12 is not divisible by train_micro_batch_size (2) x "
            "data parallel size (4) = 8"
        ),
    ):
        validate_policy_config(p, world_size=8)
    p["jax_cfg"]["fsdp_size"] = 3  # dp = 3 (explicit), 12 % 6 == 0
    validate_policy_config(p, world_size=6)
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "policy.jax_cfg.fsdp_size: fsdp_size (3) x tensor_parallel_size (2) = 6 does not equal the world size (8)"
        ),
    ):
        validate_policy_config(p, world_size=8)
    p["jax_cfg"]["tensor_parallel_size"] = 3
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "policy.jax_cfg.tensor_parallel_size: tensor_parallel_size (3) does not divide the world size (8)"
        ),
    ):
        validate_policy_config(p, world_size=8)
    p["jax_cfg"]["fsdp_size"] = 0
    with pytest.raises(ConfigError, match=r"policy\.jax_cfg\.fsdp_size: must be >= 1, or -1"):
        validate_policy_config(p)


def test_without_world_size_gbs_must_still_divide_by_mbs(cfg):
    p = cfg["policy"]
    p["train_global_batch_size"], p["train_micro_batch_size"] = 7, 2
    with pytest.raises(
        ConfigError, match=re.escape("policy.train_global_batch_size: 7 is not divisible by train_micro_batch_size (2)")
    ):
        validate_policy_config(p)


def test_cluster_sizes_positive(cfg):
    cfg["cluster"]["gpus_per_node"] = 0
    assert "cluster.gpus_per_node: must be >= 1, got 0" in errors_of(cfg)


# ---- losses
@pytest.fixture
def pg(default_raw):
    return copy.deepcopy(default_raw["loss_fn"])


def test_clipped_pg_ok(pg):
    assert validate_loss_config(pg, ClippedPGLossConfig) is pg


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"ratio_clip_min": -0.1}, "loss_fn.ratio_clip_min: must be >= 0, got -0.1"),
        ({"ratio_clip_max": -1}, "loss_fn.ratio_clip_max: must be >= 0, got -1"),
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
        ({"kl_input_clamp_value": 0.0}, "loss_fn.kl_input_clamp_value: must be > 0, got 0.0"),
        ({"kl_output_clamp_value": -1.0}, "loss_fn.kl_output_clamp_value: must be > 0, got -1.0"),
        (
            {"truncated_importance_sampling_type": "foo"},
            "loss_fn.truncated_importance_sampling_type: expected one of 'tis', 'icepop', 'seq-mask-tis', got 'foo'",
        ),
    ],
)
def test_clipped_pg_semantics(pg, changes, message):
    pg.update(changes)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_loss_config(pg, ClippedPGLossConfig)


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
    validate_loss_config(pg, ClippedPGLossConfig)
    pg.update(sequence_level_importance_ratios=True, token_level_loss=False)  # GSPO
    validate_loss_config(pg, ClippedPGLossConfig)


def test_loss_semantics_also_run_from_master(cfg):
    cfg["loss_fn"]["ratio_clip_c"] = 0.5
    assert any(e.startswith("loss_fn.ratio_clip_c: must be > 1") for e in errors_of(cfg))


def test_loss_custom_path(pg):
    del pg["token_level_loss"]
    with pytest.raises(ConfigError, match=r"^grpo\.loss\.token_level_loss: missing required key$"):
        validate_loss_config(pg, ClippedPGLossConfig, path="grpo.loss")


def test_dpo():
    dpo = {
        "reference_policy_kl_penalty": 0.05,
        "preference_loss_weight": 1,
        "sft_loss_weight": 0.0,
        "preference_average_log_probs": False,
        "sft_average_log_probs": False,
    }
    validate_loss_config(dpo, DPOLossConfig, "dpo")
    dpo["sft_loss_weight"] = -1.0
    with pytest.raises(ConfigError, match=re.escape("dpo.sft_loss_weight: must be >= 0, got -1.0")):
        validate_loss_config(dpo, DPOLossConfig, "dpo")


# =============================================================================
# overrides
# =============================================================================
@pytest.mark.parametrize(
    "text, keys, value",
    [
        ("policy.train_micro_batch_size=2", ("policy", "train_micro_batch_size"), 2),
        ("policy.dtensor_cfg.cpu_offload=true", ("policy", "dtensor_cfg", "cpu_offload"), True),
        ("policy.max_grad_norm=null", ("policy", "max_grad_norm"), None),
        ("policy.generation.stop_token_ids=[1, 2]", ("policy", "generation", "stop_token_ids"), [1, 2]),
        ("policy.optimizer.kwargs.lr=1e-6", ("policy", "optimizer", "kwargs", "lr"), 1e-6),
        ("a=-2E+3", ("a",), -2000.0),
        ("a=[1e-6, 2]", ("a",), [1e-6, 2]),
        ("a=3.5", ("a",), 3.5),
        ("a='1e-6'", ("a",), "1e-6"),  # quoting keeps a string
        ("a='2'", ("a",), "2"),
        ("policy.model_name=Qwen/Qwen2.5-0.5B", ("policy", "model_name"), "Qwen/Qwen2.5-0.5B"),
        (" a.b = x=y", ("a", "b"), "x=y"),
        ("a={x: 1}", ("a",), {"x": 1}),
    ],
)
def test_parse_override(text, keys, value):
    k, v = parse_override(text)
    assert k == keys
    assert v == value and type(v) is type(value)


@pytest.mark.parametrize("text", ["policy.train_micro_batch_size", "=2", "a..b=1", "a.=1"])
def test_parse_override_bad_syntax(text):
    with pytest.raises(ConfigError, match=re.escape(f"override {text!r}")):
        parse_override(text)


def test_apply_overrides_sets_and_creates_and_copies():
    base = {"policy": {"x": 1}}
    out = apply_overrides(base, ["policy.x=2", "policy.new.deep.key=true", "top=[1]"])
    assert out == {"policy": {"x": 2, "new": {"deep": {"key": True}}}, "top": [1]}
    assert base == {"policy": {"x": 1}}  # not mutated
    out = apply_overrides({"a": None}, [(("a", "b"), 1), ("c.d", 2)])
    assert out == {"a": {"b": 1}, "c": {"d": 2}}


def test_apply_override_into_non_mapping():
    with pytest.raises(ConfigError, match=r"^policy\.model_name: cannot apply override 'policy\.model_name\.x=1'"):
        apply_overrides({"policy": {"model_name": "m"}}, ["policy.model_name.x=1"])


def test_overrides_through_load_config():
    cfg = load_config(
        DEFAULT_CONFIG_PATH,
        [
            "policy.train_micro_batch_size=4",
            "policy.optimizer.kwargs.lr=1e-6",
            "policy.max_grad_norm=null",
            "policy.generation.stop_token_ids=[151643]",
            "policy.dtensor_cfg.sequence_parallel=true",
        ],
    )
    p = cfg["policy"]
    assert p["train_micro_batch_size"] == 4
    assert p["optimizer"]["kwargs"]["lr"] == 1e-6
    assert p["max_grad_norm"] is None
    assert p["generation"]["stop_token_ids"] == [151643]
    assert p["dtensor_cfg"]["sequence_parallel"] is True


def test_unknown_key_via_override():
    with pytest.raises(
        ConfigError,
        match=re.escape("policy.train_micro_batchsize: unknown key (did you mean 'train_micro_batch_size'?)"),
    ):
        load_config(DEFAULT_CONFIG_PATH, ["policy.train_micro_batchsize=2"])


def test_bad_value_via_override_collects_all():
    with pytest.raises(ConfigError) as ei:
        load_config(DEFAULT_CONFIG_PATH, ["policy.precision=fp32", "cluster.num_nodes=two"])
    assert [e.split(":")[0] for e in ei.value.errors] == ["policy.precision", "cluster.num_nodes"]


def test_backend_flag():
    assert load_config(DEFAULT_CONFIG_PATH, backend="jax_pjit")["policy"]["backend"] == "jax_pjit"
    # --backend wins over an override of the same key
    cfg = load_config(DEFAULT_CONFIG_PATH, ["policy.backend=torch_fsdp"], backend="torch_dtensor")
    assert cfg["policy"]["backend"] == "torch_dtensor"
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "policy.backend: unknown backend 'jax'; choose one of 'torch_fsdp', 'torch_dtensor', 'jax_pjit'"
        ),
    ):
        load_config(DEFAULT_CONFIG_PATH, backend="jax")


def test_backend_flag_changes_dp_checks():
    # world 2; dtensor tp=2 -> dp 1 so gbs 2 / mbs 2 is fine; torch_fsdp -> dp 2 and it is not.
    ov = [
        "policy.dtensor_cfg.tensor_parallel_size=2",
        "policy.train_global_batch_size=2",
        "policy.train_micro_batch_size=2",
    ]
    load_config(DEFAULT_CONFIG_PATH, ov, backend="torch_dtensor")
    with pytest.raises(ConfigError, match=r"2 is not divisible by .* data parallel size \(2\) = 4"):
        load_config(DEFAULT_CONFIG_PATH, ov, backend="torch_fsdp")


# =============================================================================
# YAML files: defaults inheritance, cycles, scientific notation
# =============================================================================
def test_defaults_inheritance(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "root.yaml").write_text("a: {x: 1, y: [1, 2]}\nb: root\nc: root\n")
    (tmp_path / "base" / "mid.yaml").write_text("defaults: root.yaml\na: {x: 2}\nc: mid\n")
    (tmp_path / "child.yaml").write_text("defaults: base/mid.yaml\na: {y: [3]}\nd: 1e-3\n")
    assert load_yaml(tmp_path / "child.yaml") == {
        "a": {"x": 2, "y": [3]},  # mappings merge, lists replace, child wins
        "b": "root",
        "c": "mid",
        "d": 1e-3,
    }


def test_defaults_list(tmp_path):
    (tmp_path / "one.yaml").write_text("a: 1\nb: 1\n")
    (tmp_path / "two.yaml").write_text("b: 2\n")
    (tmp_path / "c.yaml").write_text("defaults: [one.yaml, two.yaml]\nc: 3\n")
    assert load_yaml(tmp_path / "c.yaml") == {"a": 1, "b": 2, "c": 3}


def test_defaults_on_the_shipped_config(tmp_path):
    (tmp_path / "exp.yaml").write_text(
        f"defaults: {DEFAULT_CONFIG_PATH}\npolicy:\n  train_micro_batch_size: 4\n"
        "  jax_cfg: {tensor_parallel_size: 2}\n"
    )
    cfg = load_config(tmp_path / "exp.yaml", backend="jax_pjit")
    assert cfg["policy"]["train_micro_batch_size"] == 4
    assert cfg["policy"]["jax_cfg"] == {
        "fsdp_size": -1,
        "tensor_parallel_size": 2,
        "context_parallel_size": 1,
        "activation_checkpointing": False,
    }
    assert cfg["policy"]["model_name"] == "Qwen/Qwen2.5-0.5B"


def test_defaults_cycle(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: b.yaml\nx: 1\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\ny: 1\n")
    with pytest.raises(ConfigError, match=r"defaults: cycle detected: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_yaml(tmp_path / "a.yaml")
    (tmp_path / "self.yaml").write_text("defaults: self.yaml\n")
    with pytest.raises(ConfigError, match="cycle detected"):
        load_yaml(tmp_path / "self.yaml")


def test_defaults_missing_file(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: nope.yaml\n")
    with pytest.raises(ConfigError, match=r"defaults: file 'nope\.yaml' not found"):
        load_yaml(tmp_path / "a.yaml")


def test_yaml_top_level_must_be_mapping(tmp_path):
    (tmp_path / "a.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_yaml(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("a: [1\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_yaml(tmp_path / "b.yaml")
    (tmp_path / "empty.yaml").write_text("")
    assert load_yaml(tmp_path / "empty.yaml") == {}


def test_deep_merge_does_not_alias():
    base = {"a": {"b": [1]}}
    out = deep_merge(base, {"a": {"c": 2}})
    out["a"]["b"].append(2)
    assert base == {"a": {"b": [1]}}
