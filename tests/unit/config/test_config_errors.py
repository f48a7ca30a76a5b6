"""Every class of config error, worded with the key, the expected type and where the value
came from (file, override or ``--backend``)."""

from __future__ import annotations

import pytest

from core.algorithms.config import (
    GRPORunConfig,
    MasterConfig,
    SFTRunConfig,
)
from core.config import (
    DEFAULT_CONFIG_PATH,
    ConfigError,
    Provenance,
    load_config,
    validate,
)
from core.environments.config import ArithmeticTaskConfig
from core.policy.config import TokenizerConfig
from core.policy.preflight import preflight_errors
from tests.unit.config.cases import (
    GRPO,
    REPO,
    SFT,
    errors_of,
    load_errors,
)


# =============================================================================
# error classes
# =============================================================================
def test_unknown_key_with_suggestion(cfg):
    cfg["policy"]["parallel"]["tensor_paralel_size"] = 2
    assert errors_of(cfg) == ["policy.parallel.tensor_paralel_size: unknown key (did you mean 'tensor_parallel_size'?)"]
    del cfg["policy"]["parallel"]["tensor_paralel_size"]
    cfg["policy"]["dtensor_cfg"]["custom_parallel_pla"] = "m.PLAN"  # a backend's own block gets the same hint
    assert errors_of(cfg) == [
        "policy.dtensor_cfg.custom_parallel_pla: unknown key (did you mean 'custom_parallel_plan'?)"
    ]


def test_unknown_key_without_close_match_lists_known_keys(cfg):
    cfg["cluster"]["zzz"] = 1
    assert errors_of(cfg) == ["cluster.zzz: unknown key (known keys: gpus_per_node, num_nodes, cpus_per_slot)"]


def test_unknown_top_level_key(cfg):
    cfg["polcy"] = {}
    assert errors_of(cfg) == ["polcy: unknown key (did you mean 'policy'?)"]


def test_unknown_key_in_a_list_item(cfg):
    cfg["policy"]["scheduler"][0]["kwarg"] = {}
    cfg["policy"]["scheduler"][2]["milestones"] = ["10"]
    errs = errors_of(cfg)
    assert "policy.scheduler[0].kwarg: unknown key (did you mean 'kwargs'?)" in errs
    assert "policy.scheduler[2].milestones[0]: expected int, got str ('10')" in errs


def test_wrong_type(cfg):
    cfg["policy"]["train_micro_batch_size"] = "two"
    assert errors_of(cfg) == ["policy.train_micro_batch_size: expected int, got str ('two')"]


def test_bool_rejected_for_int(cfg):
    cfg["policy"]["logprob_batch_size"] = True
    assert errors_of(cfg) == ["policy.logprob_batch_size: expected int, got bool (True)"]


def test_float_rejected_for_int(cfg):
    cfg["policy"]["generation_batch_size"] = 1.5  # int | None
    assert errors_of(cfg) == ["policy.generation_batch_size: expected int, got float (1.5)"]


def test_int_accepted_for_float_but_bool_and_str_not(cfg):
    cfg["policy"]["max_grad_norm"] = 1
    cfg["loss_fn"]["ratio_clip_min"] = 0
    model = validate(MasterConfig, cfg)
    assert model.policy.max_grad_norm == 1.0 and isinstance(model.policy.max_grad_norm, float)
    cfg["policy"]["max_grad_norm"] = True
    assert errors_of(cfg) == ["policy.max_grad_norm: expected float, got bool (True)"]
    cfg["policy"]["max_grad_norm"] = "1.0"
    assert errors_of(cfg) == ["policy.max_grad_norm: expected float, got str ('1.0')"]


def test_int_not_accepted_for_bool(cfg):
    cfg["policy"]["cpu_offload"] = 1
    assert errors_of(cfg) == ["policy.cpu_offload: expected bool, got int (1)"]


def test_unknown_backend(cfg):
    cfg["policy"]["backend"] = "jax"
    assert errors_of(cfg) == [
        "policy.backend: 'jax' is not a registered backend; known: ['torch_fsdp', 'torch_dtensor', 'jax_pjit']"
    ]


def test_literal(cfg):
    cfg["policy"]["precision"] = "fp32"
    assert errors_of(cfg) == ["policy.precision: expected one of 'float32', 'bfloat16', 'float16', got 'fp32'"]


def test_literal_in_optional_field_of_loss(cfg):
    cfg["loss_fn"]["reference_policy_kl_type"] = "k4"
    assert errors_of(cfg) == ["loss_fn.reference_policy_kl_type: expected one of 'k1', 'k2', 'k3', got 'k4'"]


def test_literal_items_of_a_list():
    errs = errors_of({"num_operands": 2, "operations": ["+", "/"]}, ArithmeticTaskConfig, "env.arithmetic")
    assert errs == ["env.arithmetic.operations[1]: expected one of '+', '-', '*', got '/'"]


