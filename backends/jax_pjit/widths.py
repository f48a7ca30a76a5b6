"""The widths the JAX backend pads a micro batch's rows to (``policy.jax_cfg.padded_widths_per_doubling``).

``jax.jit`` compiles one program per input shape, so rows are padded to a ladder of widths:
from 16, ``per_doubling`` evenly spaced rungs per doubling (1: 16, 32, 64, ...; 2: 16, 24, 32,
48, ...), capped at ``max_total_sequence_length`` (or a packing budget).  Finer rungs pad less
for more programs.

No jax here: the driver checks a context-parallel ladder (``spec``) before any worker starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.data.context_parallel import check_cp_width

if TYPE_CHECKING:
    from core.policy.config import PolicyConfig

MIN_BUCKET = 16


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def octave_round_up(n: int, per_doubling: int) -> int:
    """``n`` rounded up to the next of ``per_doubling`` evenly spaced rungs between the powers of
    two around it (``per_doubling`` a power of two): 17..32 with 4 -> 20, 24, 28 or 32; with 1
    the next power of two.  A rung is at most ``1 + 1 / per_doubling`` times ``n``."""
    shift = max((n - 1).bit_length() - 1 - (per_doubling.bit_length() - 1), 0)
    return round_up(n, 1 << shift)


def length_buckets(max_len: int, minimum: int = MIN_BUCKET, multiple: int = 1, per_doubling: int = 1) -> list[int]:
    """The widths from ``minimum`` up to, and always ending at, ``max_len``: ``per_doubling``
    evenly spaced rungs per doubling (1: powers of two; 2: 16, 24, 32, 48, ...); with
    ``multiple`` > 1 (``policy.make_sequence_length_divisible_by``) every rung is rounded up
    to a multiple of it -- the top one too, which may then exceed ``max_len`` (padding)."""
    top = round_up(max_len, multiple)
    ladder: list[int] = []
    n = minimum
    while n < max_len:
        rung = round_up(n, multiple)
        if rung < top and (not ladder or rung > ladder[-1]):
            ladder.append(rung)
        n = octave_round_up(n + 1, per_doubling)
    return ladder + [top]


def bucket_for(
    length: int,
    max_len: int,
    multiple: int = 1,
    field: str = "policy.max_total_sequence_length",
    per_doubling: int = 1,
) -> int:
    """The smallest bucket holding ``length`` tokens (``field`` names ``max_len`` in the error)."""
    if length > max_len:
        raise ValueError(f"sequence length {length} exceeds {field}={max_len}")
    return next(b for b in length_buckets(max_len, multiple=multiple, per_doubling=per_doubling) if b >= length)


def check_cp_ladder(
    max_len: int, cp: int, multiple: int, field: str = "policy.max_total_sequence_length", per_doubling: int = 1
) -> None:
    """Context parallelism splits every row into ``2 * cp`` chunks, so every width of the
    ladder up to ``max_len`` (``field``) must be a multiple of ``2 * cp``; the widths are
    rounded up to ``policy.make_sequence_length_divisible_by``, the field the error names."""
    if cp <= 1:
        return
    ladder = length_buckets(max_len, multiple=multiple, per_doubling=per_doubling)
    for width in ladder:
        try:
            check_cp_width(width, cp, 2 * cp, "policy.make_sequence_length_divisible_by")
        except ValueError as err:
            raise ValueError(
                f"{err} (policy.parallel.context_parallel_size={cp}: the JAX backend pads rows to the widths "
                f"{ladder} for {field}={max_len}, {per_doubling} per doubling "
                f"(policy.jax_cfg.padded_widths_per_doubling), each rounded up to "
                f"make_sequence_length_divisible_by={multiple})"
            ) from None


def check_cp_ladders(policy: PolicyConfig, cp: int, per_doubling: int) -> None:
    """:func:`check_cp_ladder` over every ladder a step can see: ``max_total_sequence_length``'s
    and, with sequence packing, each packing budget's."""
    multiple = policy.make_sequence_length_divisible_by
    check_cp_ladder(policy.max_total_sequence_length, cp, multiple, per_doubling=per_doubling)
    if policy.sequence_packing.enabled:
        for key in ("train_mb_tokens", "logprob_mb_tokens"):
            budget = getattr(policy.sequence_packing, key)
            if budget is not None:
                check_cp_ladder(budget, cp, multiple, f"policy.sequence_packing.{key}", per_doubling)
