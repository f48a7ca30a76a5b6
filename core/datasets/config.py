"""The ``data`` section: the built-in task, a local JSONL/parquet file or a hub dataset.

One section for every algorithm; each reads the keys of its data format (GRPO prompts, SFT
prompt/response or chat ``messages``, DPO prompt/chosen/rejected) and its run config refuses
the others by name (``core.algorithms.config``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import Field, field_validator

from core.config import ConfigModel, Problem
from core.environments.config import ArithmeticTaskConfig, ReasoningGymConfig


class DataConfig(ConfigModel):
    """Training data: the built-in task, a local JSONL/parquet file, or a Hugging Face dataset."""

    dataset_name: str = Field(min_length=1)
    """"arithmetic" / "arithmetic-preferences" / "tool-arithmetic" / "reasoning_gym" (built-in), a
    .jsonl/.json/.parquet path or a hub name."""
    dataset_config: str | None = None
    """Hub subset, e.g. "main"."""
    split: str = "train"
    """The training split of a file or hub dataset."""
    val_dataset_name: str | None = None
    """null = hold validation rows out of dataset_name."""
    val_split: str | None = None
    """null = split."""
    val_seed: int | None = None
    """The seed that draws the held-out validation set: a built-in task's problems, or the rows
    held out of a file / hub dataset.  null = the run's seed + 1 (built-in) / the run's seed
    (held out).  Set it to compare runs of several seeds on one validation set (and, for a
    built-in model, one warm start: it never sees the held-out prompts)."""
    prompt_key: str | None = None
    """Column with the prompt text (default "prompt"; null with SFT's messages_key)."""
    answer_key: str | None = None
    """GRPO: column with the reference answer (-> the environment's ground truth)."""
    response_key: str | None = None
    """SFT: column with the response text (default "response"); null with messages_key."""
    messages_key: str | None = None
    """SFT: column with a chat conversation (list of {role, content}); loss on assistant turns."""
    chosen_key: str = "chosen"
    """DPO: the preferred response (text or messages)."""
    rejected_key: str = "rejected"
    """DPO: the dispreferred response."""
    prompt_template: str = "{prompt}"
    """str.format template around the prompt."""
    system_prompt: str | None = None
    """System message (chat template only)."""
    use_chat_template: bool | Literal["auto"] = "auto"
    """"auto" = when the tokenizer has one."""
    max_input_seq_length: int | None = Field(None, ge=1)
    """GRPO: longest prompt in tokens (required there)."""
    on_long_prompt: Literal["error", "filter"] = "error"
    """GRPO: what a longer prompt does."""
    on_long_sequence: Literal["truncate", "filter", "error"] = "truncate"
    """SFT/DPO: a sequence over policy.max_total_sequence_length."""
    shuffle: bool = True
    """Shuffle the training rows each epoch (the order is a function of the seed)."""
    arithmetic: ArithmeticTaskConfig | None = None
    """SFT/DPO: knobs of the built-in task (GRPO: env.arithmetic); null = the defaults."""
    reasoning_gym: ReasoningGymConfig | None = None
    """GRPO/SFT, built-in "reasoning_gym" only (required there): its tasks -- one, or a weighted
    mix, each with its generator settings and seed (core/environments/reasoning_gym.py)."""
    tool_demo_fraction: float | None = Field(None, ge=0.0, le=1.0)
    """SFT, built-in "tool-arithmetic" only (required there): share of its conversations that
    demonstrate a calculator call (core/environments/tools/demos.py)."""

    @field_validator("use_chat_template", mode="plain")
    @classmethod
    def _chat_mode(cls, value: object) -> bool | str:
        # One message instead of pydantic's two (one per member of the union).
        if isinstance(value, bool) or value == "auto":
            return value
        raise ValueError(f"expected true, false or 'auto', got {value!r}")

    def check(self) -> Iterable[Problem]:
        yield from self._reasoning_gym_problems()
        if "{prompt}" not in self.prompt_template:
            yield "prompt_template", f"must contain '{{prompt}}', got {self.prompt_template!r}"
        if self.tool_demo_fraction is not None and self.dataset_name != "tool-arithmetic":
            yield (
                "tool_demo_fraction",
                f"only the built-in source 'tool-arithmetic' reads it (data.dataset_name is {self.dataset_name!r})",
            )

    def _reasoning_gym_problems(self) -> Iterable[Problem]:
        """data.reasoning_gym goes with the source of that name (the package checked first)."""
        names = (self.dataset_name, self.val_dataset_name)
        if "reasoning_gym" not in names:
            if self.reasoning_gym is not None:
                yield "reasoning_gym", "only the built-in source 'reasoning_gym' reads it; remove it"
            return
        from core.environments.reasoning_gym_checks import missing_package

        missing = missing_package()
        key = "dataset_name" if self.dataset_name == "reasoning_gym" else "val_dataset_name"
        if missing:
            yield key, missing
        elif self.reasoning_gym is None:
            yield (
                "reasoning_gym",
                "required with the built-in source 'reasoning_gym' (its tasks: a list of {name, ...})",
            )

    @property
    def prompt_column(self) -> str:
        """The prompt's column: ``prompt_key``, else ``messages_key`` (SFT chats), else "prompt"."""
        return self.prompt_key or self.messages_key or "prompt"

    @property
    def response_column(self) -> str:
        return self.response_key or "response"
