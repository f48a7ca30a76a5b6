"""The building blocks every model family shares, numerically matching transformers 5.19.

transformers 5.x ships no Flax models, so the JAX backend carries its own.  The
computation follows the HF modules step by step (same cast order) so that fp32 logits
agree with HF torch to ~1e-6:

* RMSNorm in float32, cast back to the input dtype, then multiplied by the scale.
* Rotate-half RoPE, ``inv_freq`` computed exactly like ``modeling_rope_utils`` (float32
  numpy mirroring the torch expression) for ``rope_type`` "default" and "llama3".
* Grouped-query attention (query head ``h`` reads kv head ``h // (heads // kv_heads)``, as
  HF ``repeat_kv``), scores and softmax in float32; optional q/k/v biases (Qwen2) and
  per-head q/k RMSNorm over ``head_dim`` before RoPE (Qwen3).  Plain
  right-padded rows go through ``jax.nn.dot_product_attention`` (cuDNN flash attention on
  NVIDIA GPUs in bf16/fp16); packed rows, context parallelism and KV-cache decoding through
  ``attend`` with an explicit mask.
* bf16 compute over fp32 params: norm scales and biases act through ``per_feature``, so their
  gradients are summed in float32 (independent of the micro-batch size up to rounding).
* SwiGLU MLP ``down(silu(gate(x)) * up(x))``; token embedding with an optional tied output
  projection.

Sharding: every ``nnx.Param`` carries its *logical* axis names (see ``logical_axes.py``)
as the flax variable metadata ``out_sharding``.  They are created with
``eager_sharding=False`` so building a model never needs a mesh; the sharding layer maps
names to mesh axes itself (``nnx.get_partition_spec`` under ``nnx.logical_axis_rules``,
or ``models.logical_axes_tree``).  Activations pass through ``constrain(x, axes)``, an
identity unless the sharding layer installs a function with ``set_activation_constraint``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from backends.jax_pjit.logical_axes import PARAM_AXES
from backends.jax_pjit.models.banded_attention import Banded, banded_attention
from backends.jax_pjit.models.config import ModelConfig

#: Per layer, the (k, v) cache of KV-cache decoding, each [B, max_len, kv_heads, head_dim].
KVCache = tuple[tuple[jax.Array, jax.Array], ...]

# --------------------------------------------------------------------------- RoPE


@functools.cache
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """``inv_freq`` [head_dim // 2] float32, computed like transformers' rope init functions.

    The torch expressions are mirrored in float32 numpy (python scalars are weak-typed in
    both), so the frequencies agree with HF's ``rotary_emb.inv_freq`` to the last bit or so.
    """
    rope = cfg.rope_parameters
    dim = cfg.head_dim
    base = float(rope["rope_theta"])
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2).astype(np.float32) / dim))  # (D/2,)
    if cfg.rope_type == "default":
        return inv_freq.astype(np.float32)
    # rope_type == "llama3" (_compute_llama3_parameters): leave high frequencies, divide
    # low ones by `factor`, interpolate in between.
    factor = float(rope["factor"])
    low_freq_factor = float(rope["low_freq_factor"])
    high_freq_factor = float(rope["high_freq_factor"])
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama).astype(np.float32)


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, S, head_dim] in ``dtype`` for integer ``positions`` [B, S] (float32 math)."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, S, D/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # (B, S, D)
    # attention_scaling is 1.0 for both supported rope types.
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, S, N, D] rotated by cos/sin [B, S, D] (broadcast over the heads axis)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (B, S, 1, D)
    return x * cos + rotate_half(x) * sin


# --------------------------------------------------------------------------- activation sharding hook

ConstraintFn = Callable[[jax.Array, tuple[str, ...]], jax.Array]
_activation_constraint: ConstraintFn | None = None

RESIDUAL_AXES = ("batch", "seq", "act_embed")
HEADS_AXES = ("batch", "seq", "act_heads", "head_dim")
#: Keys / values as attention reads them: every query of a row needs every key, so under
#: context parallelism (``seq`` -> ``cp``) they are gathered over ``cp`` (``kv_seq`` is replicated).
KV_AXES = ("batch", "kv_seq", "act_heads", "head_dim")
MLP_AXES = ("batch", "seq", "act_mlp")
LOGITS_AXES = ("batch", "seq", "act_vocab")


def set_activation_constraint(fn: ConstraintFn | None) -> ConstraintFn | None:
    """Install ``fn(x, logical_axes) -> x`` (e.g. a ``with_sharding_constraint`` through the
    rules table); ``None`` restores the identity.  Returns the previous function.

    The hook is read while tracing: a function already compiled by ``jit`` keeps the
    constraint it was traced with.
    """
    global _activation_constraint
    previous, _activation_constraint = _activation_constraint, fn
    return previous


@contextlib.contextmanager
def activation_constraint(fn: ConstraintFn | None) -> Iterator[None]:
    """``set_activation_constraint`` for the duration of a ``with`` block."""
    previous = set_activation_constraint(fn)
    try:
        yield
    finally:
        set_activation_constraint(previous)


def constrain(x: jax.Array, logical_axes: tuple[str, ...]) -> jax.Array:
    """Identity unless a constraint function is installed; ``logical_axes`` names x's dims."""
    return x if _activation_constraint is None else _activation_constraint(x, logical_axes)


def placement(logical: str) -> tuple[Any, str] | None:
    """``(mesh, axis)`` when the installed constraint splits the logical axis ``logical`` over
    exactly one mesh axis (of any size), else None (no constraint installed, or it does not
    say): what a ``shard_map`` over that axis needs (the MoE: each device's rows over
    ``batch``'s, expert parallelism over ``expert``'s)."""
    find = getattr(_activation_constraint, "placement", None)
    return None if find is None else find(logical)


# --------------------------------------------------------------------------- layers


def _param(value: jax.Array, axes: tuple[str, ...]) -> nnx.Param:
    """A parameter tagged with its logical axes (flax metadata ``out_sharding``).

    ``eager_sharding=False``: flax 0.12 would otherwise try to place the value on a mesh
    at creation (and fail without one); placement is the sharding layer's job.
    """
    assert len(axes) == value.ndim and all(a in PARAM_AXES for a in axes), (axes, value.shape)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def per_feature(op: Callable, x: jax.Array, param: jax.Array, dtype) -> jax.Array:
    """``op(x, param)`` for a per-feature parameter broadcast over every token, in ``dtype``.

    Both operands are rounded to ``dtype`` (as the torch backends' bf16 params and
    activations are), the op runs in float32 and its result is rounded once: for a product or
    a sum of two bf16 values that is the bf16 op's result.  Why not the op in ``dtype``: the
    parameter's gradient is a sum over all tokens of the micro batch, and in bf16 XLA
    accumulates that sum in bf16 (a ``reduce`` with a bf16 ``add``), an error that grows with
    the tokens per micro batch -- bf16 training then depended on the micro-batch size (norm
    scale gradients of micro batch 1 vs 2 differed by 1e-2).  Here the sum is float32 and
    rounded once, as torch does.  In float32 every cast is a no-op.
    """
    x32 = x.astype(dtype).astype(jnp.float32)
    p32 = param.astype(dtype).astype(jnp.float32)
    return op(x32, p32).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dense_product(x: jax.Array, kernel: jax.Array, n_in: int) -> jax.Array:
    """``x[..., in...] . kernel[in..., out...]`` (``n_in`` contracted dims): ``jnp.tensordot``,
    with a backward written as two plain matrix products over the flattened tokens.

    Why not autodiff's backward: XLA:CPU gets the weight gradient ``x^T dy`` as a dot
    contracting the tokens of a transposed operand, and lays it out by materialising ``dy``
    transposed ([out, tokens]) -- a strided copy as large as the activation, fused into the
    elementwise producer of ``dy``, which it then computes twice (once per layout).  Here the
    weight gradient is ``x2.T @ dy2`` on the [tokens, features] matrices, which XLA folds into
    the dot with no copy; the input gradient is ``dy2 @ kernel2.T``.  The values are the same
    products, equal to autodiff's up to the order of fp32 summation."""
    return jnp.tensordot(x, kernel, axes=n_in)


def _dense_forward(x: jax.Array, kernel: jax.Array, n_in: int) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return dense_product(x, kernel, n_in), (x, kernel)


def _dense_backward(n_in: int, saved: tuple[jax.Array, jax.Array], dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, kernel = saved
    features_in = math.prod(kernel.shape[:n_in])
    x2 = x.reshape(-1, features_in)  # (tokens, in)
    dy2 = dy.reshape(x2.shape[0], -1)  # (tokens, out)
    kernel2 = kernel.reshape(features_in, -1)  # (in, out)
    dx = jnp.dot(dy2, kernel2.T).reshape(x.shape)
    dkernel = jnp.dot(x2.T, dy2).reshape(kernel.shape)
    return dx, dkernel


dense_product.defvjp(_dense_forward, _dense_backward)


class Dense(nnx.Module):
    """``y[..., out] = x[..., in] . kernel[in, out] (+ bias[out])`` with multi-dim in/out.

    ``in_shape``/``out_shape`` may have several dims (e.g. out = (heads, head_dim)), so the
    kernel stores heads as their own axis and sharding never has to split a fused dim.
    """

    # LoRA adapters: class-level None; ``backends.jax_pjit.lora.apply_lora`` sets them on the
    # targeted layers' instances.
    lora_a: nnx.Param | None = None
    lora_b: nnx.Param | None = None
    lora_scale: float = 0.0

    def __init__(self, in_shape, out_shape, in_axes, out_axes, *, use_bias: bool, dtype, param_dtype, rngs: nnx.Rngs):
        self.n_in = len(in_shape)
        self.dtype = dtype
        init = jax.nn.initializers.normal(0.02)
        shape = tuple(in_shape) + tuple(out_shape)
        self.kernel = _param(init(rngs.params(), shape, param_dtype), tuple(in_axes) + tuple(out_axes))
        self.bias = _param(jnp.zeros(tuple(out_shape), param_dtype), tuple(out_axes)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = dense_product(x.astype(self.dtype), self.kernel[...].astype(self.dtype), self.n_in)
        if self.bias is not None:
            y = per_feature(jnp.add, y, self.bias[...], self.dtype)
        if self.lora_a is not None and self.lora_b is not None:
            # LoRA, as the torch backends' LoRALinear: x A [.., r], then B [r, out..], scaled.
            h = jnp.tensordot(x.astype(self.dtype), self.lora_a[...].astype(self.dtype), axes=self.n_in)
            y = y + jnp.tensordot(h, self.lora_b[...].astype(self.dtype), axes=1) * self.lora_scale
        return y


class RMSNorm(nnx.Module):
    """HF ``LlamaRMSNorm``: normalise in float32, cast to the input dtype, then scale."""

    def __init__(self, size: int, eps: float, *, dtype, param_dtype):
        self.eps = eps
        self.dtype = dtype
        self.scale = _param(jnp.ones((size,), param_dtype), ("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        input_dtype = x.dtype
        h = x.astype(jnp.float32)
        variance = jnp.mean(h * h, axis=-1, keepdims=True)  # (B, S, 1)
        h = h * jax.lax.rsqrt(variance + self.eps)
        return per_feature(
            jnp.multiply, h.astype(input_dtype), self.scale[...], jnp.result_type(input_dtype, self.dtype)
        )


class RightPadded(NamedTuple):
    """The attention mask of plain right-padded rows, as the key count of each row: query
    ``t`` reads keys ``s <= t`` with ``s < lengths[b]`` (a pytree, so it passes ``nnx.remat``).
    The explicit-mask paths (packing, context parallelism, KV-cache decoding) pass a
    ``[B, T, S]`` bool array instead."""

    lengths: jax.Array  # [B] int32


def attention_implementation(q: jax.Array) -> Literal["xla", "cudnn"]:
    """Which ``jax.nn.dot_product_attention`` implementation serves ``q`` [B, T, H, D]:
    ``"cudnn"`` (flash attention: no [B, H, T, S] scores in memory) on an NVIDIA GPU when
    ``flash_eligible``, else ``"xla"`` (the scores are materialised; float32 compute always
    is: flash kernels are half precision only).

    The choice is made here because ``implementation=None`` still means XLA in jax 0.10 (its
    auto-selection is a TODO), and XLA's scores ran a 1B Llama at 4 x 2048 out of memory on
    an H100.
    """
    return "cudnn" if _on_nvidia_gpu() and flash_eligible(q.dtype, q.shape[-1]) else "xla"


def flash_eligible(dtype, head_dim: int) -> bool:
    """cuDNN flash attention's dtype / head-dim conditions (jax's ``check_layout`` and
    ``check_is_flash_attention``): bf16 or fp16, head dim a multiple of 8 up to 128 (256 from
    Hopper on; 128 holds everywhere)."""
    return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128


def _on_nvidia_gpu() -> bool:
    """JAX runs on CUDA GPUs (ROCm reports backend "gpu" too; cuDNN is NVIDIA's)."""
    if jax.default_backend() != "gpu":
        return False
    return "cuda" in str(getattr(jax.devices()[0].client, "platform_version", "")).lower()


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, scale: float) -> jax.Array:
    """Causal grouped-query attention over right-padded rows (``RightPadded``).

    q [B, T, H, D]; k, v [B, T, KV, D] (KV heads read natively, never repeated); lengths [B].
    On an NVIDIA GPU (``attention_implementation`` "cudnn") through ``jax.nn.dot_product_attention``
    (flash attention); elsewhere ``attend`` with the causal and padding mask, whose layout XLA:CPU
    runs faster than ``jax.nn.dot_product_attention``'s "xla" path (see ``attend``).
    A padding query (t >= lengths[b]) reads the row's valid keys; its output is never used.  A
    row of length 0 (a padding row of a micro batch) is given one key: no query reads an empty
    key range (cuDNN is not asked what one means; ``attend`` would give it a uniform mix).
    """
    kv_lengths = jnp.maximum(lengths, 1).astype(jnp.int32)
    if attention_implementation(q) == "cudnn":
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, key_value_seq_lengths=kv_lengths, implementation="cudnn"
        )
    t = jnp.arange(q.shape[1])
    allowed = (t[None, :, None] >= t[None, None, :]) & (t[None, None, :] < kv_lengths[:, None, None])
    return attend(q, k, v, allowed, scale)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, scale: float) -> jax.Array:
    """Grouped-query softmax attention.

    q [B, T, H, D]; k, v [B, S, KV, D]; allowed [B, T, S] bool (query t may read key s).
    Returns [B, T, H, D] in q's dtype.  Rows with no allowed key (padding queries) get a
    uniform distribution instead of NaN: masking uses the finite float32 minimum.

    Head-major: the G = H / KV query heads of each KV head are folded into its query rows
    ([B, KV, T * G, D], t-major, so a ``cp``-sharded T stays a contiguous block), and both
    products are single-batch-dim matmuls [T * G, D] x [D, S].  XLA:CPU runs that layout faster,
    forward and forward + backward, than per-(KV, G) einsums (docs/results.md#kernels-attention-and-moe-dispatch).
    """
    b, t, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    qh = q.reshape(b, t, kv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kv, t * g, d)  # head h = kv * G + g
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, KV, S, D)
    # Scores leave the matmul in float32 and are scaled there (bf16 compute: not rounded to
    # bf16 first), as in jax.nn.dot_product_attention.
    scores = jnp.einsum("bkqd,bksd->bkqs", qh, kh, preferred_element_type=jnp.float32) * scale
    rows = jnp.repeat(allowed, g, axis=1)[:, None]  # (B, 1, T * G, S): row t * G + g is query t
    scores = jnp.where(rows, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, vh)  # (B, KV, T * G, D)
    return out.reshape(b, kv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        e, h, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = Dense((e,), (h, d), ("embed",), ("heads", "head_dim"), use_bias=cfg.qkv_bias, **kw)
        self.k_proj = Dense((e,), (kv, d), ("embed",), ("kv_heads", "head_dim"), use_bias=cfg.qkv_bias, **kw)
        self.v_proj = Dense((e,), (kv, d), ("embed",), ("kv_heads", "head_dim"), use_bias=cfg.qkv_bias, **kw)
        self.o_proj = Dense((h, d), (e,), ("heads", "head_dim"), ("embed",), use_bias=False, **kw)
        # Qwen3: one [head_dim] scale shared by every head of the layer (so replicated, "norm").
        norm_kw = dict(dtype=dtype, param_dtype=param_dtype)
        # Typed as a callable module: a family's own norm may take the slot (Gemma 3's 1 + w).
        self.q_norm: Callable[[jax.Array], jax.Array] | None = (
            RMSNorm(d, cfg.rms_norm_eps, **norm_kw) if cfg.qk_norm else None
        )
        self.k_norm: Callable[[jax.Array], jax.Array] | None = (
            RMSNorm(d, cfg.rms_norm_eps, **norm_kw) if cfg.qk_norm else None
        )
        self.scale = d**-0.5
        self.dtype = dtype

    def project_qk(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Queries [B, T, H, D] and keys [B, T, KV, D], rotated; with ``q_norm`` / ``k_norm``
        normalised over head_dim first, as HF Qwen3 does (a family may override this)."""
        q, k = self.q_proj(x), self.k_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def __call__(self, x, cos, sin, allowed, cache=None, cache_index=None):
        """x [B, T, E] -> ([B, T, E], new (k, v) cache or None).

        Without a cache the keys are this call's own tokens (``allowed`` [B, T, T], or
        ``RightPadded`` for plain right-padded rows: causal, flash attention on GPU); with a
        cache (k, v [B, L, KV, D]) the new keys/values are written at slots
        ``cache_index .. cache_index + T - 1`` and the queries read all L slots
        (``allowed`` [B, T, L]).
        """
        q, k = self.project_qk(x, cos, sin)  # (B, T, H, D), (B, T, KV, D)
        q = constrain(q, HEADS_AXES)
        v = self.v_proj(x)  # (B, T, KV, D)
        new_cache = None
        if cache is not None:
            cache_k, cache_v = cache
            start = (0, cache_index, 0, 0)
            k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), start)  # (B, L, KV, D)
            v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), start)  # (B, L, KV, D)
            new_cache = (k, v)
        k, v = constrain(k, KV_AXES), constrain(v, KV_AXES)
        k, v = k.astype(self.dtype), v.astype(self.dtype)
        if isinstance(allowed, RightPadded):
            out = causal_attention(q, k, v, allowed.lengths, self.scale)  # (B, T, H, D)
        elif isinstance(allowed, Banded):
            out = banded_attention(q, k, v, allowed, self.scale)  # (B, T, H, D)
        else:
            out = attend(q, k, v, allowed, self.scale)  # (B, T, H, D)
        return self.o_proj(constrain(out, HEADS_AXES)), new_cache


class MLP(nnx.Module):
    #: The gate's activation (SwiGLU; a family may swap it, e.g. Gemma's tanh-GELU).
    activation: Callable[[jax.Array], jax.Array] = staticmethod(jax.nn.silu)

    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        e, m = cfg.hidden_size, cfg.intermediate_size
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = Dense((e,), (m,), ("embed",), ("mlp",), **kw)
        self.up_proj = Dense((e,), (m,), ("embed",), ("mlp",), **kw)
        self.down_proj = Dense((m,), (e,), ("mlp",), ("embed",), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain(self.activation(self.gate_proj(x)) * self.up_proj(x), MLP_AXES)  # (B, T, M)
        return self.down_proj(h)


def mask_padded_vocab(logits: jax.Array, vocab_size: int) -> jax.Array:
    """Logits [..., Vp] with the padding columns (ids >= ``vocab_size``) at the dtype's lowest
    finite value: no probability after any softmax (exp underflows to exactly 0), never sampled,
    and ``where`` sends them zero gradient (so the zero padding rows stay zero under AdamW).
    Finite, not -inf, so p * log p (entropy) stays 0 instead of NaN."""
    real = jnp.arange(logits.shape[-1]) < vocab_size  # (Vp,)
    return jnp.where(real, logits, jnp.finfo(logits.dtype).min)


class Embed(nnx.Module):
    def __init__(self, vocab: int, size: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        init = jax.nn.initializers.normal(0.02)
        self.embedding = _param(init(rngs.params(), (vocab, size), param_dtype), ("vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)  # (B, S, E)

    def attend(self, h: jax.Array) -> jax.Array:
        """Tied output projection: h [B, S, E] @ embedding.T -> [B, S, V]."""
        return jnp.einsum("bse,ve->bsv", h, self.embedding[...].astype(self.dtype))


__all__ = [
    "KVCache",
    "RESIDUAL_AXES",
    "HEADS_AXES",
    "KV_AXES",
    "MLP_AXES",
    "LOGITS_AXES",
    "rope_inv_freq",
    "rope_cos_sin",
    "apply_rope",
    "set_activation_constraint",
    "activation_constraint",
    "constrain",
    "per_feature",
    "Dense",
    "RMSNorm",
    "RightPadded",
    "attention_implementation",
    "flash_eligible",
    "causal_attention",
    "attend",
    "Attention",
    "MLP",
    "mask_padded_vocab",
    "Embed",
]


# --------------------------------------------------------------------------- what every CausalLM shares


def positions_and_mask(
    input_ids: jax.Array,
    attention_mask: jax.Array | None,
    positions: jax.Array | None,
    allowed: jax.Array | Banded | None,
) -> tuple[jax.Array, jax.Array | RightPadded | Banded]:
    """A family ``CausalLM.__call__``'s ``positions`` (default 0..S-1 on every row) and mask:
    ``allowed`` ([B, S, S], or a ``Banded`` one over packed rows) when given, else the
    right-padded rows' key counts (``RightPadded``)."""
    b, s = input_ids.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, :], (b, s))  # (B, S)
    if allowed is not None:
        return positions, allowed
    if attention_mask is None:
        raise ValueError("CausalLM: pass attention_mask or allowed")
    return positions, RightPadded(jnp.sum(attention_mask.astype(jnp.int32), axis=-1))  # (B,)


