"""The `dualrl` command line: config validation as a user runs it."""

import pytest
import yaml

from core.config import ConfigError
from dualrl.cli import main


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    assert "usage: dualrl" in capsys.readouterr().out


def test_config_prints_the_resolved_config(capsys):
    assert main(["config", "--backend", "jax_pjit", "policy.train_micro_batch_size=4"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["policy"]["backend"] == "jax_pjit"
    assert cfg["policy"]["train_micro_batch_size"] == 4


def test_config_errors_name_every_bad_field(capsys):
    rc = main(["config", "policy.train_global_batch_size=30", "policy.parallel.tensor_paralel_size=2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "policy.train_global_batch_size: 30 is not divisible" in err
    assert (
        "policy.parallel.tensor_paralel_size: unknown key (did you mean 'tensor_parallel_size'?) "
        "(from override 'policy.parallel.tensor_paralel_size=2')" in err
    )


def test_config_errors_of_several_sections_are_listed_together(capsys):
    rc = main(["config", "cluster.num_nodes=two", "policy.parallel.tensor_paralel_size=2", "loss_fn.ratio_clip_c=1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "cluster.num_nodes: expected int, got str ('two') (from override 'cluster.num_nodes=two')" in err
    assert "policy.parallel.tensor_paralel_size: unknown key (did you mean 'tensor_parallel_size'?)" in err
    assert "loss_fn.ratio_clip_c: must be > 1 (or null to disable dual clipping), got 1.0" in err


def test_config_checks_a_run_config_as_its_command_would(capsys):
    from core.config import EMBEDDED_CONFIGS

    shipped = sorted(EMBEDDED_CONFIGS["grpo"].parent.glob("*.yaml"))  # every shipped config, as it is
    assert set(EMBEDDED_CONFIGS.values()) <= set(shipped)
    for path in shipped:
        assert main(["config", "--config", str(path)]) == 0, path.name
    capsys.readouterr()
    rc = main(["config", "--config", str(EMBEDDED_CONFIGS["sft"]), "env.name=arithmetic", "env.num_workers=1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "env: not used by dualrl sft" in err


def test_the_async_switch_alone_reads_the_embedded_async_default():
    """``dualrl grpo grpo.async_grpo.enabled=true`` (no --config) is the embedded default set up
    for async; the same switch on the synchronous file is refused, naming what async needs."""
    import argparse

    from dualrl.cli import (
        GRPO_ASYNC_DEFAULT_CONFIG_PATH,
        GRPO_DEFAULT_CONFIG_PATH,
        default_config_path,
        load_command_config,
    )

    on = ["grpo.async_grpo.enabled=true"]
    assert default_config_path("grpo", on) == GRPO_ASYNC_DEFAULT_CONFIG_PATH
    assert default_config_path("grpo", ["grpo.async_grpo.enabled=false"]) == GRPO_DEFAULT_CONFIG_PATH
    assert default_config_path("grpo", ["grpo.async_grpo.enabled"]) == GRPO_DEFAULT_CONFIG_PATH  # malformed
    assert default_config_path("sft", on) != GRPO_ASYNC_DEFAULT_CONFIG_PATH

    def load(path, overrides):
        args = argparse.Namespace(command="grpo", config=str(path), overrides=overrides, backend="jax_pjit")
        return load_command_config(args)

    cfg = load(default_config_path("grpo", on), on)
    assert cfg.grpo.async_grpo.enabled and not cfg.policy.generation.colocated.enabled
    assert cfg.loss_fn.use_importance_sampling_correction and cfg.policy.backend == "jax_pjit"
    with pytest.raises(ConfigError, match="grpo.async_grpo.enabled.*colocated.enabled: false"):
        load(GRPO_DEFAULT_CONFIG_PATH, on)
