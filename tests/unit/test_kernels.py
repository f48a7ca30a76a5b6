"""Every kernel against a float64 NumPy reference, on torch and on jax, values and gradients."""

from __future__ import annotations

import numpy as np
import pytest

from core import kernels as K
from tests.unit.engines import ENGINES, to_engine, to_numpy, value_and_grad, x64

RNG = np.random.default_rng(0)


# ----------------------------------------------------------------------------- references


def np_log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_logprobs(x, ids):
    return np.take_along_axis(np_log_softmax(x), ids[..., None], -1)[..., 0]


def np_entropy(x):
    lp = np_log_softmax(x)
    return -(np.exp(lp) * lp).sum(-1)


def np_masked_mean(v, m, axis=None, g=None):
    norm = m.sum(axis) if g is None else g
    return (v * m).sum(axis) / (norm + 1e-8)


def np_kl(lp, ref, kind, cin, cout):
    logr = ref - lp
    if cin is not None:
        logr = np.clip(logr, -cin, cin)
    kl = {"k1": -logr, "k2": logr**2 / 2, "k3": np.exp(logr) - 1 - logr}[kind]
    return kl if cout is None else np.clip(kl, -cout, cout)


def np_clipped(r, a, lo, hi, c):
    loss = np.maximum(-a * r, -a * np.clip(r, 1 - lo, 1 + hi))
    if c is not None:
        loss = np.where(a < 0, np.minimum(loss, -a * c), loss)
    return loss


def np_truncated_is(logw, m, kind, hi, lo):
    r = np.exp(logw)
    if kind == "tis":
        return np.minimum(r, hi)
    if kind == "icepop":
        return np.where((r >= lo) & (r <= hi), r, 0.0)
    g = np.exp((logw * m).sum(-1, keepdims=True) / (m.sum(-1, keepdims=True) + 1e-8))
    return np.where((g >= lo) & (g <= hi), r, 0.0)


# ----------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("chunk_size", [None, 1, 3, 7, 100])
def test_logprobs_from_logits_matches_numpy(engine, chunk_size):
    x = RNG.normal(size=(3, 7, 11)) * 3
    ids = RNG.integers(0, 11, size=(3, 7))
    with x64(engine):
        out = K.logprobs_from_logits(to_engine(engine, x), to_engine(engine, ids), chunk_size=chunk_size)
        assert str(out.dtype).endswith("float64")
        np.testing.assert_allclose(to_numpy(out), np_logprobs(x, ids), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("engine", ENGINES)
def test_logprobs_gradient_matches_numpy(engine):
    x = RNG.normal(size=(2, 5, 6))
    ids = RNG.integers(0, 6, size=(2, 5))
    w = RNG.normal(size=(2, 5))
    # d/dx sum(w * logp) = w * (onehot - softmax)
    expected = w[..., None] * (np.eye(6)[ids] - np.exp(np_log_softmax(x)))
    with x64(engine):
        wi, ii = to_engine(engine, w), to_engine(engine, ids)
        _, grad = value_and_grad(engine, lambda t: (K.logprobs_from_logits(t, ii, chunk_size=2) * wi).sum(), x)
    np.testing.assert_allclose(grad, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("engine", ENGINES)
def test_logprobs_low_precision_computed_in_fp32(engine):
    x = RNG.normal(size=(2, 4, 9)).astype(np.float32)
    ids = RNG.integers(0, 9, size=(2, 4))
    if engine == "torch":
        import torch

        logits = torch.from_numpy(x).to(torch.bfloat16)
        ref = np_logprobs(logits.float().numpy().astype(np.float64), ids)
    else:
        import jax.numpy as jnp

        logits = jnp.asarray(x, dtype=jnp.bfloat16)
        ref = np_logprobs(np.asarray(logits.astype(jnp.float32), dtype=np.float64), ids)
    out = K.logprobs_from_logits(logits, to_engine(engine, ids), chunk_size=3)
    assert str(out.dtype).endswith("float32")
    np.testing.assert_allclose(to_numpy(out), ref, rtol=1e-5, atol=1e-5)


def test_logprobs_torch_gradcheck_and_bf16_grad_dtype():
    import torch

    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 4, (2, 5))
    assert torch.autograd.gradcheck(lambda t: K.logprobs_from_logits(t, ids, chunk_size=2), (x,))
    xb = torch.randn(2, 5, 4, dtype=torch.bfloat16, requires_grad=True)
    K.logprobs_from_logits(xb, ids, chunk_size=2).sum().backward()
    assert xb.grad.dtype == torch.bfloat16


def test_logprobs_jit_matches_eager_jax():
    import jax

    x = to_engine("jax", RNG.normal(size=(2, 6, 5)).astype(np.float32))
    ids = to_engine("jax", RNG.integers(0, 5, size=(2, 6)))
    f = lambda t: K.logprobs_from_logits(t, ids, chunk_size=4).sum()  # noqa: E731
    np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(f))(x)), np.asarray(jax.grad(f)(x)), rtol=1e-6)


