"""The shipped configs load for every backend, and every default lives in one place (the
section models), documented; ``dualrl config`` prints what a command would run."""

from __future__ import annotations

import copy
import re
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
    ConfigModel,
    join_path,
    load_config,
    load_raw_config,
    load_yaml,
    validate,
)
from core.losses.config import ClippedPGLossConfig
from core.policy.backend_blocks import block_models
from core.policy.config import PolicyConfig
from core.policy.preflight import preflight_errors
from dualrl.cli import file_config_class, main
from tests.unit.config.cases import (
    BACKENDS,
    DPO,
    GRPO,
    REPO,
    SFT,
    SHIPPED_YAMLS,
    config_models,
    section_class,
)


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
        section = section_class(model.model_fields[key].annotation)
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
        for model in config_models()
        for name, field in model.model_fields.items()
        if not field.description and section_class(field.annotation) is None
    }
    assert not (undocumented - KNOWN_UNDOCUMENTED), "fields without a docstring"
    assert not (KNOWN_UNDOCUMENTED - undocumented), "documented now: remove them from KNOWN_UNDOCUMENTED"


def test_everysection_class_has_a_docstring():
    assert [m.__name__ for m in config_models() if not (m.__doc__ or "").strip()] == []


def test_every_section_is_strict_and_closed():
    """No section loosens the shared rules (unknown keys refused, no coercion, assignments checked).
    A section with sections known only at run time (the policy: the backends' blocks) takes
    extra keys to check them itself -- an unknown one is still refused (test_unknown_key_*)."""
    loose = [
        m.__name__
        for m in config_models()
        if (m.model_config.get("extra"), m.model_config.get("strict"), m.model_config.get("validate_assignment"))
        != ("allow" if m.extra_sections.__func__ is not ConfigModel.extra_sections.__func__ else "forbid", True, True)
    ]
    assert loose == []


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
