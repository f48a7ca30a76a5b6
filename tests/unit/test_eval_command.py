"""``dualrl eval``'s bad input, refused before any worker starts with a message naming the flag,
field, file or checkpoint; and the validation fields it shares with GRPO."""

from __future__ import annotations

import pytest
import yaml

from core.algorithms.config import GRPORunConfig
from core.checkpointing import CheckpointManager
from core.config import EMBEDDED_CONFIGS, ConfigError, load_config
from dualrl.cli import build_parser, main


def _errors(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(EMBEDDED_CONFIGS["grpo"], list(overrides), schema=GRPORunConfig)
    return info.value.errors


def test_sampled_validation_fields():
    cfg = load_config(EMBEDDED_CONFIGS["grpo"], ["grpo.val_pass_at_k=[1,4]"], schema=GRPORunConfig)
    assert cfg.grpo.val_samples_per_prompt == 4  # null val_num_samples: the largest k
    cfg = load_config(EMBEDDED_CONFIGS["grpo"], [], schema=GRPORunConfig)
    assert cfg.grpo.val_pass_at_k is None and cfg.grpo.val_samples_per_prompt == 0
    (line,) = _errors("grpo.val_pass_at_k=[1,8]", "grpo.val_num_samples=4")
    assert line.startswith("grpo.val_pass_at_k: pass@8 needs at least 8 samples per prompt, but val_num_samples is 4")
    assert "(dualrl eval: --k / --num-samples)" in line and "(from override 'grpo.val_pass_at_k=[1,8]')" in line
    (line,) = _errors("grpo.val_num_samples=4")
    assert line.startswith("grpo.val_num_samples: set without val_pass_at_k")
    for ks in ("[]", "[2,2]", "[0]"):
        (line,) = _errors(f"grpo.val_pass_at_k={ks}")
        assert line.startswith("grpo.val_pass_at_k: must be distinct k's >= 1"), line


def _eval(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["eval", *argv])
    return rc, capsys.readouterr().err


def test_k_above_the_samples_is_refused_naming_the_flags(capsys):
    rc, err = _eval(capsys, "--k", "1", "8", "--num-samples", "4")
    assert rc == 2
    assert "grpo.val_pass_at_k: pass@8 needs at least 8 samples per prompt" in err and "--k / --num-samples" in err


def test_k_must_be_positive_and_model_and_checkpoint_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--k", "0"])
    assert "argument --k: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--model", "m", "--checkpoint", "c"])
    assert "argument --checkpoint: not allowed with argument --model" in capsys.readouterr().err


def test_a_missing_dataset_file_is_named(capsys, tmp_path):
    rc, err = _eval(capsys, "--dataset", str(tmp_path / "nope.jsonl"))
    assert rc == 2 and "dualrl eval --dataset: dataset file" in err and "nope.jsonl" in err


def test_a_missing_checkpoint_is_named(capsys, tmp_path):
    rc, err = _eval(capsys, "--checkpoint", str(tmp_path / "ck"))
    assert rc == 2 and "does not exist" in err and str(tmp_path / "ck") in err
    (tmp_path / "ck").mkdir()
    rc, err = _eval(capsys, "--checkpoint", str(tmp_path / "ck"))
    assert rc == 2 and "holds no complete run checkpoint" in err


def _checkpoint(root, identity: dict, config: dict) -> None:
    manager = CheckpointManager({"enabled": True, "checkpoint_dir": str(root), "save_period": 1}, identity=identity)
    write = lambda p: (p.mkdir(), (p / "weights").mkdir(), (p / "weights" / "x").write_bytes(b"x"))  # noqa: E731
    manager.save(3, write, train_state={}, config=config, metrics={"val/accuracy": 0.5})


def test_a_checkpoint_of_another_model_is_refused_before_any_worker(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DUALRL_CACHE_DIR", str(tmp_path / "cache"))  # the random-init model: built in seconds
    cfg = load_config(
        EMBEDDED_CONFIGS["grpo"],
        ["policy.model_name=builtin:arithmetic-llama-base", "policy.tokenizer.name=builtin:arithmetic-llama-base"],
        schema=GRPORunConfig,
    )
    other = {"algorithm": "grpo", "backend": "torch_dtensor", "model_name": "org/other-model", "model_fingerprint": "0"}
    _checkpoint(tmp_path / "ck", other, cfg.to_dict())
    rc, err = _eval(capsys, "--checkpoint", str(tmp_path / "ck"))  # the latest of a run's checkpoints
    assert rc == 2
    assert "the checkpoint holds another model than the config's" in err
    assert "model_name: the checkpoint's is 'org/other-model', the config's 'builtin:arithmetic-llama-base@" in err
    assert "step_3" in err


def test_an_sft_checkpoint_needs_a_grpo_config(capsys, tmp_path):
    sft = yaml.safe_load(EMBEDDED_CONFIGS["sft"].read_text())
    _checkpoint(tmp_path / "ck", {"algorithm": "sft"}, sft)
    rc, err = _eval(capsys, "--checkpoint", str(tmp_path / "ck" / "step_3"))
    assert rc == 2 and "written by dualrl sft" in err and "give --config FILE" in err
