"""Backends are plug-ins: one spec object per backend, found by entry point, asked instead of
branching on a name; one key per option, each refused by name where a backend lacks it; the old
per-backend spellings refused naming the new key.  Config level only: no Ray, no worker."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from core.config import DEFAULT_CONFIG_PATH, ConfigError, ConfigModel, load_config, load_yaml
from core.policy.backend_blocks import renamed_keys
from core.policy.backend_spec import BackendSpec
from core.policy.config import PolicyConfig
from core.policy.options import OPTIONS, option
from core.policy.registry import (
    ENTRY_POINT_GROUP,
    BackendNotFound,
    backend_names,
    backend_spec,
    register_backend,
    unregister_backend,
)

REPO = Path(__file__).resolve().parents[2]
#: The built-in backends, as pyproject.toml declares them.
BUILTINS = ("torch_fsdp", "torch_dtensor", "jax_pjit")
#: A value that asks each option for its feature (with what it needs to mean anything).
ASKING = {
    "parallel.tensor_parallel_size": {"parallel": {"tensor_parallel_size": 2}},
    "parallel.sequence_parallel": {"parallel": {"tensor_parallel_size": 2, "sequence_parallel": True}},
    "parallel.context_parallel_size": {"parallel": {"context_parallel_size": 2}},
    "parallel.expert_parallel_size": {"parallel": {"expert_parallel_size": 2}},
    "activation_checkpointing": {"activation_checkpointing": True},
    "cpu_offload": {"cpu_offload": True},
    "compile": {"compile": True},
    "make_vocab_size_divisible_by": {"make_vocab_size_divisible_by": 64},
    "sequence_packing.enabled": {"sequence_packing": {"enabled": True}},
    "sequence_packing.shared_prompts": {"sequence_packing": {"enabled": True, "shared_prompts": True}},
    "dynamic_batching.enabled": {"dynamic_batching": {"enabled": True}},
    "lora.enabled": {"lora": {"enabled": True}},
    "lora.dropout": {"lora": {"enabled": True, "dropout": 0.1}},
    "generation.backend": {"generation": {"backend": "hf"}},
    "numerics": {"numerics": "exact", "generation": {"backend": "hf"}},
}


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def policy(backend: str, **changes) -> dict:
    """The default policy section on ``backend`` with ``changes`` merged in (one level deep)."""
    raw = copy.deepcopy(load_yaml(DEFAULT_CONFIG_PATH)["policy"])
    raw["backend"] = backend
    for key, value in changes.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
    return raw


def errors(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        PolicyConfig.coerce(raw, "policy")
    return info.value.errors


# ----------------------------------------------------------------------------- the registry
def test_the_builtins_are_found_through_the_entry_point_table():
    assert backend_names()[:3] == list(BUILTINS)
    for name in BUILTINS:
        spec = backend_spec(name)
        assert spec.name == name and spec.worker.startswith(f"backends.{name}.")
    with pytest.raises(BackendNotFound, match=r"'nope' is not a registered backend; known: \['torch_fsdp'"):
        backend_spec("nope")
    table = (REPO / "pyproject.toml").read_text()
    assert f'[project.entry-points."{ENTRY_POINT_GROUP}"]' in table


def test_reading_every_spec_and_validating_imports_no_engine():
    """The driver validates a config on any backend without torch, jax or flax."""
    code = textwrap.dedent(
        """
        import sys
        from core.algorithms.config import GRPORunConfig
        from core.config import EMBEDDED_CONFIGS, load_config
        from core.policy.registry import backend_spec
        for name in ("torch_fsdp", "torch_dtensor", "jax_pjit"):  # a plug-in on the path may refuse 2 workers
            load_config(EMBEDDED_CONFIGS["grpo"], backend=backend_spec(name).name, schema=GRPORunConfig)
        print(sorted(m for m in ("torch", "jax", "flax", "ray") if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_a_spec_refuses_an_option_it_does_not_know():
    with pytest.raises(ValueError, match=r"\['parallel.tensor_parallel'\] are not policy options"):
        BackendSpec("bad", "m:C", "bad", supports=frozenset({"parallel.tensor_parallel"}))


# ----------------------------------------------------------------------------- one key per option
REFUSED = [(b, o.key) for b in BUILTINS for o in OPTIONS if o.key not in backend_spec(b).supports]
SUPPORTED = [(b, o.key) for b in BUILTINS for o in OPTIONS if o.key in backend_spec(b).supports]


@pytest.mark.parametrize("backend, key", REFUSED, ids=[f"{b}-{k}" for b, k in REFUSED])
def test_an_option_a_backend_lacks_is_refused_by_name(backend, key):
    lines = [line for line in errors(policy(backend, **ASKING[key])) if line.startswith(f"policy.{key}: ")]
    assert len(lines) == 1, lines
    assert f"the {backend} backend does not support {option(key).what}" in lines[0]
    assert lines[0].endswith(f"; set it to {option(key).off}")
    assert backend_spec(backend).why_not[key] in lines[0]  # every refusal says why


@pytest.mark.parametrize("backend, key", SUPPORTED, ids=[f"{b}-{k}" for b, k in SUPPORTED])
def test_an_option_a_backend_has_is_accepted(backend, key):
    cfg = PolicyConfig.coerce(policy(backend, **ASKING[key]), "policy")
    assert option(key).asked(cfg)


def test_an_option_that_asks_nothing_is_no_refusal():
    """Off values are what every backend does: a config that runs on one backend validates on all."""
    for backend in BUILTINS:
        PolicyConfig.coerce(policy(backend, lora={"enabled": False, "dropout": 0.1}), "policy")


def test_sequence_parallel_needs_tensor_parallelism():
    (line,) = errors(policy("torch_dtensor", parallel={"sequence_parallel": True}))
    assert line.startswith("policy.parallel.sequence_parallel: true needs tensor_parallel_size >= 2")


@pytest.mark.parametrize("old, new", sorted(renamed_keys().items()))
def test_each_old_spelling_is_refused_naming_its_one_key(old, new):
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT_CONFIG_PATH, [f"policy.{old}=true"], schema=_master())
    assert info.value.errors == [
        f"policy.{old}: renamed: use policy.{new} (one key on every backend; docs/configuration.md) "
        f"(from override 'policy.{old}=true')"
    ]


def test_an_old_spelling_in_a_file_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(f"defaults: {DEFAULT_CONFIG_PATH}\npolicy:\n  jax_cfg: {{fsdp_size: 2, moe_dispatch: dense}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, schema=_master())
    assert info.value.errors == [
        "policy.jax_cfg.fsdp_size: renamed: use policy.parallel.fsdp_size (one key on every backend; "
        f"docs/configuration.md) (from {path})"
    ]
    # what the block still holds is kept: moe_dispatch is the JAX backend's own setting
    path.write_text(f"defaults: {DEFAULT_CONFIG_PATH}\npolicy:\n  jax_cfg: {{moe_dispatch: dense}}\n")
    cfg = load_config(path, backend="jax_pjit", schema=_master())
    assert cfg.policy.block(backend_spec("jax_pjit"), backend_spec("jax_pjit").config_block).moe_dispatch == "dense"


def test_the_chosen_backends_block_is_filled_in_and_read_through_its_spec():
    raw = policy("jax_pjit")
    del raw["jax_cfg"], raw["dtensor_cfg"]
    cfg = PolicyConfig.coerce(raw, "policy")
    assert cfg.to_dict()["jax_cfg"] == {"moe_dispatch": "auto", "padded_widths_per_doubling": 2}
    assert "dtensor_cfg" not in cfg.to_dict()
    spec = backend_spec("torch_dtensor")
    assert cfg.block(spec, spec.config_block).custom_parallel_plan is None  # another backend's: its defaults
    (line,) = errors(policy("jax_pjit", jax_cfg={"moe_dispatch": "fast"}))
    assert line.startswith("policy.jax_cfg.moe_dispatch: expected one of 'auto', 'dense', 'blocked', 'grouped'")
    (line,) = errors(policy("jax_pjit", jax_cfg={"padded_widths_per_doubling": 3}))
    assert line.startswith("policy.jax_cfg.padded_widths_per_doubling: expected one of 1, 2, 4, 8")


def _master():
    from core.algorithms.config import MasterConfig

    return MasterConfig


# ----------------------------------------------------------------------------- a backend core does not know
class ToyConfig(ConfigModel):
    """The toy backend's own block."""

    eager: bool = True
    """Whether it is eager."""


TOY = BackendSpec(
    name="toy_eager",
    worker="toy.worker:ToyWorker",
    layout_prefix="toy",
    supports=frozenset({"activation_checkpointing"}),
    why_not={"parallel.tensor_parallel_size": "one process, no mesh"},
    config_key="toy_cfg",
    config_block=ToyConfig,
    renamed={"toy_cfg.lazy": "toy_cfg.eager"},
)


@pytest.fixture
def toy():
    register_backend(TOY)
    yield TOY
    unregister_backend(TOY.name)


def test_a_backend_registered_at_run_time_is_validated_without_a_line_of_core(toy):
    from benchmarks.lib.layouts import LayoutError, grammar, parse_layout

    raw = policy("toy_eager", toy_cfg={"eager": False}, activation_checkpointing=True)
    cfg = PolicyConfig.coerce(raw, "policy")
    assert cfg.spec is toy and cfg.block(toy, ToyConfig).eager is False
    assert cfg.parallel_dims(2).dp == 2 and toy.layout(cfg, 2).axis_size("dp") == 2
    (line,) = errors(policy("toy_eager", parallel={"tensor_parallel_size": 2}))
    assert line.startswith("policy.parallel.tensor_parallel_size: 2: the toy_eager backend does not support tensor")
    assert "(one process, no mesh)" in line
    (line,) = errors(policy("toy_eager", toy_cfg={"lazy": True}))
    assert line.startswith("policy.toy_cfg.lazy: renamed: use policy.toy_cfg.eager")
    (line,) = errors(policy("toy_eager", toy_cfg={"eagre": True}))
    assert line == "policy.toy_cfg.eagre: unknown key (did you mean 'eager'?)"
    assert parse_layout("toy-dp2").backend == "toy_eager" and "toy-[dp<D>]" in grammar()
    with pytest.raises(LayoutError, match="-tp asks for tensor parallelism .* the toy_eager backend does not"):
        parse_layout("toy-dp1-tp2")


def test_an_outside_package_registers_by_entry_point(tmp_path):
    """A package outside the repository (a module and its dist-info on PYTHONPATH) declares a
    backend in the ``dualrl.backends`` group: ``--backend`` offers it, ``dualrl config``
    validates a config on it, and the layouts know its grammar."""
    site = tmp_path / "site"
    (site / "toyplug-0.1.dist-info").mkdir(parents=True)
    (site / "toyplug-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: toyplug\nVersion: 0.1\n")
    (site / "toyplug-0.1.dist-info" / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\ntoyplug = toyplug_spec:SPEC\n"
    )
    (site / "toyplug_spec.py").write_text(
        "from core.policy.backend_spec import BackendSpec\n"
        "SPEC = BackendSpec(name='toyplug', worker='toyplug_spec:Worker', layout_prefix='toyp')\n"
    )
    env = {"PYTHONPATH": f"{REPO}:{site}", "PATH": "/usr/bin:/bin"}
    run = [sys.executable, "-m", "dualrl", "config", "--backend", "toyplug", "policy.train_micro_batch_size=4"]
    out = subprocess.run(run, capture_output=True, text=True, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    assert "backend: toyplug" in out.stdout
    refused = subprocess.run([*run, "policy.compile=true"], capture_output=True, text=True, cwd=REPO, env=env)
    assert refused.returncode == 2 and "policy.compile: true: the toyplug backend does not support" in refused.stderr
    code = "from benchmarks.lib.layouts import parse_layout; import json; l = parse_layout('toyp-dp2'); "
    code += "print(json.dumps([l.backend, l.workers]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env)
    assert json.loads(out.stdout) == ["toyplug", 2], out.stderr


@pytest.mark.parametrize("backend", BUILTINS)
def test_the_data_parallel_size_counts_devices_whatever_a_worker_owns(backend):
    """Batch sizes are per data-parallel device on every backend, so the driver counts the
    ranks in devices: 2 workers x 4 devices each (where a worker owns a host) or 8 workers of
    one device -> 8 ranks of train_micro_batch_size rows each per micro batch (4 with tp 2)."""
    import dataclasses

    spec = backend_spec(backend)
    tp = 2 if "parallel.tensor_parallel_size" in spec.supports else 1
    cfg = PolicyConfig.coerce(policy(backend, parallel={"tensor_parallel_size": tp}), "policy")
    if spec.one_worker_per_device:
        assert spec.devices_per_worker is None and spec.data_parallel_size(cfg, None, 8) == 8 // tp
    else:
        assert spec.devices_per_worker is not None  # asks the cluster how many devices a host gives
        hosts = dataclasses.replace(spec, devices_per_worker=lambda cluster: 4)
        assert hosts.data_parallel_size(cfg, None, 2) == 8 // tp


# ----------------------------------------------------------------------------- the checks that keep it so
def test_core_names_no_builtin_backend():
    assert _load_tool("backend_names").hits() == []


def test_the_name_check_finds_a_branch_on_a_backend_name(tmp_path, monkeypatch):
    tool = _load_tool("backend_names")
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "bad.py").write_text('if cfg.backend == "jax_pjit":\n    x = cfg.dtensor_cfg  # FSDP1\n')
    monkeypatch.setattr(tool, "REPO", tmp_path)
    monkeypatch.setattr(tool, "CHECKED", ("core",))
    assert tool.hits() == ["core/bad.py:1: 'jax_pjit'", "core/bad.py:2: 'dtensor_cfg'", "core/bad.py:2: 'FSDP1'"]


def test_the_docs_options_table_is_the_specs():
    tool = _load_tool("options_table")
    assert tool.documented() == tool.table()
