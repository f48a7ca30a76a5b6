"""JAX: a non-finite or all-masked optimizer step is skipped inside the jitted update.

``make_apply_updates`` (fast, no Ray): an inf gradient, a NaN loss or ``valid=False`` leave
params *and* optimizer state bit for bit as they were and return ``skipped``; the next
finite update equals the one of a state that never saw the bad calls, and no call compiles a
second program.  The Policy-level scenario on every layout: tests/backends/test_non_finite_steps.py.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np

from backends.jax_pjit import steps
from backends.jax_pjit.optim import build_optax, set_learning_rate
from core.config.loader import DEFAULT_CONFIG_PATH, load_raw_config


def _tx():
    cfg = copy.deepcopy(load_raw_config(DEFAULT_CONFIG_PATH)["policy"])
    cfg["optimizer"]["kwargs"].update(lr=1e-2, weight_decay=0.01)
    tx, schedule = build_optax(cfg["optimizer"], cfg["scheduler"], 1.0)
    return tx, schedule


def _on_device(tree):
    """Committed to one device, like the worker's sharded state (uncommitted inputs would
    make the first call's program differ from the later ones')."""
    return jax.device_put(tree, jax.devices()[0])


def _params():
    return _on_device({"w": jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 10, "b": jnp.ones(3, jnp.float32)})


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_apply_updates_skips_non_finite_and_masked_steps():
    tx, schedule = _tx()
    apply = steps.make_apply_updates(tx)
    grads = {"w": jnp.full((4, 3), 0.5, jnp.float32), "b": jnp.full(3, -0.25, jnp.float32)}

    params = _params()
    opt_state = _on_device(set_learning_rate(tx.init(params), schedule(0)))
    # An inf gradient (first leaf), a NaN gradient, a NaN loss, an inf loss, no valid tokens.
    bad_calls = [
        ({**grads, "w": grads["w"].at[0, 0].set(jnp.inf)}, 1.0, True),
        ({**grads, "b": grads["b"].at[1].set(jnp.nan)}, 1.0, True),
        (grads, jnp.float32(jnp.nan), True),
        (grads, jnp.float32(-jnp.inf), True),
        (grads, 1.0, False),
    ]
    for bad_grads, loss, valid in bad_calls:
        before_params, before_state = _host(params), _host(opt_state)
        params, opt_state, norm, skipped = apply(params, opt_state, bad_grads, jnp.float32(loss), valid)
        assert bool(skipped), (loss, valid)
        _assert_same(params, before_params)
        _assert_same(opt_state, before_state)

    params, opt_state, norm, skipped = apply(params, opt_state, grads, jnp.float32(1.0), True)
    assert not bool(skipped) and np.isfinite(float(norm))

    fresh_params = _params()
    fresh_state = _on_device(set_learning_rate(tx.init(fresh_params), schedule(0)))
    fresh_params, fresh_state, fresh_norm, fresh_skipped = apply(
        fresh_params, fresh_state, grads, jnp.float32(1.0), True
    )
    assert not bool(fresh_skipped) and float(fresh_norm) == float(norm)
    _assert_same(params, fresh_params)  # moments, step count and weight decay untouched by the skips
    _assert_same(opt_state, fresh_state)
    assert not np.allclose(np.asarray(params["w"]), np.asarray(_params()["w"]))  # a real step moved them
    assert apply._cache_size() == 1  # skipping or not, one program