def test_missing_required_key(cfg):
    del cfg["policy"]["model_name"]
    assert errors_of(cfg) == ["policy.model_name: missing required key"]


def test_missing_required_section(cfg):
    del cfg["policy"]
    assert errors_of(cfg) == ["policy: missing required section"]


def test_missing_not_required_key_is_fine_and_gets_the_model_default(cfg):
    for key in ("generation", "optimizer", "scheduler", "sequence_packing", "refit_buffer_size_gb"):
        del cfg["policy"][key]
    del cfg["loss_fn"]
    model = validate(MasterConfig, cfg)
    assert model.loss_fn is None
    p = model.policy
    assert (p.generation, p.optimizer, p.scheduler) == (None, None, None)
    assert p.sequence_packing.enabled is False and p.refit_buffer_size_gb == 4.0


def test_optional_accepts_none_only_where_declared(cfg):
    cfg["policy"]["optimizer"] = None
    cfg["policy"]["scheduler"] = None
    cfg["policy"]["max_grad_norm"] = None
    cfg["policy"]["generation"] = None
    validate(MasterConfig, cfg)
    cfg["policy"]["model_name"] = None
    assert errors_of(cfg) == ["policy.model_name: expected str, got None"]


def test_section_of_wrong_type(cfg):
    cfg["policy"]["dtensor_cfg"] = [1, 2]
    assert errors_of(cfg) == ["policy.dtensor_cfg: expected a mapping (DTensorConfig), got list ([1, 2])"]


def test_list_item_of_wrong_type(cfg):
    cfg["policy"]["scheduler"][1] = 3
    assert errors_of(cfg) == ["policy.scheduler[1]: expected a mapping (SchedulerEntry), got int (3)"]


def test_mapping_with_a_key_that_is_not_a_string(cfg):
    cfg["policy"]["optimizer"]["kwargs"] = {3: 1.0}
    (line,) = errors_of(cfg)
    assert line.startswith("policy.optimizer.kwargs") and line.endswith("expected str, got int (3)")


def test_not_a_mapping_at_all():
    assert errors_of([]) == ["<config>: expected a mapping (MasterConfig), got list ([])"]


def test_validate_prefixes_the_given_path():
    assert errors_of({}, TokenizerConfig, "policy.tokenizer") == ["policy.tokenizer.name: missing required key"]
    assert validate(TokenizerConfig, {"name": "t"}, "policy.tokenizer").name == "t"
    with pytest.raises(ConfigError, match=r"^policy\.tokenizer\.name: missing required key$"):
        TokenizerConfig.coerce({}, "policy.tokenizer")


def test_positive_sizes(cfg):
    cfg["policy"]["train_micro_batch_size"] = 0
    cfg["policy"]["logprob_batch_size"] = -1
    cfg["policy"]["max_total_sequence_length"] = 0
    cfg["policy"]["refit_buffer_size_gb"] = 0
    cfg["policy"]["dynamic_batching"]["train_mb_tokens"] = 0
    errs = errors_of(cfg)
    assert "policy.train_micro_batch_size: must be > 0, got 0" in errs
    assert "policy.logprob_batch_size: must be > 0, got -1" in errs
    assert "policy.max_total_sequence_length: must be > 0, got 0" in errs
    assert "policy.refit_buffer_size_gb: must be > 0.0, got 0" in errs  # a float field's bound
    assert "policy.dynamic_batching.train_mb_tokens: must be > 0, got 0" in errs
    assert len(errs) == 5, errs


def test_cluster_sizes_positive(cfg):
    cfg["cluster"]["gpus_per_node"] = 0
    assert errors_of(cfg) == ["cluster.gpus_per_node: must be >= 1, got 0"]


def test_several_errors_reported_together(cfg):
    cfg["policy"]["parallel"]["tensor_paralel_size"] = 2
    cfg["policy"]["train_micro_batch_size"] = "two"
    cfg["policy"]["precision"] = "fp32"
    del cfg["policy"]["model_name"]
    cfg["cluster"]["num_nodes"] = "1"
    with pytest.raises(ConfigError) as ei:
        validate(MasterConfig, cfg)
    errs = ei.value.errors
    assert len(errs) == 5, errs
    assert str(ei.value) == "\n".join(errs)  # one per line
    for prefix in (
        "policy.parallel.tensor_paralel_size:",
        "policy.train_micro_batch_size:",
        "policy.precision:",
        "policy.model_name:",
        "cluster.num_nodes:",
    ):
        assert sum(e.startswith(prefix) for e in errs) == 1, (prefix, errs)


