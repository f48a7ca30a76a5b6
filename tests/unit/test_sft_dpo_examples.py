"""SFT / DPO examples: token ids and loss masks, chat-template rendering, config and row errors.

Tokenizers are built locally: the character tokenizer of the arithmetic task (bos 1, eos 2,
adds ``<s>``) and the word-level test tokenizer (one token per word) with a small chat
template that writes each turn as ``<s> <role letter> <content> </s>``, so every expected id
sequence can be spelled out as text.
"""

import pytest

from core.datasets.config import DataConfig
from core.datasets.examples import (
    PreferenceDatum,
    PreferenceEncoder,
    SequenceDatum,
    SFTEncoder,
    render_conversation,
)
from core.models.char_tokenizer import char_tokenizer
from core.testing.tiny_models import tiny_tokenizer

# Roles are written by their first letter (s, u, a, t): single letters are words of the vocab.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'][0] }} {{ m['content'] }} </s> "
    "{% endfor %}{% if add_generation_prompt %}<s> a {% endif %}"
)
# Like templates that strip the content of earlier assistant turns (reasoning models): a
# conversation prefix ending in an assistant turn renders that turn differently.
STRIPPING_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'][0] }} "
    "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }} {% endif %}"
    "</s> {% endfor %}{% if add_generation_prompt %}<s> a {% endif %}"
)
SRC = "dataset 'x.jsonl'"


def section(data: dict) -> DataConfig:
    """A ``data`` section with these settings (the encoders take the validated section)."""
    return DataConfig.coerce({"dataset_name": "x.jsonl", **data}, "data")


def sft(data: dict, tokenizer, max_length: int) -> SFTEncoder:
    return SFTEncoder(section(data), tokenizer, max_length)


def preference(data: dict, tokenizer, max_length: int) -> PreferenceEncoder:
    return PreferenceEncoder(section(data), tokenizer, max_length)


@pytest.fixture
def chars():
    return char_tokenizer()


@pytest.fixture
def tok():
    t = tiny_tokenizer()
    t.chat_template = CHAT_TEMPLATE
    return t


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def turn(role, content):
    return {"role": role, "content": content}


def masked(tokenizer, *parts):
    """Ids and mask of text ``parts`` given as (text, mask bit) pairs."""
    out_ids, out_mask = [], []
    for text, bit in parts:
        piece = ids(tokenizer, text)
        out_ids += piece
        out_mask += [bit] * len(piece)
    return tuple(out_ids), tuple(out_mask)


# ---------------------------------------------------------------- SFT, prompt/response
def test_char_tokenizer_prompt_response_ids_and_mask(chars):
    enc = sft({}, chars, 32)
    d = enc.encode({"prompt": "12+7=", "response": "19", "level": 2}, 5, SRC)
    assert isinstance(d, SequenceDatum)
    assert list(d.input_ids) == [1, *ids(chars, "12+7="), *ids(chars, "19"), 2]
    assert d.token_mask == (0,) * 6 + (1, 1, 1)
    assert d.num_response_tokens == 3
    assert d.metadata == {"level": 2, "raw_prompt": "12+7=", "index": 5, "truncated": False}
    assert (enc.prompt_key, enc.limit, enc.on_long) == ("prompt", 32, "truncate")
    assert enc.limit_key == "policy.max_total_sequence_length"
    assert "data.on_long_sequence=filter" == sft({"on_long_sequence": "filter"}, chars, 32).drop_note
    # prompt_template applies to the prompt part only.
    d = sft({"prompt_template": "({prompt})"}, chars, 32).encode({"prompt": "1+1=", "response": "2"}, 0, SRC)
    assert list(d.input_ids) == [1, *ids(chars, "(1+1=)"), *ids(chars, "2"), 2]
    assert d.token_mask == (0,) * 7 + (1, 1)


def test_chat_template_prompt_response_masks_the_assistant_turn(tok):
    cfg = {"system_prompt": "z", "prompt_template": "q {prompt}"}
    d = sft(cfg, tok, 64).encode({"prompt": "a b", "response": "c d"}, 0, SRC)
    assert (d.input_ids, d.token_mask) == masked(tok, ("<s> s z </s> <s> u q a b </s> <s> a", 0), ("c d </s>", 1))
    # use_chat_template: false takes the plain path even though the tokenizer has a template.
    d = sft({"use_chat_template": False, "prompt_template": "q {prompt}"}, tok, 64).encode(
        {"prompt": "a b", "response": "c d"}, 0, SRC
    )
    assert (d.input_ids, d.token_mask) == masked(tok, ("q a b", 0), ("c d </s>", 1))


