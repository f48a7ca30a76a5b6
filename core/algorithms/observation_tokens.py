"""The tokens an environment's observation adds to a conversation between two assistant turns.

The policy's own tokens are never decoded and re-encoded: a conversation is the prompt's
ids, then each turn's generated ids exactly as sampled, then the ids of what this module
renders for the observation, and so on.

* With a chat template (``data.use_chat_template`` on and the tokenizer has one): the
  observation is a ``tool`` message.  Its tokens are the *difference* the template adds
  after an assistant turn: ``render([..., assistant, tool(obs)], add_generation_prompt)``
  minus ``render([..., assistant])``, preceded by the template's end of the assistant turn
  (what it writes after the assistant's content, e.g. ``<|im_end|>\\n``) less the stop token
  the model generated itself.  So the next turn starts exactly where the template would
  start it (``<|im_start|>assistant\\n``).
* Without one (the built-in character tokenizer): the observation's raw text, encoded
  without special tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ObservationTokens"]

# Stands for an assistant message's content while finding where the template closes the turn.
_SENTINEL = "DUALRL_ASSISTANT_SENTINEL"
_OBS_SENTINEL = "DUALRL_OBSERVATION_SENTINEL"
_PREFIX = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _SENTINEL}]


class ObservationTokens:
    """Observation text -> token ids, for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, use_chat_template: bool, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.templated = bool(use_chat_template and getattr(tokenizer, "chat_template", None))
        self.stop_token_ids = set(stop_token_ids)
        if self.templated:
            self._close, self._before, self._after = self._template_pieces()

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        rendered = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(rendered)

    def _template_pieces(self) -> tuple[str, str, str]:
        """(end of an assistant turn after its content, text before / after the observation)."""
        name = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
        prefix = self._render(_PREFIX, add_generation_prompt=False)
        try:
            full = self._render([*_PREFIX, {"role": "tool", "content": _OBS_SENTINEL}], add_generation_prompt=True)
        except Exception as err:
            raise ValueError(
                f"tokenizer {name!r}: its chat template cannot render a tool message ({type(err).__name__}: {err}); "
                "multi-turn rollouts need a template with a tool role, or data.use_chat_template: false"
            ) from err
        if not full.startswith(prefix) or full.count(_OBS_SENTINEL) != 1 or prefix.count(_SENTINEL) != 1:
            raise ValueError(
                f"tokenizer {name!r}: its chat template renders a conversation differently once a tool message "
                "follows (the rendered prefix changes), so observation tokens cannot be appended after the "
                "model's own; use data.use_chat_template: false"
            )
        close = prefix[prefix.index(_SENTINEL) + len(_SENTINEL) :]
        delta = full[len(prefix) :]
        before, after = delta.split(_OBS_SENTINEL)
        return close, before, after

    def tokens(self, observation: str, generated: list[int]) -> list[int]:
        """The ids to append after a turn whose generated ids are ``generated``."""
        if not self.templated:
            return self._encode(observation)
        close = self._close
        if generated and generated[-1] in self.stop_token_ids:
            stop_text = str(self.tokenizer.decode([generated[-1]]))
            if close.startswith(stop_text):  # the model wrote the template's end-of-turn token itself
                close = close[len(stop_text) :]
        return self._encode(close + self._before + observation + self._after)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))
