"""The loader: ``key=value`` overrides, ``--backend``, ``defaults:`` chains, YAML details."""

from __future__ import annotations

import re

import pytest

from core.algorithms.config import (
    MasterConfig,
)
from core.config import (
    DEFAULT_CONFIG_PATH,
    ConfigError,
    apply_overrides,
    deep_merge,
    load_config,
    load_raw_config,
    load_yaml,
    parse_override,
)
from tests.unit.config.cases import (
    load_errors,
)


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