def test_rendered_template_gets_no_second_bos(tok):
    from tokenizers.processors import TemplateProcessing

    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)]
    )
    d = sft({}, tok, 64).encode({"prompt": "a", "response": "b"}, 0, SRC)
    # One BOS per turn, as rendered; the tokenizer's own BOS is not added in front.
    assert list(d.input_ids) == ids(tok, "<s> u a </s> <s> a b </s>")
    assert d.input_ids.count(tok.bos_token_id) == 2


# ---------------------------------------------------------------- SFT, conversations
def test_multi_turn_conversation_masks_every_assistant_turn(tok):
    enc = sft({"messages_key": "messages"}, tok, 64)
    assert enc.prompt_key == "messages"
    msgs = [
        turn("system", "x"),
        turn("user", "b"),
        turn("assistant", "c d"),
        turn("user", "e"),
        turn("tool", "g"),
        turn("assistant", "f"),
    ]
    d = enc.encode({"messages": msgs, "id": 7}, 3, SRC)
    assert (d.input_ids, d.token_mask) == masked(
        tok,
        ("<s> s x </s> <s> u b </s> <s> a", 0),
        ("c d </s>", 1),
        ("<s> u e </s> <s> t g </s> <s> a", 0),
        ("f </s>", 1),
    )
    assert d.metadata == {"id": 7, "index": 3, "truncated": False}


def test_system_prompt_is_prepended_only_without_a_system_turn(tok):
    enc = sft({"messages_key": "m", "system_prompt": "z"}, tok, 64)
    d = enc.encode({"m": [turn("user", "b"), turn("assistant", "c")]}, 0, SRC)
    assert (d.input_ids, d.token_mask) == masked(tok, ("<s> s z </s> <s> u b </s> <s> a", 0), ("c </s>", 1))
    d = enc.encode({"m": [turn("system", "y"), turn("user", "b"), turn("assistant", "c")]}, 0, SRC)
    assert ids(tok, "z")[0] not in d.input_ids


def test_conversations_without_a_chat_template_render_as_raw_text(chars):
    # As a multi-turn rollout builds them: prompt with <s>, assistant turns + </s> trained on,
    # tool turns (observations) raw and untrained.
    enc = sft({"messages_key": "m", "use_chat_template": False}, chars, 64)
    convo = [turn("user", "1+2="), turn("assistant", "(3)"), turn("tool", "3"), turn("assistant", "3")]
    d = enc.encode({"m": convo}, 0, SRC)
    eos = chars.eos_token_id
    assert d.input_ids == (1, *ids(chars, "1+2="), *ids(chars, "(3)"), eos, *ids(chars, "3"), *ids(chars, "3"), eos)
    assert d.token_mask == (0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 1)
    with pytest.raises(ValueError, match=r"data\.messages_key: .*message 0 is a system message.*chat template"):
        enc.encode({"m": [turn("system", "1"), *convo]}, 0, SRC)
    with pytest.raises(ValueError, match=r"data\.messages_key: .*starts with an assistant turn"):
        enc.encode({"m": convo[1:]}, 0, SRC)
    with pytest.raises(ValueError, match=r"data\.system_prompt: .*raw text without a chat template"):
        sft({"messages_key": "m", "system_prompt": "z"}, chars, 64)
    # A prompt_template would be silently ignored by conversations: refuse it.
    with pytest.raises(ValueError, match=r"data\.prompt_template: 'q \{prompt\}'.*conversations"):
        sft({"messages_key": "m", "prompt_template": "q {prompt}"}, chars, 64)


def test_no_assistant_turn_names_row_source_and_column(tok):
    enc = sft({"messages_key": "messages"}, tok, 64)
    with pytest.raises(
        ValueError,
        match=r"row 3 of dataset 'x\.jsonl' has no assistant turn in "
        r"column 'messages'",
    ):
        enc.encode({"messages": [turn("user", "a")]}, 3, SRC)
    with pytest.raises(ValueError, match=r"row 3 of .* starts with an assistant turn"):
        enc.encode({"messages": [turn("assistant", "a")]}, 3, SRC)
    # With data.system_prompt the conversation no longer starts with the assistant.
    d = sft({"messages_key": "messages", "system_prompt": "z"}, tok, 64).encode(
        {"messages": [turn("assistant", "a")]}, 3, SRC
    )
    assert (d.input_ids, d.token_mask) == masked(tok, ("<s> s z </s> <s> a", 0), ("a </s>", 1))


