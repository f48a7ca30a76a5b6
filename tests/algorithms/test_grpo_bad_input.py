"""``dualrl grpo`` refuses bad input with a message naming the cause -- before any worker
starts where it can be known then (config, data, resume checkpoint), and with the sample
named when a reward function fails during a step."""

from __future__ import annotations

import json

import pytest

from core.environments import EnvironmentReturn
from dualrl.cli import main
from tests.algorithms.conftest import SMALL_RUN


class RaisingEnv:
    """A user environment whose reward code crashes on one kind of answer."""

    name = "raising"

    def __init__(self, cfg):
        pass

    def score(self, prompts, completions, metadata):
        if prompts:
            raise ZeroDivisionError(f"cannot score {prompts[0]!r}")
        return EnvironmentReturn([], [])


def _grpo(tmp_path, capsys, *overrides):
    args = [
        "grpo",
        *SMALL_RUN,
        f"logger.log_dir={tmp_path / 'logs'}",
        f"checkpointing.checkpoint_dir={tmp_path / 'ck'}",
        *overrides,
    ]
    rc = main(args)
    return rc, capsys.readouterr().err


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "override, expected",
    [
        ("grpo.num_generations_per_prompt=1", "grpo.num_generations_per_prompt: must be >= 2"),
        (
            "policy.train_global_batch_size=6",
            "policy.train_global_batch_size: 6 is not divisible by "
            "train_micro_batch_size (4) x data parallel size (2) = 8",
        ),
        ("data.dataset_name=/no/such/prompts.jsonl", "/no/such/prompts.jsonl"),
    ],
)
def test_config_and_missing_file_errors(tmp_path, capsys, override, expected):
    rc, err = _grpo(tmp_path, capsys, override)
    assert rc == 2 and expected in err


def test_dataset_without_the_prompt_column(tmp_path, capsys):
    data = _jsonl(tmp_path / "d.jsonl", [{"question": "1+1=", "answer": "2"}] * 20)
    rc, err = _grpo(tmp_path, capsys, f"data.dataset_name={data}", "env.name=math")
    assert rc == 2 and "data.prompt_key" in err and "'prompt'" in err and "question" in err


def test_prompt_longer_than_the_limit(tmp_path, capsys):
    rc, err = _grpo(tmp_path, capsys, "data.max_input_seq_length=4")
    assert rc == 2 and "data.max_input_seq_length" in err and "over the limit of 4" in err


def test_resume_without_a_checkpoint(builtin_cache, tmp_path, capsys):
    rc, err = _grpo(tmp_path, capsys, "checkpointing.enabled=true", "checkpointing.resume=true")
    assert rc == 2 and "no complete checkpoint" in err


def test_resume_from_a_partial_checkpoint(builtin_cache, tmp_path, capsys):
    partial = tmp_path / "ck" / "step_3"
    (partial / "policy").mkdir(parents=True)
    (partial / "train_state.json").write_text("{}")
    rc, err = _grpo(tmp_path, capsys, "checkpointing.enabled=true", "--resume")
    assert rc == 2 and "step_3" in err and "checkpoint.json" in err


def test_resume_from_another_backend(builtin_cache, tmp_path, capsys):
    from core.algorithms.config import GRPORunConfig
    from core.algorithms.run_setup import run_identity
    from core.algorithms.warm_start import resolve_model
    from core.checkpointing import CheckpointManager
    from core.config import load_config
    from core.datasets import build_prompt_datasets
    from core.models.char_tokenizer import char_tokenizer
    from dualrl.cli import GRPO_DEFAULT_CONFIG_PATH

    cfg = load_config(GRPO_DEFAULT_CONFIG_PATH, SMALL_RUN, backend="jax_pjit", schema=GRPORunConfig)
    _, val = build_prompt_datasets(cfg.data, cfg.env.arithmetic, char_tokenizer(), num_val=8, seed=cfg.grpo.seed)
    resolved = resolve_model(cfg, [val[i].metadata["raw_prompt"] for i in range(len(val))])
    manager = CheckpointManager(
        {"enabled": True, "checkpoint_dir": str(tmp_path / "ck"), "save_period": 1, "keep_top_k": None},
        identity=run_identity("grpo", cfg, resolved),
    )
    manager.save(
        1,
        lambda p: (p.mkdir(), (p / "weights").write_bytes(b"x")),
        train_state={},
        config=cfg.to_dict(),
        metrics={},
    )
    rc, err = _grpo(tmp_path, capsys, "checkpointing.enabled=true", "--resume", "--backend", "torch_fsdp")
    assert rc == 2 and "backend" in err and "'jax_pjit'" in err and "'torch_fsdp'" in err


def test_a_reward_function_that_raises_names_the_sample(ray_session, builtin_cache, tmp_path, capsys):
    rc, err = _grpo(
        tmp_path,
        capsys,
        "env.name=tests.algorithms.test_grpo_bad_input:RaisingEnv",
        "policy.generation.backend=hf",
        "cluster.gpus_per_node=1",
    )
    assert rc == 1 and "sample 0" in err and "ZeroDivisionError" in err and "cannot score" in err
