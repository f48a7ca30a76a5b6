"""KV-cache generation for the JAX backend, returning the torch backends' ``GenerationOutputSpec``.

Same conventions as ``backends.torch_common.generation.hf_generate`` (numpy instead of
torch; the worker converts):

* ``output_ids`` [B, S + N]: the row's valid prompt tokens, its generated tokens, then
  ``pad_token_id`` (N = max_new_tokens; the width never depends on when rows stopped).
* ``generation_lengths`` [B]: generated tokens up to and including the one that met a
  stop condition (a stop token id, or a stop string completed in the row's generated
  text), else N.  ``unpadded_sequence_lengths`` = input_lengths + generation_lengths.
* ``logprobs`` [B, S + N] float32 in the ``get_logprobs`` layout: 0 on prompt and padding,
  ``log_softmax(raw_logits / temperature)[token]`` at generated positions -- before
  top-k/top-p filtering, at the configured temperature even for greedy decoding.

How it runs.  The right-padded prompts are prefilled in place (no left-padding shuffle):
row b's prompt occupies cache slots ``[0, L_b)`` of a width-S prefill, and its n-th
generated token is written at slot ``S + n`` with RoPE position ``L_b + n`` (see
``CausalLM.decode``).  The cache therefore holds ``S + N - 1`` slots (the last generated
token is never fed back).  Two jitted programs do all the device work:

* ``prefill``: the prompt (T = S) -> cache and the first token per row.  Only the hidden
  state at each row's last prompt position goes through the LM head, so no [B, S, V]
  logits are materialised.
* ``step``: one token per row (T = 1) -> the next token; the step counter, cache index,
  RNG key and per-row done flags live in the (donated) device state, so one program
  serves every step.

Randomness: one key for the batch (``rng``), split every step; or, with ``sample_seeds``,
one key per row that stays fixed and has the token index folded in at every step, so row
b's t-th draw is a function of ``sample_seeds[b]`` and t only (not of the other rows, the
sharding or the call count).  The key's shape (scalar or [B]) picks the scheme when the
programs are traced.

Sampling knobs (temperature, top_k, top_p, min_new_tokens) and the pad id are traced scalars
and the stop token ids a [V] bool mask, so changing them never recompiles; only the shapes
(B, S, N), ``greedy`` and the model's graph are part of the compile key.  A call compiles at most 2
programs per such key.  As with ``steps``, the activation-constraint hook is read when a
program is traced (the worker installs the same mesh's hook around every call); it is
deliberately not a compile key, since the worker builds a fresh hook closure per call.

A host loop dispatches the steps and stops early once every row is done.  It reads the
previous step's done flags (and, when stop strings are configured, its tokens) while the
next step is already queued, so the device never idles on the host; at most one extra
step is computed, and it changes nothing (finished rows are frozen).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from backends.jax_pjit.models.layers import KVCache, constrain
from backends.jax_pjit.models.llama import CausalLM
from core.generation.sampling import assemble_padded
from core.kernels.logprobs import logprobs_from_logits
from core.policy import generation_args as rules
from core.policy.generation_config import GenerationConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DecodeFns",
    "DecodeState",
    "make_decode_fns",
    "generate",
    "sample_token",
    "filter_logits",
    "row_keys",
    "compile_cache_sizes",
]


# --------------------------------------------------------------------------- device state


class DecodeState(NamedTuple):
    """Everything the step program reads and writes (a pytree; donated to each step).

    count: scalar int32, tokens generated so far (the next one goes to column ``count``).
    key: one PRNG key (split once per step) or [B] per-row keys (fixed; see ``_draw_keys``).
    """

    cache: KVCache  # per layer (k, v) [B, S + N - 1, KV, D]
    slot_mask: jax.Array  # [B, S + N - 1] int32: 1 on slots holding real tokens
    input_lengths: jax.Array  # [B] int32
    last_token: jax.Array  # [B] int32, fed to the next step
    count: jax.Array  # type: ignore[assignment]  # scalar int32 (the field shadows tuple.count)
    key: jax.Array  # PRNG key (scalar, split once per step) or [B] per-row keys
    done: jax.Array  # [B] bool: row met a stop token (its later tokens are pad)
    gen_lengths: jax.Array  # [B] int32: N until a stop token is hit
    tokens: jax.Array  # [B, N] int32 generated tokens (pad after a row's end)
    logprobs: jax.Array  # [B, N] float32


class StepAux(NamedTuple):
    """Small per-step outputs the host reads (kept out of the donated state)."""

    done: jax.Array  # [B] bool after this step
    token: jax.Array  # [B] int32 generated by this step


# --------------------------------------------------------------------------- sampling


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p (nucleus) filtering of [B, V] float32 logits; removed entries -> -inf.

    ``top_k`` <= 0 and ``top_p`` >= 1 are "off" (both may be traced).  As HF's warpers:
    top-k keeps every logit >= the k-th largest (ties kept); top-p then keeps the smallest
    set of highest-probability tokens, of the top-k-filtered distribution, whose mass
    reaches ``top_p`` (the most likely token is always kept).  One sort serves both.
    """
    vocab = logits.shape[-1]
    neg_inf = jnp.asarray(-jnp.inf, logits.dtype)
    sorted_desc = -jnp.sort(-logits, axis=-1)  # (B, V)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab).astype(jnp.int32)
    kth = jax.lax.dynamic_slice_in_dim(sorted_desc, k - 1, 1, axis=-1)  # (B, 1)
    sorted_desc = jnp.where(sorted_desc < kth, neg_inf, sorted_desc)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of strictly better tokens
    keep = (mass_before < top_p) | (top_p >= 1.0)
    keep = keep.at[:, 0].set(True)
    n_keep = jnp.sum(keep, axis=-1, keepdims=True)  # keep is a prefix of the sorted order
    threshold = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)  # (B, 1); -inf if top-p keeps all
    threshold = jnp.maximum(threshold, kth)  # top-k's own cut
    return jnp.where(logits < threshold, neg_inf, logits)