@pytest.mark.parametrize(
    "value, match",
    [
        ("a b", r"row 1 of .* has str in column 'm', not a non-empty list"),
        ([], r"row 1 of .* has list in column 'm', not a non-empty list"),
        ([turn("bot", "a")], r"row 1 of .*column 'm', message 0 has unknown role 'bot'"),
        ([turn("user", "a"), {"role": "assistant"}], r"row 1 of .*'m', message 1 is not a dict"),
        ([turn("user", "a"), turn("assistant", 3)], r"row 1 .*message 1 is not a dict.*'content'"),
        (["a"], r"row 1 .*message 0 is not a dict"),
    ],
)
def test_bad_messages_name_row_and_column(tok, value, match):
    enc = sft({"messages_key": "m"}, tok, 64)
    with pytest.raises(ValueError, match=r"data\.messages_key: " + match):
        enc.encode({"m": value}, 1, SRC)


def test_bad_prompt_or_response_values(chars):
    enc = sft({}, chars, 64)
    with pytest.raises(ValueError, match=r"data\.prompt_key: row 2 of .* int in column 'prompt'"):
        enc.encode({"prompt": 12, "response": "1"}, 2, SRC)
    with pytest.raises(
        ValueError,
        match=r"data\.response_key: row 2 .* NoneType in column "
        r"'response', not text",
    ):
        enc.encode({"prompt": "1", "response": None}, 2, SRC)


def test_missing_columns_name_key_and_available_columns(chars, tok):
    enc = sft({"response_key": "answer"}, chars, 64)
    enc.check_columns({"prompt": "1", "answer": "2"}, SRC)
    with pytest.raises(
        ValueError,
        match=r"data\.response_key: column 'answer' is not in dataset "
        r"'x\.jsonl'; available columns: \['prompt', 'response']",
    ):
        enc.check_columns({"prompt": "1", "response": "2"}, SRC)
    with pytest.raises(ValueError, match=r"data\.messages_key: column 'chat' .*\['messages'\]"):
        sft({"messages_key": "chat"}, tok, 64).check_columns({"messages": []}, SRC)


def test_config_is_validated_up_front(chars, tok):
    with pytest.raises(
        ValueError,
        match=r"^data\.on_long_sequence: expected one of 'truncate', 'filter', 'error', got 'cut'$",
    ):
        sft({"on_long_sequence": "cut"}, chars, 64)
    with pytest.raises(ValueError, match=r"data\.prompt_template"):
        preference({"prompt_template": "{question}"}, chars, 64)
    with pytest.raises(ValueError, match=r"data\.system_prompt"):
        sft({"system_prompt": "be brief"}, chars, 64)
    with pytest.raises(ValueError, match=r"data\.use_chat_template"):
        preference({"use_chat_template": True}, chars, 64)
    with pytest.raises(ValueError, match=r"policy\.max_total_sequence_length: 0"):
        sft({}, chars, 0)


# ---------------------------------------------------------------- length limits
def test_long_sequence_error_filter_truncate(chars):
    row = {"prompt": "12+7=", "response": "19"}  # 6 prompt + 3 response tokens
    with pytest.raises(
        ValueError,
        match=r"policy\.max_total_sequence_length: row 4 of dataset "
        r"'x\.jsonl' is 9 tokens, over the limit of 8.*"
        r"data\.on_long_sequence",
    ):
        sft({"on_long_sequence": "error"}, chars, 8).encode(row, 4, SRC)
    assert sft({"on_long_sequence": "filter"}, chars, 8).encode(row, 4, SRC) is None
    full = sft({}, chars, 9).encode(row, 4, SRC)
    assert not full.metadata["truncated"]
    cut = sft({}, chars, 8).encode(row, 4, SRC)
    assert cut.input_ids == full.input_ids[:8] and cut.token_mask == (0,) * 6 + (1, 1)
    assert cut.metadata["truncated"] and cut.num_response_tokens == 2
    # Cut inside the prompt: nothing is left to train on.
    assert sft({}, chars, 6).encode(row, 4, SRC) is None


