"""The exact sampler of the JAX backend (``policy.numerics: exact``): KV-cache decoding by the
exact forward (``models.exact``), through ``generate``'s host loop and device state.

Two programs like ``generate``'s (a prefill, then one step per token), with the exact
forward instead of ``CausalLM.decode``:

* the cache holds every key at the column of its position (row b's prompt at 0..L_b-1, its
  k-th new token at L_b + k), where ``generate`` writes new tokens after the whole prompt
  width: attention then visits a query's keys in the key blocks of the training forward;
* the logits, the draw and the reported logprob run in row tiles (``row_map``) with the
  trainer's tile functions: the reported logprob is the one ``get_logprobs`` computes, and
  the token is drawn from the very logits it is computed from (temperature-scaled, top-k /
  top-p filtered, one Gumbel draw per row from the row's own key).

With ``sample_seeds`` a row's tokens depend on its seed only (alone or in any batch); with
one batch key the key is split into one key per row.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from backends.jax_pjit.generate import DecodeFns, DecodeState, _banned, _draw_keys, _record, filter_logits
from backends.jax_pjit.models.exact import (
    check_exact_model,
    exact_hidden,
    on_own_rows,
    output_logits,
    row_map,
    scaled_logits,
    token_logprobs,
)
from backends.jax_pjit.models.llama import CausalLM
from core.kernels.exact import KEY_BLOCK, padded

__all__ = ["ExactDecodeFns", "make_exact_decode_fns"]


def _draw_tile(knobs: Mapping[str, jax.Array], greedy: bool, banned, logits, key_data):
    """Tile: logits [T, Vp] (compute dtype), per-row key data [T, ...] -> tokens [T] int32."""
    neg_inf = jnp.asarray(-jnp.inf, jnp.float32)
    if greedy:
        return jnp.argmax(jnp.where(banned[None, :], neg_inf, logits.astype(jnp.float32)), axis=-1).astype(jnp.int32)
    scores = scaled_logits(logits, knobs["temperature"]).astype(jnp.float32)
    scores = filter_logits(jnp.where(banned[None, :], neg_inf, scores), knobs["top_k"], knobs["top_p"])
    keys = jax.random.wrap_key_data(key_data)
    return jax.vmap(jax.random.categorical)(keys, scores).astype(jnp.int32)


def _row_key_data(key: jax.Array, batch: int) -> jax.Array:
    """Per-row key data [B, ...]: the per-row keys as they are, or one batch key split per row."""
    keys = key if key.ndim == 1 else jax.random.split(key, batch)
    return jax.random.key_data(keys)


def _sample(model, h_rows, key_data, knobs, stop_mask, count, greedy: bool):
    """Hidden rows [B, E] -> (token [B], logprob [B]) through the exact tile functions."""
    logits = output_logits(model, h_rows)  # (B, Vp)
    draw = functools.partial(_draw_tile, knobs, greedy, _banned(stop_mask, count, knobs))
    token = row_map(draw, logits, key_data)
    return token, token_logprobs(logits, token, knobs["temperature"])


def _prefill_rows(graphdef, rest, greedy, new_tokens, shared, ids, lengths, key_data):
    """One device's rows: prompt [b, S] -> (cache, first token [b], its logprob [b])."""
    params, knobs, stop_mask = shared
    model = nnx.merge(graphdef, params, rest)
    batch, width = ids.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :], (batch, width))
    cache = model.init_cache(batch, padded(width + new_tokens, KEY_BLOCK))
    h, cache = exact_hidden(model, ids, positions, cache)
    last = h.reshape(batch, width, -1)[jnp.arange(batch), lengths - 1]  # (b, E)
    token, logprob = _sample(model, last, key_data, knobs, stop_mask, jnp.zeros((), jnp.int32), greedy)
    return cache, token, logprob


