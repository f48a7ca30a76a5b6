"""The config machinery: typed sections (``core.config.base``), the run configs of each
command (``core.algorithms.config``) and the loader with ``defaults:`` chains, overrides and
the provenance of every value (``core.config.loader``)."""

from __future__ import annotations

import copy
import re
import typing
from pathlib import Path
from types import UnionType
from typing import Any

import pytest
import yaml

from core.algorithms.config import (
    RUN_CONFIGS,
    DPORunConfig,
    GRPORunConfig,
    MasterConfig,
    SFTRunConfig,
    run_config_class,
)
from core.config import (
    DEFAULT_CONFIG_PATH,
    EMBEDDED_CONFIGS,
    ConfigError,
    ConfigModel,
    Provenance,
    apply_overrides,
    deep_merge,
    join_path,
    load_config,
    load_raw_config,
    load_yaml,
    parse_override,
    validate,
)
from core.environments.config import ArithmeticTaskConfig
from core.losses.config import ClippedPGLossConfig, DPOLossConfig
from core.policy.backend_blocks import block_models
from core.policy.config import PolicyConfig, TokenizerConfig
from core.policy.preflight import preflight_errors
from dualrl.cli import file_config_class, main

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = DEFAULT_CONFIG_PATH.parent
SHIPPED_YAMLS = sorted(CONFIG_DIR.glob("*.yaml"))
GRPO, SFT, DPO = EMBEDDED_CONFIGS["grpo"], EMBEDDED_CONFIGS["sft"], EMBEDDED_CONFIGS["dpo"]
#: The built-in backends (pyproject.toml's dualrl.backends entry points).
BACKENDS = ("torch_fsdp", "torch_dtensor", "jax_pjit")


@pytest.fixture(scope="module")
def default_raw():
    return load_yaml(DEFAULT_CONFIG_PATH)


@pytest.fixture
def cfg(default_raw):
    return copy.deepcopy(default_raw)


def errors_of(raw: Any, schema: type[ConfigModel] = MasterConfig, path: str = "") -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(schema, raw, path)
    return info.value.errors


def load_errors(path: Path, *overrides: str, backend: str | None = None, schema=None) -> list[str]:
    schema = schema or run_config_class(load_raw_config(path, overrides, backend))
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides), backend=backend, schema=schema)
    return info.value.errors


def layout_errors(policy: Any, world_size: int) -> list[str]:
    """``PolicyConfig.layout_problems`` as the run config words them (``policy.`` prefixed)."""
    return [
        f"{join_path('policy', p)}: {m}" for p, m in PolicyConfig.coerce(policy, "policy").layout_problems(world_size)
    ]


# =============================================================================
# the shipped configs
# =============================================================================
def test_default_yaml_validates():
    cfg = load_config(DEFAULT_CONFIG_PATH, schema=MasterConfig)
    assert isinstance(cfg, MasterConfig) and isinstance(cfg.policy, PolicyConfig)
    assert cfg.policy.backend in BACKENDS
    assert cfg.policy.model_name == "Qwen/Qwen2.5-0.5B"
    assert cfg.cluster.world_size == cfg.cluster.gpus_per_node * cfg.cluster.num_nodes == 2
    assert isinstance(cfg.policy.optimizer.kwargs["lr"], float)  # "5.0e-6"
    assert isinstance(cfg.loss_fn, ClippedPGLossConfig)
    assert cfg.grpo is None and cfg.sft is None and cfg.data is None  # optional sections stay absent


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", SHIPPED_YAMLS, ids=lambda p: p.name)
def test_every_shipped_yaml_loads_for_every_backend(path, backend):
    """As ``dualrl config`` / ``dualrl <command>`` load it: its run config, then the preflight."""
    schema = file_config_class(load_raw_config(path, backend=backend))
    cfg = load_config(path, backend=backend, schema=schema, checks=[lambda c: preflight_errors(c.policy)])
    assert cfg.policy.backend == backend
    algorithm = {GRPO: "grpo", SFT: "sft", DPO: "dpo"}.get(path)
    if algorithm is not None:  # each embedded default belongs to its command
        assert schema is RUN_CONFIGS[algorithm]


def test_run_config_class_picks_the_command_of_the_file():
    assert run_config_class(load_raw_config(GRPO)) is GRPORunConfig
    assert run_config_class(load_raw_config(SFT)) is SFTRunConfig
    assert run_config_class(load_raw_config(DPO)) is DPORunConfig
    assert run_config_class(load_raw_config(DEFAULT_CONFIG_PATH)) is MasterConfig  # no algorithm section
    assert run_config_class({"grpo": {}, "sft": {}}) is MasterConfig  # several: no single command


