"""Text rows -> tokenized SFT / DPO training examples with a loss mask.

``SFTEncoder`` turns a prompt/response row, or a conversation (chat-templated, or raw text
for a tokenizer without a template, as multi-turn rollouts render it), into one
``SequenceDatum``; ``PreferenceEncoder`` turns a prompt/chosen/rejected row into a
``PreferenceDatum``.  The mask is 1 exactly on the tokens the model should learn to emit:
the response, or every assistant turn as the chat template renders it (including the
end-of-turn / eos tokens it emits for that turn).  Prompt formatting reuses
``core.datasets.prompts`` so that SFT, DPO and RL prompts are identical for one config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.datasets.config import DataConfig
from core.datasets.prompts import (
    chat_template_used,
    format_prompt,
    tokenize_prompt,
    tokenizer_name,
)

_ROLES = ("system", "user", "assistant", "tool")
_ON_LONG = ("truncate", "filter", "error")


@dataclass(frozen=True)
class SequenceDatum:
    """One training sequence and the tokens its loss trains on."""

    input_ids: tuple[int, ...]
    token_mask: tuple[int, ...]  # 1 on response / assistant tokens (incl. their eos), else 0
    metadata: dict[str, Any]  # index, truncated + the row's other columns

    @property
    def num_response_tokens(self) -> int:
        return sum(self.token_mask)


@dataclass(frozen=True)
class PreferenceDatum:
    """A chosen and a rejected continuation of one prompt."""

    chosen: SequenceDatum
    rejected: SequenceDatum
    metadata: dict[str, Any]  # index, truncated (either side) + the row's other columns


def _chat_ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    """Token ids of a rendered conversation (the template's own specials, none added)."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    if isinstance(out, Mapping):  # transformers 5 returns a BatchEncoding unless return_dict=False
        out = out["input_ids"]
    return [int(t) for t in out]


def render_conversation(
    tokenizer, messages: list[dict], train_turns: list[int], where: str
) -> tuple[list[int], list[int]]:
    """Ids of ``messages`` and a mask that is 1 on the assistant turns ``train_turns``.

    Few templates support ``return_assistant_tokens_mask``, so a turn's tokens are located by
    rendering prefixes: turn k spans from the end of ``messages[:k]`` + generation prompt to
    the end of ``messages[:k + 1]``.  That is only sound if prefixes render as prefixes.
    """
    full = _chat_ids(tokenizer, messages)
    mask = [0] * len(full)
    for k in train_turns:
        if k == 0:  # transformers refuses to render the empty conversation before it
            raise ValueError(
                f"{where}: the conversation starts with an assistant turn; put a user (or system) turn before it"
            )
        before = _chat_ids(tokenizer, messages[:k], add_generation_prompt=True)
        upto = _chat_ids(tokenizer, messages[: k + 1])
        if upto[: len(before)] != before or full[: len(upto)] != upto:
            raise ValueError(
                f"{where}: the chat template of tokenizer {tokenizer_name(tokenizer)} does not "
                f"render conversation prefixes as prefixes of the conversation (turn {k}), so "
                f"the assistant tokens to train on cannot be located"
            )
        if len(upto) == len(before):  # nothing to train on would silently waste the row
            raise ValueError(f"{where}: the chat template renders no tokens for assistant turn {k}")
        mask[len(before) : len(upto)] = [1] * (len(upto) - len(before))
    return full, mask


def render_raw_conversation(tokenizer, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """Ids of ``messages`` without a chat template, and a mask 1 on the assistant turns: what
    a multi-turn rollout builds for a tokenizer without one (docs/multi-turn.md).  The first
    message is the prompt (with the tokenizer's special tokens, e.g. BOS); every assistant turn
    its text then the eos token (the stop token a rollout's turn ends with), trained on; every
    other turn (user, tool: an observation) its raw text, without special tokens, not trained on."""
    ids: list[int] = []
    mask: list[int] = []
    for k, message in enumerate(messages):
        role = message["role"]
        if role == "system":
            raise ValueError(
                f"data.messages_key: {where}, message {k} is a system message, which needs a chat template"
            )
        if role == "assistant" and k == 0:
            raise ValueError(
                f"data.messages_key: {where} starts with an assistant turn; put a user turn (the prompt) before it"
            )
        part = [int(t) for t in tokenizer(message["content"], add_special_tokens=k == 0)["input_ids"]]
        if role == "assistant":
            part.append(int(tokenizer.eos_token_id))
        ids += part
        mask += [int(role == "assistant")] * len(part)
    return ids, mask


def _messages(value: Any, key: str, column: str, where: str) -> list[dict]:
    """Validate a column holding a conversation: a non-empty list of role/content dicts."""
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"data.{key}: {where} has {type(value).__name__} in column {column!r}, "
            f"not a non-empty list of {{'role', 'content'}} messages"
        )
    for j, m in enumerate(value):
        if not isinstance(m, Mapping) or "role" not in m or not isinstance(m.get("content"), str):
            raise ValueError(
                f"data.{key}: {where}, column {column!r}, message {j} is not a "
                f"dict with a 'role' and a str 'content': {m!r}"
            )
        if m["role"] not in _ROLES:
            raise ValueError(
                f"data.{key}: {where}, column {column!r}, message {j} has unknown "
                f"role {m['role']!r}; known: {', '.join(_ROLES)}"
            )
    return [dict(m) for m in value]  # copies: other keys (tool_calls, ...) reach the template


def _require_chat(data_cfg: DataConfig, tokenizer, key: str, column: str) -> None:
    """DPO conversations need a chat template (and :func:`_check_conversations`)."""
    if not chat_template_used(data_cfg, tokenizer):
        raise ValueError(
            f"data.{key}: column {column!r} holds conversations, which need a chat template, "
            f"but none is applied (tokenizer {tokenizer_name(tokenizer)}, "
            f"data.use_chat_template: {data_cfg.use_chat_template})"
        )
    _check_conversations(data_cfg, tokenizer, key, column)


def _check_conversations(data_cfg: DataConfig, tokenizer, key: str, column: str) -> None:
    """``prompt_template`` cannot apply to conversations; without a chat template (raw text,
    :func:`render_raw_conversation`) neither can ``system_prompt``."""
    if not chat_template_used(data_cfg, tokenizer) and data_cfg.system_prompt:
        raise ValueError(
            f"data.system_prompt: conversations in column {column!r} are rendered as raw text without a "
            f"chat template (tokenizer {tokenizer_name(tokenizer)}, data.use_chat_template: "
            f"{data_cfg.use_chat_template}), which has no place for a system message; unset it"
        )
    template = data_cfg.prompt_template
    if template != "{prompt}":  # ignoring it silently would train on other prompts
        raise ValueError(
            f"data.prompt_template: {template!r} applies to text prompts only, "
            f"not to conversations in column {column!r}; unset it"
        )


def _assistant_turns(messages: list[dict], start: int = 0) -> list[int]:
    return [k for k in range(start, len(messages)) if messages[k]["role"] == "assistant"]


class _Encoder:
    """Config checks, prompt/response rendering and length handling shared by SFT and DPO."""

    def __init__(self, data_cfg: DataConfig, tokenizer, max_length: int):
        self.on_long = data_cfg.on_long_sequence
        if self.on_long not in _ON_LONG:
            raise ValueError(f"data.on_long_sequence: {self.on_long!r} is not one of {', '.join(_ON_LONG)}")
        self.limit = int(max_length)
        # Named by core.datasets.base in its warnings / errors about dropped rows.
        self.limit_key = "policy.max_total_sequence_length"
        self.drop_note = (
            f"data.on_long_sequence={self.on_long}"
            if self.on_long == "filter"
            else "data.on_long_sequence=truncate (nothing left to train on)"
        )
        if self.limit < 1:
            raise ValueError(f"policy.max_total_sequence_length: {self.limit} must be positive")
        format_prompt("", data_cfg, tokenizer)  # surfaces template / chat-template errors now
        self._cfg, self._tok = data_cfg, tokenizer
        self._chat = chat_template_used(data_cfg, tokenizer)
        self._template = data_cfg.prompt_template
        if not self._chat and tokenizer.eos_token_id is None:
            # Without a template the eos is what teaches the model to stop.
            raise ValueError(
                f"data.use_chat_template: without a chat template responses end "
                f"with the eos token, but tokenizer {tokenizer_name(tokenizer)} "
                f"has none"
            )

    def _with_system(self, messages: list[dict]) -> list[dict]:
        system = self._cfg.system_prompt
        if system and not any(m["role"] == "system" for m in messages):
            return [{"role": "system", "content": system}] + messages
        return messages

    def _text_example(self, prompt: str, response: str, where: str):
        """(ids, mask) of a text prompt + response: loss on the response and its end token."""
        if self._chat:
            user = {"role": "user", "content": self._template.format(prompt=prompt)}
            msgs = self._with_system([user, {"role": "assistant", "content": response}])
            return render_conversation(self._tok, msgs, [len(msgs) - 1], where)
        head = tokenize_prompt(format_prompt(prompt, self._cfg, self._tok), self._tok, False)
        tail = [int(t) for t in self._tok(response, add_special_tokens=False)["input_ids"]]
        tail.append(int(self._tok.eos_token_id))
        return head + tail, [0] * len(head) + [1] * len(tail)

    def _fit(self, ids: list[int], mask: list[int], where: str):
        """Apply ``on_long_sequence``: (ids, mask, truncated), or None to drop the row."""
        if len(ids) <= self.limit:
            return ids, mask, False
        if self.on_long == "error":
            raise ValueError(
                f"policy.max_total_sequence_length: {where} is {len(ids)} tokens, over the "
                f"limit of {self.limit}; raise policy.max_total_sequence_length or set "
                f"data.on_long_sequence: truncate or filter"
            )
        if self.on_long == "filter":
            return None
        ids, mask = ids[: self.limit], mask[: self.limit]
        return (ids, mask, True) if any(mask) else None  # nothing left to train on

    def _check(self, row: Mapping, source: str, keys: list[tuple[str, str]]) -> None:
        for key, column in keys:
            if column not in row:
                raise ValueError(f"data.{key}: column {column!r} is not in {source}; available columns: {sorted(row)}")


def _text(row: Mapping, key: str, column: str, where: str) -> str:
    value = row.get(column)
    if not isinstance(value, str):
        raise ValueError(f"data.{key}: {where} has {type(value).__name__} in column {column!r}, not text")
    return value


class SFTEncoder(_Encoder):
    """A prompt/response row or a conversation (``data.messages_key``) -> ``SequenceDatum``."""

    def __init__(self, data_cfg: DataConfig, tokenizer, max_length: int):
        self.messages_key = data_cfg.messages_key
        self.response_key = data_cfg.response_column
        self.prompt_key = data_cfg.prompt_column if self.messages_key is None else self.messages_key
        if self.messages_key:  # before the base class, whose system_prompt error is less apt
            for key in ("prompt_key", "response_key"):
                if getattr(data_cfg, key) is not None:  # a column that would be silently ignored
                    raise ValueError(
                        f"data.{key}: {getattr(data_cfg, key)!r} is not used when data.messages_key is "
                        f"set (conversations carry their own turns); set it to null"
                    )
            _check_conversations(data_cfg, tokenizer, "messages_key", self.messages_key)
        super().__init__(data_cfg, tokenizer, max_length)

    def check_columns(self, row: Mapping, source: str) -> None:
        """The configured columns must exist (checked on the first row)."""
        keys = (
            [("messages_key", self.messages_key)]
            if self.messages_key
            else [("prompt_key", self.prompt_key), ("response_key", self.response_key)]
        )
        self._check(row, source, keys)

    def encode(self, row: Mapping, index: int, source: str) -> SequenceDatum | None:
        """The row as a datum, or None when ``on_long_sequence`` drops it."""
        where = f"row {index} of {source}"
        if self.messages_key:
            msgs = _messages(row.get(self.messages_key), "messages_key", self.messages_key, where)
            if not _assistant_turns(msgs):
                raise ValueError(f"data.messages_key: {where} has no assistant turn in column {self.messages_key!r}")
            msgs = self._with_system(msgs)
            if self._chat:
                ids, mask = render_conversation(self._tok, msgs, _assistant_turns(msgs), where)
            else:
                ids, mask = render_raw_conversation(self._tok, msgs, where)
            used = {self.messages_key}
        else:
            prompt = _text(row, "prompt_key", self.prompt_key, where)
            response = _text(row, "response_key", self.response_key, where)
            ids, mask = self._text_example(prompt, response, where)
            used = {self.prompt_key, self.response_key}
        fitted = self._fit(ids, mask, where)
        if fitted is None:
            return None
        ids, mask, truncated = fitted
        extra = {k: v for k, v in row.items() if k not in used}
        if not self.messages_key:  # the text that identifies the example (held-out checks)
            extra["raw_prompt"] = row[self.prompt_key]
        return SequenceDatum(tuple(ids), tuple(mask), {**extra, "index": index, "truncated": truncated})


class PreferenceEncoder(_Encoder):
    """A prompt/chosen/rejected row -> ``PreferenceDatum``.

    Per row, from the value types: (a) text prompt, chosen, rejected; (b) a conversation
    prompt + chosen / rejected assistant messages; (c) no prompt, chosen / rejected full
    conversations sharing an implicit prompt (TRL's format): loss on the final assistant turn.
    """

    def __init__(self, data_cfg: DataConfig, tokenizer, max_length: int):
        super().__init__(data_cfg, tokenizer, max_length)
        self.prompt_key = data_cfg.prompt_column
        self.chosen_key = data_cfg.chosen_key
        self.rejected_key = data_cfg.rejected_key

    def check_columns(self, row: Mapping, source: str) -> None:
        """Chosen/rejected always; the prompt unless the first row holds full conversations."""
        self._check(row, source, [("chosen_key", self.chosen_key), ("rejected_key", self.rejected_key)])
        if self.prompt_key not in row and not isinstance(row[self.chosen_key], list):
            raise ValueError(
                f"data.prompt_key: column {self.prompt_key!r} is not in {source}; available "
                f"columns: {sorted(row)}.  It is needed because the first row's column "
                f"{self.chosen_key!r} holds text: only full conversations (lists of messages) "
                f"in chosen / rejected may go without a prompt"
            )

    def encode(self, row: Mapping, index: int, source: str) -> PreferenceDatum | None:
        """The pair, or None when ``on_long_sequence`` drops either side."""
        where = f"row {index} of {source}"
        sides = self._sides(row, where)
        if sides[0][0] == sides[1][0]:
            raise ValueError(
                f"data.chosen_key / data.rejected_key: {where} has the same "
                f"sequence in columns {self.chosen_key!r} and {self.rejected_key!r}: "
                f"no preference to learn"
            )
        fitted = [
            self._fit(ids, mask, f"{where} ({side} side)")
            for (ids, mask), side in zip(sides, ("chosen", "rejected"), strict=True)
        ]
        # Truncation may also cut away everything that told the two sides apart.
        if None in fitted or fitted[0][0] == fitted[1][0]:
            return None
        extra = {k: v for k, v in row.items() if k not in (self.prompt_key, self.chosen_key, self.rejected_key)}
        if isinstance(row.get(self.prompt_key), str):  # the text that identifies the example
            extra["raw_prompt"] = row[self.prompt_key]
        chosen, rejected = (
            SequenceDatum(tuple(ids), tuple(mask), {**extra, "index": index, "truncated": cut})
            for ids, mask, cut in fitted
        )
        return PreferenceDatum(chosen, rejected, {**extra, "index": index, "truncated": fitted[0][2] or fitted[1][2]})

    def _sides(self, row: Mapping, where: str) -> list[tuple[list[int], list[int]]]:
        """(ids, mask) of the chosen and the rejected side, untruncated."""
        prompt = row.get(self.prompt_key)
        if isinstance(prompt, str):  # (a)
            return [
                self._text_example(prompt, _text(row, key, column, where), where)
                for key, column in (("chosen_key", self.chosen_key), ("rejected_key", self.rejected_key))
            ]
        if prompt is not None and not isinstance(prompt, list):
            raise ValueError(
                f"data.prompt_key: {where} has {type(prompt).__name__} in column "
                f"{self.prompt_key!r}, not text or a list of messages"
            )
        head = _messages(prompt, "prompt_key", self.prompt_key, where) if prompt else []
        return [
            self._conversation_side(head, row, key, column, where)
            for key, column in (("chosen_key", self.chosen_key), ("rejected_key", self.rejected_key))
        ]

    def _conversation_side(
        self, head: list[dict], row: Mapping, key: str, column: str, where: str
    ) -> tuple[list[int], list[int]]:
        """(b) with a prompt conversation ``head``, else (c) an implicit-prompt conversation."""
        value = row.get(column)
        if not isinstance(value, list):
            form = "a list of messages" if head else "no prompt"
            raise ValueError(
                f"data.{key}: {where} has {form} in column {self.prompt_key!r} "
                f"but {type(value).__name__} in column {column!r}; it must hold a "
                f"list of {'assistant' if head else 'conversation'} messages"
            )
        _require_chat(self._cfg, self._tok, key, column)
        tail = _messages(value, key, column, where)
        turns = _assistant_turns(head + tail, len(head))
        if not turns:
            raise ValueError(f"data.{key}: {where} has no assistant turn in column {column!r}")
        msgs = self._with_system(head + tail)
        shift = len(msgs) - len(head) - len(tail)  # the prepended system turn, if any
        train = [k + shift for k in turns] if head else [turns[-1] + shift]
        return render_conversation(self._tok, msgs, train, where)