# ---------------------------------------------------------------- DPO
def test_dpo_text_rows_share_the_prompt(chars):
    enc = preference({}, chars, 32)
    enc.check_columns({"prompt": "1+1=", "chosen": "2", "rejected": "3"}, SRC)
    d = enc.encode({"prompt": "1+1=", "chosen": "2", "rejected": "11", "src": "a"}, 9, SRC)
    assert isinstance(d, PreferenceDatum)
    head = [1, *ids(chars, "1+1=")]
    assert list(d.chosen.input_ids) == head + ids(chars, "2") + [2]
    assert list(d.rejected.input_ids) == head + ids(chars, "11") + [2]
    assert d.chosen.token_mask == (0,) * 5 + (1, 1)
    assert d.rejected.token_mask == (0,) * 5 + (1, 1, 1)
    assert d.metadata == {"src": "a", "raw_prompt": "1+1=", "index": 9, "truncated": False}
    assert d.chosen.metadata["index"] == d.rejected.metadata["index"] == 9


def test_dpo_text_rows_with_a_chat_template(tok):
    d = preference({"prompt_template": "q {prompt}"}, tok, 64).encode(
        {"prompt": "a", "chosen": "b", "rejected": "c d"}, 0, SRC
    )
    assert (d.chosen.input_ids, d.chosen.token_mask) == masked(tok, ("<s> u q a </s> <s> a", 0), ("b </s>", 1))
    assert (d.rejected.input_ids, d.rejected.token_mask) == masked(tok, ("<s> u q a </s> <s> a", 0), ("c d </s>", 1))


def test_dpo_conversation_prompt_masks_only_chosen_and_rejected_turns(tok):
    enc = preference({"system_prompt": "z"}, tok, 64)
    prompt = [turn("user", "a"), turn("assistant", "b"), turn("user", "c")]
    d = enc.encode(
        {"prompt": prompt, "chosen": [turn("assistant", "d")], "rejected": [turn("assistant", "e f")]}, 0, SRC
    )
    head = ("<s> s z </s> <s> u a </s> <s> a b </s> <s> u c </s> <s> a", 0)
    assert (d.chosen.input_ids, d.chosen.token_mask) == masked(tok, head, ("d </s>", 1))
    assert (d.rejected.input_ids, d.rejected.token_mask) == masked(tok, head, ("e f </s>", 1))


def test_dpo_implicit_prompt_masks_only_the_final_assistant_turn(tok):
    enc = preference({}, tok, 64)
    shared = [turn("user", "a"), turn("assistant", "b"), turn("user", "c")]
    row = {"chosen": shared + [turn("assistant", "d")], "rejected": shared + [turn("assistant", "e")]}
    enc.check_columns(row, SRC)  # no prompt column: fine for full conversations
    d = enc.encode(row, 0, SRC)
    head = ("<s> u a </s> <s> a b </s> <s> u c </s> <s> a", 0)
    assert (d.chosen.input_ids, d.chosen.token_mask) == masked(tok, head, ("d </s>", 1))
    assert (d.rejected.input_ids, d.rejected.token_mask) == masked(tok, head, ("e </s>", 1))
    assert enc.encode({**row, "prompt": None}, 0, SRC) == d  # a null prompt is no prompt


def test_dpo_column_and_format_errors(chars, tok):
    enc = preference({}, tok, 64)
    with pytest.raises(
        ValueError,
        match=r"data\.rejected_key: column 'rejected' .*"
        r"\['chosen', 'prompt'\]",
    ):
        enc.check_columns({"prompt": "a", "chosen": "b"}, SRC)
    with pytest.raises(
        ValueError,
        match=r"data\.prompt_key: column 'prompt' is not in .*"
        r"available columns: \['chosen', 'rejected'\].*"
        r"first row's column 'chosen' holds text",
    ):
        enc.check_columns({"chosen": "b", "rejected": "c"}, SRC)
    with pytest.raises(
        ValueError,
        match=r"data\.chosen_key: row 2 of .* list of messages in "
        r"column 'prompt' but str in column 'chosen'",
    ):
        enc.encode({"prompt": [turn("user", "a")], "chosen": "b", "rejected": "c"}, 2, SRC)
    with pytest.raises(
        ValueError,
        match=r"data\.chosen_key: row 2 of .* no prompt in column "
        r"'prompt' but str in column 'chosen'",
    ):
        enc.encode({"chosen": "b", "rejected": "c"}, 2, SRC)
    with pytest.raises(
        ValueError,
        match=r"data\.rejected_key: row 2 .* list in column "
        r"'rejected', not text",
    ):
        enc.encode({"prompt": "a", "chosen": "b", "rejected": [turn("assistant", "c")]}, 2, SRC)
    with pytest.raises(ValueError, match=r"data\.prompt_key: row 2 .* int in column 'prompt'"):
        enc.encode({"prompt": 3, "chosen": "b", "rejected": "c"}, 2, SRC)
    with pytest.raises(ValueError, match=r"data\.rejected_key: row 2 .* no assistant turn"):
        enc.encode(
            {"prompt": [turn("user", "a")], "chosen": [turn("assistant", "b")], "rejected": [turn("user", "c")]}, 2, SRC
        )
    conv = {
        "chosen": [turn("user", "a"), turn("assistant", "b")],
        "rejected": [turn("user", "a"), turn("assistant", "c")],
    }
    with pytest.raises(
        ValueError,
        match=r"data\.chosen_key: column 'chosen' holds "
        r"conversations.*chat template",
    ):
        preference({}, chars, 64).encode(conv, 2, SRC)