def sample_token(
    logits: jax.Array, key: jax.Array, knobs: Mapping[str, jax.Array], greedy: bool, banned: jax.Array | None = None
):
    """Next token and its logprob from raw logits [B, V] (model compute dtype).

    ``key``: one key for the whole batch, or [B] keys (row b draws with ``key[b]`` only).
    ``banned``: a [V] bool mask of tokens never drawn (the stop tokens while a row is shorter
    than ``min_new_tokens``), applied before filtering as HF's ``min_new_tokens``.
    Returns (token [B] int32, logprob [B] float32).  The logprob is the ``get_logprobs``
    one: ``apply_temperature`` in the logits' dtype, then an fp32 log-softmax, unfiltered
    and unmasked.
    """
    temperature = knobs["temperature"]
    scaled = logits / temperature.astype(logits.dtype)  # as apply_temperature (a weak scalar)
    drawn = logits if banned is None else jnp.where(banned[None, :], jnp.asarray(-jnp.inf, logits.dtype), logits)
    if greedy:
        token = jnp.argmax(drawn, axis=-1)
    else:
        # HF samples in float32: temperature, then top-k, then top-p.
        warped = filter_logits(drawn.astype(jnp.float32) / temperature, knobs["top_k"], knobs["top_p"])
        if key.ndim == 0:
            token = jax.random.categorical(key, warped, axis=-1)
        else:  # per-row keys: each row's Gumbel noise comes from its own key
            token = jax.vmap(jax.random.categorical)(key, warped)
    token = token.astype(jnp.int32)
    logprob = logprobs_from_logits(scaled[:, None, :], token[:, None])[:, 0].astype(jnp.float32)
    return token, logprob


