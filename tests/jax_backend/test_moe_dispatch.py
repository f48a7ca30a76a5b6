"""The grouped (``ragged_dot``) and blocked expert dispatches against the dense one.

fp32 on CPU: values and gradients (w.r.t. tokens, routing weights and the three kernels) must
agree to rounding, with K = 3, an expert no token chose, a token count that is a multiple of
nothing, every token routed to one expert, and the experts sharded over a 2-device mesh.
One shape throughout: compiling dominates this file's time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from backends.jax_pjit.models.moe_dispatch import (
    blocked_experts,
    dense_experts,
    expert_parallel_experts,
    grouped_experts,
)

TOKENS, EMBED, MLP, EXPERTS, TOP_K = 37, 16, 8, 6, 3
UNUSED = 3  # no token is routed to this expert in ``_random_index``

# Block 16: ~22 rows per used expert under random routing (a full and a partial block), 37 on
# an expert every token chose (3 blocks), fewer than 16 on some (one partial block).
DISPATCHES = {"grouped": grouped_experts, "blocked": functools.partial(blocked_experts, block=16)}


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _random_index(rng: np.random.Generator) -> np.ndarray:
    """[T, K] distinct experts per token, never ``UNUSED``."""
    keys = rng.random((TOKENS, EXPERTS))
    keys[:, UNUSED] = 2.0  # sorts last
    return np.argsort(keys, axis=1)[:, :TOP_K]


def _inputs(index: np.ndarray | None = None) -> tuple[jax.Array, ...]:
    """(x, index, weight, gate, up, down) in float32 (numpy-drawn: no eager jax ops to compile)."""
    rng = np.random.default_rng(0)
    index = _random_index(rng) if index is None else index
    weight = rng.random((TOKENS, TOP_K)) + 0.1
    arrays = (
        rng.standard_normal((TOKENS, EMBED)),
        weight / weight.sum(axis=1, keepdims=True),
        *(0.3 * rng.standard_normal((EXPERTS, EMBED, MLP)) for _ in range(2)),
        0.3 * rng.standard_normal((EXPERTS, MLP, EMBED)),
    )
    x, weight, gate, up, down = (jnp.asarray(a, jnp.float32) for a in arrays)
    return x, jnp.asarray(index, jnp.int32), weight, gate, up, down


@functools.partial(jax.jit, static_argnums=0)
def _value_and_grads(fn, x, index, weight, gate, up, down):
    """fn's output and the gradients of sum(sin(output)) w.r.t. every float input, in one program."""
    out, vjp = jax.vjp(lambda x, w, g, u, d: fn(x, index, w, g, u, d), x, weight, gate, up, down)
    return out, vjp(jnp.cos(out))


def _assert_close(actual, expected, what: str) -> None:
    expected = np.asarray(expected)
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-5 * scale, err_msg=what)


def _assert_matches_dense(fn, args) -> tuple[jax.Array, ...]:
    """Asserts fn's output and gradients equal the dense dispatch's; returns the gradients."""
    out, grads = _value_and_grads(fn, *args)
    ref_out, ref_grads = _value_and_grads(dense_experts, *args)
    _assert_close(out, ref_out, "output")
    for name, g, ref in zip(("x", "weight", "gate", "up", "down"), grads, ref_grads, strict=True):
        _assert_close(g, ref, f"d/d{name}")
    return grads


@pytest.mark.parametrize("name", DISPATCHES)
def test_matches_dense(name):
    args = _inputs()
    assert not np.any(np.asarray(args[1]) == UNUSED)
    grads = _assert_matches_dense(DISPATCHES[name], args)
    for g in grads[2:]:  # the unused expert's kernels get exactly no gradient
        assert not np.any(np.asarray(g)[UNUSED])


@pytest.mark.parametrize("name", DISPATCHES)
def test_all_tokens_on_one_expert(name):
    """Expert 4 in every token's first slot (one group of all T tokens), slots 2-3 over experts
    0-3, expert 5 chosen by none."""
    t = np.arange(TOKENS)
    index = np.stack([np.full(TOKENS, 4), t % 4, (t + 1) % 4], axis=1)
    _assert_matches_dense(DISPATCHES[name], _inputs(index))