def test_dpo_identical_sides_have_no_preference(chars, tok):
    with pytest.raises(
        ValueError,
        match=r"row 4 of dataset 'x\.jsonl' .*'chosen' and "
        r"'rejected': no preference to learn",
    ):
        preference({}, chars, 64).encode({"prompt": "1", "chosen": "2", "rejected": "2"}, 4, SRC)
    same = [turn("user", "a"), turn("assistant", "b")]
    with pytest.raises(ValueError, match=r"row 4 .*no preference"):
        preference({}, tok, 64).encode({"chosen": same, "rejected": list(same)}, 4, SRC)


def test_dpo_long_sequences(chars):
    row = {"prompt": "1+1=", "chosen": "2", "rejected": "11"}  # 7 and 8 tokens
    with pytest.raises(
        ValueError,
        match=r"row 0 of .* \(rejected side\) is 8 tokens, over the "
        r"limit of 7",
    ):
        preference({"on_long_sequence": "error"}, chars, 7).encode(row, 0, SRC)
    assert preference({"on_long_sequence": "filter"}, chars, 7).encode(row, 0, SRC) is None
    d = preference({}, chars, 7).encode(row, 0, SRC)
    assert not d.chosen.metadata["truncated"] and d.rejected.metadata["truncated"]
    assert d.metadata["truncated"] and d.rejected.token_mask == (0,) * 5 + (1, 1)
    # Cut inside the prompt: the pair has nothing to train on and is dropped.
    assert preference({}, chars, 5).encode(row, 0, SRC) is None
    # Cut before the sides differ ("11" vs "12"): nothing left to prefer, dropped too.
    row = {"prompt": "1+1=", "chosen": "11", "rejected": "12"}
    assert preference({}, chars, 6).encode(row, 0, SRC) is None


# ---------------------------------------------------------------- template checks
def test_template_that_rewrites_earlier_turns_is_refused(tok):
    tok.chat_template = STRIPPING_TEMPLATE
    enc = sft({"messages_key": "m"}, tok, 64)
    one = [turn("user", "a"), turn("assistant", "b")]
    assert enc.encode({"m": one}, 0, SRC).num_response_tokens == 2  # single turn: fine
    two = one + [turn("user", "c"), turn("assistant", "d")]
    with pytest.raises(
        ValueError,
        match=r"row 6 of dataset 'x\.jsonl': the chat template of "
        r"tokenizer .* does not render conversation prefixes "
        r"as prefixes.*cannot be located",
    ):
        enc.encode({"m": two}, 6, SRC)


def test_generation_prompt_that_differs_from_the_turn_is_refused(tok):
    tok.chat_template = CHAT_TEMPLATE.replace("<s> a {% endif %}", "<s> x {% endif %}")
    with pytest.raises(ValueError, match=r"row 0 of .*does not render conversation prefixes"):
        sft({}, tok, 64).encode({"prompt": "a", "response": "b"}, 0, SRC)


def test_render_accepts_a_dict_result():
    class DictTokenizer:  # apply_chat_template returning a dict, as transformers 5 does by default
        name_or_path = "fake"

        def apply_chat_template(self, messages, add_generation_prompt=False, **_):
            out = [t for m in messages for t in ({"user": 1, "assistant": 3}[m["role"]], 20)]
            return {"input_ids": out + [3] * add_generation_prompt}

    msgs = [turn("user", "a"), turn("assistant", "b")]
    assert render_conversation(DictTokenizer(), msgs, [1], "row 0") == ([1, 20, 3, 20], [0, 0, 0, 1])
