"""Config honesty: every accepted field is used (or refused by name when its feature does not
exist), ``dualrl config`` refuses what the run would refuse, and every error says where the
value came from (the override, ``--backend`` or the YAML file)."""

from __future__ import annotations

import argparse
import inspect
import json
import re
from pathlib import Path

import pytest

from core.config import EMBEDDED_CONFIGS, ConfigError
from core.policy.preflight import import_error, model_vocab_size
from dualrl.cli import load_command_config, main
from tests.unit.config.cases import GRPO, REPO, config_models


def load_config(path, overrides=(), backend=None):
    """What ``dualrl config --config PATH [--backend B] OVERRIDES`` validates: the run config of
    the file's command, then the preflight (vocabulary, optimizer and scheduler classes)."""
    args = argparse.Namespace(command="config", config=str(path), overrides=list(overrides), backend=backend)
    return load_command_config(args)


def errors_of(*overrides, backend=None, path=GRPO) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides), backend=backend)
    return info.value.errors


def the_error(field: str, *overrides, **kw) -> str:
    """The one error line about ``field``."""
    lines = [e for e in errors_of(*overrides, **kw) if e.startswith(f"{field}: ")]
    assert len(lines) == 1, errors_of(*overrides, **kw)
    return lines[0]


# ----------------------------------------------------------------------------- every field is read
#: Fields whose feature does not exist: accepted only when off, refused by name when on.
REFUSED_SWITCHES = {("VllmConfig", "async_engine"): "policy.generation.vllm_cfg.async_engine=true"}


def _source_text() -> str:
    """core/ and backends/ without the config machinery and the modules that define the
    sections (a model's own checks read its fields; that is not a use)."""
    model_files = {Path(inspect.getfile(m)).resolve() for m in config_models()}
    files = [
        p
        for root in ("core", "backends")
        for p in (REPO / root).rglob("*.py")
        if p.resolve() not in model_files and p.parent != REPO / "core" / "config"
    ]
    return "\n".join(p.read_text() for p in files)


def test_every_schema_field_is_read_outside_the_config_modules():
    """A field nobody reads is a setting that silently does nothing (generation_batch_size was one)."""
    source = _source_text()
    models = config_models()
    assert len(models) > 20  # every section module was imported
    unread = sorted(
        f"{model.__name__}.{key}"
        for model in models
        for key in model.model_fields
        if (model.__name__, key) not in REFUSED_SWITCHES and not re.search(rf"\b{key}\b", source)
    )
    assert unread == []


@pytest.mark.parametrize("override", REFUSED_SWITCHES.values())
def test_a_switch_for_a_missing_feature_is_refused_when_on(override):
    field = override.split("=")[0]
    line = the_error(field, override)
    assert "True: " in line and "no async vLLM engine" in line
    load_config(GRPO, [override.replace("true", "false")])  # off: what happens anyway


# ----------------------------------------------------------------------------- generation values
def test_temperature_must_be_positive():
    line = the_error("policy.generation.temperature", "policy.generation.temperature=0")
    assert "must be > 0, got 0" in line and "greedy=True" in line
    assert "got -0.5" in the_error("policy.generation.temperature", "policy.generation.temperature=-0.5")


def test_top_k_zero_is_a_typo_and_minus_one_is_off():
    line = the_error("policy.generation.top_k", "policy.generation.top_k=0")
    assert "-1 means off; 0 is probably a typo" in line
    assert "-3: must be a positive number" in the_error("policy.generation.top_k", "policy.generation.top_k=-3")
    for ok in ("-1", "null", "5"):
        load_config(GRPO, [f"policy.generation.top_k={ok}"])


def test_token_ids_outside_the_builtin_vocabulary_are_refused():
    line = the_error("policy.generation.stop_token_ids[1]", "policy.generation.stop_token_ids=[2, 32]")
    assert "32 is outside the vocabulary of builtin:arithmetic-llama (vocab_size 32" in line
    assert "99 is outside" in the_error("policy.generation.pad_token_id", "policy.generation.pad_token_id=99")
    assert "-1: token ids are >= 0" in the_error(
        "policy.generation.stop_token_ids[0]", "policy.generation.stop_token_ids=[-1]"
    )
    load_config(GRPO, ["policy.generation.stop_token_ids=[2, 31]"])