@pytest.mark.parametrize("engine", ENGINES)
def test_next_token_logprobs_and_sequence_layout(engine):
    x = RNG.normal(size=(2, 5, 7))
    ids = RNG.integers(0, 7, size=(2, 5))
    lengths = np.array([5, 3])
    with x64(engine):
        nxt = K.next_token_logprobs(to_engine(engine, x), to_engine(engine, ids))
        expected = np_logprobs(x[:, :-1], ids[:, 1:])
        np.testing.assert_allclose(to_numpy(nxt), expected, rtol=1e-12)
        layout = to_numpy(K.logprobs_to_sequence_layout(nxt, to_engine(engine, lengths)))
    assert layout.shape == (2, 5)
    np.testing.assert_array_equal(layout[:, 0], 0.0)
    np.testing.assert_allclose(layout[0, 1:], expected[0])
    np.testing.assert_allclose(layout[1, 1:3], expected[1, :2])
    np.testing.assert_array_equal(layout[1, 3:], 0.0)


@pytest.mark.parametrize("engine", ENGINES)
def test_logprobs_shape_errors(engine):
    x = to_engine(engine, np.zeros((2, 3, 4), dtype=np.float32))
    with pytest.raises(ValueError, match=r"does not match logits \[B, S\] = \(2, 3\)"):
        K.logprobs_from_logits(x, to_engine(engine, np.zeros((2, 4), dtype=np.int64)))
    with pytest.raises(ValueError, match=r"logits must be \[B, S, V\]"):
        K.logprobs_from_logits(x[0], to_engine(engine, np.zeros((3,), dtype=np.int64)))
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        K.logprobs_from_logits(x, to_engine(engine, np.zeros((2, 3), dtype=np.int64)), chunk_size=0)


def test_mixing_engines_is_an_error():
    import jax.numpy as jnp
    import torch

    with pytest.raises(TypeError, match="different engines"):
        K.calculate_kl(torch.ones(3), jnp.ones(3))
    with pytest.raises(TypeError, match="expected torch tensors or jax arrays"):
        K.masked_sum(np.ones(3), np.ones(3))


@pytest.mark.parametrize("engine", ENGINES)
def test_entropy_and_temperature(engine):
    x = RNG.normal(size=(2, 5, 8)) * 2
    with x64(engine):
        ent = to_numpy(K.entropy_from_logits(to_engine(engine, x), chunk_size=2))
        np.testing.assert_allclose(ent, np_entropy(x), rtol=1e-12)
        scaled = to_numpy(K.apply_temperature(to_engine(engine, x), 0.5))
    np.testing.assert_allclose(scaled, x / 0.5)
    with pytest.raises(ValueError, match="temperature must be positive"):
        K.apply_temperature(to_engine(engine, x), 0.0)


# ----------------------------------------------------------------------------- reductions


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("axis", [None, -1, 0])
@pytest.mark.parametrize("global_norm", [None, 7.0])
def test_masked_mean_and_sum(engine, axis, global_norm):
    v = RNG.normal(size=(4, 6))
    m = (RNG.random((4, 6)) > 0.4).astype(np.float64)
    with x64(engine):
        out = K.masked_mean(
            to_engine(engine, v), to_engine(engine, m), axis=axis, global_normalization_factor=global_norm
        )
        np.testing.assert_allclose(to_numpy(out), np_masked_mean(v, m, axis, global_norm), rtol=1e-12)
        s = K.masked_sum(to_engine(engine, v), to_engine(engine, m.astype(bool)), axis=axis)
        np.testing.assert_allclose(to_numpy(s), (v * m).sum(axis), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("engine", ENGINES)
def test_masked_mean_all_masked_is_exactly_zero(engine):
    out = K.masked_mean(to_engine(engine, np.ones((2, 3))), to_engine(engine, np.zeros((2, 3))))
    assert float(out) == 0.0


# ----------------------------------------------------------------------------- KL


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("clamps", [(None, None), (20.0, 10.0), (0.5, 0.3)])
def test_calculate_kl(engine, kind, clamps):
    lp = RNG.normal(size=(3, 5)) - 2
    ref = RNG.normal(size=(3, 5)) - 2
    with x64(engine):
        out = K.calculate_kl(to_engine(engine, lp), to_engine(engine, ref), kind, *clamps)
        np.testing.assert_allclose(to_numpy(out), np_kl(lp, ref, kind, *clamps), rtol=1e-12)
        _, g = value_and_grad(engine, lambda t: K.calculate_kl(t, to_engine(engine, ref), kind, *clamps).sum(), lp)
    # reference gradient by central differences (all functions are piecewise smooth)
    eps = 1e-6
    fd = (np_kl(lp + eps, ref, kind, *clamps) - np_kl(lp - eps, ref, kind, *clamps)) / (2 * eps)
    np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-7)


