"""``policy.numerics: exact`` for the JAX backend: the Llama-family forward (llama, qwen2,
qwen3; ``llama.CausalLM``'s parameters as they are) with every reduction on fixed shapes.

XLA picks the code of a dot, a reduction or a vectorised ``exp`` from the array's shape, so
a token's bits change with the batch, the padding and the decode step.  Here every
per-token computation runs as a loop over tiles of ``ROW_TILE`` token rows
(:func:`row_map`): each iteration is one fixed-shape computation whatever the row count,
and a row's result depends on the row alone.  Attention runs over tiles of queries of one
(row, kv head) and key blocks at absolute positions (``core.kernels.exact``), the blocks in
a loop too.  The loops' trip counts are hidden from XLA in the forward-only programs
(logprobs, decoding): a loop XLA knows runs once is inlined into its caller and fused
with its neighbours, which could change its code; the training forward, which must be
differentiable, uses ``lax.map`` / a static ``fori_loop`` (the same tile functions).

The tile functions are shared by the trainer (:func:`make_exact_logprob_step`, the
gradient step's :func:`exact_apply_fn`) and the sampler (``backends.jax_pjit.exact_generate``):
the same functions on the same shapes compile to the same code in every program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from backends.jax_pjit.models.layers import MLP, KVCache, mask_padded_vocab, rope_inv_freq
from core.kernels.exact import (
    KEY_BLOCK,
    QUERY_TILE,
    ROW_TILE,
    block_scores,
    online_softmax_init,
    online_softmax_result,
    online_softmax_update,
    padded,
)
from core.kernels.logprobs import logprobs_from_logits
from core.parallel_dims import FSDP

#: Families whose layers this module computes (dense, full attention).
EXACT_FAMILIES = ("llama", "qwen2", "qwen3")
#: Attention items (query tiles of one row and kv head) per loop iteration.
ATTENTION_ITEMS = 16
_HIGHEST = lax.Precision.HIGHEST


# --------------------------------------------------------------------------- loops over tiles


def _hidden_count(n: int) -> jax.Array:
    """``n`` as a traced int32 XLA cannot see through (a loop bound it cannot fold)."""
    return lax.optimization_barrier(jnp.asarray(n, jnp.int32))


def row_map(f: Callable, *arrays: jax.Array, tile: int = ROW_TILE, differentiable: bool = False) -> Any:
    """``f`` over tiles of ``tile`` rows of ``arrays`` (same leading size M), results joined
    back to M rows.  The rows are padded with zeros to whole tiles (the padding dropped).

    The tiles carry one spare all-zero tile: with a single tile the loop's slice would be
    the whole array, which XLA hoists out of the loop and compiles with its neighbours (other
    code, other bits); the barrier keeps XLA from sinking the padding into the loop."""
    m = arrays[0].shape[0]
    count = padded(m, tile) // tile
    tiles = lax.optimization_barrier(
        [_pad_rows(a, (count + 1) * tile).reshape(count + 1, tile, *a.shape[1:]) for a in arrays]
    )
    if differentiable:
        out = jax.tree.map(lambda o: o[:count], lax.map(lambda xs: f(*xs), tiles))
    else:
        out = _loop_map(f, tiles, count)
    return jax.tree.map(lambda o: o.reshape(count * tile, *o.shape[2:])[:m], out)


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
    return a if a.shape[0] == rows else jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


def _loop_map(f: Callable, tiles: list[jax.Array], count: int) -> Any:
    shapes = jax.eval_shape(f, *[t[0] for t in tiles])
    out = jax.tree.map(lambda s: jnp.zeros((count + 1, *s.shape), s.dtype), shapes)

    def body(i, out):
        res = f(*[lax.dynamic_index_in_dim(t, i, keepdims=False) for t in tiles])
        return jax.tree.map(lambda o, r: lax.dynamic_update_index_in_dim(o, r, i, 0), out, res)

    return jax.tree.map(lambda o: o[:count], lax.fori_loop(0, _hidden_count(count), body, out))


def _block_loop(count: int, body: Callable, carry: Any, differentiable: bool) -> Any:
    return lax.fori_loop(0, count if differentiable else _hidden_count(count), body, carry)


def on_own_rows(fn: Callable, mesh: Mesh | None, rows: int, row_args: int) -> Callable:
    """``fn(params, *row_arrays)`` run by every device of ``mesh`` on its own rows, with whole
    parameters: the rows split over ``fsdp`` when it divides them (as the worker places
    them), else every device runs them all.  Left to XLA's partitioner, a tile's rows or a
    matmul's ``K`` could be split over devices, which changes the reductions."""
    if mesh is None:
        return fn
    spec = P(FSDP) if rows % mesh.shape[FSDP] == 0 else P()
    # check_vma off: the tile loops start from fresh zeros (unvarying) and fill them with
    # per-device rows (varying); the outputs are per-device rows by construction.
    return jax.shard_map(fn, mesh=mesh, in_specs=(P(),) + (spec,) * row_args, out_specs=spec, check_vma=False)