@pytest.mark.parametrize("name", DISPATCHES)
def test_experts_sharded_over_two_devices(name):
    """Kernels sharded over experts on a 2-device mesh (Auto axes, as the model's mesh), tokens
    and routing replicated: the dense output (grouped stays expert-parallel and all-reduces the
    rows; blocked all-gathers the kernels)."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 (virtual) jax devices")
    args = _inputs()
    mesh = jax.make_mesh((2,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    specs = (PartitionSpec(),) * 3 + (PartitionSpec("expert"),) * 3
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]
    out = jax.jit(DISPATCHES[name])(*placed)
    _assert_close(out, _value_and_grads(dense_experts, *args)[0], "sharded output")


def test_the_model_runs_blocked_only_where_it_does_less_work():
    """``blocked_where_cheaper`` (the model's "blocked"): on CPU dense up to X * block / (X - K)
    tokens (256 here: decoding steps, short micro batches), the block scan above, exact either
    way.  On GPU the measured rule keeps small layers dense whatever the tokens, and scans a
    Qwen3-30B-A3B layer from 8,192 tokens (see ``BLOCKED_RULES``)."""
    from backends.jax_pjit.models.moe_dispatch import BLOCKED_RULES, blocked_is_cheaper, blocked_where_cheaper

    assert EXPERTS * BLOCKED_RULES["cpu"]["block"] // (EXPERTS - TOP_K) == 256
    assert [blocked_is_cheaper(t, EXPERTS, TOP_K, EMBED, MLP, "cpu") for t in (256, 257)] == [False, True]
    a3b = dict(experts=128, top_k=8, embed=2048, mlp=768, platform="gpu")
    assert [blocked_is_cheaper(t, **a3b) for t in (4096, 8192, 16384)] == [False, True, True]
    assert not blocked_is_cheaper(16384, 8, 2, 512, 704, "gpu")  # the bench model's layer
    for tokens, scans in ((TOKENS, False), (300, True)):
        rng = np.random.default_rng(1)
        index = np.argsort(rng.random((tokens, EXPERTS)), axis=1)[:, :TOP_K]
        x = jnp.asarray(rng.standard_normal((tokens, EMBED)), jnp.float32)
        args = (x, jnp.asarray(index, jnp.int32), *_inputs()[2:])
        args = (*args[:2], jnp.full((tokens, TOP_K), 1.0 / TOP_K, jnp.float32), *args[3:])
        program = str(jax.make_jaxpr(blocked_where_cheaper)(*args))
        assert ("scan" in program) == scans, tokens
        _assert_close(jax.jit(blocked_where_cheaper)(*args), jax.jit(dense_experts)(*args), f"{tokens} tokens")


def _expert_parallel(ranks: int):
    """``expert_parallel_experts`` under ``shard_map`` over an ``ranks``-device ``expert`` axis:
    tokens, routing and kernels split over it (the first 36 tokens: a multiple of 2 and 3)."""
    mesh = jax.make_mesh((ranks,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:ranks])
    spec = PartitionSpec("expert")
    run = functools.partial(expert_parallel_experts, axis="expert", block=4)
    sharded = jax.shard_map(run, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec, axis_names={"expert"})
    return lambda x, index, weight, *kernels: sharded(x[:36], index[:36], weight[:36], *kernels)


@pytest.mark.parametrize("ranks", [2, 3])
def test_expert_parallel_matches_dense(ranks):
    """Each rank runs only its own experts (6 / ranks) on every rank's gathered tokens, empty
    blocks skipped, outputs reduce-scattered back: dense's output and gradients (w.r.t. the
    tokens, routing weights and every kernel), the unused expert's kernels untouched."""
    if jax.device_count() < ranks:
        pytest.skip(f"needs {ranks} (virtual) jax devices")
    x, index, weight, *kernels = _inputs()
    args = (x[:36], index[:36], weight[:36], *kernels)
    grads = _assert_matches_dense(_expert_parallel(ranks), args)
    for g in grads[2:]:
        assert not np.any(np.asarray(g)[UNUSED])


def test_blocked_drops_the_pairs_routed_past_the_last_expert():
    """Expert X (one past the last) is the expert-parallel dispatch's "another rank's": those
    pairs contribute nothing, exactly as if their weight were 0 (empty blocks skipped or not)."""
    x, index, weight, gate, up, down = _inputs()
    dropped = np.asarray(index) == 1
    past = jnp.where(dropped, EXPERTS, index)
    zero = jnp.where(dropped, 0.0, weight)
    expected = dense_experts(x, index, zero, gate, up, down)
    for skip in (False, True):
        out = blocked_experts(x, past, weight, gate, up, down, block=16, skip_empty=skip)
        _assert_close(out, expected, f"skip_empty={skip}")