def _draw_keys(key: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(key to carry to the next step, key(s) to sample the ``count``-th token with).

    A single key is split (one stream for the batch, so a row's draw depends on its
    position in the batch).  Per-row keys [B] are carried unchanged and the token index is
    folded in, so the draw of row b's ``count``-th token depends on its own key only.
    """
    if key.ndim == 0:
        carry, sub = jax.random.split(key)
        return carry, sub
    return key, jax.vmap(jax.random.fold_in, in_axes=(0, None))(key, count)


def _typed_key(key: jax.Array) -> jax.Array:
    """A typed key (shape ()) from a typed or legacy raw (``PRNGKey``, uint32 [2]) key:
    the programs tell one batch key from per-row keys by the key array's shape."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key)


def row_keys(sample_seeds: Any, batch: int) -> jax.Array:
    """[B] PRNG keys ``jax.random.key(sample_seeds[b])`` (seeds checked by the rule every
    engine shares: ``checked_sample_seeds``)."""
    return jax.vmap(jax.random.key)(rules.checked_sample_seeds(sample_seeds, batch).astype(np.uint32))


def _record(state: DecodeState, token, logprob, knobs, stop_mask, cache, slot_mask, key) -> tuple:
    """Write this step's token (pad for finished rows) into column ``count``; update stop flags."""
    alive = ~state.done
    token = jnp.where(alive, token, knobs["pad_token_id"]).astype(jnp.int32)
    logprob = jnp.where(alive, logprob, 0.0).astype(jnp.float32)
    n = state.count
    hit = alive & stop_mask[token]
    new = DecodeState(
        cache=cache,
        slot_mask=slot_mask,
        input_lengths=state.input_lengths,
        last_token=token,
        count=n + 1,
        key=key,
        done=state.done | hit,
        gen_lengths=jnp.where(hit, n + 1, state.gen_lengths).astype(jnp.int32),
        tokens=jax.lax.dynamic_update_slice(state.tokens, token[:, None], (0, n)),
        logprobs=jax.lax.dynamic_update_slice(state.logprobs, logprob[:, None], (0, n)),
    )
    return _constrain_state(new), StepAux(done=new.done, token=token)


#: Logical axes of the state's per-row arrays (by rank); the cache uses CACHE_AXES.
_ROW_AXES = {0: (), 1: ("batch",), 2: ("batch", "seq")}
CACHE_AXES = ("batch", "seq", "act_heads", "head_dim")


def _constrain_state(state: DecodeState) -> DecodeState:
    """Pin the layout of everything the step carries (when a sharding hook is installed).

    The prefill's outputs are the first step's inputs and each step's outputs the next
    one's; ``jit`` keys its cache on input shardings, so both programs must emit the same
    layout or the second step would compile a third program.
    """
    cache = tuple((constrain(k, CACHE_AXES), constrain(v, CACHE_AXES)) for k, v in state.cache)
    rows = {
        name: constrain(x, _ROW_AXES[x.ndim]) for name, x in state._asdict().items() if name not in ("cache", "key")
    }
    return state._replace(cache=cache, **rows)


# --------------------------------------------------------------------------- the two programs


def _prefill_last_hidden(model: CausalLM, input_ids, positions, cache, slot_mask, last_index):
    """``CausalLM.decode`` at cache index 0, but returning only the hidden state at
    ``last_index`` [B] (each row's last prompt token): [B, 1, E], and the filled cache.

    Same computation as ``decode`` up to the LM head, which is then applied to B rows
    instead of B x S (the [B, S, V] prefill logits would dominate memory).
    """
    h, new_cache = model.decode_hidden(input_ids, positions, cache, 0, slot_mask)  # (B, T, E)
    h_last = jnp.take_along_axis(h, last_index[:, None, None].astype(jnp.int32), axis=1)  # (B, 1, E)
    return h_last, new_cache


def _banned(stop_mask: jax.Array, count: jax.Array, knobs: Mapping[str, jax.Array]) -> jax.Array:
    """The stop tokens while ``count`` (tokens generated so far) < ``min_new_tokens``, else none."""
    return stop_mask & (count < knobs["min_new_tokens"])


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy", "max_new_tokens"))
def _prefill(
    params, rest, input_ids, input_lengths, stop_mask, knobs, key, *, graphdef, greedy: bool, max_new_tokens: int
):
    """Prompt [B, S] -> (DecodeState after the first generated token, StepAux)."""
    model = nnx.merge(graphdef, params, rest)
    batch, width = input_ids.shape
    max_len = width + max_new_tokens - 1
    input_lengths = input_lengths.astype(jnp.int32)
    valid = jnp.arange(width)[None, :] < input_lengths[:, None]  # (B, S)
    ids = jnp.where(valid, input_ids, 0).astype(jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :], (batch, width))
    slot_mask = jnp.concatenate([valid.astype(jnp.int32), jnp.zeros((batch, max_new_tokens - 1), jnp.int32)], axis=1)
    cache = model.init_cache(batch, max_len)
    h_last, cache = _prefill_last_hidden(model, ids, positions, cache, slot_mask, input_lengths - 1)
    logits = model._logits(h_last)[:, 0]  # (B, V)
    key, sub = _draw_keys(key, jnp.zeros((), jnp.int32))
    token, logprob = sample_token(logits, sub, knobs, greedy, _banned(stop_mask, jnp.zeros((), jnp.int32), knobs))
    state = DecodeState(
        cache=cache,
        slot_mask=slot_mask,
        input_lengths=input_lengths,
        last_token=jnp.zeros((batch,), jnp.int32),
        count=jnp.zeros((), jnp.int32),
        key=key,
        done=jnp.zeros((batch,), bool),
        gen_lengths=jnp.full((batch,), max_new_tokens, jnp.int32),
        tokens=jnp.full((batch, max_new_tokens), knobs["pad_token_id"], jnp.int32),
        logprobs=jnp.zeros((batch, max_new_tokens), jnp.float32),
    )
    return _record(state, token, logprob, knobs, stop_mask, cache, slot_mask, key)


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy"), donate_argnames=("state",))
def _step(params, rest, state: DecodeState, stop_mask, knobs, *, graphdef, greedy: bool):
    """Feed each row's last token (slot S + count - 1, position L_b + count - 1); sample the next."""
    model = nnx.merge(graphdef, params, rest)
    max_len = state.slot_mask.shape[1]
    width = max_len - state.tokens.shape[1] + 1  # S
    slot = width + state.count - 1
    slot_mask = jnp.where(jnp.arange(max_len)[None, :] == slot, 1, state.slot_mask).astype(jnp.int32)
    positions = (state.input_lengths + state.count - 1)[:, None]  # (B, 1)
    logits, cache = model.decode(state.last_token[:, None], positions, state.cache, slot, slot_mask)
    key, sub = _draw_keys(state.key, state.count)
    token, logprob = sample_token(logits[:, 0], sub, knobs, greedy, _banned(stop_mask, state.count, knobs))
    return _record(state, token, logprob, knobs, stop_mask, cache, slot_mask, key)