# --------------------------------------------------------------------------- per-tile layers


def _dense(x: jax.Array, kernel: jax.Array, n_in: int, dtype) -> jax.Array:
    """``Dense`` in float32 on ``dtype``-rounded operands (bf16 products are exact in f32)."""
    x32 = x.astype(dtype).astype(jnp.float32)
    k32 = kernel.astype(dtype).astype(jnp.float32)
    return jnp.tensordot(x32, k32, axes=n_in, precision=_HIGHEST).astype(dtype)


def _add_bias(y: jax.Array, bias: Any, dtype) -> jax.Array:
    if bias is None:
        return y
    return (y.astype(jnp.float32) + bias[...].astype(dtype).astype(jnp.float32)).astype(dtype)


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype) -> jax.Array:
    """``layers.RMSNorm`` on a tile."""
    h = x.astype(jnp.float32)
    h = h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return (h.astype(dtype).astype(jnp.float32) * scale.astype(dtype).astype(jnp.float32)).astype(dtype)


def _rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, dtype) -> jax.Array:
    """x [T, N, D] rotated to ``positions`` [T] (``layers.rope_cos_sin`` / ``apply_rope``)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq  # (T, D/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # (T, 1, D)
    cos, sin = jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def _attention_inputs(layer, cfg, dtype, h: jax.Array, positions: jax.Array):
    """Tile [T, E] (and positions [T]) -> rotated q [T, H, D], k [T, KV, D], v [T, KV, D]."""
    attn = layer.self_attn
    x = _rms_norm(h, layer.input_layernorm.scale[...], cfg.rms_norm_eps, dtype)
    q = _add_bias(_dense(x, attn.q_proj.kernel[...], 1, dtype), attn.q_proj.bias, dtype)
    k = _add_bias(_dense(x, attn.k_proj.kernel[...], 1, dtype), attn.k_proj.bias, dtype)
    v = _add_bias(_dense(x, attn.v_proj.kernel[...], 1, dtype), attn.v_proj.bias, dtype)
    if cfg.qk_norm:
        q = _rms_norm(q, attn.q_norm.scale[...], cfg.rms_norm_eps, dtype)
        k = _rms_norm(k, attn.k_norm.scale[...], cfg.rms_norm_eps, dtype)
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    return _rope(q, positions, inv_freq, dtype), _rope(k, positions, inv_freq, dtype), v


def _attention_output_and_mlp(layer, cfg, dtype, h: jax.Array, attended: jax.Array) -> jax.Array:
    """Tile: residual [T, E] + o_proj(attended [T, H, D]), then the post-norm SwiGLU MLP."""
    h = h + _dense(attended, layer.self_attn.o_proj.kernel[...], 2, dtype)
    x = _rms_norm(h, layer.post_attention_layernorm.scale[...], cfg.rms_norm_eps, dtype)
    mlp = layer.mlp
    gate = _dense(x, mlp.gate_proj.kernel[...], 1, dtype).astype(jnp.float32)
    up = _dense(x, mlp.up_proj.kernel[...], 1, dtype).astype(jnp.float32)
    act = (gate * jax.nn.sigmoid(gate) * up).astype(dtype)
    return h + _dense(act, mlp.down_proj.kernel[...], 1, dtype)


def _logits_tile(model, h: jax.Array) -> jax.Array:
    """Tile [T, E] -> logits [T, Vp] in the compute dtype (final norm, LM head, padded vocab masked)."""
    cfg, dtype = model.cfg, model.dtype
    x = _rms_norm(h, model.norm.scale[...], cfg.rms_norm_eps, dtype)
    if model.lm_head is None:
        logits = _dense(x, model.embed_tokens.embedding[...].T, 1, dtype)
    else:
        logits = _dense(x, model.lm_head.kernel[...], 1, dtype)
    return mask_padded_vocab(logits, cfg.vocab_size) if cfg.is_vocab_padded else logits


def scaled_logits(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """``apply_temperature`` with a traced temperature (float32 scalar), in the logits' dtype."""
    return logits / temperature.astype(logits.dtype)


