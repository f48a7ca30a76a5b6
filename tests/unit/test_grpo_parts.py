"""GRPO's driver-side parts without workers: advantages, rollout tensors, seeds, config rules,
the shared training loop, the built-in model's cache key and warm-start batches."""

from __future__ import annotations

import math

import pytest
import torch

from core.algorithms.advantages import compute_advantages, group_baseline_and_std
from core.algorithms.config import GRPORunConfig
from core.algorithms.rollouts import generation_mask, prompt_batch, sample_seeds, training_batch
from core.config import EMBEDDED_CONFIGS, ConfigError, load_config, load_raw_config
from core.data import BatchedDataDict

GRPO_CONFIG = EMBEDDED_CONFIGS["grpo"]


# ----------------------------------------------------------------------------- advantages
def _reference(rewards: list[float], n: int, loo: bool, normalize: bool) -> list[float]:
    """Plain-Python NeMo RL formulas, one sample at a time."""
    out = []
    for i, r in enumerate(rewards):
        g = i // n
        group = rewards[g * n : (g + 1) * n]
        others = [x for j, x in enumerate(group) if j != i % n] if loo else group
        mean = sum(others) / len(others)
        std = math.sqrt(max(sum(x * x for x in others) / len(others) - mean * mean, 0.0))
        adv = r - mean
        if normalize and std > 0:
            adv /= std
        out.append(0.0 if max(group) == min(group) else adv)
    return out


@pytest.mark.parametrize("loo", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
def test_advantages_match_the_per_sample_formulas(loo, normalize):
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0, 2.0, 1.0]
    adv = compute_advantages(torch.tensor(rewards), 4, estimator="grpo", leave_one_out=loo, normalize=normalize)
    assert adv.advantages.tolist() == pytest.approx(_reference(rewards, 4, loo, normalize), abs=1e-6)
    assert adv.zero_variance_groups == 1 and adv.num_groups == 3


def test_zero_variance_groups_give_exact_zero_advantages():
    adv = compute_advantages(
        torch.tensor([0.3] * 4 + [0.0, 1.0, 0.0, 1.0]), 4, estimator="grpo", leave_one_out=True, normalize=True
    )
    assert adv.advantages[:4].tolist() == [0.0] * 4
    assert adv.metrics()["zero_variance_group_fraction"] == 0.5


def test_group_mean_baseline_without_leave_one_out_balances_the_group():
    """With the group's own mean the advantages of a group sum to zero (normalised or not)."""
    adv = compute_advantages(
        torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0]), 8, estimator="grpo", leave_one_out=False, normalize=True
    )
    assert float(adv.advantages.sum()) == pytest.approx(0.0, abs=1e-5)
    baseline, std = group_baseline_and_std(torch.tensor([1.0, 0, 0, 0]), 4, leave_one_out=False)
    assert baseline.tolist() == [0.25] * 4 and std.tolist() == pytest.approx([math.sqrt(0.1875)] * 4)


def test_advantage_input_errors():
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        compute_advantages(torch.zeros(6), 4, estimator="grpo", leave_one_out=False, normalize=False)
    with pytest.raises(ValueError, match="reward of sample 2 is nan"):
        compute_advantages(
            torch.tensor([0.0, 1.0, float("nan"), 0.0]), 2, estimator="grpo", leave_one_out=False, normalize=False
        )


# ----------------------------------------------------------------------------- rollouts
def test_prompt_batch_repeats_each_prompt_as_a_group():
    batch = prompt_batch([[1, 5, 6], [1, 7]], 3, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[1, 5, 6]] * 3 + [[1, 7, 0]] * 3
    assert batch["input_lengths"].tolist() == [3, 3, 3, 2, 2, 2]
    with pytest.raises(ValueError, match="no prompts"):
        prompt_batch([], 2, 0)


def _fake_generation() -> tuple[BatchedDataDict, torch.Tensor]:
    """Two rollouts in the GenerationOutputSpec layout: prompt lengths 3 and 2, generated 2 and 3."""
    out = BatchedDataDict(
        output_ids=torch.tensor([[1, 5, 6, 9, 2, 0, 0], [1, 7, 8, 8, 2, 0, 0]]),
        logprobs=torch.tensor([[0, 0, 0, -0.5, -0.1, 0, 0], [0, 0, -0.3, -0.2, -0.4, 0, 0]]),
        generation_lengths=torch.tensor([2, 3]),
        unpadded_sequence_lengths=torch.tensor([5, 5]),
    )
    return out, torch.tensor([3, 2])


