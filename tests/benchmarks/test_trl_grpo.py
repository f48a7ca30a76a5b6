"""``benchmarks.lib.trl_grpo``: the spec built from dualrl's GRPO config, and two TRL GRPO steps."""

from __future__ import annotations

import math

import pytest

from benchmarks.lib import trl_grpo


def test_spec_and_grpo_config_follow_the_embedded_grpo_config():
    from core.algorithms.config import GRPORunConfig
    from core.config.loader import EMBEDDED_CONFIGS, load_config

    cfg = load_config(EMBEDDED_CONFIGS["grpo"], schema=GRPORunConfig)
    # benchmarks.trl_grpo still reads a plain dict: the resolved config's data
    data = cfg.to_dict()
    spec = trl_grpo.spec_from_dualrl(data, ["1+2=", "3+4=", "5-1="], ["3", "7", "4"], "/m", "/t")
    g, policy, loss = cfg.grpo, cfg.policy, cfg.loss_fn
    opt = policy.optimizer.kwargs
    assert set(trl_grpo.REQUIRED_KEYS) <= set(spec)
    assert (spec["model_path"], spec["tokenizer_path"]) == ("/m", "/t")
    assert spec["prompts"] == ["1+2=", "3+4=", "5-1="] and spec["answers"] == ["3", "7", "4"]
    assert (
        (spec["prompts_per_step"], spec["group_size"], spec["seed"])
        == (128, 4, 42)
        == (g.num_prompts_per_step, g.num_generations_per_prompt, g.seed)
    )
    assert spec["max_new_tokens"] == policy.generation.max_new_tokens == 6
    assert (spec["temperature"], spec["top_p"], spec["top_k"]) == (1.0, 1.0, None)
    assert (
        (spec["learning_rate"], spec["betas"], spec["eps"], spec["weight_decay"])
        == (opt["lr"], list(opt["betas"]), opt["eps"], opt["weight_decay"])
        == (2e-4, [0.9, 0.999], 1e-8, 0.0)
    )
    assert (spec["foreach"], spec["fused"]) == (None, None)  # unset: torch's own kernel choice on both sides
    assert spec["max_grad_norm"] == policy.max_grad_norm == 1.0
    assert spec["kl_beta"] == loss.reference_policy_kl_penalty == 0.0
    assert (spec["epsilon"], spec["epsilon_high"]) == (loss.ratio_clip_min, loss.ratio_clip_max) == (0.2, 0.2)
    assert spec["precision"] == "float32"
    assert spec["micro_batch_size"] == policy.train_micro_batch_size == 128
    assert (spec["loss_type"], spec["scale_rewards"], spec["importance_sampling_level"]) == ("dapo", "group", "token")
    assert spec["env"]["name"] == "arithmetic" and spec["env"]["arithmetic"]["max_value"] == 49
    # dualrl's step takes the old logprobs from its training forward (one optimizer step per
    # batch, grpo.fuse_old_logprobs): TRL's stock on-policy step does the same, no extra pass
    assert spec["use_chat_template"] == "auto" and spec["old_logprobs_pass"] is False
    assert spec["gradient_checkpointing"] is False

    kw = trl_grpo.grpo_config_kwargs(spec, "/out")
    # 512 completions per optimizer step: 4 micro batches of 128, one generation per step
    assert kw["per_device_train_batch_size"] == 128
    assert kw["gradient_accumulation_steps"] == kw["steps_per_generation"] == 4 and kw["num_iterations"] == 1
    assert kw["num_generations"] == 4 and kw["max_completion_length"] == 6 and kw["use_vllm"] is False
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (1.0, 1.0, 0)
    assert (kw["beta"], kw["epsilon"], kw["epsilon_high"], kw["loss_type"], kw["scale_rewards"]) == (
        0.0,
        0.2,
        0.2,
        "dapo",
        "group",
    )
    assert (kw["learning_rate"], kw["adam_beta1"], kw["adam_beta2"], kw["adam_epsilon"], kw["weight_decay"]) == (
        2e-4,
        0.9,
        0.999,
        1e-8,
        0.0,
    )
    assert kw["max_grad_norm"] == 1.0 and kw["lr_scheduler_type"] == "constant" and kw["warmup_steps"] == 0
    assert kw["use_cpu"] is True and kw["bf16"] is False and kw["gradient_checkpointing"] is False
    assert kw["report_to"] == [] and kw["logging_strategy"] == kw["save_strategy"] == kw["eval_strategy"] == "no"
    assert kw["shuffle_dataset"] is False and kw["seed"] == 42
    assert spec["min_new_tokens"] == 0 and kw["generation_kwargs"] is None  # TRL's generation untouched

    # full-length completions: min_new_tokens into HF's GenerationConfig through generation_kwargs
    full = {**data, "policy": {**data["policy"], "generation": {**data["policy"]["generation"], "min_new_tokens": 6}}}
    spec_full = trl_grpo.spec_from_dualrl(full, ["1+1="], ["2"], "/m", "/t")
    assert spec_full["min_new_tokens"] == 6
    assert trl_grpo.grpo_config_kwargs(spec_full, "/out")["generation_kwargs"] == {"min_new_tokens": 6}
    with pytest.raises(ValueError, match=r"min_new_tokens must be an int in \[0, max_new_tokens=6\], got 7"):
        trl_grpo.check_spec({**spec_full, "min_new_tokens": 7})
    # an unfused dualrl step (grpo.fuse_old_logprobs: false) runs its old-logprob pass: TRL too
    unfused = {**data, "grpo": {**data["grpo"], "fuse_old_logprobs": False}}
    assert trl_grpo.spec_from_dualrl(unfused, ["1+1="], ["2"], "/m", "/t")["old_logprobs_pass"] is True

    # asymmetric clip, sequence-level loss, no normalisation, bf16, top-k, no clipping
    cfg2 = {
        **data,
        "loss_fn": {**data["loss_fn"], "ratio_clip_max": 0.28, "token_level_loss": False},
        "grpo": {**data["grpo"], "normalize_rewards": False},
        "policy": {
            **data["policy"],
            "precision": "bfloat16",
            "max_grad_norm": None,
            "generation": {**data["policy"]["generation"], "top_k": 5},
        },
    }
    kw2 = trl_grpo.grpo_config_kwargs(trl_grpo.spec_from_dualrl(cfg2, ["1+1="], ["2"], "/m", "/t"), "/out")
    assert (kw2["epsilon"], kw2["epsilon_high"], kw2["loss_type"], kw2["scale_rewards"]) == (0.2, 0.28, "grpo", "none")
    assert kw2["bf16"] is True and kw2["max_grad_norm"] == 0.0 and kw2["top_k"] == 5
    # several optimizer steps per dualrl step: refused
    with pytest.raises(ValueError, match="train_global_batch_size"):
        trl_grpo.spec_from_dualrl(
            {**data, "policy": {**data["policy"], "train_global_batch_size": 128}}, ["1+1="], ["2"], "/m", "/t"
        )
    # several generate calls per dualrl step (DAPO's dynamic sampling): refused
    with pytest.raises(ValueError, match="grpo.use_dynamic_sampling: dualrl's step would make up to 3 generate"):
        trl_grpo.spec_from_dualrl(
            {**data, "grpo": {**data["grpo"], "use_dynamic_sampling": True, "dynamic_sampling_max_gen_batches": 3}},
            ["1+1="],
            ["2"],
            "/m",
            "/t",
        )
    # the prompts are walked in order, prompts_per_step per step, cycling
    rows = trl_grpo.cycled_rows(["a", "b", "c"], ["1", "2", "3"], 2)
    assert [r["prompt"] for r in rows] == ["a", "b", "c", "a", "b", "c"] and rows[4]["answer"] == "2"


