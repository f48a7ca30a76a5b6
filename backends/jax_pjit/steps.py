"""Jitted logprob and train steps of the JAX backend, with shape bucketing.

The steps are pure functions of ``(params, batch)``; the model enters as
``apply_fn(params, input_ids, attention_mask, positions) -> logits [B, S, V]``.  The loss
is one of the shared ``core.losses`` objects, called on jax arrays through its
``loss_from_logprobs`` (the same logprob path as ``get_logprobs``: temperature, then
``core.kernels.next_token_logprobs``).

Why buckets: ``jit`` compiles one program per input shape.  Every micro batch is padded
to ``micro_batch_size`` rows (padding rows have ``sample_mask = 0``, so they contribute
nothing) and to a width of a short ladder (``widths``), so a run compiles at most
``len(ladder)`` programs per step kind, however ragged its batches are.  ``CompileCounter``
reports how many were built.

Context parallelism and sequence packing use the ``layout`` steps further down: the rows
carry explicit positions and segments (packed rows: several sequences each), the columns
are permuted for the ``cp`` load balance inside the program, and packed logprobs are
unpacked onto the plain ``[rows, S-1]`` layout before the same ``loss_from_logprobs``.

Gradient accumulation uses the same global normalisation as the torch backends: the
loss of every micro batch is divided by the *global* number of valid tokens (or
sequences) of the step's batch, so the accumulated gradient is the full-batch gradient,
independent of the micro-batch size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from backends.jax_pjit.models.banded_attention import Banded, band_keys, band_window, banded_mask
from backends.jax_pjit.models.layers import constrain
from core.data.context_parallel import attention_allowed, load_balanced_columns, row_segments
from core.data.sequence_packing import PackedRow
from core.data.shared_prompts import prompt_groups
from core.kernels import apply_temperature, logprobs_from_logits, logprobs_to_sequence_layout, next_token_logprobs
from core.kernels.moe import routed_experts_of

if TYPE_CHECKING:
    from core.interfaces import LogprobLossFunction
    from core.losses.router_aux import RouterAux


class ApplyFn(Protocol):
    """``models.make_apply_fn``'s function (``remat`` possibly bound): ``CausalLM.__call__``
    with the params passed in -> logits [B, S, V]."""

    def __call__(
        self,
        params: Any,
        input_ids: jax.Array,
        attention_mask: jax.Array | None,
        positions: jax.Array | None = None,
        allowed: jax.Array | Banded | None = None,
        capture_router: bool = False,
    ) -> Any: ...


def pad_micro_batch(batch: Mapping[str, np.ndarray], rows: int, width: int) -> dict[str, np.ndarray]:
    """Pad every per-row array to ``rows`` rows and every per-token array to ``width``
    columns (zeros; masks therefore exclude the padding).  Inputs are host numpy arrays."""
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        pad = [(0, rows - value.shape[0])] + [(0, 0)] * (value.ndim - 1)
        if value.ndim >= 2:
            pad[1] = (0, width - value.shape[1])
        out[key] = np.pad(value, pad)
    return out


def positions_and_mask(input_lengths: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """``attention_mask`` [B, S] (1 on valid tokens) and ``positions`` [B, S] (0, 1, ...)."""
    pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :], (input_lengths.shape[0], width))
    return pos, (pos < input_lengths[:, None]).astype(jnp.int32)


def make_logprob_step(apply_fn: ApplyFn, temperature: float, route_top_k: int | None = None) -> Callable:
    """``(params, input_ids [B,S], input_lengths [B]) -> logprobs [B,S] float32`` in the
    ``get_logprobs`` layout; with ``route_top_k`` (a MoE policy recording its routing) ``->
    (logprobs, routed_experts [B, S, sparse layers, top_k] int16)``."""

    @jax.jit
    def step(params, input_ids, input_lengths):
        positions, mask = positions_and_mask(input_lengths, input_ids.shape[1])
        if route_top_k is None:
            logits, router = apply_fn(params, input_ids, mask, positions), None
        else:
            logits, router = apply_fn(params, input_ids, mask, positions, capture_router=True)
        next_lp = next_token_logprobs(apply_temperature(logits, temperature), input_ids)
        lp = logprobs_to_sequence_layout(next_lp, input_lengths).astype(jnp.float32)
        if route_top_k is None or router is None:
            return lp
        return lp, routed_experts_of(router, route_top_k).astype(jnp.int16)

    return step


def zero_grads(params: Any) -> Any:
    """A gradient accumulator: zeros shaped *and sharded* like ``params``.

    The sharding must be the one the grad step returns, or the second micro batch would see
    a differently laid-out accumulator and compile a second program.  One program makes every
    leaf: one dispatch per train call, not one per parameter.
    """
    leaves, treedef = jax.tree.flatten(params)
    return _zeros_program(treedef, tuple((x.shape, x.dtype, x.sharding) for x in leaves))()


@functools.lru_cache(maxsize=16)
def _zeros_program(treedef: Any, leaves: tuple[tuple[tuple[int, ...], Any, Any], ...]) -> Callable[[], Any]:
    """The jitted zeros of one params tree (kept: a fresh ``jax.jit`` per call would trace again)."""
    shardings = jax.tree.unflatten(treedef, [sharding for _, _, sharding in leaves])

    def zeros() -> Any:
        return jax.tree.unflatten(treedef, [jnp.zeros(shape, dtype) for shape, dtype, _ in leaves])

    return jax.jit(zeros, out_shardings=shardings)


def value_and_grad_of(micro_loss: Callable, trainable: Any = None) -> Callable:
    """``jax.value_and_grad(micro_loss, has_aux=True)`` with respect to the params (the first
    argument), or -- ``trainable``: an nnx filter (LoRA's adapter type) -- to the params it
    selects only: the others are closed over, get no gradient, and cost no weight-gradient work."""
    if trainable is None:
        return jax.value_and_grad(micro_loss, has_aux=True)
    from flax import nnx

    def grad_fn(params, *args):
        train, frozen = nnx.split_state(params, trainable, ...)
        return jax.value_and_grad(lambda t, *a: micro_loss(nnx.merge_state(t, frozen), *a), has_aux=True)(train, *args)

    return grad_fn


def make_grad_step(
    apply_fn: ApplyFn,
    loss_fn: LogprobLossFunction,
    temperature: float,
    grad_shardings: Any = None,
    trainable: Any = None,
    router_aux: RouterAux | None = None,
    replay: bool = False,
) -> Callable:
    """``(params, grads_acc, batch, global_valid_seqs, global_valid_toks) ->
    (grads_acc + d loss/d params, metrics)`` for one micro batch.

    ``grads_acc`` is donated: the accumulator is updated in place on the devices, and kept
    in ``grad_shardings`` (the params' shardings) so every call reuses one program.
    ``trainable``: differentiate only the params this nnx filter selects (``grads_acc`` and
    ``grad_shardings`` then hold those only).  ``router_aux`` (a MoE model): the forward
    records the router logits and the router's load-balancing loss joins the loss and metrics;
    ``replay``: the sparse layers route every token to the batch's ``routed_experts``.
    """

    def micro_loss(params, batch, gseq, gtok):
        ids = batch["input_ids"]
        positions, mask = positions_and_mask(batch["input_lengths"], ids.shape[1])
        routing = jnp.moveaxis(batch["routed_experts"], 2, 0).astype(jnp.int32) if replay else None
        if router_aux is None:
            logits, router_logits = apply_fn(params, ids, mask, positions), None
        else:
            logits, router_logits = apply_fn(params, ids, mask, positions, capture_router=True, routing=routing)
        next_lp = next_token_logprobs(apply_temperature(logits, temperature), ids)
        loss, metrics = loss_fn.loss_from_logprobs(next_lp, batch, gseq, gtok)
        if router_aux is not None and router_logits is not None:
            loss, metrics = router_aux.add_to(loss, metrics, router_logits, batch, gseq, gtok)
        return loss, metrics

    out_shardings = None if grad_shardings is None else (grad_shardings, None)

    grad_fn = value_and_grad_of(micro_loss, trainable)

    @functools.partial(jax.jit, donate_argnums=(1,), out_shardings=out_shardings)
    def step(params, grads_acc, batch, gseq, gtok):
        (_, metrics), grads = grad_fn(params, batch, gseq, gtok)
        return jax.tree.map(jnp.add, grads_acc, grads), metrics

    return step


# ------------------------------------------------------------ explicit row layouts (CP, packing)
#
# The steps above serve plain right-padded rows on a mesh without context parallelism.  The
# ones below take each row's token ``positions`` and ``segments`` explicitly (the attention
# mask is built from them with ``core.data.context_parallel.attention_allowed``), which
# serves both packed rows (several sequences per row, positions restarting per sequence)
# and context parallelism (``cp`` > 1: the columns are permuted into
# ``load_balanced_columns(width, cp)`` order before the model, so the contiguous split of
# the sequence over the ``cp`` mesh axis gives every device a head and a tail chunk).

ROW_KEYS = ("input_ids", "positions", "segments", "prefix_segments")
MASK_AXES = ("batch", "seq", "kv_seq")
#: Query columns per block of banded attention over packed rows (``packed_micro_batch``).
BAND_BLOCK = 64


def layout_next_logprobs(
    apply_fn: ApplyFn,
    params: Any,
    rows: Mapping[str, jax.Array],
    cp: int,
    temperature: float,
    capture_router: bool = False,
) -> Any:
    """Next-token logprobs ``[B, W-1]`` (column order, compute dtype) of the ``ROW_KEYS`` arrays
    ``rows``: ``input_ids`` ``[B, W]`` whose tokens carry ``positions`` (RoPE) and ``segments`` (attention stays
    within a segment, causal in column order; ``prefix_segments``: the segment each token reads
    as well, a shared prompt's).  Column ``t`` scores ``input_ids[:, t+1]``.

    With ``cp`` > 1 the model sees the columns in load-balanced order (ids, positions and
    the mask follow the permutation); the target of the token at column ``c`` is
    ``input_ids[:, c+1]`` and the logprobs are put back into column order afterwards, so
    the result equals ``cp`` = 1 up to float summation order.  ``capture_router``: returns
    ``(logprobs, router logits [layers, B, W, experts] in column order, or None)``.
    """
    input_ids, positions, segments = rows["input_ids"], rows["positions"], rows["segments"]
    prefix_segments = rows.get("prefix_segments")
    width = input_ids.shape[1]
    cols = load_balanced_columns(width, cp).reshape(-1) if cp > 1 else np.arange(width)
    # Column indices as (small) device constants: the [W, W] comparison is computed by the
    # program instead of being embedded in it.
    dev_cols = jnp.asarray(cols, dtype=jnp.int32)
    allowed: jax.Array | Banded
    if "band_keys" in rows and cp == 1:  # packed rows whose tokens reach back less than half the row
        allowed = banded_mask(rows["band_keys"], segments, prefix_segments)
    else:
        allowed = constrain(attention_allowed(dev_cols, dev_cols, segments, prefix_segments), MASK_AXES)  # (B, W, W)
    ids, pos = (
        (input_ids, positions) if cp == 1 else (jnp.take(input_ids, dev_cols, 1), jnp.take(positions, dev_cols, 1))
    )
    if capture_router:
        logits, router = apply_fn(params, ids, None, pos, allowed=allowed, capture_router=True)
    else:
        logits, router = apply_fn(params, ids, None, pos, allowed=allowed), None
    if cp == 1:
        next_lp = next_token_logprobs(apply_temperature(logits, temperature), input_ids)
        return (next_lp, router) if capture_router else next_lp
    # The last column's target is a dummy in-vocabulary id; its logprob is dropped below.
    targets = jnp.take(input_ids, jnp.asarray(np.minimum(cols + 1, width - 1), jnp.int32), axis=1)
    lp = logprobs_from_logits(apply_temperature(logits, temperature), targets)  # (B, W), permuted
    restore = jnp.asarray(np.argsort(cols), jnp.int32)
    next_lp = jnp.take(lp, restore, axis=1)[:, :-1]
    if not capture_router:
        return next_lp
    return next_lp, None if router is None else jnp.take(router, restore, axis=2)


def unpack_next(next_lp: jax.Array, index: jax.Array, valid: jax.Array) -> jax.Array:
    """Packed next-token logprobs ``[B, W-1]`` -> the unpacked ``[R, S-1]`` layout through a
    flat ``index`` / ``valid`` pair from :func:`packed_micro_batch` (0 where not valid)."""
    return jnp.where(valid, next_lp.reshape(-1)[index], 0.0)


def make_layout_logprob_step(apply_fn: ApplyFn, temperature: float, cp: int) -> Callable:
    """``(params, rows) -> next-token logprobs [B, W-1] float32`` for the ``ROW_KEYS`` arrays
    ``rows`` ([B, W] each); the caller unpacks / lays them out on the host."""

    @jax.jit
    def step(params, rows):
        return layout_next_logprobs(apply_fn, params, rows, cp, temperature).astype(jnp.float32)

    return step


def make_layout_grad_step(
    apply_fn: ApplyFn,
    loss_fn: LogprobLossFunction,
    temperature: float,
    cp: int,
    grad_shardings: Any = None,
    trainable: Any = None,
    router_aux: RouterAux | None = None,
) -> Callable:
    """``(params, grads_acc, rows, batch, global_valid_seqs, global_valid_toks) ->
    (grads_acc + d loss/d params, metrics)``: ``make_grad_step`` for explicit row layouts.

    ``rows`` holds the model's ``ROW_KEYS`` arrays [B, W], and for packed rows also
    ``unpack_index`` / ``unpack_valid`` [R, S-1]: the logprobs are then unpacked onto the
    loss batch's rows first.  ``batch`` is the loss's batch in the plain [R, S] layout, so
    ``loss_fn.loss_from_logprobs`` and the global normalisation are exactly the unpacked ones.
    ``router_aux``: as ``make_grad_step`` (packed rows' router logits mapped back onto the loss
    batch's rows through ``token_index``).
    """

    def micro_loss(params, rows, batch, gseq, gtok):
        out = layout_next_logprobs(apply_fn, params, rows, cp, temperature, capture_router=router_aux is not None)
        next_lp, router_logits = out if router_aux is not None else (out, None)
        if "unpack_index" in rows:
            next_lp = unpack_next(next_lp, rows["unpack_index"], rows["unpack_valid"])
        loss, metrics = loss_fn.loss_from_logprobs(next_lp, batch, gseq, gtok)
        if router_aux is None or router_logits is None:
            return loss, metrics
        if "token_index" in rows:  # packed rows -> the loss batch's rows
            layers, experts = router_logits.shape[0], router_logits.shape[-1]
            router_logits = router_logits.reshape(layers, -1, experts)[:, rows["token_index"]]
        return router_aux.add_to(loss, metrics, router_logits, batch, gseq, gtok)

    out_shardings = None if grad_shardings is None else (grad_shardings, None)

    grad_fn = value_and_grad_of(micro_loss, trainable)

    @functools.partial(jax.jit, donate_argnums=(1,), out_shardings=out_shardings)
    def step(params, grads_acc, rows, batch, gseq, gtok):
        (_, metrics), grads = grad_fn(params, rows, batch, gseq, gtok)
        return jax.tree.map(jnp.add, grads_acc, grads), metrics

    return step


def plain_rows(input_ids: np.ndarray, input_lengths: np.ndarray) -> dict[str, np.ndarray]:
    """``ROW_KEYS`` of right-padded rows (host): positions 0.., padding as its own segment."""
    rows, width = input_ids.shape
    segments = row_segments(input_lengths, width).astype(np.int32)
    return {
        "input_ids": input_ids,
        "positions": np.broadcast_to(np.arange(width, dtype=np.int32), (rows, width)).copy(),
        "segments": segments,
        "prefix_segments": segments,
    }


def bin_layout(
    input_ids: np.ndarray, input_lengths: np.ndarray, token_mask: np.ndarray | None, a: int, b: int, multiple: int = 1
) -> PackedRow:
    """The packed row of rows ``[a, b)``; with ``token_mask`` (shared-prompt packing) the rows
    of one prompt hold it once (``core.data.shared_prompts``)."""
    groups = () if token_mask is None else prompt_groups(input_ids[a:b], input_lengths[a:b], token_mask[a:b])
    return PackedRow.build(input_lengths[a:b], input_ids.shape[1], multiple=multiple, groups=groups)


def packed_micro_batch(
    input_ids: np.ndarray,
    input_lengths: np.ndarray,
    bins: list[tuple[int, int]],
    rows: int,
    width: int,
    unpack_rows: int | None = None,
    token_mask: np.ndarray | None = None,
    band_block: int | None = BAND_BLOCK,
) -> tuple[dict, list[PackedRow]]:
    """Pack ``bins`` (row ranges of the right-padded ``input_ids`` [N, S]) into ``rows`` packed
    rows of ``width`` tokens each (``PackedRow.build``; rows past ``len(bins)`` are all
    padding).  Returns the host ``ROW_KEYS`` arrays [rows, width] and the ``PackedRow`` of each
    bin; with ``unpack_rows`` also ``unpack_index`` / ``unpack_valid`` [unpack_rows, S-1]
    mapping the packed next-token logprobs (flattened) onto the bins' rows in order,
    followed by invalid padding rows, and ``token_index`` [unpack_rows, S] mapping packed
    per-token values (router logits) the same way (padding reads token 0).  ``token_mask``
    [N, S] (shared-prompt packing): each bin's rows of one prompt hold it once
    (:func:`bin_layout`).  ``band_block``: when every real token reaches back less than half
    the row (``PackedRow.attention_reach``), also ``band_keys`` [rows, width / band_block,
    window]: the model then attends over that band only (``models.banded_attention``; None:
    never, e.g. with context parallelism, whose columns are permuted)."""
    source_width = input_ids.shape[1]
    if len(bins) > rows:
        raise ValueError(f"packed_micro_batch: {len(bins)} bins do not fit {rows} rows")
    packs = [bin_layout(input_ids, input_lengths, token_mask, a, b, width) for a, b in bins]
    if any(p.width != width for p in packs):
        raise ValueError(f"packed_micro_batch: a bin of {[p.tokens for p in packs]} tokens exceeds the width {width}")
    empty = PackedRow.build(np.zeros(0, np.int64), source_width, multiple=width)
    out = {key: np.zeros((rows, width), np.int32) for key in ROW_KEYS}
    for k in range(rows):
        pack = packs[k] if k < len(packs) else empty
        if k < len(packs):
            a, b = bins[k]
            out["input_ids"][k] = pack.pack(np.asarray(input_ids[a:b]))[0]
        out["positions"][k] = pack.positions
        out["segments"][k] = pack.segments
        out["prefix_segments"][k] = pack.prefix_segments
    if band_block is not None and packs:
        window = band_window(max(p.attention_reach for p in packs), width, band_block)
        if window is not None:
            out["band_keys"] = band_keys(rows, width, band_block, window)
    if unpack_rows is not None:
        index = np.zeros((unpack_rows, source_width - 1), np.int32)
        valid = np.zeros((unpack_rows, source_width - 1), bool)
        tokens = np.zeros((unpack_rows, source_width), np.int32)
        row = 0
        for k, pack in enumerate(packs):
            i, v = pack.unpack_index()
            index[row : row + len(i)], valid[row : row + len(i)] = i + k * (width - 1), v
            tokens[row : row + len(i)] = pack.token_index()[0] + k * width
            row += len(i)
        out["unpack_index"], out["unpack_valid"], out["token_index"] = index, valid, tokens
    return out, packs


def make_apply_updates(tx, param_shardings: Any = None, opt_shardings: Any = None, trainable: Any = None) -> Callable:
    """``(params, opt_state, grads, loss=0, valid=True) -> (params, opt_state, grad_norm,
    skipped)``; params and optimizer state are donated (updated in place) and kept in their
    shardings, so the steps that consume them next see the same layout and reuse their programs.

    The step is skipped -- params *and* optimizer state returned bit for bit as they came in,
    ``skipped`` True -- when the global gradient norm or ``loss`` (the step's global loss) is
    not finite, or ``valid`` is false (the global batch has no valid token).  The choice is a
    ``jnp.where`` inside the program on globally reduced values, so every device and host
    makes the same one; the update computed from bad gradients is simply not selected.
    ``trainable`` (an nnx filter): ``grads`` and ``opt_state`` cover those params only; the
    others pass through unchanged.
    """
    import optax
    from flax import nnx

    out = None if param_shardings is None else (param_shardings, opt_shardings, None, None)

    @functools.partial(jax.jit, donate_argnums=(0, 1), out_shardings=out)
    def apply(params, opt_state, grads, loss=0.0, valid=True):
        norm = optax.global_norm(grads)
        ok = jnp.isfinite(norm) & jnp.isfinite(loss) & jnp.asarray(valid, bool)
        train, frozen = (params, None) if trainable is None else nnx.split_state(params, trainable, ...)
        updates, new_state = tx.update(grads, opt_state, train)
        new_train = optax.apply_updates(train, updates)

        def keep(new, old):
            return jnp.where(ok, new, old)

        kept = jax.tree.map(keep, new_train, train)
        return (
            kept if trainable is None else nnx.merge_state(kept, frozen),
            jax.tree.map(keep, new_state, opt_state),
            norm,
            jnp.logical_not(ok),
        )

    return apply


def global_valid_counts(
    sample_mask: np.ndarray, token_mask: np.ndarray | None, input_lengths: np.ndarray
) -> tuple[np.float32, np.float32]:
    """Valid sequences and next-token positions of a whole (global) batch, on the host.

    Computed before the micro-batch loop from the step batch's rows on this process, and
    summed over the processes when there are several (each holds only its own rows):
    exactly what the torch backends all-reduce over their data-parallel ranks.
    """
    sample_mask = np.asarray(sample_mask, np.float64)
    if token_mask is not None:
        tokens = (np.asarray(token_mask, np.float64)[:, 1:] * sample_mask[:, None]).sum()
    else:
        tokens = ((np.asarray(input_lengths) - 1).clip(0) * sample_mask).sum()
    seqs = sample_mask.sum()
    if jax.process_count() > 1:
        seqs, tokens = _sum_over_processes(seqs, tokens)
    return np.float32(seqs), np.float32(tokens)


def _sum_over_processes(*values: float) -> tuple[float, ...]:
    """Each value summed over the JAX processes (a collective: every process calls it).

    The gather travels as float32 (jax without x64); counts stay exact below 2**24 per
    process, and the sum is taken in float64 here."""
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(values, np.float64))  # [processes, n]
    return tuple(float(v) for v in np.asarray(gathered, np.float64).reshape(-1, len(values)).sum(0))


class CompileCounter:
    """How many programs the jitted steps compiled (``jax.jit``'s own cache sizes)."""

    def __init__(self, **steps: Callable) -> None:
        self.steps = steps

    def counts(self) -> dict[str, int]:
        # _cache_size: jax's (private) count of a jitted function's compiled programs, which
        # jax's types leave out.
        return {name: fn._cache_size() for name, fn in self.steps.items()}  # type: ignore[attr-defined]