def test_default_yaml_spells_out_every_policy_and_loss_key(default_raw):
    # The example is complete: it spells out every PolicyConfig key.
    assert set(default_raw["policy"]) == set(PolicyConfig.model_fields) | set(block_models())
    # Every loss key but those an advantage estimator sets when the file leaves them out (each
    # named in a comment there), which the file must leave out for the estimator to set them.
    from core.algorithms.advantages import ESTIMATORS

    implied = {k.partition(".")[2] for e in ESTIMATORS.values() for k in e.implies if k.startswith("loss_fn.")}
    left_out = set(ClippedPGLossConfig.model_fields) - set(default_raw["loss_fn"])
    assert left_out and left_out <= implied
    assert all(f"# {key}:" in DEFAULT_CONFIG_PATH.read_text() for key in left_out)
    assert set(default_raw) == {"policy", "cluster", "loss_fn"}
    # The run sections are spelled out by the embedded defaults (one per algorithm, each with
    # exactly the sections its command reads), which inherit policy and cluster.
    seen = set()
    for algorithm, path in EMBEDDED_CONFIGS.items():
        sections = set(load_yaml(path))
        assert sections == set(RUN_CONFIGS[algorithm].sections()), algorithm
        seen |= sections
    assert seen == set(MasterConfig.model_fields)


def test_validate_returns_a_model_and_coerce_keeps_one(cfg):
    before = copy.deepcopy(cfg)
    model = validate(MasterConfig, cfg)
    assert cfg == before  # the input is not modified
    assert MasterConfig.coerce(model) is model
    assert PolicyConfig.coerce(model.policy, "policy") is model.policy
    assert ClippedPGLossConfig.coerce(cfg["loss_fn"], "loss_fn") == model.loss_fn
    # to_dict is plain YAML-ready data that validates back to the same config.
    data = model.to_dict()
    assert isinstance(data["policy"]["dtensor_cfg"], dict)
    assert validate(MasterConfig, yaml.safe_load(yaml.safe_dump(data))) == model


def test_models_validate_assignments(cfg):
    policy = validate(MasterConfig, cfg).policy
    policy.train_micro_batch_size = 4
    assert policy.train_micro_batch_size == 4
    with pytest.raises(ValueError, match="train_micro_batch_size"):
        policy.train_micro_batch_size = "4"
    with pytest.raises(ValueError, match="tensor_paralel_size"):
        policy.parallel.tensor_paralel_size = 2