def test_training_batch_masks_exactly_the_generated_tokens():
    out, prompt_lengths = _fake_generation()
    data = training_batch(out, prompt_lengths, torch.tensor([1.5, -0.5]))
    assert data["input_ids"].shape == (2, 5)  # columns past the longest rollout dropped
    assert data["token_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]
    assert data["advantages"].tolist() == [[0, 0, 0, 1.5, 1.5], [0, 0, -0.5, -0.5, -0.5]]
    assert data["generation_logprobs"][0].tolist() == pytest.approx([0, 0, 0, -0.5, -0.1])
    assert data["input_lengths"].tolist() == [5, 5] and data["sample_mask"].tolist() == [1, 1]
    assert generation_mask(out, prompt_lengths).sum() == 5


def test_sample_seeds_are_a_pure_function_of_seed_step_and_stream():
    a = sample_seeds(42, 3, 16)
    assert torch.equal(a, sample_seeds(42, 3, 16))
    assert not torch.equal(a, sample_seeds(42, 4, 16)) and not torch.equal(a, sample_seeds(43, 3, 16))
    assert not torch.equal(a, sample_seeds(42, 3, 16, stream=1))
    assert int(a.min()) >= 0 and int(a.max()) < 2**32 and len(set(a.tolist())) == 16  # engines take 32-bit seeds


# ----------------------------------------------------------------------------- config rules
def test_embedded_default_config_is_valid():
    cfg = load_config(GRPO_CONFIG, schema=GRPORunConfig)
    assert cfg.policy.model_name == "builtin:arithmetic-llama"
    assert cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt % cfg.policy.train_global_batch_size == 0


@pytest.mark.parametrize(
    "override, message",
    [
        ("grpo.num_generations_per_prompt=1", "grpo.num_generations_per_prompt: must be >= 2"),
        (
            "grpo.num_prompts_per_step=3",
            "grpo.num_prompts_per_step: 3 prompts x 4 generations = 12 samples per step "
            "is not divisible by policy.train_global_batch_size (512)",
        ),
        (
            "policy.train_global_batch_size=100",
            "policy.train_global_batch_size: 100 is not divisible by "
            "train_micro_batch_size (128) x data parallel size (2)",
        ),
        ("data.max_input_seq_length=32", "data.max_input_seq_length: 32 leaves no room for a response"),
        ("data.prompt_template=plain", "data.prompt_template: must contain '{prompt}'"),
        ("env.arithmetic.max_valu=3", "env.arithmetic.max_valu: unknown key (did you mean 'max_value'?)"),
        ("grpo.val_perod=3", "grpo.val_perod: unknown key (did you mean 'val_period'?)"),
        ("checkpointing.save_period=0", "checkpointing.save_period: must be >= 1"),
        ("env.arithmetic.min_value=60", "env.arithmetic.min_value: 60 is greater than max_value (49)"),
        ("data.on_long_prompt=truncate", "data.on_long_prompt: expected one of 'error', 'filter'"),
    ],
)
def test_bad_run_configs_name_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(GRPO_CONFIG, [override], schema=GRPORunConfig)
    assert message in str(err.value)


def test_grpo_needs_its_sections():
    from core.algorithms.grpo_setup import check_grpo_config

    raw = load_raw_config(GRPO_CONFIG)
    assert isinstance(check_grpo_config(raw), GRPORunConfig)
    typed = load_config(GRPO_CONFIG, schema=GRPORunConfig)
    assert check_grpo_config(typed) is typed
    del raw["env"]
    with pytest.raises(ConfigError, match="env: missing section"):
        check_grpo_config(raw)


# ----------------------------------------------------------------------------- built-in model
def test_builtin_model_names_and_cache_key(tmp_path, monkeypatch):
    from core.algorithms.warm_start import cache_key
    from core.models.builtin import builtin_tokenizer, cache_root, is_builtin

    monkeypatch.setenv("DUALRL_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    assert is_builtin("builtin:arithmetic-llama") and not is_builtin("Qwen/Qwen2.5-0.5B")
    with pytest.raises(ValueError, match="policy.tokenizer.name: unknown built-in model 'builtin:nope'"):
        builtin_tokenizer("builtin:nope")
    task = {"min_value": 0, "max_value": 20}
    base = cache_key("arithmetic-llama-base", task, ["1+1="])
    assert base == cache_key("arithmetic-llama-base", {**task, "max_value": 21}, [])  # random init: task-free
    key = cache_key("arithmetic-llama", task, ["1+1="])
    assert key == cache_key("arithmetic-llama", dict(task), ["1+1="])
    assert key != cache_key("arithmetic-llama", {**task, "max_value": 21}, ["1+1="])
    assert key != cache_key("arithmetic-llama", task, ["1+2="])  # another held-out set: another model
    # the distillation student: its own base and a shorter warm start, so another model
    from core.algorithms.warm_start import warm_start_config

    small = warm_start_config(task, short="arithmetic-llama-small")
    assert small.policy.model_name == "builtin:arithmetic-llama-small-base" and small.sft.max_num_steps == 100
    assert warm_start_config(task).policy.model_name == "builtin:arithmetic-llama-base"
    assert cache_key("arithmetic-llama-small", task, ["1+1="]) not in (key, base)


def test_char_tokenizer_round_trips_and_the_sft_batch_masks_the_answer():
    from core.algorithms.sft import sequence_batch
    from core.datasets.config import DataConfig
    from core.datasets.examples import SFTEncoder
    from core.models.char_tokenizer import char_tokenizer

    tok = char_tokenizer()
    ids = tok("12+7=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 6
    assert tok.decode(ids, skip_special_tokens=True) == "12+7="
    encoder = SFTEncoder(DataConfig(dataset_name="arithmetic", response_key="answer"), tok, max_length=32)
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "10+10=", "answer": "20"}]
    batch = sequence_batch([encoder.encode(r, i, "test") for i, r in enumerate(rows)], tok.pad_token_id)
    # <s> 1 + 2 = | 3 </s>   and   <s> 1 0 + 1 0 = | 2 0 </s>
    assert batch["token_mask"][0].tolist()[:7] == [0, 0, 0, 0, 0, 1, 1]
    assert batch["token_mask"][1].tolist() == [0] * 7 + [1, 1, 1]
    assert tok.decode(batch["input_ids"][0][5:7].tolist()) == "3</s>"


# ----------------------------------------------------------------------------- loss metric
def test_clip_fraction_counts_tokens_outside_the_trust_region():
    from core.losses import ClippedPGLossFn

    cfg = load_config(GRPO_CONFIG, schema=GRPORunConfig).loss_fn
    loss_fn = ClippedPGLossFn({**cfg.to_dict(), "reference_policy_kl_penalty": 0.0})  # a plain mapping is coerced
    logprobs = torch.tensor([[0.0, -1.0, -1.0, -1.0]])
    prev = torch.tensor([[0.0, -1.0, -1.5, -0.5]])  # ratios 1, e^0.5 (clipped), e^-0.5 (clipped)
    data = {
        "input_ids": torch.zeros(1, 4, dtype=torch.long),
        "token_mask": torch.ones(1, 4),
        "sample_mask": torch.ones(1),
        "advantages": torch.ones(1, 4),
        "prev_logprobs": prev,
        "generation_logprobs": prev,
        "reference_policy_logprobs": prev,
    }
    _, metrics = loss_fn.loss_from_logprobs(logprobs[:, 1:], data, None, None)
    assert float(metrics["clip_fraction"]) == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------- the shared loop
def _loop(tmp_path, step_fn, **kwargs):
    from core.algorithms.loop import TrainingLoop
    from core.checkpointing import CheckpointManager
    from core.logging import MetricsLogger, StepProgress

    logger = MetricsLogger({"log_dir": str(tmp_path / "logs"), "tensorboard_enabled": False})
    ckpt = CheckpointManager(
        {"enabled": True, "checkpoint_dir": str(tmp_path / "ckpt"), "save_period": 2, "keep_top_k": None},
        identity={"algorithm": "test"},
    )
    saved = []

    def write_policy(path):
        path.mkdir(parents=True)
        (path / "weights.bin").write_bytes(b"w" * 8)
        saved.append(path)

    loop = TrainingLoop(
        algorithm="test",
        max_steps=5,
        step_fn=step_fn,
        validate_fn=lambda s: {"accuracy": s / 10},
        write_policy=write_policy,
        train_state_fn=lambda: {"position": 7},
        logger=logger,
        progress=StepProgress(5, enabled=False),
        checkpoints=ckpt,
        config={"x": 1},
        **kwargs,
    )
    return loop, logger, ckpt


def test_loop_schedules_validation_and_checkpoints(tmp_path):
    loop, logger, ckpt = _loop(
        tmp_path, lambda s: {"loss": 1.0 / s, "reward_mean": s}, val_period=2, val_at_start=True, val_at_end=True
    )
    assert loop.run() == 5
    val_steps = [r["step"] for r in logger.history if r["split"] == "val"]
    assert val_steps == [0, 2, 4, 5]
    assert sorted(p.name for p in ckpt.checkpoint_dir.glob("step_*")) == ["step_2", "step_4", "step_5"]
    loaded = ckpt.load()
    assert loaded.step == 5 and loaded.train_state == {"position": 7}
    assert loaded.metrics["val/accuracy"] == 0.5 and loaded.metrics["reward_mean"] == 5


def test_loop_stops_on_a_non_finite_loss_before_checkpointing_it(tmp_path):
    from core.algorithms.loop import NonFiniteLossError

    loop, _, ckpt = _loop(tmp_path, lambda s: {"loss": float("nan") if s == 4 else 1.0})
    with pytest.raises(NonFiniteLossError, match="step 4: loss is nan"):
        loop.run()
    assert [p.name for p in ckpt.checkpoint_dir.glob("step_*")] == ["step_2"]


def test_loop_resumes_after_the_start_step_and_honours_should_stop(tmp_path):
    steps = []
    loop, _, _ = _loop(
        tmp_path, lambda s: steps.append(s) or {"loss": 0.0}, should_stop=lambda: "done" if len(steps) == 2 else None
    )
    assert loop.run(start_step=2) == 4 and steps == [3, 4]


def test_jax_cpu_flags_add_devices_and_turn_eigen_threads_off_without_overriding_the_user():
    from core.distributed.ray_init import jax_cpu_flags

    assert jax_cpu_flags("", 2) == "--xla_force_host_platform_device_count=2 --xla_cpu_multi_thread_eigen=false"
    user = "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=true"
    assert jax_cpu_flags(user, 2) == user