def _logprob_tile(temperature: jax.Array, logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Tile: logits [T, Vp], targets [T] -> log p(target) [T] float32 at ``temperature``."""
    scaled = scaled_logits(logits, temperature)
    return logprobs_from_logits(scaled[:, None, :], targets[:, None])[:, 0].astype(jnp.float32)


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: jax.Array, differentiable: bool = False):
    """Rows of logits [M, Vp] and targets [M] -> [M] float32 (the exact logprob kernel)."""
    return row_map(functools.partial(_logprob_tile, temperature), logits, targets, differentiable=differentiable)


def output_logits(model, h: jax.Array, differentiable: bool = False) -> jax.Array:
    """Hidden rows [M, E] -> logits [M, Vp]."""
    return row_map(functools.partial(_logits_tile, model), h, differentiable=differentiable)


# --------------------------------------------------------------------------- attention


def _fixed_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum("...ij,...jk->...ik", a, b, precision=_HIGHEST)


def blocked_attention(q, keys, values, q_positions, scale: float, differentiable: bool = False) -> jax.Array:
    """Causal GQA: q [B, T, H, D] at ``q_positions`` [B, T]; keys / values [B, L, KV, D] at
    positions 0..L-1 -> [B, T, H, D] float32, batch invariant (``core.kernels.exact``)."""
    b, t, h, d = q.shape
    kv = keys.shape[2]
    g = h // kv
    rows = t * g
    tiles = padded(rows, QUERY_TILE) // QUERY_TILE
    q_rows = q.reshape(b, t, kv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kv, rows, d)  # position-major
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, tiles * QUERY_TILE - rows), (0, 0)))
    pos = jnp.pad(jnp.repeat(q_positions, g, axis=1), ((0, 0), (0, tiles * QUERY_TILE - rows)))
    items = b * kv * tiles
    q_items = q_rows.reshape(items, QUERY_TILE, d)
    pos_items = jnp.broadcast_to(pos.reshape(b, 1, tiles, QUERY_TILE), (b, kv, tiles, QUERY_TILE))
    item_row = jnp.repeat(jnp.arange(b), kv * tiles)
    item_head = jnp.tile(jnp.repeat(jnp.arange(kv), tiles), b)
    length = padded(keys.shape[1], KEY_BLOCK)
    keys, values = (jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0))) for x in (keys, values))
    attend = functools.partial(_attend_items, keys, values, scale, length // KEY_BLOCK, differentiable)
    out = row_map(
        attend,
        q_items,
        pos_items.reshape(items, QUERY_TILE),
        item_row,
        item_head,
        tile=ATTENTION_ITEMS,
        differentiable=differentiable,
    )
    out = out.reshape(b, kv, tiles * QUERY_TILE, d)[:, :, :rows]
    return out.reshape(b, kv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)


def _attend_items(keys, values, scale, blocks, differentiable, q, positions, rows, heads):
    """Items' queries [C, QT, D] against their (row, kv head)'s key blocks, in order."""
    q = q.astype(jnp.float32)

    def fold(j, carry):
        columns = j * KEY_BLOCK + jnp.arange(KEY_BLOCK)
        k_block = keys[rows[:, None], columns[None, :], heads[:, None]].astype(jnp.float32)  # (C, KB, D)
        v_block = values[rows[:, None], columns[None, :], heads[:, None]].astype(jnp.float32)
        scores = block_scores(q, jnp.swapaxes(k_block, -1, -2), positions, j * KEY_BLOCK, scale, _fixed_matmul)
        return online_softmax_update(carry, scores, v_block, _fixed_matmul)

    return online_softmax_result(_block_loop(blocks, fold, online_softmax_init(q), differentiable))


# --------------------------------------------------------------------------- the forward


def check_exact_model(model) -> None:
    """Refuse a model whose layers this module does not compute (ValueError naming it)."""
    family = model.cfg.family
    if family not in EXACT_FAMILIES:
        raise ValueError(
            f"policy.numerics=exact: the JAX {family!r} family is not covered (exact layers exist for "
            f"{', '.join(EXACT_FAMILIES)})"
        )
    if any(not isinstance(layer.mlp, MLP) for layer in model.layers):
        raise ValueError("policy.numerics=exact: mixture-of-experts layers have no exact form")


def exact_hidden(model, input_ids, positions, cache: KVCache | None = None, differentiable: bool = False):
    """Hidden rows [B*T, E] (before the final norm) of ``input_ids`` [B, T] at ``positions``
    [B, T]; with ``cache`` (per layer (k, v) [B, L, KV, D]) the new keys / values are written
    at the columns of their positions and attention reads the whole cache.  Returns
    (hidden, new cache or None)."""
    cfg, dtype = model.cfg, model.dtype
    b, t = input_ids.shape
    h = jnp.take(model.embed_tokens.embedding[...], input_ids.reshape(-1), axis=0).astype(dtype)
    flat_pos = positions.reshape(-1)
    new_cache = []
    for i, layer in enumerate(model.layers):
        q, k, v = row_map(
            functools.partial(_attention_inputs, layer, cfg, dtype), h, flat_pos, differentiable=differentiable
        )
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        k, v = (x.reshape(b, t, cfg.num_kv_heads, cfg.head_dim) for x in (k, v))
        if cache is not None:
            k, v = (_write(c, x, positions) for c, x in zip(cache[i], (k, v), strict=True))
            new_cache.append((k, v))
        attended = blocked_attention(q, k, v, positions, cfg.head_dim**-0.5, differentiable).astype(dtype)
        h = row_map(
            functools.partial(_attention_output_and_mlp, layer, cfg, dtype),
            h,
            attended.reshape(b * t, cfg.num_heads, cfg.head_dim),
            differentiable=differentiable,
        )
    return h, (tuple(new_cache) if cache is not None else None)


def _write(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """cache [B, L, KV, D] with ``new`` [B, T, KV, D] at columns ``positions`` [B, T]."""
    rows = jnp.arange(new.shape[0])[:, None]
    return cache.at[rows, positions].set(new.astype(cache.dtype))


def exact_next_logprobs(model, mesh: Mesh | None = None) -> tuple[Callable, Any]:
    """``(fn, params)``: ``fn(params, input_ids [B, S], temperature, differentiable=False)
    -> [B, S-1] float32`` next-token logprobs at ``temperature`` (a float32 array: a constant
    would let XLA rewrite the division), computed by each device on its own rows
    (``on_own_rows``).

    ``differentiable``: the training forward.  Its value is the forward-only computation
    itself (the logprob step's and the sampler's loops, so the same bits: a differentiable
    loop -- ``lax.map``, a static ``fori_loop`` -- compiles with the backward pass's
    residuals and gave a token a different last bit now and then), and its gradient is that
    of the same tile functions in differentiable loops, recomputed in the backward pass
    (``jax.custom_vjp``; the forward is thus always rematerialised)."""
    check_exact_model(model)
    graphdef, params, *rest = nnx.split(model, nnx.Param, ...)

    def forward(params, ids, temperature, differentiable):
        module = nnx.merge(graphdef, params, *rest)
        b, s = ids.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, :], (b, s))
        h, _ = exact_hidden(module, ids, positions, differentiable=differentiable)
        targets = jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1).reshape(-1)
        logits = output_logits(module, h, differentiable)
        return token_logprobs(logits, targets, temperature, differentiable).reshape(b, s)[:, :-1]

    @jax.custom_vjp
    def trained(params, ids, temperature):
        return forward(params, ids, temperature, False)

    def trained_fwd(params, ids, temperature):
        return forward(params, ids, temperature, False), (params, ids, temperature)

    def trained_bwd(residuals, cotangent):
        params, ids, temperature = residuals
        _, vjp = jax.vjp(lambda p: forward(p, ids, temperature, True), params)
        return (*vjp(cotangent), None, None)

    trained.defvjp(trained_fwd, trained_bwd)

    def local(differentiable, shared, input_ids):
        params, temperature = shared
        if differentiable:
            return trained(params, input_ids, temperature)
        return forward(params, input_ids, temperature, False)

    def fn(params, input_ids, temperature, differentiable=False):
        run = on_own_rows(functools.partial(local, differentiable), mesh, input_ids.shape[0], 1)
        return run((params, temperature), input_ids)

    return fn, params
