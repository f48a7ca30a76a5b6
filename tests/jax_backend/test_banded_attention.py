"""Banded attention over packed rows (``backends.jax_pjit.models.banded_attention``).

A packed row of short sequences attends over a band of keys instead of the whole row: every
real token must see exactly the keys the dense mask (``attention_allowed``) gives it, the
outputs and gradients must be the dense ones up to summation order, and a packed JAX worker
whose rows take the band must still equal packing off (and HF).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from backends.jax_pjit import steps
from backends.jax_pjit.models.banded_attention import band_keys, band_window, banded_attention, banded_mask
from backends.jax_pjit.models.layers import attend
from core.data.context_parallel import attention_allowed
from core.data.sequence_packing import PackedRow
from core.data.shared_prompts import PromptGroup
from core.losses import ClippedPGLossFn
from tests.jax_backend.test_context_parallel import jax_worker
from tests.jax_backend.test_sequence_packing import packing, uneven_batch
from tests.torch_backends.conftest import hf_logprobs
from tests.unit.test_losses import BASE_CFG

#: A row of 512 columns: six sequences, rows 1-3 sharing a 12-token prompt, then padding.
LENGTHS = [30, 50, 20, 70, 44, 9]
GROUPS = [PromptGroup(start=1, end=4, shared=12)]


def packed_row(groups=GROUPS) -> PackedRow:
    return PackedRow.build(LENGTHS, 80, multiple=512, groups=groups)


def dense_reach(row: PackedRow) -> int:
    """``attention_reach`` by brute force from the dense mask."""
    cols = np.arange(row.width)
    mask = attention_allowed(cols, cols, row.segments[None], row.prefix_segments[None])[0]
    return max(int(q - np.flatnonzero(mask[q]).min()) for q in np.flatnonzero(row.valid))


@pytest.mark.parametrize("groups", [pytest.param(GROUPS, id="shared-prompt"), pytest.param((), id="plain")])
def test_attention_reach_is_the_dense_masks(groups):
    row = packed_row(groups)
    assert row.attention_reach == dense_reach(row)
    # A shared prompt's samples read back to the prompt: further than their own segment.
    assert (row.attention_reach > max(LENGTHS) - 1) == bool(groups)


def test_the_window_covers_the_reach_and_must_save_half():
    assert band_window(115, 512, 64) == 256  # 115 + 64 -> 3 blocks -> 4 (a power of two)
    assert band_window(0, 512, 64) == 64
    assert band_window(200, 512, 64) is None  # 512 would not save half of 512
    assert band_window(10, 500, 64) is None  # the block does not divide the width
    keys = band_keys(2, 256, 64, 128)
    assert keys.shape == (2, 4, 128)
    np.testing.assert_array_equal(keys[0, 0], [-1] * 64 + list(range(64)))
    np.testing.assert_array_equal(keys[1, 3], range(128, 256))


@pytest.mark.parametrize(
    ("groups", "heads"),
    [
        pytest.param(GROUPS, (8, 4), id="shared-prompt-gqa2"),
        pytest.param((), (4, 4), id="plain-mha"),
        pytest.param(GROUPS, (8, 2), id="shared-prompt-gqa4"),
    ],
)
def test_banded_attention_is_dense_attention_on_every_real_token(groups, heads):
    row = packed_row(groups)
    width, block = row.width, 64
    window = band_window(row.attention_reach, width, block)
    assert window is not None and window < width
    seg, pre = jnp.asarray(row.segments[None], jnp.int32), jnp.asarray(row.prefix_segments[None], jnp.int32)
    band = banded_mask(jnp.asarray(band_keys(1, width, block, window)), seg, pre)
    cols = jnp.arange(width)
    dense = attention_allowed(cols, cols, seg, pre)
    real = row.valid
    np.testing.assert_array_equal(np.asarray(band.dense(width))[0][real], np.asarray(dense)[0][real])
    pad = np.flatnonzero(~real)
    assert np.asarray(band.dense(width))[0][pad, pad].all(), "a padding query reads itself"

    h, kv = heads
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal((1, width, n, 16)), jnp.float32) for n in (h, kv, kv))
    out_dense, out_band = attend(q, k, v, dense, 0.25), banded_attention(q, k, v, band, 0.25)
    np.testing.assert_allclose(np.asarray(out_band)[0][real], np.asarray(out_dense)[0][real], rtol=0, atol=1e-6)

    def loss(fn, mask):
        return lambda q, k, v: (fn(q, k, v, mask, 0.25)[0][real] ** 2).sum()

    grads_dense = jax.grad(loss(attend, dense), argnums=(0, 1, 2))(q, k, v)
    grads_band = jax.grad(loss(banded_attention, band), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", grads_dense, grads_band, strict=True):
        scale = float(jnp.abs(a).max())
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6 * scale, err_msg=name)


def test_packed_micro_batch_adds_band_keys_only_where_they_pay():
    ids = np.ones((6, 80), np.int32)
    lengths = np.asarray(LENGTHS)
    rows, _ = steps.packed_micro_batch(ids, lengths, [(0, 6)], rows=2, width=512)
    assert rows["band_keys"].shape == (2, 512 // steps.BAND_BLOCK, 256)  # reach 69: 69 + 64 -> 3 blocks -> 4
    # One long sequence reaches back most of the row: dense.
    rows, _ = steps.packed_micro_batch(np.ones((1, 300), np.int32), np.asarray([300]), [(0, 1)], rows=1, width=512)
    assert "band_keys" not in rows
    rows, _ = steps.packed_micro_batch(ids, lengths, [(0, 6)], rows=2, width=512, band_block=None)
    assert "band_keys" not in rows


#: Rows of at most 30 tokens packed into rows of 256 (the budget): the band applies.
WIDE_BUDGET = 256
SHORT_LENGTHS = [30, 2, 5, 17, 3, 28, 9, 1, 22, 30, 14, 6]


def test_a_banded_packed_worker_equals_packing_off_and_hf(model_dirs, tokenizer):
    data = uneven_batch(SHORT_LENGTHS, seed=11)
    rows, _ = steps.packed_micro_batch(
        data["input_ids"].numpy(), data["input_lengths"].numpy(), [(0, len(SHORT_LENGTHS))], rows=1, width=WIDE_BUDGET
    )
    assert "band_keys" in rows, "these rows must take the band"
    results = {}
    for name, enabled in (("off", False), ("banded", True)):
        worker = jax_worker(model_dirs["llama"], tokenizer, 4, 1, 2, sequence_packing=packing(enabled, WIDE_BUDGET))
        before = worker.get_logprobs(data)["logprobs"]
        results[name] = before, worker.train(data, ClippedPGLossFn(BASE_CFG)), worker.get_logprobs(data)["logprobs"]
    (off_lp, off_train, off_after), (lp, train, after) = results["off"], results["banded"]
    hf = hf_logprobs(
        AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval(), data["input_ids"], data["input_lengths"]
    )
    torch.testing.assert_close(lp, hf, rtol=0, atol=1e-5)
    torch.testing.assert_close(lp, off_lp, rtol=0, atol=1e-5)
    for step in range(len(off_train.loss)):
        assert math.isclose(float(train.loss[step]), float(off_train.loss[step]), rel_tol=1e-5)
        assert math.isclose(float(train.grad_norm[step]), float(off_train.grad_norm[step]), rel_tol=1e-5)
    torch.testing.assert_close(after, off_after, rtol=0, atol=1e-5)