@pytest.mark.slow
def test_two_trl_grpo_steps_on_a_tiny_llama(tmp_path):
    pytest.importorskip("trl")
    from core.testing.tiny_models import save_tiny_model

    model = save_tiny_model("llama_gen", tmp_path / "llama_gen")
    spec = {
        "model_path": str(model),
        "tokenizer_path": str(model / "tokenizer"),
        "prompts": ["a b c", "d e f", "g h"],
        "answers": ["w40", "w41", "w42"],
        "prompts_per_step": 2,
        "group_size": 2,
        "max_new_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "learning_rate": 1e-3,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.01,
        "max_grad_norm": 1.0,
        "kl_beta": 0.01,
        "epsilon": 0.2,
        "seed": 0,
        "precision": "float32",
        "min_new_tokens": 8,  # every completion full length (HF's min_new_tokens through generation_kwargs)
        "old_logprobs_pass": True,
    }
    runner = trl_grpo.TRLGRPORunner(spec, tmp_path, threads=1)
    try:
        assert runner.threads == [1] and runner.params > 0 and runner.startup_s > 0
        config = runner.ready["config"]
        assert config["generation_batch_size"] == 4 and config["per_device_train_batch_size"] == 4
        assert config["gradient_accumulation_steps"] == config["steps_per_generation"] == 1
        assert config["num_generations"] == 2 and config["max_completion_length"] == 8
        assert config["use_vllm"] is False and config["beta"] == 0.01 and config["loss_type"] == "dapo"
        assert config["generation_kwargs"] == {"min_new_tokens": 8}
        assert runner.ready["reference_model"] is True and runner.ready["add_special_tokens"] is True
        steps = [runner.step() for _ in range(2)]
    finally:
        runner.close()
    for out in steps:
        assert out["seconds"] > 0 and out["loop_s"] >= out["seconds"]
        assert math.isfinite(out["loss"]) and math.isfinite(out["grad_norm"])
        assert 0 < out["generation_s"] < out["rollout_s"] <= out["seconds"]
        assert out["reference_s"] > 0 and out["old_logprobs_s"] > 0
        assert 0.0 <= out["reward_mean"] <= 1.0
        assert out["completion_length_mean"] == 8
        assert math.isfinite(out["kl"]) and math.isfinite(out["entropy"])
