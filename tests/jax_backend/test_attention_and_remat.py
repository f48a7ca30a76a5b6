"""Attention that fits, and remat, in the JAX model.

* Plain right-padded rows attend through ``causal_attention``: in fp32 it equals the
  explicit-mask ``attend`` (and ``jax.nn.dot_product_attention``'s XLA path) within 1e-6, forward
  and gradients, with right padding and grouped-query heads; on an NVIDIA GPU in bf16 it asks
  ``jax.nn.dot_product_attention`` for cuDNN flash attention with shapes and dtypes that pass
  cuDNN's own checks (jax's ``check_layout`` / ``check_is_flash_attention``, run here on the
  recorded call; cuDNN itself cannot run on CPU), elsewhere it runs ``attend``.
* ``policy.activation_checkpointing``: the worker's grad step rematerialises every
  decoder layer (a ``remat`` primitive per layer in its jaxpr, no attention-sized residual
  saved for the backward) and its gradients equal the plain step's within 1e-6 in fp32.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from backends.jax_pjit import steps
from backends.jax_pjit.models import ModelConfig, abstract_model, make_apply_fn
from backends.jax_pjit.models import layers as jax_layers
from backends.jax_pjit.models.layers import attend, causal_attention
from core.losses import ClippedPGLossFn
from core.policy.config import PolicyConfig
from tests.torch_backends.conftest import pg_batch, policy_config
from tests.unit.test_losses import BASE_CFG

B, T, H, KV, D = 3, 10, 4, 2, 16
LENGTHS = np.array([10, 7, 1], np.int32)  # a full row, a padded one, a single token
REMAT = re.compile(r"\b(?:remat2|checkpoint)\[")


def _qkv(dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    return (
        jax.random.normal(kq, (B, T, H, D), dtype),
        jax.random.normal(kk, (B, T, KV, D), dtype),
        jax.random.normal(kv, (B, T, KV, D), dtype),
    )


def _old_attend(q, k, v, lengths):
    """The explicit-mask path as the plain path used to build it (causal & padding keys)."""
    allowed = jnp.tril(jnp.ones((T, T), bool))[None] & (jnp.arange(T)[None, :] < lengths[:, None])[:, None, :]
    return attend(q, k, v, allowed, D**-0.5)


def test_causal_attention_equals_attend_in_fp32_forward_and_gradients():
    q, k, v = _qkv()
    lengths = jnp.asarray(LENGTHS)
    new = jax.jit(causal_attention, static_argnums=4)(q, k, v, lengths, D**-0.5)
    old = jax.jit(_old_attend)(q, k, v, lengths)
    assert new.shape == (B, T, H, D) and new.dtype == jnp.float32
    np.testing.assert_allclose(new, old, atol=1e-6, rtol=0)  # padding queries included
    xla = jax.nn.dot_product_attention(
        q, k, v, scale=D**-0.5, is_causal=True, key_value_seq_lengths=jnp.maximum(lengths, 1), implementation="xla"
    )
    np.testing.assert_allclose(new, xla, atol=1e-6, rtol=0)  # jax's own reference of the same attention
    cotangent = jax.random.normal(jax.random.key(1), (B, T, H, D))

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v, lengths) * cotangent)

    def grads(fn):
        return jax.jit(jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2)))(q, k, v)

    grads_new = grads(lambda *a: causal_attention(*a, D**-0.5))
    grads_old = grads(_old_attend)
    for g_new, g_old in zip(grads_new, grads_old, strict=True):
        assert float(jnp.abs(g_old).max()) > 0.1  # real gradients, not zeros
        np.testing.assert_allclose(g_new, g_old, atol=1e-6, rtol=0)


def test_empty_row_stays_finite():
    """A padding row of a micro batch (length 0) reads one key instead of none: finite."""
    q, k, v = _qkv()
    out = jax.jit(causal_attention, static_argnums=4)(q, k, v, jnp.zeros(B, jnp.int32), D**-0.5)
    assert np.isfinite(np.asarray(out)).all()


def _tiny(dtype):
    """A 2-layer GQA Llama with abstract params (shapes only: these tests trace, never run)."""
    cfg = ModelConfig(
        family="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    return make_apply_fn(abstract_model(cfg, dtype=dtype))


def _recorded_attention_calls(monkeypatch, dtype, on_gpu: bool) -> list[dict]:
    """The model's ``jax.nn.dot_product_attention`` calls of one plain forward, as if on an
    NVIDIA GPU (``on_gpu``); each call then runs as XLA (cuDNN cannot run on CPU)."""
    calls, original = [], jax.nn.dot_product_attention

    def record(q, k, v, *args, implementation=None, **kwargs):
        calls.append(dict(kwargs, q=q, k=k, v=v, args=args, implementation=implementation))
        return original(q, k, v, *args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", record)
    monkeypatch.setattr(jax_layers, "_on_nvidia_gpu", lambda: on_gpu)
    apply_fn, params = _tiny(dtype)
    ids = jnp.ones((2, 32), jnp.int32)
    mask = (jnp.arange(32)[None] < jnp.asarray([32, 20])[:, None]).astype(jnp.int32)
    jax.eval_shape(lambda p: apply_fn(p, ids, mask), params)
    return calls


def test_plain_path_asks_for_flash_attention_that_cudnn_accepts(monkeypatch):
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    calls = _recorded_attention_calls(monkeypatch, jnp.bfloat16, on_gpu=True)
    assert len(calls) == 2  # one per layer
    for call in calls:
        q, k, v, kv_lengths = call["q"], call["k"], call["v"], call["key_value_seq_lengths"]
        assert call["implementation"] == "cudnn" and call["is_causal"] is True and not call["args"]
        assert call.get("mask") is None and call.get("bias") is None  # no [B, S, S] mask built
        assert q.dtype == k.dtype == v.dtype == jnp.bfloat16
        assert q.shape == (2, 32, 4, 16) and k.shape == v.shape == (2, 32, 2, 16)  # GQA: kv heads not repeated
        assert kv_lengths.dtype == jnp.int32 and kv_lengths.shape == (2,)
        # cuDNN's own admission checks (what dot_product_attention(implementation="cudnn") runs
        # first; the query lengths it fills in when only key lengths are given are [B] int32 too).
        q_lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
        cudnn.check_layout(q, k, v, None, q_lengths, kv_lengths, None, None, None, None, cudnn.AttentionLayout.BTNH)
        cudnn.check_is_flash_attention(q, k, v, cudnn.AttentionLayout.BTNH.value, 90000, False, True)


@pytest.mark.parametrize("dtype, on_gpu", [(jnp.float32, True), (jnp.bfloat16, False)])
def test_attend_where_cudnn_cannot_serve(monkeypatch, dtype, on_gpu):
    """fp32 on a GPU, or any CPU: the head-major ``attend`` (no jax.nn.dot_product_attention)."""
    attended = []
    original = jax_layers.attend
    monkeypatch.setattr(jax_layers, "attend", lambda *a: attended.append(a[3].shape) or original(*a))
    assert _recorded_attention_calls(monkeypatch, dtype, on_gpu) == []
    assert attended == [(2, 32, 32)] * 2  # one [B, T, S] causal-and-padding mask per layer


def test_flash_eligibility_by_dtype_and_head_dim():
    assert jax_layers.flash_eligible(jnp.bfloat16, 128) and jax_layers.flash_eligible(jnp.float16, 64)
    assert not jax_layers.flash_eligible(jnp.bfloat16, 20)  # not a multiple of 8
    assert not jax_layers.flash_eligible(jnp.bfloat16, 192)  # over 128
    assert not jax_layers.flash_eligible(jnp.float32, 64)


# ------------------------------------------------------------------------- remat


def test_remat_saves_no_attention_residuals(capsys):
    """Without remat the backward keeps [.., S, S] attention arrays of every layer; with it
    only the layers' inputs (and small per-token values) are saved."""
    apply_fn, params = _tiny(jnp.float32)
    ids, mask = jnp.ones((2, 48), jnp.int32), jnp.ones((2, 48), jnp.int32)  # S = 48, hidden 64

    def square_residuals(remat):
        capsys.readouterr()
        print_saved_residuals(lambda p: apply_fn(p, ids, mask, remat=remat).sum(), params)
        shapes = re.findall(r"^\w+\[([\d,]*)\]", capsys.readouterr().out, flags=re.M)
        assert shapes  # the report was parsed
        # [.., rows, S] with rows a multiple of S: the head-major attention's [B, KV, T * G, S]
        return [s for s in shapes if s.endswith(",48") and int(s.split(",")[-2]) % 48 == 0]

    assert len(square_residuals(False)) >= 2  # at least one per layer
    assert square_residuals(True) == []