@dataclasses.dataclass(frozen=True, eq=False)
class DecodeFns:
    """A model's static graph plus the two jitted programs (shared across models of the same
    graph: the jit caches key on ``graphdef``)."""

    graphdef: Any
    rest: Any  # non-Param state (empty for CausalLM)
    params: Any  # the model's own params (used when ``generate`` gets params=None)
    logits_width: int  # the padded vocabulary (padded ids get -inf logits in the model)

    def prefill(self, params, input_ids, input_lengths, stop_mask, knobs, key, *, greedy: bool, max_new_tokens: int):
        return _prefill(
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
        )

    def step(self, params, state: DecodeState, stop_mask, knobs, *, greedy: bool):
        return _step(params, self.rest, state, stop_mask, knobs, graphdef=self.graphdef, greedy=greedy)


def make_decode_fns(model: CausalLM) -> DecodeFns:
    """Split ``model`` once: ``generate(make_decode_fns(model), params, ...)``."""
    # flax types a split by two filters as (graphdef, state, *states): here exactly one more.
    graphdef, params, *others = nnx.split(model, nnx.Param, ...)
    (rest,) = others
    width = model.cfg.padded_vocab_size or model.cfg.vocab_size  # __post_init__ fills it; None only in its type
    return DecodeFns(graphdef=graphdef, rest=rest, params=params, logits_width=width)


