"""``dualrl bench``'s GRPO flags (``--grpo-new-tokens``, ``--grpo-prompts``, ``--grpo-group``,
``--[no-]grpo-full-length``, ``--grpo-async``, ``--grpo-task``): what they parse to, the run configs and TRL spec
they produce, the refusals before anything starts, and the async rows in the report and chart.
No benchmark runs here (test_bench_compare.py's smoke runs one with ``--grpo-async``)."""

from __future__ import annotations

import pytest

from benchmarks import compare
from benchmarks.lib import trl_grpo, trl_grpo_child
from benchmarks.lib.grpo_step import (
    ASYNC_OVERRIDES,
    ASYNC_PHASES,
    PHASES,
    grpo_config,
    grpo_overrides,
    micro_batch,
    summarize,
    task_prompt_room,
)
from benchmarks.lib.layouts import parse_layout
from benchmarks.lib.sizes import SIZES, GRPOWorkload

SMALL = ["--size", "small", "--sections", "grpo", "--layouts", "fsdp1-dp1", "dtensor-dp2", "jax-fsdp2"]


@pytest.fixture
def with_vllm(monkeypatch):
    """As on a machine with vLLM (the CPU development machines have it; CI may not)."""
    monkeypatch.setattr(compare, "vllm_missing", lambda: None)


def parse(*flags: str):
    return compare.parse([*SMALL, *flags])


def test_defaults_are_the_size_workload_and_the_flags_override_it(with_vllm):
    assert parse().grpo_work == SIZES["small"].grpo and not parse().grpo_async
    work = parse("--grpo-new-tokens", "128").grpo_work
    small = SIZES["small"].grpo
    assert (work.new_tokens, work.seq, work.full_length) == (128, small.prompt_room + 128, True)
    assert (work.prompts, work.group, work.micro_batch, work.steps) == (
        small.prompts,
        small.group,
        small.micro_batch,
        small.steps,
    )
    assert not parse("--grpo-new-tokens", "128", "--no-grpo-full-length").grpo_work.full_length
    assert parse("--grpo-full-length").grpo_work.full_length  # at the size's own length too
    other = parse("--grpo-prompts", "4", "--grpo-group", "2").grpo_work
    assert (other.prompts, other.group, other.samples, other.new_tokens, other.full_length) == (4, 2, 8, 16, False)
    assert parse("--grpo-async").grpo_async
    tuned = parse("--grpo-micro-batch", "64", "--grpo-steps", "4", "--grpo-warmup", "3").grpo_work
    assert (tuned.micro_batch, tuned.steps, tuned.prompts, tuned.new_tokens) == (64, 4, small.prompts, small.new_tokens)
    assert (tuned.warmup, parse().grpo_work.warmup) == (3, small.warmup)
    wide = parse("--grpo-packed-row-sequences", "32").grpo_work
    assert (wide.packed_row_sequences, small.packed_row_sequences) == (32, 2)
    budget = f"policy.sequence_packing.train_mb_tokens={32 * wide.seq}"
    assert budget in grpo_overrides(parse_layout("jax-fsdp2-packed"), wide, "m", "t", "float32", "/x")


