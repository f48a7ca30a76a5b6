"""Multi-turn rollouts on hand-built conversations (in-process; the engine is a scripted
test double returning fixed ids + logprobs): exactly the generated tokens are masked in,
across turns, with and without a chat template; the ids trained on are the ids generated;
limits, seeds, step validation and the GRPO config keys."""

from __future__ import annotations

import time

import pytest
import torch

from core.algorithms.evaluation import Evaluation, Samples
from core.algorithms.multi_turn import (
    EpisodeRunner,
    episode_summaries,
    episodes_to_rows,
    multi_turn_metrics,
    turn_seeds,
)
from core.algorithms.observation_tokens import ObservationTokens
from core.algorithms.rollouts import training_batch, truncated_rows
from core.data import BatchedDataDict
from core.environments.multi_turn import EpisodeError, StepResult, check_step_result
from core.environments.tools import Tool, ToolEnvironment

WORDS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "tool", "question"]
WORDS += [chr(c) for c in range(ord("a"), ord("z") + 1)]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def _tokenizer(template: bool):
    """Word-level: one token per whitespace-separated word; the chat variant has a template
    with a tool role whose turns end with <|im_end|> (its eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    eos = "<|im_end|>" if template else "</s>"
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token=eos, unk_token="<unk>"
    )
    out.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if template:
        out.chat_template = TEMPLATE
    return out


def ids(text: str) -> list[int]:
    return [WORDS.index(w) for w in text.split()]


class ScriptedEngine:
    """Generates the scripted turns of each episode (keyed by the prompt's first token),
    with logprob -(k+1)/10 on its k-th token of the call; records every call."""

    def __init__(self, scripts: dict[int, list[list[int]]]) -> None:
        self.scripts, self.calls, self.seen = scripts, [], {}

    def __call__(self, batch: BatchedDataDict, greedy: bool) -> BatchedDataDict:
        self.calls.append(batch)
        rows = []
        for b in range(batch.size):
            n = int(batch["input_lengths"][b])
            prompt = batch["input_ids"][b, :n].tolist()
            turn = self.seen.get(prompt[0], 0)
            self.seen[prompt[0]] = turn + 1
            rows.append((prompt, self.scripts[prompt[0]][turn]))
        width = max(len(p) + len(g) for p, g in rows)
        out_ids = torch.zeros(len(rows), width, dtype=torch.long)
        logprobs = torch.zeros(len(rows), width)
        for b, (prompt, gen) in enumerate(rows):
            out_ids[b, : len(prompt) + len(gen)] = torch.tensor(prompt + gen)
            logprobs[b, len(prompt) : len(prompt) + len(gen)] = -torch.arange(1, len(gen) + 1) / 10
        return BatchedDataDict(
            output_ids=out_ids,
            logprobs=logprobs,
            generation_lengths=torch.tensor([len(g) for _, g in rows]),
            unpadded_sequence_lengths=torch.tensor([len(p) + len(g) for p, g in rows]),
        )


class EchoEnv:
    """Ends an episode when the message contains 'z'; otherwise observes 'o k', reward 0.25."""

    name = "echo"

    def reset(self, metadata):
        return {"turns": 0}

    def step(self, state, message):
        state["turns"] += 1
        if "z" in message.split():
            return StepResult(None, 1.0, True, {"correct": True, "tool_calls": 0})
        return StepResult("o k", 0.25, False, {"correct": False, "tool_calls": 1, "malformed_tool_calls": 1})


def _runner(tok, env=None, max_turns=3, max_total=64, step_timeout_s=5, **kw):
    stops = [tok.eos_token_id]
    obs = ObservationTokens(tok, use_chat_template=bool(tok.chat_template), stop_token_ids=stops)
    return EpisodeRunner(
        env or EchoEnv(), tok, obs, max_turns=max_turns, max_total_tokens=max_total, step_timeout_s=step_timeout_s, **kw
    )


def _play(runner, engine, prompts, greedy=False):
    return runner.run(prompts, [{} for _ in prompts], engine, greedy=greedy, seed=3, step=7, stream=1)


@pytest.mark.parametrize("template", [False, True])
def test_exactly_the_generated_tokens_are_masked_across_turns(template):
    tok = _tokenizer(template)
    end = tok.eos_token_id
    engine = ScriptedEngine({ids("a")[0]: [ids("b c") + [end], ids("z") + [end]], ids("d")[0]: [ids("z") + [end]]})
    episodes = _play(_runner(tok), engine, [ids("a a"), ids("d")])
    obs = ids("<|im_start|> tool o k <|im_end|> <|im_start|> assistant") if template else ids("o k")
    expected = ids("a a") + ids("b c") + [end] + obs + ids("z") + [end]
    rows = episodes_to_rows(episodes, tok.pad_token_id)
    assert rows["output_ids"][0].tolist() == expected
    mask0 = [0, 0, 1, 1, 1] + [0] * len(obs) + [1, 1]
    assert rows["token_mask"][0].tolist() == mask0
    lp0 = [0, 0, -0.1, -0.2, -0.3] + [0] * len(obs) + [-0.1, -0.2]
    assert rows["logprobs"][0].tolist() == pytest.approx(lp0)
    pad = len(expected) - 3
    assert rows["output_ids"][1].tolist() == ids("d z") + [end] + [tok.pad_token_id] * pad
    assert rows["token_mask"][1].tolist() == [0, 1, 1] + [0] * pad
    assert rows["rewards"].tolist() == [1.25, 1.0]  # the sum of the step rewards
    assert rows["generation_lengths"].tolist() == [5, 2] and rows["observation_tokens"].tolist() == [len(obs), 0]
    assert rows["turns"].tolist() == [2, 1] and rows["tool_calls"].tolist() == [1, 0]
    assert [i["ended"] for i in rows["infos"]] == ["done", "done"]
    metrics = multi_turn_metrics(rows)  # episode 0 used the tool and was right; episode 1 answered at once
    assert metrics["multi_turn/reward_turns_2"] == 1.25 and metrics["multi_turn/reward_turns_1"] == 1.0
    assert metrics["multi_turn/tool_use_rate"] == 0.5 and metrics["multi_turn/correct_with_tool_rate"] == 0.5
    assert metrics["multi_turn/generated_tokens_mean"] == 3.5 and metrics["multi_turn/tool_calls_mean"] == 0.5
    # Validation reports the same per-episode counts of its greedy episodes (val/...).
    greedy = Samples(1, rewards=rows["rewards"].tolist(), infos=rows["infos"], lengths=[5, 2])
    greedy.episodes = episode_summaries(rows)
    val = Evaluation([None, None], greedy).metrics()  # type: ignore[list-item]
    assert val["tool_use_rate"] == 0.5 and val["turns_mean"] == 1.5 and val["correct_with_tool_rate"] == 0.5
    # One batched generate call per turn, of the live episodes only, each row with its own room
    # (max_total 64 minus its conversation so far: the longer row does not cut the shorter one).
    assert [c.size for c in engine.calls] == [2, 1]
    assert engine.calls[0]["max_new_tokens"].tolist() == [64 - 2, 64 - 1]
    assert engine.calls[1]["max_new_tokens"].tolist() == [64 - 5 - len(obs)]
    # The training batch trains on exactly these ids, with this mask and these logprobs.
    data = training_batch(rows, rows["prompt_lengths"], torch.tensor([1.0, -1.0]))
    assert data["input_ids"][0].tolist() == expected and data["token_mask"][0].tolist() == mask0
    assert torch.equal(data["generation_logprobs"], rows["logprobs"] * rows["token_mask"])
    assert data["advantages"][1].tolist() == [0, -1, -1] + [0] * pad


def test_the_template_closes_a_turn_the_model_did_not_close():
    tok = _tokenizer(True)
    obs = ObservationTokens(tok, use_chat_template=True, stop_token_ids=[tok.eos_token_id])
    assert obs.tokens("o", ids("b") + [tok.eos_token_id]) == ids(
        "<|im_start|> tool o <|im_end|> <|im_start|> assistant"
    )
    assert obs.tokens("o", ids("b c")) == ids("<|im_end|> <|im_start|> tool o <|im_end|> <|im_start|> assistant")


def test_max_turns_and_truncation_end_episodes_before_an_observation():
    tok = _tokenizer(False)
    never = {ids("a")[0]: [ids("b")] * 5, ids("d")[0]: [ids("b c e f")] * 5}
    episodes = _play(_runner(tok, max_turns=2, max_total=7), ScriptedEngine(never), [ids("a"), ids("d")])
    # a: a b (o k) b -> 2 turns, no observation after the last; d: d bcef + (o k) would leave no room.
    assert episodes[0].ids == ids("a b o k b") and episodes[0].ended == "max_turns"
    assert episodes[1].ids == ids("d b c e f") and episodes[1].ended == "truncated"
    rows = episodes_to_rows(episodes, tok.pad_token_id)
    assert truncated_rows(rows, [tok.eos_token_id], 4).tolist() == [False, True]
    metrics = multi_turn_metrics(rows)
    assert metrics["multi_turn/truncated"] == 1 and metrics["multi_turn/max_turns_reached"] == 1
    assert metrics["multi_turn/turns_mean"] == 1.5


def test_turn_seeds_are_per_run_step_row_and_turn():
    base = turn_seeds(3, 7, 1, [0, 1], 0)
    assert torch.equal(base, turn_seeds(3, 7, 1, [0, 1], 0))
    others = [turn_seeds(3, 7, 1, [0, 1], 1), turn_seeds(3, 8, 1, [0, 1], 0), turn_seeds(4, 7, 1, [0, 1], 0)]
    assert all(not torch.equal(base, o) for o in others) and base[0] != base[1]
    assert int(base.max()) < 2**32 and int(base.min()) >= 0
    tok = _tokenizer(False)
    engine = ScriptedEngine({ids("a")[0]: [ids("b"), ids("z")], ids("d")[0]: [ids("z")]})
    _play(_runner(tok), engine, [ids("a"), ids("d")])
    assert torch.equal(engine.calls[0]["sample_seeds"], base)
    assert torch.equal(engine.calls[1]["sample_seeds"], turn_seeds(3, 7, 1, [0], 1))
    greedy = ScriptedEngine({ids("a")[0]: [ids("z")]})
    _play(_runner(tok), greedy, [ids("a")], greedy=True)
    assert "sample_seeds" not in greedy.calls[0]


@pytest.mark.parametrize(
    "result, fragment",
    [
        ("text", "step() must return a StepResult, got str"),
        (StepResult("o", float("nan"), False), "field 'reward' is nan"),
        (StepResult("o", True, False), "field 'reward': True of type bool"),
        (StepResult("o", 1.0, 1), "field 'done' must be a bool, got int"),
        (StepResult("o", 1.0, False, info=[]), "field 'info' must be a dict, got list"),
        (StepResult(3, 1.0, False), "field 'observation' must be a str or None, got int"),
        (StepResult(None, 1.0, False), "field 'observation' is None but done is False"),
    ],
)
def test_step_result_errors_name_episode_turn_and_field(result, fragment):
    with pytest.raises(EpisodeError) as err:
        check_step_result(result, episode=5, turn=2, env_name="echo")
    assert str(err.value).startswith("environment 'echo': episode 5, turn 2: ") and fragment in str(err.value)


class BrokenEnv(EchoEnv):
    name = "broken"

    def __init__(self, how):
        self.how = how

    def step(self, state, message):
        if self.how == "raise":
            raise RuntimeError("no network")
        if self.how == "slow":
            time.sleep(0.5)
        return StepResult("o", float("inf"), False)


@pytest.mark.parametrize(
    "how, fragment",
    [
        ("raise", "step() raised RuntimeError: no network"),
        ("slow", "step() ran past env.timeout_s=0.05 s"),
        ("inf", "field 'reward' is inf"),
    ],
)
def test_episode_errors_fail_or_end_the_episode(how, fragment):
    tok = _tokenizer(False)
    script = {ids("a")[0]: [ids("b")], ids("d")[0]: [ids("b")]}
    runner = _runner(tok, BrokenEnv(how), step_timeout_s=0.05)
    with pytest.raises(EpisodeError) as err:
        _play(runner, ScriptedEngine(script), [ids("a")])
    assert str(err.value).startswith("environment 'broken': episode 0, turn 0: ") and fragment in str(err.value)
    lenient = _runner(tok, BrokenEnv(how), on_error="end_episode", step_timeout_s=0.05)
    episodes = _play(lenient, ScriptedEngine(script), [ids("a"), ids("d")])
    assert [e.ended for e in episodes] == ["error", "error"] and fragment in episodes[1].info["error"]
    assert "episode 1, turn 0" in episodes[1].info["error"]
    assert episodes_to_rows(episodes, 0)["episode_errors"].tolist() == [True, True]


def test_an_engine_that_changes_the_conversation_is_refused():
    tok = _tokenizer(False)

    def engine(batch, greedy):
        out = ScriptedEngine({ids("a")[0]: [ids("b")]})(batch, greedy)
        out["output_ids"][0, 0] = ids("c")[0]
        return out

    with pytest.raises(EpisodeError, match="episode 0, turn 0: field 'output_ids'"):
        _play(_runner(tok), engine, [ids("a")])


def test_max_turns_below_one_is_refused():
    with pytest.raises(ValueError, match="max_rollout_turns must be >= 1"):
        _runner(_tokenizer(False), max_turns=0)


# ------------------------------------------------------------------ config
def _grpo(*overrides):
    from core.algorithms.config import GRPORunConfig
    from core.config import load_config
    from dualrl.cli import GRPO_DEFAULT_CONFIG_PATH

    return load_config(GRPO_DEFAULT_CONFIG_PATH, list(overrides), schema=GRPORunConfig)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["env.name=tool_arithmetic", "grpo.max_rollout_turns=0"], "grpo.max_rollout_turns"),
        (["env.name=tool_arithmetic"], "grpo.max_rollout_turns: required with the multi-turn environment"),
        (["grpo.max_rollout_turns=3"], "grpo.max_rollout_turns: set, but env.name 'arithmetic' is single-turn"),
        (["env.on_episode_error=end_episode"], "env.on_episode_error: end_episode is only supported by multi-turn"),
        (["env.num_workers=0"], "env.num_workers: 0 (in-process) is only supported by multi-turn"),
        (["env.tools.timeout_s=1"], "env.tools: not read by env.name 'arithmetic'"),
        (
            ["env.name=tool_arithmetic", "grpo.max_rollout_turns=2", "grpo.overlong_filtering=true"],
            "grpo.overlong_filtering: not supported with the multi-turn environment",
        ),
    ],
)
def test_multi_turn_config_refusals(overrides, fragment):
    from core.config import ConfigError

    with pytest.raises(ConfigError) as err:
        _grpo(*overrides)
    assert fragment in str(err.value)


def test_multi_turn_config_accepted():
    from core.environments.episode_pool import episode_executor
    from core.environments.episodes import InProcessEpisodes

    cfg = _grpo("env.name=tool_arithmetic", "grpo.max_rollout_turns=3", "env.on_episode_error=end_episode")
    assert cfg.is_multi_turn() and cfg.grpo.max_rollout_turns == 3 and cfg.env.on_episode_error == "end_episode"
    assert cfg.env.num_workers == 1  # the default: episodes in the Ray pool (tests/environments/test_episode_pool.py)
    in_process = _grpo("env.name=tool_arithmetic", "grpo.max_rollout_turns=3", "env.num_workers=0")
    executor = episode_executor(in_process.env)
    assert isinstance(executor, InProcessEpisodes) and executor.name == "tool_arithmetic"


def test_one_executor_call_per_turn_steps_every_live_episode():
    """The runner hands the executor all live episodes of a turn at once (what makes the
    pool's one call per actor and turn possible), and drops the states at the end."""
    from core.environments.episodes import InProcessEpisodes

    class Recording(InProcessEpisodes):
        def __init__(self):
            super().__init__(EchoEnv(), 5)
            self.calls = []

        def step_episodes(self, rows, messages):
            self.calls.append(list(rows))
            return super().step_episodes(rows, messages)

        def end_rollout(self):
            self.calls.append("end")
            super().end_rollout()

    tok = _tokenizer(False)
    executor = Recording()
    engine = ScriptedEngine({ids("a")[0]: [ids("b"), ids("z")], ids("d")[0]: [ids("z")], ids("e")[0]: [ids("b")] * 2})
    runner = EpisodeRunner(executor, tok, _runner(tok).observations, max_turns=2, max_total_tokens=64)
    episodes = runner.run([ids("a"), ids("d"), ids("e")], [{}] * 3, engine, greedy=True, seed=0, step=0, row_offset=4)
    assert executor.calls == [[4, 5, 6], [4, 6], "end"] and executor._states.states == {}
    assert [ep.ended for ep in episodes] == ["done", "done", "max_turns"]


class UpperEnv(ToolEnvironment):
    """A user's tool environment, named ``env.name: tests.unit.test_multi_turn:UpperEnv``."""

    name = "upper"
    tools = (Tool("upper", "upper-cases a word", lambda arguments, state: arguments["word"].upper(), {"word": str}),)

    def judge(self, answer, metadata):
        return answer.strip() == metadata["ground_truth"], answer.strip()


def test_a_user_tool_environment_is_named_by_module_and_class():
    from core.environments.registry import environment_is_multi_turn, make_multi_turn_environment

    name = "tests.unit.test_multi_turn:UpperEnv"
    assert environment_is_multi_turn(name)
    cfg = _grpo(f"env.name={name}", "grpo.max_rollout_turns=2", "env.tools.timeout_s=2")
    assert cfg.is_multi_turn()
    env = make_multi_turn_environment(cfg.env)
    assert isinstance(env, ToolEnvironment) and env.timeout_s == 2
    state = env.reset({"ground_truth": "AB"})
    call = '<tool_call>{"name": "upper", "arguments": {"word": "ab"}}</tool_call>'
    assert env.step(state, call).observation == "<tool_response>\nAB\n</tool_response>"
    assert env.step(state, "AB").reward == 1.0


def test_a_single_turn_environment_runs_as_one_step_episodes():
    from core.environments import ArithmeticEnvironment
    from core.environments.multi_turn import SingleTurnEpisodes

    tok = _tokenizer(False)
    env = SingleTurnEpisodes(ArithmeticEnvironment())
    engine = ScriptedEngine({ids("a")[0]: [ids("b")], ids("d")[0]: [ids("c")]})
    runner = _runner(tok, env)
    metadata = [{"ground_truth": "b", "raw_prompt": "a"}, {"ground_truth": "b", "raw_prompt": "d"}]
    episodes = runner.run([ids("a"), ids("d")], metadata, engine, greedy=True, seed=0, step=0)
    rows = episodes_to_rows(episodes, tok.pad_token_id)
    assert rows["rewards"].tolist() == [1.0, 0.0] and rows["turns"].tolist() == [1, 1]
    assert [i["correct"] for i in rows["infos"]] == [True, False] and [i["ended"] for i in rows["infos"]] == [
        "done"
    ] * 2