def test_vocabulary_comes_from_a_local_model_directory_and_is_unknown_for_a_hub_id(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    (tmp_path / "vlm").mkdir()
    (tmp_path / "vlm" / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 77}}))
    assert model_vocab_size(str(tmp_path)) == 300
    assert model_vocab_size(str(tmp_path / "vlm")) == 77
    assert model_vocab_size("builtin:arithmetic-llama-base") == 32
    assert model_vocab_size("Qwen/Qwen2.5-0.5B") is None  # not looked up: validation stays offline
    assert model_vocab_size(str(tmp_path / "missing")) is None
    line = the_error(
        "policy.generation.stop_token_ids[0]", f"policy.model_name={tmp_path}", "policy.generation.stop_token_ids=[300]"
    )
    assert f"300 is outside the vocabulary of {tmp_path} (vocab_size 300" in line
    load_config(GRPO, ["policy.model_name=Qwen/Qwen2.5-0.5B", "policy.generation.stop_token_ids=[151643]"])


def test_vllm_max_model_len_must_hold_a_whole_sequence():
    line = the_error("policy.generation.vllm_cfg.max_model_len", "policy.generation.vllm_cfg.max_model_len=16")
    assert "16 is below policy.max_total_sequence_length (32)" in line
    # The hf engine has no max_model_len: the vllm block is then not read.
    load_config(GRPO, ["policy.generation.vllm_cfg.max_model_len=16", "policy.generation.backend=hf"])


def test_generation_model_name_is_refused_where_nothing_reads_it():
    line = the_error(
        "policy.generation.model_name", "policy.generation.backend=hf", "policy.generation.model_name=other/model"
    )
    assert "not used by generation.backend 'hf'" in line
    load_config(GRPO, ["policy.generation.model_name=other/model"])  # vllm: the engine's architecture


# ----------------------------------------------------------------------------- optimizer / scheduler
def test_empty_scheduler_list_and_milestones_alone_are_refused():
    assert "[]: no scheduler to run; use null" in the_error("policy.scheduler", "policy.scheduler=[]")
    line = the_error("policy.scheduler", "policy.scheduler=[{milestones: [3]}]")
    assert "only a milestones entry: no scheduler to run" in line
    load_config(GRPO, ["policy.scheduler=null"])


@pytest.mark.parametrize("backend", ["torch_dtensor", "torch_fsdp"])
def test_torch_backends_need_importable_classes(backend):
    line = the_error("policy.optimizer.name", "policy.optimizer.name=torch.optim.AdamWW", backend=backend)
    assert "cannot import 'torch.optim.AdamWW': module 'torch.optim' has no attribute 'AdamWW'" in line
    line = the_error(
        "policy.scheduler[0].name", "policy.scheduler=[{name: no_such_pkg.Sched, kwargs: {}}]", backend=backend
    )
    assert "cannot import 'no_such_pkg.Sched'" in line
    # Any importable class is the torch backends' to use (they import it the same way).
    load_config(GRPO, ["policy.optimizer.name=torch.optim.RMSprop"], backend=backend)


def test_jax_accepts_only_the_classes_optax_reproduces():
    line = the_error("policy.optimizer.name", "policy.optimizer.name=torch.optim.RMSprop", backend="jax_pjit")
    assert "'torch.optim.RMSprop' is not supported by the jax_pjit backend" in line
    line = the_error(
        "policy.scheduler[0].name",
        "policy.scheduler=[{name: torch.optim.lr_scheduler.StepLR, kwargs: {}}]",
        backend="jax_pjit",
    )
    assert "'torch.optim.lr_scheduler.StepLR' is not supported by the jax_pjit backend" in line


def test_the_driver_mirrors_the_backends_class_resolution():
    pytest.importorskip("optax")
    from backends.jax_pjit.optim import SUPPORTED_OPTIMIZERS, SUPPORTED_SCHEDULERS
    from backends.torch_common.optim import import_object
    from core.policy.registry import backend_spec

    jax = backend_spec("jax_pjit")
    assert (jax.optimizers, jax.schedulers) == (SUPPORTED_OPTIMIZERS, SUPPORTED_SCHEDULERS)
    assert backend_spec("torch_fsdp").optimizers is backend_spec("torch_dtensor").optimizers is None
    for path in ("torch.optim.AdamW", "torch.optim.Nope", "nodots", "no_such_pkg.X"):
        try:
            import_object(path, "x")
            backend_ok = True
        except ValueError:
            backend_ok = False
        assert (import_error(path) is None) == backend_ok, path


# ----------------------------------------------------------------------------- provenance
def test_an_error_names_the_override_not_the_default_file():
    line = the_error("policy.generation.temperature", "policy.generation.temperature=0")
    assert line.endswith("(from override 'policy.generation.temperature=0')")
    assert "default.yaml" not in line and "grpo_arithmetic.yaml" not in line