def _step_rows(graphdef, rest, greedy, shared, last_token, positions, cache, key_data):
    """One device's rows: each row's last token at its position -> (cache, next token, logprob)."""
    params, knobs, stop_mask, count = shared
    model = nnx.merge(graphdef, params, rest)
    h, cache = exact_hidden(model, last_token[:, None], positions[:, None], cache)
    token, logprob = _sample(model, h, key_data, knobs, stop_mask, count, greedy)
    return cache, token, logprob


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy", "max_new_tokens", "mesh"))
def _exact_prefill(
    params, rest, input_ids, input_lengths, stop_mask, knobs, key, *, graphdef, greedy, max_new_tokens, mesh
):
    """Prompt [B, S] -> (DecodeState after the first generated token, StepAux)."""
    batch, width = input_ids.shape
    lengths = input_lengths.astype(jnp.int32)
    ids = jnp.where(jnp.arange(width)[None, :] < lengths[:, None], input_ids, 0).astype(jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    key, sub = _draw_keys(key, zero)
    rows = functools.partial(_prefill_rows, graphdef, rest, greedy, max_new_tokens)
    cache, token, logprob = on_own_rows(rows, mesh, batch, 3)(
        (params, knobs, stop_mask), ids, lengths, _row_key_data(sub, batch)
    )
    slot_mask = jnp.zeros((batch, 1), jnp.int32)  # unused: positions say which keys a query reads
    state = DecodeState(
        cache=cache,
        slot_mask=slot_mask,
        input_lengths=lengths,
        last_token=jnp.zeros((batch,), jnp.int32),
        count=zero,
        key=key,
        done=jnp.zeros((batch,), bool),
        gen_lengths=jnp.full((batch,), max_new_tokens, jnp.int32),
        tokens=jnp.full((batch, max_new_tokens), knobs["pad_token_id"], jnp.int32),
        logprobs=jnp.zeros((batch, max_new_tokens), jnp.float32),
    )
    return _record(state, token, logprob, knobs, stop_mask, cache, slot_mask, key)


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy", "mesh"), donate_argnames=("state",))
def _exact_step(params, rest, state: DecodeState, stop_mask, knobs, *, graphdef, greedy: bool, mesh):
    """Feed each row's last token at position L_b + count - 1; sample the next."""
    batch = state.last_token.shape[0]
    key, sub = _draw_keys(state.key, state.count)
    rows = functools.partial(_step_rows, graphdef, rest, greedy)
    cache, token, logprob = on_own_rows(rows, mesh, batch, 4)(
        (params, knobs, stop_mask, state.count),
        state.last_token,
        state.input_lengths + state.count - 1,
        state.cache,
        _row_key_data(sub, batch),
    )
    return _record(state, token, logprob, knobs, stop_mask, cache, state.slot_mask, key)


@dataclasses.dataclass(frozen=True, eq=False)
class ExactDecodeFns(DecodeFns):
    """``DecodeFns`` whose two programs are the exact ones (``generate`` runs them as its own);
    ``mesh``: each device decodes its own rows (``on_own_rows``; None: one device)."""

    mesh: Mesh | None = None

    def prefill(self, params, input_ids, input_lengths, stop_mask, knobs, key, *, greedy: bool, max_new_tokens: int):
        return _exact_prefill(
            params,
            self.rest,
            input_ids,
            input_lengths,
            stop_mask,
            knobs,
            key,
            graphdef=self.graphdef,
            greedy=greedy,
            max_new_tokens=max_new_tokens,
            mesh=self.mesh,
        )

    def step(self, params, state: DecodeState, stop_mask, knobs, *, greedy: bool):
        return _exact_step(
            params, self.rest, state, stop_mask, knobs, graphdef=self.graphdef, greedy=greedy, mesh=self.mesh
        )


def make_exact_decode_fns(model: CausalLM, mesh: Mesh | None = None) -> ExactDecodeFns:
    """``make_decode_fns`` for the exact programs (a ValueError for a model they do not cover)."""
    check_exact_model(model)
    graphdef, params, *others = nnx.split(model, nnx.Param, ...)
    (rest,) = others
    width = model.cfg.padded_vocab_size or model.cfg.vocab_size
    return ExactDecodeFns(graphdef=graphdef, rest=rest, params=params, logits_width=width, mesh=mesh)