def compile_cache_sizes() -> dict[str, int]:
    """Programs compiled so far by the two jitted functions (all models and shapes)."""
    # _cache_size: jax's (private) count of a jitted function's programs; not in JitWrapped's type.
    return {"prefill": _prefill._cache_size(), "step": _step._cache_size()}  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- host side


def _knobs(gen_cfg: GenerationConfig, greedy: bool, pad_token_id: int, min_new: int = 0) -> dict[str, np.generic]:
    temperature = float(gen_cfg.temperature)
    if temperature <= 0:
        raise ValueError(f"generation temperature must be > 0 (use greedy=True for argmax), got {temperature}")
    top_p = gen_cfg.top_p
    top_p = 1.0 if top_p is None else float(top_p)
    top_k = 0  # filter_logits' "off"; greedy decoding never filters
    if not greedy:
        top_k = rules.top_k_or_off(gen_cfg.top_k)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    return dict(
        temperature=np.float32(temperature),
        top_k=np.int32(top_k),
        top_p=np.float32(top_p),
        pad_token_id=np.int32(pad_token_id),
        min_new_tokens=np.int32(min_new),
    )


def _stop_mask(stop_token_ids: Sequence[int], vocab: int) -> np.ndarray:
    mask = np.zeros((vocab,), bool)
    ids = [t for t in stop_token_ids if 0 <= t < vocab]  # others can never be generated
    mask[ids] = True
    return mask


def _row_stop_strings(gen_cfg, stop_strings, batch: int) -> list[tuple[str, ...]]:
    """gen_cfg.stop_strings + the row's own strings (de-duplicated, in order)."""
    return rules.row_stop_strings(gen_cfg, stop_strings, batch)


class _StopStrings:
    """Host-side stop-string matching on the generated tokens (decoded tails, like vLLM)."""

    def __init__(self, tokenizer, row_strings: list[tuple[str, ...]], min_new: int = 0):
        self.tokenizer = tokenizer
        self.row_strings = row_strings
        self.min_new = min_new
        self.window = rules.stop_window(row_strings)
        self.history: list[list[int]] = [[] for _ in row_strings]
        self.stopped_at = np.zeros(len(row_strings), np.int64)  # 0: never

    def update(self, tokens: np.ndarray, done_before: np.ndarray, count: int) -> None:
        """``tokens`` [B]: the ``count``-th generated token of every row."""
        for b, strings in enumerate(self.row_strings):
            if not strings or self.stopped_at[b] or done_before[b]:
                continue
            self.history[b].append(int(tokens[b]))
            tail = self.history[b][-self.window :]
            if rules.stop_string_ends_row(self.tokenizer, tail, strings, count, self.min_new):
                self.stopped_at[b] = count