def _worker(model_dir, tokenizer, remat):
    from backends.jax_pjit.worker import JaxPolicyWorker

    cfg = policy_config(model_dir, "jax_pjit")
    cfg["parallel"].update(fsdp_size=4, tensor_parallel_size=2)
    cfg["activation_checkpointing"] = remat
    return JaxPolicyWorker(PolicyConfig.checked(cfg), tokenizer)


def _grads(worker, loss_fn, data):
    """The worker's own grad step over its micro batches (what ``train`` accumulates)."""
    host = {k: v.numpy() for k, v in data.items()}
    gseq, gtok = steps.global_valid_counts(host["sample_mask"], host.get("token_mask"), host["input_lengths"])
    step, acc = worker._grad_step(loss_fn), steps.zero_grads(worker.params)
    with worker._on_mesh():
        for args in worker.rows.train_micro_batches(host, None, 2, worker.rows.bucket(host["input_ids"].shape[1])):
            acc, _ = step(worker.params, acc, *args, gseq, gtok)
    return step, args, acc


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) jax devices")
def test_activation_checkpointing_remats_every_layer_with_equal_gradients(model_dirs, tokenizer):
    loss_fn, data = ClippedPGLossFn(BASE_CFG), pg_batch(4, seed=3)
    plain, remat = (_worker(model_dirs["qwen2"], tokenizer, flag) for flag in (False, True))
    assert (plain.remat, remat.remat) == (False, True)
    _, _, g_plain = _grads(plain, loss_fn, data)
    step, args, g_remat = _grads(remat, loss_fn, data)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_plain)) > 1e-3
    acc = steps.zero_grads(remat.params)
    with remat._on_mesh():
        jaxpr = str(jax.make_jaxpr(step)(remat.params, acc, *args, np.float32(4), np.float32(30)))
    # jax.checkpoint's primitive (remat2; "checkpoint" in other jax versions), once per layer
    assert len(REMAT.findall(jaxpr)) == remat.model_cfg.num_layers
    with plain._on_mesh():
        assert not REMAT.findall(
            str(jax.make_jaxpr(plain._grad_step(loss_fn))(plain.params, acc, *args, np.float32(4), np.float32(30)))
        )
