"""The tool-use tokenizer of ``builtin:arithmetic-llama-tools`` and its warm-start data.

A call it encodes decodes back to the same text (skipping special tokens, as the rollout
decodes a turn), the shared parser accepts it, and the demonstrations' tool turns are exactly
the observations ``tool_arithmetic`` returns for their calls.
"""

import pytest

from core.environments.arithmetic import ArithmeticTask
from core.environments.tools import CALCULATOR, ToolArithmeticEnvironment, parse_tool_calls
from core.environments.tools.demos import ToolDemoTask, calculator_call
from core.models.builtin import builtin_tokenizer
from core.models.char_tokenizer import CHARACTERS, TOOL_WORDS, char_tokenizer, tool_char_tokenizer

HARD = {"max_value": 999, "num_operands": 3, "operations": ["+", "-", "*"]}


def test_a_call_round_trips_and_parses():
    tok = tool_char_tokenizer()
    call = calculator_call("123*456+789")
    ids = tok(call, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and len(ids) == 16 + len("123*456+789")
    assert all(len(tok(word, add_special_tokens=False)["input_ids"]) == 1 for word in TOOL_WORDS)
    text = tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True)
    assert text == call
    (parsed,) = parse_tool_calls(text, {"calculator": CALCULATOR})
    assert parsed.ok and parsed.arguments == {"expression": "123*456+789"}
    observation = "<tool_response>\n56877\n</tool_response>"
    assert tok.decode(tok(observation, add_special_tokens=False)["input_ids"]) == observation


def test_the_character_ids_are_the_character_tokenizers():
    tools, chars = tool_char_tokenizer(), char_tokenizer()
    text = "".join(CHARACTERS)
    assert tools(text)["input_ids"] == chars(text)["input_ids"]
    assert builtin_tokenizer("builtin:arithmetic-llama-tools").get_vocab() == tools.get_vocab()
    assert builtin_tokenizer("builtin:arithmetic-llama").get_vocab() == chars.get_vocab()


def test_demonstrations_are_what_the_environment_answers():
    task = ArithmeticTask(HARD)
    env = ToolArithmeticEnvironment({"name": "tool_arithmetic", "arithmetic": HARD})
    rows = ToolDemoTask(task, 1.0).problems(0, 0, 4)
    for row in rows:
        user, call, tool, answer = row["messages"]
        state = env.reset({"ground_truth": row["answer"]})
        assert env.step(state, call["content"]).observation == tool["content"]
        assert env.step(state, answer["content"]).reward == 1.0
    assert all(len(r["messages"]) == 2 for r in ToolDemoTask(task, 0.0).problems(0, 0, 4))
    with pytest.raises(ValueError, match=r"data\.tool_demo_fraction: .*'tool-arithmetic'"):
        ToolDemoTask(task, None)


def test_the_embedded_models_cache_keys_did_not_move():
    # Adding the tools model (its tokenizer, data.tool_demo_fraction) must not rebuild the
    # embedded default's cached models: their keys, as computed before it existed.
    from core.algorithms.warm_start import cache_key
    from core.environments.config import ArithmeticTaskConfig

    assert cache_key("arithmetic-llama", ArithmeticTaskConfig(), ["1+2="]) == "75e09adbe821cb07"
    assert cache_key("arithmetic-llama-small", ArithmeticTaskConfig(), ["1+2="]) == "1f4f367eff91d920"


def test_a_warm_start_on_more_cpus_per_slot_keys_its_own_build(monkeypatch):
    # cluster.cpus_per_slot is left out of the key at its default only (the published keys above);
    # another thread count may change the weights' bits, so it builds apart.
    from core.algorithms.warm_start import cache_key
    from core.environments.config import ArithmeticTaskConfig
    from core.models.builtin import WARM_START_SFT_OVERRIDES

    monkeypatch.setitem(WARM_START_SFT_OVERRIDES, "arithmetic-llama", ("cluster.cpus_per_slot=2",))
    assert cache_key("arithmetic-llama", ArithmeticTaskConfig(), ["1+2="]) != "75e09adbe821cb07"