class _DecodingLM(Protocol):
    """What :class:`CachedDecoding` needs of the ``CausalLM`` it is mixed into."""

    cfg: Any
    dtype: Any

    def decode_hidden(
        self, input_ids: jax.Array, positions: jax.Array, cache: KVCache, cache_index, attention_mask_full: jax.Array
    ) -> tuple[jax.Array, KVCache]: ...

    def _logits(self, h: jax.Array) -> jax.Array: ...


class CachedDecoding:
    """``init_cache`` and ``decode`` of a family's ``CausalLM`` (which provides ``cfg``,
    ``dtype``, ``decode_hidden`` and ``_logits``): the same for every family."""

    def init_cache(self: _DecodingLM, batch: int, max_len: int, dtype=None) -> KVCache:
        """Zeroed cache: one (k, v) pair per layer, each [B, max_len, kv_heads, head_dim]."""
        shape = (batch, max_len, self.cfg.num_kv_heads, self.cfg.head_dim)
        dtype = dtype or self.dtype
        return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(self.cfg.num_layers))

    def decode(
        self: _DecodingLM,
        input_ids: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        cache_index,
        attention_mask_full: jax.Array,
    ) -> tuple[jax.Array, KVCache]:
        """``decode_hidden`` through the LM head: (logits [B, T, V], new cache)."""
        h, new_cache = self.decode_hidden(input_ids, positions, cache, cache_index, attention_mask_full)
        return self._logits(h), new_cache