def test_the_checks_of_a_well_typed_section_run_although_another_is_not(cfg):
    cfg["cluster"]["num_nodes"] = "1"
    cfg["loss_fn"]["ratio_clip_c"] = 0.5
    assert errors_of(cfg) == [
        "cluster.num_nodes: expected int, got str ('1')",
        "loss_fn.ratio_clip_c: must be > 1 (or null to disable dual clipping), got 0.5",
    ]


def test_a_rule_error_is_reported_next_to_a_type_error_of_the_same_section(cfg):
    cfg["policy"]["parallel"]["tensor_paralel_size"] = 2
    cfg["policy"]["train_global_batch_size"] = 30
    cfg["policy"]["train_micro_batch_size"] = 4
    errs = errors_of(cfg)
    assert "policy.parallel.tensor_paralel_size: unknown key (did you mean 'tensor_parallel_size'?)" in errs
    assert any(e.startswith("policy.train_global_batch_size: 30 is not divisible") for e in errs), errs


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)
    e = ConfigError("a.b: bad")
    assert e.errors == ["a.b: bad"] and str(e) == "a.b: bad"
    e = ConfigError(["a: x", "b: y"])
    assert e.errors == ["a: x", "b: y"] and str(e) == "a: x\nb: y"


# =============================================================================
# provenance: every error line names where the value came from
# =============================================================================
def test_an_error_names_the_override():
    (line,) = load_errors(GRPO, "policy.train_micro_batch_size=two")
    assert line == (
        "policy.train_micro_batch_size: expected int, got str ('two') "
        "(from override 'policy.train_micro_batch_size=two')"
    )


def test_an_error_names_the_file_of_the_defaults_chain_that_set_the_value(tmp_path):
    (tmp_path / "base.yaml").write_text(f"defaults: {GRPO}\nloss_fn:\n  ratio_clip_c: 0.5\n")
    (tmp_path / "run.yaml").write_text("defaults: base.yaml\ngrpo:\n  max_num_steps: 3\n")
    (line,) = load_errors(tmp_path / "run.yaml")
    assert line.startswith("loss_fn.ratio_clip_c: must be > 1")
    assert line.endswith(f"(from {tmp_path / 'base.yaml'})")  # not run.yaml, not the shipped default
    (line,) = load_errors(tmp_path / "run.yaml", "loss_fn.ratio_clip_c=0.7")  # a later source wins
    assert line.endswith("(from override 'loss_fn.ratio_clip_c=0.7')")


def test_an_error_in_a_shipped_file_names_it_relative_to_the_working_directory(monkeypatch):
    monkeypatch.chdir(REPO)
    errs = load_errors(GRPO, schema=SFTRunConfig)
    assert (
        "grpo: not used by dualrl sft; remove the section (it reads policy, cluster, sft, data, logger, "
        "checkpointing) (from core/configs/grpo_arithmetic.yaml)" in errs
    )


def test_an_error_names_the_backend_flag():
    (line,) = load_errors(GRPO, "policy.backend=torch_fsdp", backend="jax")
    assert line == (
        "policy.backend: 'jax' is not a registered backend; known: ['torch_fsdp', 'torch_dtensor', 'jax_pjit'] "
        "(from --backend jax)"
    )


def test_a_missing_section_has_no_source():
    (line,) = load_errors(SFT, "sft=null", schema=SFTRunConfig)
    assert line == "sft: expected a mapping (SFTConfig), got None (from override 'sft=null')"
    errs = load_errors(DEFAULT_CONFIG_PATH, schema=SFTRunConfig)
    assert "sft: missing section (dualrl sft needs policy, cluster, sft, data, logger, checkpointing)" in errs


def test_provenance_of_list_items_and_of_lines_without_a_field():
    prov = Provenance()
    prov.record(("policy", "scheduler"), "from override 'policy.scheduler=[...]'")
    prov.record(("policy", "backend"), "from --backend jax_pjit")
    assert prov.source_of("policy.scheduler[2].milestones") == "from override 'policy.scheduler=[...]'"
    assert prov.source_of("policy.backend") == "from --backend jax_pjit"
    assert prov.source_of("cluster.num_nodes") is None
    explained = prov.explain(ConfigError(["policy.backend: bad", "<config>: bad", "no field here", "cluster: x"]))
    assert explained.errors == [
        "policy.backend: bad (from --backend jax_pjit)",
        "<config>: bad",
        "no field here",
        "cluster: x",
    ]


def test_checks_after_validation_name_their_source_too():
    with pytest.raises(ConfigError) as info:
        load_config(
            GRPO,
            ["policy.optimizer.name=torch.optim.AdamWW"],
            schema=GRPORunConfig,
            checks=[lambda c: preflight_errors(c.policy)],
        )
    (line,) = info.value.errors
    assert line.startswith("policy.optimizer.name: cannot import 'torch.optim.AdamWW'")
    assert line.endswith("(from override 'policy.optimizer.name=torch.optim.AdamWW')")