def test_calculate_kl_rejects_unknown_type():
    import torch

    with pytest.raises(ValueError, match="kl_type must be one of"):
        K.calculate_kl(torch.zeros(2), torch.zeros(2), "k4")


# ----------------------------------------------------------------------------- ratios


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("clip", [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.2, 3.0), (0.1, 0.3, 2.0)])
def test_clipped_surrogate_loss(engine, clip):
    r = np.exp(RNG.normal(size=(4, 6)))
    a = RNG.normal(size=(4, 6)) * 2
    with x64(engine):
        loss, clamped = K.clipped_surrogate_loss(to_engine(engine, r), to_engine(engine, a), *clip)
    np.testing.assert_allclose(to_numpy(loss), np_clipped(r, a, *clip), rtol=1e-12)
    np.testing.assert_allclose(to_numpy(clamped), np.clip(r, 1 - clip[0], 1 + clip[1]), rtol=1e-12)


def test_dual_clip_requires_c_above_one():
    import torch

    with pytest.raises(ValueError, match="ratio_clip_c must be > 1"):
        K.clipped_surrogate_loss(torch.ones(2), torch.ones(2), 0.2, 0.2, 1.0)


@pytest.mark.parametrize("engine", ENGINES)
def test_sequence_level_ratio(engine):
    logr = RNG.normal(size=(3, 5)) * 0.3
    m = (RNG.random((3, 5)) > 0.3).astype(np.float64)
    m[:, 0] = 1
    expected = np.exp((logr * m).sum(-1, keepdims=True) / (m.sum(-1, keepdims=True) + 1e-8))
    with x64(engine):
        out = K.sequence_level_ratio(to_engine(engine, logr), to_engine(engine, m))
    np.testing.assert_allclose(to_numpy(out), expected, rtol=1e-12)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["tis", "icepop", "seq-mask-tis"])
def test_truncated_importance_weights(engine, kind):
    logw = RNG.normal(size=(4, 6)) * 0.5
    m = np.ones((4, 6))
    m[1, 3:] = 0
    with x64(engine):
        w, oob = K.truncated_importance_weights(to_engine(engine, logw), to_engine(engine, m), kind, 1.5, 0.6)
    expected = np_truncated_is(logw, m, kind, 1.5, 0.6)
    np.testing.assert_allclose(to_numpy(w), expected, rtol=1e-12)
    changed = ~np.isclose(expected, np.exp(logw))
    np.testing.assert_array_equal(to_numpy(oob).astype(bool), changed)


def test_truncated_importance_weights_errors():
    import torch

    with pytest.raises(ValueError, match="must be one of"):
        K.truncated_importance_weights(torch.zeros(1, 2), torch.ones(1, 2), "bogus", 2.0)
    with pytest.raises(ValueError, match="needs truncated_importance_sampling_ratio_min"):
        K.truncated_importance_weights(torch.zeros(1, 2), torch.ones(1, 2), "icepop", 2.0)


def test_jax_kernel_never_materialises_fp32_logits():
    """XLA's compiled memory plan: the kernel (fwd and fwd+bwd) allocates no [N, V] temporary,
    while naive log_softmax + gather allocates a whole one."""
    import jax
    import jax.numpy as jnp

    logits = jnp.zeros((4, 64, 4096), jnp.float32)
    ids = jnp.zeros((4, 64), jnp.int32)
    full_bytes = logits.size * 4

    def temp_bytes(fn):
        return jax.jit(fn).lower(logits).compile().memory_analysis().temp_size_in_bytes

    def naive(x):
        return jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), ids[..., None], axis=-1)[..., 0].sum()

    def ours(x):
        return K.logprobs_from_logits(x, ids).sum()

    assert temp_bytes(naive) >= full_bytes
    assert temp_bytes(ours) <= full_bytes / 16
    assert temp_bytes(jax.grad(ours)) <= full_bytes / 16
