"""The primitives of exact mode (``policy.numerics: exact``), bit for bit.

Each primitive must give a row the same bits whatever else is computed with it: other rows
(and how many), the row's place among them, the thread count, the alignment of the weight, a
key cache longer than the keys a query may read.  Bits are compared as integers (``-0.0`` and
``0.0`` differ, NaN equals itself), never with a tolerance; a tolerance only checks that the
exact forms compute what the library forms compute.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.torch_common.exact_ops import blocked_attention, exact_linear, exact_silu
from core.kernels.exact import KEY_BLOCK, ROW_TILE
from core.losses.metrics import whole_batch_metrics


def bits(x) -> np.ndarray:
    a = x.detach().float().contiguous().numpy() if torch.is_tensor(x) else np.asarray(x, np.float32)
    return a.view(np.int32)


def same_bits(a, b) -> bool:
    return np.array_equal(bits(a), bits(b))


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(64, 96), (256, 32), (130, 300)])
def test_exact_linear_rows_do_not_depend_on_their_batch(threads, dtype, k, n):
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(3 * ROW_TILE + 5, k, generator=g).to(dtype)
    weight = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    # The weight once more, at an odd offset into a larger buffer (an FSDP flat parameter's view).
    flat = torch.zeros(n * k + 3, dtype=dtype)
    flat[3:] = weight.reshape(-1)
    shifted = flat[3:].view(n, k)
    torch.set_num_threads(1)
    reference = exact_linear(x, weight, bias)
    assert reference.dtype == dtype
    for count in (2, 1):
        torch.set_num_threads(count)
        assert same_bits(exact_linear(x, shifted, bias), reference)
        for start, rows in [(0, 1), (7, 1), (5, 3), (ROW_TILE - 1, 2), (0, ROW_TILE + 1), (11, 2 * ROW_TILE)]:
            assert same_bits(exact_linear(x[start : start + rows], weight, bias), reference[start : start + rows])
    # Rows of a [B, T, K] input are the same rows.
    assert same_bits(exact_linear(x[:12].view(3, 4, k), weight, bias).view(12, n), reference[:12])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(reference.float(), expected, rtol=tol, atol=tol)


def test_exact_silu_is_the_same_on_every_code_path():
    # torch's fp32 sigmoid runs a vectorised body and a scalar tail; the exact SiLU must not care
    # which one an element falls in.
    x = torch.randn(1003, generator=torch.Generator().manual_seed(1)) * 6
    whole = exact_silu(x)
    assert same_bits(torch.cat([exact_silu(x[i : i + 3]) for i in range(0, 1003, 3)]), whole)
    torch.testing.assert_close(whole, torch.nn.functional.silu(x), rtol=1e-6, atol=1e-6)


def _qkv(batch, heads, kv_heads, length, dim, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, heads, length, dim, generator=g),
        torch.randn(batch, kv_heads, length, dim, generator=g),
        torch.randn(batch, kv_heads, length, dim, generator=g),
    )


def test_blocked_attention_decode_step_equals_the_full_forward():
    """A query at position p reads the same keys in the same blocks whether the keys are a
    training forward's (width S) or a cache of any length holding garbage past p."""
    b, h, kv, s, d = 3, 4, 2, KEY_BLOCK + 9, 16
    q, k, v = _qkv(b, h, kv, s, d, seed=2)
    positions = torch.arange(s)[None]
    full = blocked_attention(q, k, v, positions, d**-0.5)  # (B, S, H, D)
    k_rep, v_rep = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)
    torch.testing.assert_close(full, reference.transpose(1, 2), rtol=1e-5, atol=1e-5)
    cache = 3 * KEY_BLOCK
    for p in (0, 5, KEY_BLOCK - 1, KEY_BLOCK, s - 1):
        keys = torch.randn(b, kv, cache, d) * 100  # columns past p: never read
        values = torch.randn(b, kv, cache, d) * 100
        keys[:, :, : p + 1], values[:, :, : p + 1] = k[:, :, : p + 1], v[:, :, : p + 1]
        step = blocked_attention(q[:, :, p : p + 1], keys, values, torch.full((b, 1), p), d**-0.5)
        assert same_bits(step[:, 0], full[:, p]), p
    # A row alone, and a prefix of the width, give the row the same bits.
    assert same_bits(blocked_attention(q[1:2], k[1:2], v[1:2], positions, d**-0.5), full[1:2])
    assert same_bits(blocked_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], positions[:, :7], d**-0.5), full[:, :7])


def test_offset_metrics_are_exact_when_every_token_agrees():
    # A loss reports each metric as micro-batch shares of the whole-batch value; shares of a
    # mean of exactly 1.0 (here 10 micro batches of 1/10) need not sum to 1.0 in float32, while
    # the excess over 1 sums to exactly 0.
    shares = np.full(10, np.float32(1) / np.float32(10), np.float32)
    assert float(np.cumsum(shares, dtype=np.float32)[-1]) != 1.0
    out = whole_batch_metrics({"token_mult_prob_excess": 0.0, "token_mult_prob_error": float(shares.sum())})
    assert out["token_mult_prob_error"] == 1.0
    assert whole_batch_metrics({"token_mult_prob_excess": 0.25})["token_mult_prob_error"] == 1.25