def test_an_error_names_the_yaml_file_that_set_the_value(tmp_path):
    (tmp_path / "base.yaml").write_text(f"defaults: {GRPO}\npolicy:\n  generation:\n    top_k: 0\n")
    (tmp_path / "run.yaml").write_text("defaults: base.yaml\npolicy:\n  train_micro_batch_size: 16\n")
    line = the_error("policy.generation.top_k", path=tmp_path / "run.yaml")
    assert line.endswith(f"(from {tmp_path / 'base.yaml'})")  # the file of the defaults chain that set it
    # The later source wins: an override of the same field.
    line = the_error("policy.generation.top_k", "policy.generation.top_k=-7", path=tmp_path / "run.yaml")
    assert line.endswith("(from override 'policy.generation.top_k=-7')")


def test_an_error_inside_a_list_names_the_override_of_the_list():
    line = the_error("policy.scheduler[0].name", "policy.scheduler=[{name: torch.optim.X, kwargs: {}}]")
    assert line.endswith("(from override 'policy.scheduler=[{name: torch.optim.X, kwargs: {}}]')")


def test_an_error_names_the_backend_flag():
    line = the_error("policy.backend", "policy.backend=torch_fsdp", backend="jax")
    assert line.endswith("(from --backend jax)")  # the flag is applied after the overrides: it won


def test_dualrl_config_names_the_override(capsys):
    assert main(["config", "policy.generation.temperature=0"]) == 2
    err = capsys.readouterr().err
    assert "policy.generation.temperature: must be > 0, got 0" in err
    assert "(from override 'policy.generation.temperature=0')" in err


def test_the_training_commands_refuse_it_at_start_up_naming_the_override(capsys, monkeypatch):
    """Before anything heavy: the training entry point is never reached."""
    import dualrl.cli as cli

    monkeypatch.setattr(cli, "_run_function", lambda name: pytest.fail(f"dualrl {name} started with a bad config"))
    for command in ("grpo", "sft", "dpo"):
        assert main([command, "policy.generation.top_k=0"]) == 2
        assert "(from override 'policy.generation.top_k=0')" in capsys.readouterr().err
    # The command's own rules (sections it does not read) name their source too.
    assert main(["sft", "env.name=arithmetic", "env.num_workers=1"]) == 2
    assert (
        "env: not used by dualrl sft; remove the section (it reads policy, cluster, sft, data, logger, "
        "checkpointing) (from override 'env.num_workers=1')" in capsys.readouterr().err
    )


def test_generation_settings_belong_to_grpo_alone(capsys, monkeypatch):
    """SFT and DPO never generate, yet the workers divide every logit by generation's
    temperature (so that GRPO trains on the distribution it sampled): a generation section
    in an SFT/DPO run would silently change the loss.  GRPO cannot run without one."""
    import dualrl.cli as cli

    monkeypatch.setattr(cli, "_run_function", lambda name: pytest.fail(f"dualrl {name} started with a bad config"))
    for command in ("sft", "dpo"):
        assert main([command, "policy.generation.temperature=0.7"]) == 2
        err = capsys.readouterr().err
        assert f"policy.generation: not used by dualrl {command}, which never generates" in err
        assert "missing required key" not in err  # the refused section's own gaps are not listed
        assert "(from override 'policy.generation.temperature=0.7')" in err
    assert main(["grpo", "policy.generation=null"]) == 2
    assert "policy.generation: missing; dualrl grpo samples its rollouts" in capsys.readouterr().err
    for command in ("sft", "dpo"):  # the embedded configs say so themselves
        assert load_config(EMBEDDED_CONFIGS[command]).policy.generation is None


# ----------------------------------------------------------------------------- env
def test_env_settings_a_builtin_environment_does_not_read_are_refused():
    from core.environments.config import BUILTIN_ENVIRONMENT_NAMES
    from core.environments.registry import BUILTIN_ENVIRONMENTS

    assert set(BUILTIN_ENVIRONMENT_NAMES) == set(BUILTIN_ENVIRONMENTS)
    assert "not read by the built-in environment 'arithmetic'" in the_error("env.kwargs", "env.kwargs={a: 1}")
    assert "not read by env.name 'arithmetic'" in the_error("env.math", "env.math={rel_tol: 0.1}")
    load_config(GRPO, ["env.name=my_pkg.rewards:Env", "env.kwargs={a: 1}", "env.math={rel_tol: 0.1}"])  # a user's


def test_compile_is_accepted_with_every_parallelism():
    """Compiled tensor-parallel blocks give the eager gradients since the fix in
    backends/torch_dtensor/compile.py (tests/torch_backends/test_compile.py checks tp=2 with
    and without sequence parallelism): no layout is refused any more."""
    for extra in (
        [],
        ["policy.parallel.tensor_parallel_size=2"],
        ["policy.parallel.tensor_parallel_size=2", "policy.parallel.sequence_parallel=true"],
    ):
        cfg = load_config(GRPO, ["policy.compile=true", *extra])
        assert cfg.policy.compile is True