def generate(
    model_or_apply: CausalLM | DecodeFns,
    params: Any,
    input_ids: np.ndarray,
    input_lengths: np.ndarray,
    gen_cfg: GenerationConfig | Mapping[str, Any],
    *,
    greedy: bool,
    pad_token_id: int,
    eos_token_ids: Sequence[int] = (),
    tokenizer=None,
    max_new_tokens: int | None = None,
    min_new_tokens: int | None = None,
    rng: jax.Array | int = 0,
    stop_strings: Sequence[Sequence[str] | str | None] | None = None,
    sample_seeds: Sequence[int] | np.ndarray | None = None,
    batch_size: int | None = None,
    row_budgets: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Continue right-padded prompts; returns the ``GenerationOutputSpec`` as numpy arrays.

    Args:
        model_or_apply: a ``CausalLM`` or ``make_decode_fns(model)`` (reuse the latter to skip
            re-splitting the model every call; the compiled programs are shared either way).
        params: the ``nnx.Param`` state to decode with (e.g. the trained, sharded params);
            ``None`` uses the model's own.
        input_ids: [B, S] right-padded prompts; input_lengths: [B], each in [1, S].
        gen_cfg: temperature, top_k (None/-1 off), top_p (1.0 off), max_new_tokens,
            stop_token_ids, stop_strings.
        greedy: argmax decoding; logprobs still use ``gen_cfg.temperature``.
        pad_token_id: fills padding in ``output_ids``.
        eos_token_ids: stop tokens added to ``gen_cfg.stop_token_ids``.
        tokenizer: required when stop strings are configured.
        max_new_tokens: overrides ``gen_cfg.max_new_tokens``.
        min_new_tokens: overrides ``gen_cfg.min_new_tokens`` (both cut to the max): until a row
            has that many tokens its stop token ids are masked before sampling (logprobs stay
            the unmasked ones) and its stop strings do not end it.
        rng: a PRNG key or an int seed (same key -> same samples); unused with ``sample_seeds``.
        stop_strings: optional per-row extra stop strings (``data['stop_strings']``).
        sample_seeds: optional [B] ints (``data['sample_seeds']``): row b samples with its
            own key (``row_keys``), so its tokens depend on its seed only, not on the
            other rows or ``rng``.  Ignored when ``greedy``.
        batch_size: decode at most this many rows at a time (``policy.generation_batch_size``);
            None = all B rows at once.  Every chunk has this many rows (the last one is
            filled up with copies of a real row, dropped afterwards), so one call compiles
            one program per step kind.  Greedy and ``sample_seeds`` results do not depend on
            it; with one ``rng`` key each chunk samples from its own split of the key.
        row_budgets: [B] each row's own limit of new tokens (<= ``max_new_tokens``;
            ``core.policy.generation_args.with_row_budgets``): rows are cut there.

    Returns:
        ``output_ids`` [B, S+N] int64, ``logprobs`` [B, S+N] float32,
        ``generation_lengths`` [B] and ``unpadded_sequence_lengths`` [B] int64.
    """
    gen_cfg = GenerationConfig.coerce(gen_cfg, "policy.generation")
    fns = model_or_apply if isinstance(model_or_apply, DecodeFns) else make_decode_fns(model_or_apply)
    params = fns.params if params is None else params
    rules.check_prompt_rows(input_ids, input_lengths)
    input_ids, input_lengths = np.asarray(input_ids).astype(np.int64), np.asarray(input_lengths).astype(np.int64)
    batch = input_ids.shape[0]
    new_tokens = gen_cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
    if new_tokens is None or int(new_tokens) <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {new_tokens!r}")
    new_tokens = int(new_tokens)
    min_new = rules.effective_min_new_tokens(gen_cfg, new_tokens, min_new_tokens)
    knobs = _knobs(gen_cfg, greedy, pad_token_id, min_new)
    stop_ids = list(dict.fromkeys([int(t) for t in (gen_cfg.stop_token_ids or [])] + [int(t) for t in eos_token_ids]))
    row_strings = _row_stop_strings(gen_cfg, stop_strings, batch)
    if any(row_strings) and tokenizer is None:
        raise ValueError(
            "stop strings are configured but no tokenizer was given: pass tokenizer= so "
            "generated tokens can be decoded and matched"
        )
    seeds = None if greedy or sample_seeds is None else rules.checked_sample_seeds(sample_seeds, batch)
    chunks = rules.row_chunks(batch, batch_size)
    keys = _chunk_keys(rng, len(chunks)) if seeds is None else [None] * len(chunks)
    stop_mask = _stop_mask(stop_ids, fns.logits_width)
    decode = _Decoder(fns, params, knobs, stop_mask, greedy, new_tokens, tokenizer, min_new)
    width = chunks[0].stop - chunks[0].start
    pieces = []
    for rows, key in zip(chunks, keys, strict=True):
        take = _fill_rows(rows, width)  # every chunk has `width` rows: one compiled shape
        chunk_seeds = None if seeds is None else seeds[take]
        out = decode(
            input_ids[take],
            input_lengths[take],
            [row_strings[i] for i in take],
            row_keys(chunk_seeds, width) if chunk_seeds is not None else key,
        )
        pieces.append(tuple(x[: rows.stop - rows.start] for x in out))
    tokens, token_logprobs, gen_lengths = (np.concatenate(parts) for parts in zip(*pieces, strict=True))
    return assemble_padded(
        input_ids, input_lengths, tokens, token_logprobs, gen_lengths, new_tokens, pad_token_id, row_budgets
    )


def _fill_rows(rows: slice, width: int) -> np.ndarray:
    """The row indices of ``rows``, filled up to ``width`` by repeating its first row (a
    copy finishes exactly when its original does, so it never prolongs the chunk)."""
    idx = np.arange(rows.start, rows.stop)
    return np.concatenate([idx, np.full(width - len(idx), rows.start, idx.dtype)])


def _chunk_keys(rng: jax.Array | int, n_chunks: int) -> list[jax.Array]:
    """One batch key per chunk: the call's key when there is one chunk (unchunked calls
    sample as before); else its splits, so rows of different chunks never share noise."""
    key = jax.random.key(rng) if isinstance(rng, (int, np.integer)) else _typed_key(rng)
    return [key] if n_chunks == 1 else list(jax.random.split(key, n_chunks))


@dataclasses.dataclass(frozen=True)
class _Decoder:
    """What every chunk of one ``generate`` call shares; calling it decodes one chunk."""

    fns: DecodeFns
    params: Any
    knobs: dict[str, np.generic]
    stop_mask: np.ndarray
    greedy: bool
    new_tokens: int
    tokenizer: PreTrainedTokenizerBase | None
    min_new: int = 0

    def __call__(self, input_ids, input_lengths, row_strings, key):
        """Prefill + steps for these rows: (tokens [b, N] int64, logprobs [b, N] float32,
        generation lengths [b] int64) on the host."""
        fns, params, greedy = self.fns, self.params, self.greedy
        matcher = _StopStrings(self.tokenizer, row_strings, self.min_new) if any(row_strings) else None
        batch = input_ids.shape[0]
        state, aux = fns.prefill(
            params,
            input_ids.astype(np.int32),
            input_lengths.astype(np.int32),
            self.stop_mask,
            self.knobs,
            key,
            greedy=greedy,
            max_new_tokens=self.new_tokens,
        )
        count = 1  # tokens generated by the programs dispatched so far (aux describes token `count`)
        done_before = np.zeros(batch, bool)
        while True:
            # Queue the next step before reading the previous one's flags (keeps the device busy).
            nxt = (
                fns.step(params, state, self.stop_mask, self.knobs, greedy=greedy) if count < self.new_tokens else None
            )
            done = np.asarray(aux.done)
            if matcher is not None:
                matcher.update(np.asarray(aux.token), done_before, count)
                finished = bool(np.all(done | (matcher.stopped_at > 0)))
            else:
                finished = bool(done.all())
            done_before = done
            if nxt is None:
                break
            state, aux = nxt
            if finished:  # the queued step ran on finished rows only: it changed nothing that is kept
                break
            count += 1

        tokens, token_logprobs, gen_lengths = jax.device_get((state.tokens, state.logprobs, state.gen_lengths))
        gen_lengths = np.asarray(gen_lengths, np.int64)
        if matcher is not None:
            gen_lengths = np.where(matcher.stopped_at > 0, np.minimum(gen_lengths, matcher.stopped_at), gen_lengths)
        return np.asarray(tokens, np.int64), np.asarray(token_logprobs), gen_lengths
