"""Attention over packed rows that reads only the keys a query can reach.

A packed row holds many sequences one after another; a token reads keys of its own sequence
(and of its shared prompt, ``core.data.shared_prompts``), never further back than
``PackedRow.attention_reach`` columns.  The dense path (``layers.attend`` with a ``[B, W, W]``
mask) still computes and masks all ``W x W`` scores: on a CPU, a micro batch packed into one
row of 2048 tokens spent most of its train step there, for sequences of a few hundred tokens.

Here the row is cut into query blocks of ``block`` columns, and each block reads the
``window`` key columns that end with the block (``band_keys``: the same for every row; the
columns before the row start are -1 and masked).  The window covers the reach of every real
token (the host picks it, ``steps.packed_micro_batch``), so each real query sees exactly the
keys the dense mask allows; the softmax sums the same nonzero terms, in another order.  A
padding query (the row's tail, whose outputs nobody reads) sees the part of the tail inside
its window, itself included, so no softmax row is empty.  The cost is ``W x window``
instead of ``W x W``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Banded(NamedTuple):
    """The mask of a banded attention call (a pytree: it passes ``nnx.remat``).

    ``keys`` [B, N, K] int32: the key column of slot ``j`` of query block ``n`` (clamped to 0
    where the window starts before the row; those slots are not ``allowed``);
    ``allowed`` [B, N, Q, K] bool: query ``i`` of block ``n`` may read slot ``j``.
    ``N * Q`` is the row width, ``K`` the window."""

    keys: jax.Array
    allowed: jax.Array

    def dense(self, width: int) -> jax.Array:
        """The ``[B, W, W]`` bool mask this band stands for (models without a banded path)."""
        b, n, q, _ = self.allowed.shape
        onehot = jax.nn.one_hot(self.keys, width, dtype=jnp.int32)  # (B, N, K, W)
        hits = jnp.einsum("bnqk,bnkw->bnqw", self.allowed.astype(jnp.int32), onehot)
        return (hits > 0).reshape(b, n * q, width)


def band_keys(rows: int, width: int, block: int, window: int) -> np.ndarray:
    """``[rows, width // block, window]`` int32: block ``n`` reads columns
    ``(n + 1) * block - window .. (n + 1) * block - 1`` (-1 before the row's start)."""
    ends = (np.arange(width // block) + 1) * block
    cols = ends[:, None] - window + np.arange(window)[None, :]
    return np.broadcast_to(np.where(cols >= 0, cols, -1).astype(np.int32), (rows, *cols.shape)).copy()


def band_window(reach: int, width: int, block: int) -> int | None:
    """The window (a power-of-two number of blocks, so that few programs compile) that covers
    a reach of ``reach`` columns from any query of a block, or None when a band would not save
    at least half of the dense scores (or ``block`` does not divide ``width``)."""
    if width % block:
        return None
    needed = -(-(reach + block) // block)  # blocks: the query's own and those its reach spans
    window = (1 << (needed - 1).bit_length()) * block
    return window if 2 * window <= width else None


def banded_mask(keys: jax.Array, segments: jax.Array, prefix_segments: jax.Array | None) -> Banded:
    """The band of ``core.data.context_parallel.attention_allowed`` (causal in column order,
    within the query's segment or the one ``prefix_segments`` names) on the ``band_keys``
    columns ``keys`` [B, N, K]; ``segments`` / ``prefix_segments`` [B, W]."""
    b, n, k = keys.shape
    width = segments.shape[1]
    q = width // n
    clamped = jnp.maximum(keys, 0)
    key_seg = jnp.take_along_axis(segments, clamped.reshape(b, n * k), axis=1).reshape(b, n, 1, k)
    q_cols = jnp.arange(width, dtype=jnp.int32).reshape(1, n, q, 1)
    q_seg = segments.reshape(b, n, q, 1)
    same = key_seg == q_seg
    if prefix_segments is not None:
        same = same | (key_seg == prefix_segments.reshape(b, n, q, 1))
    k_cols = keys[:, :, None, :]
    return Banded(keys=clamped, allowed=(k_cols >= 0) & (k_cols <= q_cols) & same)


def banded_attention(q: jax.Array, k: jax.Array, v: jax.Array, band: Banded, scale: float) -> jax.Array:
    """Grouped-query softmax attention of ``layers.attend``, block by block over the band.

    q [B, T, H, D]; k, v [B, T, KV, D]; ``band`` of ``N`` blocks of ``T / N`` queries and ``K``
    keys.  Returns [B, T, H, D] in q's dtype.  Head-major like ``attend``: a KV head's ``G``
    query heads are folded into its query rows (t-major), scores in float32, masked with the
    finite float32 minimum."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    _, n, w = band.keys.shape
    blk = t // n
    qh = q.reshape(b, n, blk, kv, g, d).transpose(0, 3, 1, 2, 4, 5).reshape(b, kv, n, blk * g, d)
    flat = band.keys.reshape(b, n * w)

    def gather(x: jax.Array) -> jax.Array:  # (B, T, KV, D) -> (B, KV, N, K, D)
        return jnp.take_along_axis(x, flat[:, :, None, None], axis=1).reshape(b, n, w, kv, d).transpose(0, 3, 1, 2, 4)

    kh, vh = gather(k), gather(v)
    scores = jnp.einsum("bknqd,bknsd->bknqs", qh, kh, preferred_element_type=jnp.float32) * scale
    rows = jnp.repeat(band.allowed, g, axis=2)[:, None]  # (B, 1, N, Q * G, K): row i * G + g is query i
    scores = jnp.where(rows, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bknqs,bknsd->bknqd", probs, vh)  # (B, KV, N, Q * G, D)
    return out.reshape(b, kv, n, blk, g, d).transpose(0, 2, 3, 1, 4, 5).reshape(b, t, h, d)