def test_the_overrides_the_workload_and_async_produce():
    work = SIZES["small"].grpo.with_overrides(new_tokens=128, full_length=True)
    layout = parse_layout("dtensor-dp2")
    sync = grpo_overrides(layout, work, "m", "t", "float32", "/tmp/x")
    for item in (
        "policy.generation.max_new_tokens=128",
        "policy.generation.min_new_tokens=128",
        "policy.max_total_sequence_length=144",
        "policy.generation.vllm_cfg.max_model_len=144",
        "cluster.gpus_per_node=2",
    ):
        assert item in sync
    assert not set(ASYNC_OVERRIDES) & set(sync)
    assert "policy.generation.min_new_tokens=0" in grpo_overrides(layout, SIZES["small"].grpo, "m", "t", "f", "/x")
    async_ = grpo_overrides(layout, work, "m", "t", "float32", "/tmp/x", async_grpo=True)
    assert async_[: len(sync)] == sync and async_[len(sync) :] == list(ASYNC_OVERRIDES)
    # the configs validate (async: engine apart, importance correction on) and feed TRL's spec
    cfg = grpo_config(layout, work, "m", "t", "float32", "/tmp/x", async_grpo=True)
    assert cfg.grpo.async_grpo.enabled and cfg.grpo.async_grpo.max_trajectory_age_steps == 1
    assert cfg.loss_fn.use_importance_sampling_correction and not cfg.policy.generation.colocated.enabled
    assert cfg.policy.generation.colocated.resources.gpus_per_node == 1 and cfg.cluster.gpus_per_node == 2
    gen = cfg.policy.generation
    assert (gen.max_new_tokens, gen.min_new_tokens) == (128, 128)
    spec = trl_grpo.spec_from_dualrl(cfg.to_dict(), ["1+1="], ["2"], "m", "t")
    assert trl_grpo.grpo_config_kwargs(spec, "/o")["generation_kwargs"] == {"min_new_tokens": 128}
    # micro batches divide each rank's rows
    odd = GRPOWorkload(prompts=6, group=8, new_tokens=16, seq=32, micro_batch=32, steps=1)
    assert (micro_batch(odd, 1), micro_batch(odd, 2), micro_batch(SIZES["small"].grpo, 2)) == (24, 24, 32)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--grpo-new-tokens", "0"], "--grpo-new-tokens must be >= 1, got 0"),
        (["--grpo-group", "1"], "--grpo-group must be >= 2 (GRPO's advantage compares a prompt's samples"),
        (["--grpo-prompts", "0"], "--grpo-prompts must be >= 1, got 0"),
        (["--grpo-micro-batch", "0"], "--grpo-micro-batch must be >= 1, got 0"),
        (["--grpo-steps", "0"], "--grpo-steps must be >= 1, got 0"),
        (["--grpo-warmup", "0"], "--grpo-warmup must be >= 1, got 0"),
        (["--grpo-packed-row-sequences", "0"], "--grpo-packed-row-sequences must be >= 1, got 0"),
        (["--grpo-steps", "2", "--sections", "refit"], "--grpo-steps: only --sections grpo and generation use"),
        (["--grpo-new-tokens", "600"], "prompt room 16 + 600 new tokens = 616 > the small model's 512 positions"),
        (["--grpo-prompts", "3", "--grpo-group", "3"], "9 samples per step do not split over the data-parallel"),
        (["--grpo-async", "--sections", "throughput"], "--grpo-async adds rows to --sections grpo"),
        (["--grpo-new-tokens", "8", "--sections", "refit"], "only --sections grpo and generation use"),
        (["--grpo-multi-turn", "1"], "--grpo-multi-turn must be >= 2 (turns per episode"),
        (["--grpo-multi-turn", "2", "--sections", "throughput"], "--grpo-multi-turn adds rows to --sections grpo"),
        (["--grpo-multi-turn", "2", "--model", "m"], "the scripted observation is sized in the built-in character"),
        (["--grpo-task", "reasoning_gym", "--grpo-multi-turn", "2"], "the multi-turn row is arithmetic only"),
        (["--grpo-task", "gsm8k"], "invalid choice: 'gsm8k'"),
        (
            ["--grpo-async", "--device", "cuda", "--max-devices", "2"],
            "the engine needs a GPU of its own beside the policy's; dtensor-dp2, jax-fsdp2 leave none",
        ),
    ],
)
def test_bad_values_are_refused_before_anything_starts(with_vllm, monkeypatch, capsys, flags, message):
    def started(*_args, **_kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(compare, "run_bench", started)
    with pytest.raises(SystemExit) as info:
        compare.main([*SMALL, *flags], prog="dualrl bench")
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_async_without_vllm_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(compare, "vllm_missing", lambda: "vLLM is not installed on this machine")
    with pytest.raises(SystemExit):
        compare.parse([*SMALL, "--grpo-async"])
    err = capsys.readouterr().err
    assert "--grpo-async needs vLLM" in err and "vLLM is not installed on this machine" in err
    assert not compare.parse(SMALL).grpo_async  # the sync rows still run on the policy's HF generate


def test_help_says_when_full_length_is_on(capsys, monkeypatch):
    # argparse wraps the help at the terminal's width (COLUMNS) and may break a line after a
    # hyphen ("--grpo-new-" / "tokens"): pin a width at which no flag name is split.
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        compare.parse(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: on when --grpo-new-tokens is given, else off" in text
    assert "--grpo-async" in text and "--grpo-prompts" in text and "--grpo-group" in text


# ----------------------------------------------------------------------------- rows, report, chart


def _steps(async_grpo: bool) -> list[dict]:
    phases = ASYNC_PHASES if async_grpo else PHASES
    steps = []
    for i, step_s in enumerate((9.0, 2.0, 4.0)):  # the first is warm-up
        m = {"step_time_s": step_s, "response_length_mean": 16.0, "token_mult_prob_error": 1.0}
        m.update({f"timing/{p}_s": 0.1 * (i + 1) for p in phases})
        if async_grpo:
            m.update({"async/generation_s": 1.5, "async/reward_s": 0.01, "refit/seconds": 0.2})
            m.update({"async/trajectory_age_mean": 1.0, "async/trainer_idle_s": 0.3, "async/engine_idle_s": 0.0})
        steps.append(m)
    return steps


def test_async_rows_report_the_trainer_phases_and_the_producer_apart(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.lib.compare.plot import grpo_panel, panels
    from benchmarks.lib.compare.report import grpo_lines

    work = SIZES["tiny"].grpo.with_overrides(new_tokens=8, full_length=True)
    sync, async_ = summarize(_steps(False), work, 1.0, False), summarize(_steps(True), work, 1.0, True)
    assert (sync["mode"], sync["step_s"], set(sync["phases_s"])) == ("sync", 3.0, set(PHASES))
    assert (async_["mode"], async_["step_s"], set(async_["phases_s"])) == ("async", 3.0, set(ASYNC_PHASES))
    assert async_["producer_s"] == {"generation": 1.5, "reward": 0.01} and async_["refit_s"] == 0.2
    assert async_["phases_s"]["train"] == pytest.approx(0.25)  # median of the timed steps only
    for row in (sync, async_):
        row.update(trl_step_s=[6.0], trl_completion_length=[8.0])
    sync["trl_phases_s"] = {"generation_s": [2.5], "reference_s": [1.0], "old_logprobs_s": [0.0], "train_s": [2.5]}
    sync["threads"] = {"policy": [2], "engines": [1, 1]}
    async_["threads"] = {"policy": [None], "engines": [1]}  # a JAX worker: XLA's pool, no torch count
    results = {
        "size": "tiny",
        "machine": {"device_name": "cpu"},
        "layouts": [{"case": "fsdp1-dp1", "grpo": sync, "grpo_async": async_}],
        "grpo_workload": vars(work),
        "grpo_generation": "vllm",
    }
    text = "\n".join(grpo_lines(results))
    assert "8 new tokens, full length: min_new_tokens = max_new_tokens on both sides" in text
    assert "| fsdp1-dp1 | sync | 3.00 | 2.00 | 4.00 | 6.00 | 2.50 / 1.00 / 0.00 / 2.50 | 0.25 | 0.25 | 0.25 |" in text
    assert "TRL generation / reference / old_logprobs / train s" in text
    # per completion token: TRL 6 s / 8 tokens against 3 s / 16 tokens
    # sync: no waits, no worker split, no producer; one 2-thread torch worker, two 1-thread engines
    assert "| - | - | - | - | 16.0 / 8.0 | 1.0000000 | 2 / 1+1 |" in text
    assert "| 16.0 / 8.0 | 1.0000000 | xla / 1 |" in text
    assert "| fsdp1-dp1 | async | 3.00 | 2.00 | 4.00 | 6.00 | - | 0.20 | - | - | 0.25 |" in text  # TRL split not kept
    assert "| 1.50 / 0.01 | 16.0 / 8.0 |" in text and "not part of the step" in text
    assert panels(results) == [grpo_panel]
    fig, ax = plt.subplots()
    grpo_panel(ax, results)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["fsdp1-dp1 sync", "fsdp1-dp1 async", "TRL GRPOTrainer"]
    plt.close(fig)


# ----------------------------------------------------------------------------- multi-turn row


def test_the_multi_turn_row_runs_scripted_episodes_that_fit_the_sequence():
    from benchmarks.lib.grpo_step import multi_turn_facts, multi_turn_sequence
    from benchmarks.lib.multi_turn_env import ENV_NAME, OBSERVATION_TOKENS, ScriptedTurnsEnv
    from core.environments.config import EnvConfig

    work = SIZES["tiny"].grpo.with_overrides(new_tokens=8)
    cfg = grpo_config(parse_layout("fsdp1-dp1"), work, "m", "t", "float32", "/tmp/x", "hf", multi_turn=3)
    seq = work.prompt_room + 3 * 8 + 2 * OBSERVATION_TOKENS
    assert multi_turn_sequence(work, 3) == seq == cfg.policy.max_total_sequence_length
    assert cfg.is_multi_turn() and cfg.grpo.max_rollout_turns == 3 and cfg.env.name == ENV_NAME
    assert cfg.policy.generation.min_new_tokens == 8 and cfg.env.num_workers == 1
    both = grpo_config(parse_layout("fsdp1-dp1"), work, "m", "t", "float32", "/x", async_grpo=True, multi_turn=2)
    assert both.is_multi_turn() and both.grpo.async_grpo.enabled  # async GRPO plays episodes too
    # every episode: exactly `turns` turns, the fixed observation between them, the last one checked
    env = ScriptedTurnsEnv(EnvConfig.coerce({"name": ENV_NAME, "kwargs": {"turns": 3}}, "env"))
    state = env.reset({"ground_truth": "12"})
    first, second, last = env.step(state, "1"), env.step(state, "9"), env.step(state, " 12")
    assert not first.done and first.observation == second.observation and len(first.observation) == 12
    assert (last.done, last.reward, last.observation) == (True, 1.0, None)
    with pytest.raises(ValueError, match="env.kwargs.turns"):
        ScriptedTurnsEnv(EnvConfig.coerce({"name": ENV_NAME}, "env"))
    steps = [{"multi_turn/turns_max": 3.0, "timing/generation_s": 0.6, "multi_turn/turns_mean": 3.0}]
    facts = multi_turn_facts(steps, 3)
    assert facts["generation_per_turn_s"] == pytest.approx(0.2) and facts["short_episodes"] == 0.0


def test_the_multi_turn_table_has_no_trl_column_and_sits_beside_the_sync_step():
    from benchmarks.lib.compare.report import multi_turn_lines
    from benchmarks.lib.grpo_step import multi_turn_facts

    work = SIZES["tiny"].grpo
    sync = summarize(_steps(False), work, 1.0, False)
    steps = _steps(False)
    for m in steps:
        m.update(
            {"multi_turn/turns_max": 2.0, "multi_turn/turns_mean": 2.0, "multi_turn/observation_tokens_mean": 12.0}
        )
    multi = {**summarize(steps, work, 1.0, False), **multi_turn_facts(steps[1:], 2)}
    results = {
        "layouts": [{"case": "fsdp1-dp1", "grpo": sync, "grpo_multi_turn": multi}],
        "grpo_workload": vars(work),
        "grpo_generation": "vllm",
        "grpo_multi_turn": 2,
    }
    text = "\n".join(multi_turn_lines(results))
    assert "scripted episodes of 2 turns x 6 new tokens" in text and "no ×TRL" in text
    assert "| fsdp1-dp1 | multi-turn 2 | 3.00 | 3.00 | 0.25 | 0.25 | 0.25 | 0.25 | 0.25 | 0.25 | 0.12 | 2.00 |" in text
    assert "| 16.0 / 12.0 | 0 |" in text


def test_the_reasoning_gym_task_runs_the_recipes_prompts_and_reward_on_both_sides(with_vllm):
    """``--grpo-task reasoning_gym``: the recipe's config with the bench's model and workload (the
    prompts keep the recipe's room), and TRL's reward scores a row with the task's own scorer."""
    from core.datasets import build_prompt_datasets
    from core.models.byte_tokenizer import byte_tokenizer

    args = parse("--grpo-task", "reasoning_gym")
    small, room = SIZES["small"].grpo, task_prompt_room("reasoning_gym")
    assert args.grpo_task == "reasoning_gym" and args.grpo_work.seq == room + small.new_tokens > small.seq
    assert parse().grpo_task == "arithmetic" and parse().grpo_work == small
    cfg = grpo_config(parse_layout("fsdp1-dp1"), args.grpo_work, "m", "t", "float32", "/tmp/x", task="reasoning_gym")
    assert cfg.data.dataset_name == "reasoning_gym" and cfg.env.name == "reasoning_gym"
    assert cfg.policy.model_name == "m" and cfg.policy.max_total_sequence_length == room + small.new_tokens
    _, val = build_prompt_datasets(cfg.data, None, byte_tokenizer(), num_val=2, seed=cfg.grpo.seed)
    items = [val[0], val[1]]
    answers = [str(p.metadata["ground_truth"]) for p in items]
    spec = trl_grpo.spec_from_dualrl(
        {
            **cfg.to_dict(),
            "policy": {
                **cfg.to_dict()["policy"],
                "train_global_batch_size": cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt,
            },
        },
        [p.prompt for p in items],
        answers,
        "m",
        "t",
        metadata=[p.metadata for p in items],
    )
    rows = trl_grpo.cycled_rows(spec["prompts"], spec["answers"], 2, spec["metadata"])
    reward = trl_grpo_child._reward_function(spec["env"])
    scores = reward(
        [r["prompt"] for r in rows],
        [answers[0], "wrong"],
        [r["answer"] for r in rows],
        metadata=[r["metadata"] for r in rows],
    )
    assert scores == [1.0, 0.0]


def test_the_reasoning_gym_task_without_the_package_is_refused(with_vllm, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(SystemExit):
        parse("--grpo-task", "reasoning_gym")
    assert (
        "--grpo-task reasoning_gym: 'reasoning_gym' needs the optional package reasoning-gym" in capsys.readouterr().err
    )


def test_the_layout_name_decides_dynamic_batching_whatever_the_task_config_says(with_vllm):
    """``-dynamic``: token-budget micro batches of one fixed micro batch's padded tokens; any
    other layout runs fixed rows, also on the reasoning-gym task whose recipe plans by tokens."""
    work = parse("--grpo-task", "reasoning_gym").grpo_work
    mbs = micro_batch(work, 2)
    for task in ("arithmetic", "reasoning_gym"):
        task_work = work if task == "reasoning_gym" else SIZES["small"].grpo
        budget = micro_batch(task_work, 2) * task_work.seq
        dynamic = grpo_config(parse_layout("dtensor-dp2-dynamic"), task_work, "m", "t", "float32", "/x", task=task)
        db = dynamic.policy.dynamic_batching
        assert (db.enabled, db.train_mb_tokens, db.logprob_mb_tokens, db.sequence_length_round) == (
            True,
            budget,
            budget,
            4,
        )
        fixed = grpo_config(parse_layout("dtensor-dp2"), task_work, "m", "t", "float32", "/x", task=task)
        assert not fixed.policy.dynamic_batching.enabled
        # one generate call per step on both sides: TRL's step has no dynamic sampling
        assert not fixed.grpo.use_dynamic_sampling and not dynamic.grpo.use_dynamic_sampling
    assert (
        mbs * work.seq
        == grpo_config(
            parse_layout("jax-fsdp2-dynamic"), work, "m", "t", "float32", "/x", task="reasoning_gym"
        ).policy.dynamic_batching.train_mb_tokens
    )
