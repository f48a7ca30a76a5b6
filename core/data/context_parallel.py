"""Context parallelism's index arithmetic, shared by the torch and JAX backends.

A row of ``width`` tokens is cut into ``2 * cp`` equal chunks and rank ``r`` keeps chunks
``r`` and ``2 * cp - 1 - r`` (a head chunk and a tail chunk).  Under a causal mask the
work of a query grows with its position, so this pairing gives every rank the same
attention cost (Llama 3's long-context recipe; torch's ``context_parallel`` load balancer
does the same).  Keys and values of all ranks are gathered in rank order, i.e. in
``load_balanced_columns(width, cp).reshape(-1)`` order, and the attention mask is built
from each token's *column* in the row (causality) and *segment* (which sequence it belongs
to: padding is its own segment; packed rows hold several), so the mask is exact whatever
the order of the gathered keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, overload

import numpy as np

if TYPE_CHECKING:
    import jax

__all__ = ["load_balanced_columns", "row_segments", "attention_allowed", "check_cp_width"]


def check_cp_width(width: int, cp: int, multiple: int, field: str) -> None:
    """Context parallelism needs rows that split into ``2 * cp`` chunks (``multiple``)."""
    if width % multiple:
        raise ValueError(
            f"sequence width {width} is not divisible by {multiple} (= 2 x context_parallel_size {cp}"
            f"{' x tensor_parallel_size with sequence parallelism' if multiple != 2 * cp else ''}); "
            f"set {field} to a multiple of {multiple}"
        )


def load_balanced_columns(width: int, cp: int) -> np.ndarray:
    """``[cp, width // cp]``: the row columns each context-parallel rank holds, ascending."""
    if cp < 1 or width % (2 * cp):
        raise ValueError(f"load_balanced_columns: width {width} must be a multiple of 2 x cp = {2 * cp}")
    chunks = np.arange(width).reshape(2 * cp, width // (2 * cp))
    return np.stack([np.concatenate([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


def row_segments(lengths: Sequence[int] | np.ndarray, width: int) -> np.ndarray:
    """``[rows, width]`` segments of right-padded rows: 0 on real tokens, 1 on padding."""
    lens = np.asarray(lengths, dtype=np.int64)
    return (np.arange(width)[None, :] >= lens[:, None]).astype(np.int64)


@overload
def attention_allowed(
    q_cols: np.ndarray, k_cols: np.ndarray, segments: np.ndarray, prefix_segments: np.ndarray | None = None
) -> np.ndarray: ...
@overload
def attention_allowed(
    q_cols: jax.Array, k_cols: jax.Array, segments: jax.Array, prefix_segments: jax.Array | None = None
) -> jax.Array: ...
def attention_allowed(q_cols, k_cols, segments, prefix_segments=None):
    """``[rows, len(q_cols), len(k_cols)]`` bool: query column q may read key column k.

    Causal in column order, and only within the query's own segment -- or the segment
    ``prefix_segments`` names for it (a shared prompt's samples read the prompt's segment;
    ``core.data.shared_prompts``).  Every query may at least read itself, so no softmax row
    is empty (padding queries read padding keys and produce finite values nobody reads)."""
    causal = k_cols[None, :] <= q_cols[:, None]  # (q, k)
    keys = segments[:, k_cols][:, None, :]
    same = segments[:, q_cols][:, :, None] == keys  # (rows, q, k)
    if prefix_segments is not None:
        same = same | (prefix_segments[:, q_cols][:, :, None] == keys)
    return causal[None] & same