# =============================================================================
# a default lives in one place
# =============================================================================
def _config_models() -> list[type[ConfigModel]]:
    import core.algorithms.config  # noqa: F401 - imports every section module
    from core.policy.registry import all_specs

    all_specs()  # the built-in backends' blocks (their spec modules)
    out, todo = set(), list(ConfigModel.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith(("core.", "backends.")) and cls not in out:
            out.add(cls)
            todo.extend(cls.__subclasses__())
    return sorted(out, key=lambda c: (c.__module__, c.__name__))


def _section_class(annotation: Any) -> type[ConfigModel] | None:
    """The section class of a field (``X``, ``X | None``, ``list[X]``), else None."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, UnionType, list):
        inner = [_section_class(a) for a in typing.get_args(annotation)]
        inner = [c for c in inner if c is not None]
        return inner[0] if len(inner) == 1 else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, ConfigModel) else None


def _unknown_keys(data: Any, model: type[ConfigModel], path: str = "") -> list[str]:
    if isinstance(data, list):
        return [e for i, item in enumerate(data) for e in _unknown_keys(item, model, f"{path}[{i}]")]
    if not isinstance(data, dict):
        return []
    out = []
    for key, value in data.items():
        where = join_path(path, str(key))
        if key in model.extra_sections():  # a backend's own block
            out += _unknown_keys(value, model.extra_sections()[key], where)
            continue
        if key not in model.model_fields:
            out.append(where)
            continue
        section = _section_class(model.model_fields[key].annotation)
        if section is not None:
            out += _unknown_keys(value, section, where)
    return out


@pytest.mark.parametrize("path", SHIPPED_YAMLS, ids=lambda p: p.name)
def test_every_key_of_a_shipped_yaml_is_a_field_of_its_model(path):
    """Each file on its own (not only merged): a YAML key is a model field, never a second
    schema -- a key the model does not know would be a setting with a default of its own."""
    data = yaml.safe_load(path.read_text())
    data.pop("defaults", None)
    assert _unknown_keys(data, file_config_class(data)) == []


def test_old_default_tables_are_gone():
    """Defaults live in the models: no component keeps a table of its section's defaults."""
    names = ("ARITHMETIC_DEFAULTS", "MATH_DEFAULTS", "LOGGER_DEFAULTS", "resolve_logger_config")
    sources = [p for root in ("core", "backends", "dualrl", "benchmarks") for p in (REPO / root).rglob("*.py")]
    found = [f"{p.relative_to(REPO)}: {n}" for p in sources for n in names if re.search(rf"\b{n}\b", p.read_text())]
    assert found == []


def test_no_module_keeps_a_copy_of_a_field_default():
    """A constant documented as the default of a config field is a second place for it."""
    sources = [p for root in ("core", "backends", "dualrl", "benchmarks") for p in (REPO / root).rglob("*.py")]
    pattern = re.compile(r"#: Default of ``(\w+(?:\.\w+)+)``")
    found = [f"{p.relative_to(REPO)}: {m}" for p in sources for m in pattern.findall(p.read_text())]
    assert found == []


#: Leaf fields with no docstring yet (their model_fields[...].description is None).  A field
#: whose type is a section is documented by that section's class docstring.  This list may
#: only shrink: document the field in its model, then remove it here.
KNOWN_UNDOCUMENTED: set[str] = set()


def test_every_field_has_a_docstring():
    """The model is the one description of a section: each field says what it does
    (``use_attribute_docstrings`` turns the docstring under a field into its description)."""
    undocumented = {
        f"{model.__module__}.{model.__name__}.{name}"
        for model in _config_models()
        for name, field in model.model_fields.items()
        if not field.description and _section_class(field.annotation) is None
    }
    assert not (undocumented - KNOWN_UNDOCUMENTED), "fields without a docstring"
    assert not (KNOWN_UNDOCUMENTED - undocumented), "documented now: remove them from KNOWN_UNDOCUMENTED"


def test_every_section_class_has_a_docstring():
    assert [m.__name__ for m in _config_models() if not (m.__doc__ or "").strip()] == []


def test_every_section_is_strict_and_closed():
    """No section loosens the shared rules (unknown keys refused, no coercion, assignments checked).
    A section with sections known only at run time (the policy: the backends' blocks) takes
    extra keys to check them itself -- an unknown one is still refused (test_unknown_key_*)."""
    loose = [
        m.__name__
        for m in _config_models()
        if (m.model_config.get("extra"), m.model_config.get("strict"), m.model_config.get("validate_assignment"))
        != ("allow" if m.extra_sections.__func__ is not ConfigModel.extra_sections.__func__ else "forbid", True, True)
    ]
    assert loose == []


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


# =============================================================================
# dualrl config
# =============================================================================
def test_dualrl_config_prints_the_resolved_config(capsys):
    assert main(["config", "--config", str(GRPO), "--backend", "jax_pjit", "policy.train_micro_batch_size=16"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["policy"]["backend"] == "jax_pjit"
    assert printed["policy"]["train_micro_batch_size"] == 16
    # Resolved: the defaults chain merged and every model default filled in.
    assert printed["policy"]["optimizer"]["name"] == "torch.optim.AdamW"  # from grpo_arithmetic.yaml
    assert printed["policy"]["jax_cfg"]["moe_dispatch"] == "auto"  # from policy.yaml
    assert printed["policy"]["generation"]["colocated"]["enabled"] is True  # a model default
    assert set(printed["policy"]) == set(PolicyConfig.model_fields) | set(block_models())
    expected = load_config(
        GRPO, ["policy.train_micro_batch_size=16"], backend="jax_pjit", schema=GRPORunConfig
    ).to_dict()
    assert printed == expected


@pytest.mark.parametrize("algorithm", list(EMBEDDED_CONFIGS))
def test_the_printed_config_is_accepted_by_its_command(algorithm, tmp_path, capsys):
    assert main(["config", "--config", str(EMBEDDED_CONFIGS[algorithm])]) == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    assert run_config_class(load_raw_config(printed)) is RUN_CONFIGS[algorithm]
    load_config(printed, schema=RUN_CONFIGS[algorithm])


def test_dualrl_config_prints_nothing_for_a_bad_config_and_names_every_error(capsys):
    assert main(["config", "--config", str(GRPO), "policy.precision=fp32", "cluster.num_nodes=two"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"invalid config {GRPO}:" in err
    assert (
        "policy.precision: expected one of 'float32', 'bfloat16', 'float16', got 'fp32' "
        "(from override 'policy.precision=fp32')" in err
    )
    assert "cluster.num_nodes: expected int, got str ('two') (from override 'cluster.num_nodes=two')" in err


# =============================================================================
# overrides
# =============================================================================
@pytest.mark.parametrize(
    "text, keys, value",
    [
        ("policy.train_micro_batch_size=2", ("policy", "train_micro_batch_size"), 2),
        ("policy.parallel.sequence_parallel=true", ("policy", "parallel", "sequence_parallel"), True),
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
        ("a=", ("a",), None),
    ],
)
def test_parse_override(text, keys, value):
    k, v = parse_override(text)
    assert k == keys
    assert v == value and type(v) is type(value)


@pytest.mark.parametrize("text", ["policy.train_micro_batch_size", "=2", "a..b=1", "a.=1", "a=[1"])
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
            "policy.parallel.tensor_parallel_size=2",
            "policy.parallel.sequence_parallel=true",
        ],
        schema=MasterConfig,
    )
    p = cfg.policy
    assert p.train_micro_batch_size == 4
    assert p.optimizer.kwargs["lr"] == 1e-6
    assert p.max_grad_norm is None
    assert p.generation.stop_token_ids == [151643]
    assert p.parallel.sequence_parallel is True


def test_load_raw_config_applies_overrides_and_backend_without_validating():
    raw = load_raw_config(DEFAULT_CONFIG_PATH, ["policy.train_micro_batch_size=two"], backend="nope")
    assert isinstance(raw, dict)
    assert raw["policy"]["train_micro_batch_size"] == "two" and raw["policy"]["backend"] == "nope"


def test_unknown_key_via_override():
    (line,) = load_errors(DEFAULT_CONFIG_PATH, "policy.train_micro_batchsize=2")
    assert line == (
        "policy.train_micro_batchsize: unknown key (did you mean 'train_micro_batch_size'?) "
        "(from override 'policy.train_micro_batchsize=2')"
    )


def test_bad_value_via_override_collects_all():
    errs = load_errors(DEFAULT_CONFIG_PATH, "policy.precision=fp32", "cluster.num_nodes=two")
    assert [e.split(":")[0] for e in errs] == ["policy.precision", "cluster.num_nodes"]


def test_backend_flag():
    assert load_config(DEFAULT_CONFIG_PATH, backend="jax_pjit", schema=MasterConfig).policy.backend == "jax_pjit"
    # --backend wins over an override of the same key
    cfg = load_config(DEFAULT_CONFIG_PATH, ["policy.backend=torch_fsdp"], backend="torch_dtensor", schema=MasterConfig)
    assert cfg.policy.backend == "torch_dtensor"
    assert load_errors(DEFAULT_CONFIG_PATH, backend="jax") == [
        "policy.backend: 'jax' is not a registered backend; known: ['torch_fsdp', 'torch_dtensor', 'jax_pjit'] "
        "(from --backend jax)"
    ]


def test_backend_flag_changes_dp_checks():
    # world 2; dtensor tp=2 -> dp 1 so gbs 2 / mbs 2 is fine; torch_fsdp -> dp 2 and it is not.
    ov = [
        "policy.parallel.tensor_parallel_size=2",
        "policy.train_global_batch_size=2",
        "policy.train_micro_batch_size=2",
    ]
    load_config(DEFAULT_CONFIG_PATH, ov, backend="torch_dtensor", schema=MasterConfig)
    (line,) = load_errors(DEFAULT_CONFIG_PATH, *ov[1:], backend="torch_fsdp")
    assert re.match(r"policy\.train_global_batch_size: 2 is not divisible by .* data parallel size \(2\) = 4", line)


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
        "  parallel: {tensor_parallel_size: 2}\n"
    )
    cfg = load_config(tmp_path / "exp.yaml", backend="jax_pjit", schema=MasterConfig)
    assert cfg.policy.train_micro_batch_size == 4
    assert cfg.policy.parallel.to_dict() == {
        "fsdp_size": -1,
        "tensor_parallel_size": 2,
        "context_parallel_size": 1,
        "sequence_parallel": False,
        "expert_parallel_size": 1,
    }
    assert cfg.policy.to_dict()["jax_cfg"] == {"moe_dispatch": "auto", "padded_widths_per_doubling": 2}
    assert cfg.policy.model_name == "Qwen/Qwen2.5-0.5B"


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
    (tmp_path / "b.yaml").write_text("defaults: {a: 1}\n")
    with pytest.raises(ConfigError, match=r"defaults: expected a file name or a list of file names"):
        load_yaml(tmp_path / "b.yaml")


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
