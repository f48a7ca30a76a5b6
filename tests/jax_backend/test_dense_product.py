"""``models.layers.dense_product``: the Dense layers' product with a backward of two plain matrix
products.  Its gradients equal autodiff's of ``jnp.tensordot`` to fp32 summation order, for the
multi-dim kernels the model uses (q [E, H, D], o [H, D, E]), and on CPU its compiled backward
has none of the transposed activation copies autodiff's got (the reason it exists)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends.jax_pjit.models.layers import dense_product


def _loss(product, n_in):
    def loss(x, kernel):
        y = product(x, kernel, n_in)
        return jnp.sum(jnp.sin(y) * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) / y.size)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _tensordot(x, kernel, n_in):
    return jnp.tensordot(x, kernel, axes=n_in)


@pytest.mark.parametrize(
    "x_shape, kernel_shape, n_in",
    [((2, 6, 16), (16, 24), 1), ((2, 6, 16), (16, 4, 8), 1), ((2, 6, 4, 8), (4, 8, 16), 2)],
    ids=["dense", "into-heads", "out-of-heads"],
)
def test_value_and_gradients_equal_autodiff_of_tensordot(x_shape, kernel_shape, n_in):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal(kernel_shape) * 0.1, jnp.float32)
    value, (dx, dk) = _loss(dense_product, n_in)(x, kernel)
    ref_value, (ref_dx, ref_dk) = _loss(_tensordot, n_in)(x, kernel)
    assert value == ref_value  # the forward is tensordot itself
    assert dx.shape == x.shape and dk.shape == kernel.shape
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dk, ref_dk, rtol=1e-6, atol=1e-6)


def test_the_cpu_backward_materialises_no_transposed_activation():
    """SwiGLU's backward through dense_product: the weight gradients are dots that read the
    activations as they are; autodiff's version copied ``dy`` into [out, tokens] for each."""
    if jax.default_backend() != "cpu":
        pytest.skip("the layout choice checked here is XLA:CPU's")
    x = jnp.zeros((2, 64, 32), jnp.float32)
    params = {k: jnp.zeros(s, jnp.float32) for k, s in (("g", (32, 96)), ("u", (32, 96)), ("d", (96, 32)))}

    def copies(product) -> int:
        def loss(p, x):
            h = jax.nn.silu(product(x, p["g"], 1)) * product(x, p["u"], 1)
            return jnp.sum(product(h, p["d"], 1) ** 2)

        text = jax.jit(jax.grad(loss)).lower(params, x).compile().as_text()
        entry = text[text.index("ENTRY") :]
        return len(
            re.findall(r"= f32\[\d+,\d+\]\{1,0\} (?:copy|transpose)\(|copy_\w*fusion|transpose_\w*fusion", entry)
        )

    assert copies(_tensordot) > 0  # what autodiff's layout costs (if XLA stops doing it, this says so)
    assert copies(dense_product) == 0
