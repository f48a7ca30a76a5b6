"""Llama / Qwen2 causal LM in flax nnx, numerically matching transformers 5.19.

transformers 5.x ships no Flax models, so the JAX backend carries its own.  The
computation follows the HF modules step by step (same cast order) so that fp32 logits
agree with HF torch to ~1e-6:

* RMSNorm in float32, cast back to the input dtype, then multiplied by the scale.
* Rotate-half RoPE, ``inv_freq`` computed exactly like ``modeling_rope_utils`` (float32
  numpy mirroring the torch expression) for ``rope_type`` "default" and "llama3".
* Grouped-query attention (query head ``h`` reads kv head ``h // (heads // kv_heads)``, as
  HF ``repeat_kv``), scores and softmax in float32; Qwen2 adds q/k/v biases.  Plain
  right-padded rows go through ``jax.nn.dot_product_attention`` (cuDNN flash attention on
  NVIDIA GPUs in bf16/fp16); packed rows, context parallelism and KV-cache decoding through
  ``attend`` with an explicit mask.
* bf16 compute over fp32 params: norm scales and biases act through ``per_feature``, so their
  gradients are summed in float32 (independent of the micro-batch size up to rounding).
* SwiGLU MLP ``down(silu(gate(x)) * up(x))``; optional tied output embedding.

Sharding: every ``nnx.Param`` carries its *logical* axis names (see ``logical_axes.py``)
as the flax variable metadata ``out_sharding``.  They are created with
``eager_sharding=False`` so building a model never needs a mesh; the sharding layer maps
names to mesh axes itself (``nnx.get_partition_spec`` under ``nnx.logical_axis_rules``,
or ``logical_axes_tree`` below).  Activations pass through ``constrain(x, axes)``, an
identity unless the sharding layer installs a function with ``set_activation_constraint``.

Layouts (logical axes):
    embed_tokens.embedding       [vocab, embed]
    *.q_proj.kernel / bias       [embed, heads, head_dim] / [heads, head_dim]
    *.k_proj, v_proj .kernel     [embed, kv_heads, head_dim] (bias [kv_heads, head_dim])
    *.o_proj.kernel              [heads, head_dim, embed]
    *.gate_proj, up_proj .kernel [embed, mlp];  down_proj.kernel [mlp, embed]
    *_layernorm.scale, norm.scale [norm]
    lm_head.kernel               [embed, vocab]   (absent when tied: logits = h @ embedding.T)
The stored vocab dim is ``cfg.padded_vocab_size`` (zero-padded for tensor parallelism; the
padded logits are masked in ``CausalLM._logits``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from backends.jax_pjit.logical_axes import PARAM_AXES

# --------------------------------------------------------------------------- config

#: HF ``model_type`` -> our family.  Mistral is Llama with a sliding window; it is
#: accepted only when the window never binds (checked in ``from_hf``).
SUPPORTED_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "llama"}
SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _freeze(value: Any) -> Any:
    """Make a config value hashable (lists -> tuples) so ``ModelConfig`` can be a jit static."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family model (hashable: usable as a ``jax.jit`` static).

    ``rope_scaling`` is HF's ``config.rope_parameters`` (``rope_type``, ``rope_theta`` and
    the type's parameters).  A dict may be passed; it is stored as sorted ``(key, value)``
    pairs to keep the dataclass hashable, and read back with ``rope_parameters``.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Any = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 2048
    #: Embedding rows / lm_head columns the model *stores* (>= ``vocab_size``; None =
    #: ``vocab_size``): tensor parallelism shards the vocabulary, so a vocabulary ``tp`` does
    #: not divide is padded with zeros (``core.policy.vocab_padding``).  The padded
    #: logits are masked in ``CausalLM._logits``; ``vocab_size`` stays the real vocabulary,
    #: and everything leaving the backend (HF export, refit, logprobs) has that many rows.
    padded_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.padded_vocab_size is None:
            object.__setattr__(self, "padded_vocab_size", self.vocab_size)
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size={self.padded_vocab_size} < vocab_size={self.vocab_size}")
        rope = dict(self.rope_scaling or {})
        rope.setdefault("rope_type", rope.get("type", "default"))
        rope.pop("type", None)
        rope.setdefault("rope_theta", self.rope_theta)
        object.__setattr__(self, "rope_scaling", tuple(sorted((k, _freeze(v)) for k, v in rope.items())))
        object.__setattr__(self, "rope_theta", float(rope["rope_theta"]))
        if self.family not in ("llama", "qwen2"):
            raise ValueError(f"unsupported model family {self.family!r}; expected 'llama' or 'qwen2'")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {self.rope_type!r}; the JAX model implements {SUPPORTED_ROPE_TYPES}"
            )
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor != 1.0 is not supported by the JAX model")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def rope_parameters(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @property
    def rope_type(self) -> str:
        return self.rope_parameters["rope_type"]

    @property
    def is_vocab_padded(self) -> bool:
        return self.padded_vocab_size != self.vocab_size

    def with_padded_vocab(self, tp: int = 1, make_divisible_by: int = 1) -> ModelConfig:
        """This config with the vocabulary padded for ``tp``-way sharding (and to a multiple of
        ``make_divisible_by``): ``core.policy.vocab_padding.padded_vocab_size``."""
        from core.policy.vocab_padding import padded_vocab_size

        return dataclasses.replace(self, padded_vocab_size=padded_vocab_size(self.vocab_size, tp, make_divisible_by))

    def unpadded(self) -> ModelConfig:
        """This config as the HF checkpoint describes it (``padded_vocab_size = vocab_size``)."""
        return dataclasses.replace(self, padded_vocab_size=self.vocab_size)

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Read a transformers 5.x ``LlamaConfig`` / ``Qwen2Config`` (/ window-free ``MistralConfig``).

        Raises ``ValueError`` naming the ``model_type`` for other architectures, and for
        options of a supported one that this model does not implement.
        """
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; the JAX backend supports {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        family = SUPPORTED_MODEL_TYPES[model_type]
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"model_type {model_type!r} with hidden_act={act!r} is not supported (only 'silu')")
        if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
            raise ValueError(f"model_type {model_type!r} with attention_bias/mlp_bias is not supported")
        max_pos = int(hf_config.max_position_embeddings)
        layer_types = getattr(hf_config, "layer_types", None) or ()
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"model_type {model_type!r} with sliding-window layers {set(layer_types)} is not supported"
            )
        if model_type == "mistral":
            window = getattr(hf_config, "sliding_window", None)
            if window is not None and window < max_pos:
                raise ValueError(
                    f"model_type 'mistral' with sliding_window={window} < max_position_embeddings={max_pos} "
                    "is not supported (the window would change attention)"
                )
        heads = int(hf_config.num_attention_heads)
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        if "rope_theta" not in rope:  # pre-5.x style configs kept the theta outside
            rope["rope_theta"] = float(getattr(hf_config, "rope_theta", None) or 10000.0)
        return cls(
            family=family,
            vocab_size=int(hf_config.vocab_size),
            hidden_size=int(hf_config.hidden_size),
            intermediate_size=int(hf_config.intermediate_size),
            num_layers=int(hf_config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
            # Qwen2Config has no head_dim attribute; Llama's may be None.
            head_dim=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads),
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=float(rope["rope_theta"]),
            rope_scaling=rope,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            max_position_embeddings=max_pos,
        )


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


class Dense(nnx.Module):
    """``y[..., out] = x[..., in] . kernel[in, out] (+ bias[out])`` with multi-dim in/out.

    ``in_shape``/``out_shape`` may have several dims (e.g. out = (heads, head_dim)), so the
    kernel stores heads as their own axis and sharding never has to split a fused dim.
    """

    def __init__(self, in_shape, out_shape, in_axes, out_axes, *, use_bias: bool, dtype, param_dtype, rngs: nnx.Rngs):
        self.n_in = len(in_shape)
        self.dtype = dtype
        init = jax.nn.initializers.normal(0.02)
        shape = tuple(in_shape) + tuple(out_shape)
        self.kernel = _param(init(rngs.params(), shape, param_dtype), tuple(in_axes) + tuple(out_axes))
        self.bias = _param(jnp.zeros(tuple(out_shape), param_dtype), tuple(out_axes)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.tensordot(x.astype(self.dtype), self.kernel[...].astype(self.dtype), axes=self.n_in)
        if self.bias is not None:
            y = per_feature(jnp.add, y, self.bias[...], self.dtype)
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


def attention_implementation(q: jax.Array) -> str:
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
    Through ``jax.nn.dot_product_attention`` (``attention_implementation``): on XLA it is
    ``attend``'s computation (scores in float32, masked, softmax in float32), in fp32 equal to
    it within 1e-6 (tested).  A padding query (t >= lengths[b]) reads the row's valid keys, as
    it does in ``attend``; its output is never used.  A row of length 0 (a padding row of a
    micro batch) is given one key: cuDNN is not asked what an empty key range means.
    """
    kv_lengths = jnp.maximum(lengths, 1).astype(jnp.int32)
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=scale,
        is_causal=True,
        key_value_seq_lengths=kv_lengths,
        implementation=attention_implementation(q),
    )


def attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, scale: float) -> jax.Array:
    """Grouped-query softmax attention.

    q [B, T, H, D]; k, v [B, S, KV, D]; allowed [B, T, S] bool (query t may read key s).
    Returns [B, T, H, D] in q's dtype.  Rows with no allowed key (padding queries) get a
    uniform distribution instead of NaN: masking uses the finite float32 minimum.
    """
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)  # (B, T, KV, G, D): head h = kv * G + g, as repeat_kv
    # Scores leave the matmul in float32 and are scaled there (bf16 compute: not rounded to
    # bf16 first), as in jax.nn.dot_product_attention: the plain and explicit-mask paths agree.
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale  # (B, KV, G, T, S)
    scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)  # (B, T, KV, G, D)
    return out.reshape(b, t, h, d)  # (B, T, H, D)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        e, h, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = Dense((e,), (h, d), ("embed",), ("heads", "head_dim"), use_bias=cfg.qkv_bias, **kw)
        self.k_proj = Dense((e,), (kv, d), ("embed",), ("kv_heads", "head_dim"), use_bias=cfg.qkv_bias, **kw)
        self.v_proj = Dense((e,), (kv, d), ("embed",), ("kv_heads", "head_dim"), use_bias=cfg.qkv_bias, **kw)
        self.o_proj = Dense((h, d), (e,), ("heads", "head_dim"), ("embed",), use_bias=False, **kw)
        self.scale = d**-0.5
        self.dtype = dtype

    def __call__(self, x, cos, sin, allowed, cache=None, cache_index=None):
        """x [B, T, E] -> ([B, T, E], new (k, v) cache or None).

        Without a cache the keys are this call's own tokens (``allowed`` [B, T, T], or
        ``RightPadded`` for plain right-padded rows: causal, flash attention on GPU); with a
        cache (k, v [B, L, KV, D]) the new keys/values are written at slots
        ``cache_index .. cache_index + T - 1`` and the queries read all L slots
        (``allowed`` [B, T, L]).
        """
        q = constrain(apply_rope(self.q_proj(x), cos, sin), HEADS_AXES)  # (B, T, H, D)
        k = apply_rope(self.k_proj(x), cos, sin)  # (B, T, KV, D)
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
        else:
            out = attend(q, k, v, allowed, self.scale)  # (B, T, H, D)
        return self.o_proj(constrain(out, HEADS_AXES)), new_cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        e, m = cfg.hidden_size, cfg.intermediate_size
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = Dense((e,), (m,), ("embed",), ("mlp",), **kw)
        self.up_proj = Dense((e,), (m,), ("embed",), ("mlp",), **kw)
        self.down_proj = Dense((m,), (e,), ("mlp",), ("embed",), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x), MLP_AXES)  # (B, T, M)
        return self.down_proj(h)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = Attention(cfg, rngs=rngs, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, rngs=rngs, **kw)

    def __call__(self, x, cos, sin, allowed, cache=None, cache_index=None):
        h, new_cache = self.self_attn(self.input_layernorm(x), cos, sin, allowed, cache, cache_index)
        x = constrain(x + h, RESIDUAL_AXES)
        x = constrain(x + self.mlp(self.post_attention_layernorm(x)), RESIDUAL_AXES)
        return x, new_cache


def _block(layer: DecoderLayer, h, cos, sin, allowed) -> jax.Array:
    """One decoder layer of the full forward (no cache)."""
    return layer(h, cos, sin, allowed)[0]


#: ``_block`` rematerialised: its activations are recomputed in the backward pass, so a
#: layer keeps only its input alive between forward and backward (``jax.checkpoint``, no
#: saveable intermediates; ``prevent_cse`` stays on, as a Python loop of layers needs).
_remat_block = nnx.remat(_block)


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


# --------------------------------------------------------------------------- the model

KVCache = tuple[tuple[jax.Array, jax.Array], ...]


class CausalLM(nnx.Module):
    """Llama / Qwen2 decoder-only LM.

    ``dtype`` is the compute dtype (activations, matmuls; logits are returned in it),
    ``param_dtype`` the storage dtype of the parameters.
    """

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        self.param_dtype = param_dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.embed_tokens = Embed(cfg.padded_vocab_size, cfg.hidden_size, rngs=rngs, **kw)
        # A Python loop over per-layer modules, not an ``nnx.scan`` over stacked layer params.
        # Scanning needs the layers stacked: stored stacked, every user of the per-layer
        # layout changes (hf_mapping's ``layers/{i}/...`` rows, the sharding rules, orbax
        # checkpoints -- old ones no longer load -- and refit); stacked inside each step, every
        # layer's weights and gradients are copied once more per micro batch.  The loop's cost
        # is compile time linear in depth, and it is small: the fp32 grad step of a tiny Llama
        # (hidden 64, batch 2 x 64) traced + compiled in 1.1 / 1.2 / 1.5 / 2.3 / 4.7 / 10.6 s
        # for 2 / 4 / 8 / 16 / 32 / 64 layers on 2 CPU cores (~0.14 s per layer; remat: 2.8 s
        # at 2 layers, 4.7 s at 16, 15.9 s at 64 on a busier machine).  A 1B Llama has 16.
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs, **kw) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        # Tied models have no lm_head: logits = h @ embedding.T.
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Dense(
                (cfg.hidden_size,), (cfg.padded_vocab_size,), ("embed",), ("vocab",), use_bias=False, rngs=rngs, **kw
            )
        )

    # -- pieces shared by the full forward and decoding

    def _embed(self, input_ids: jax.Array) -> jax.Array:
        return constrain(self.embed_tokens(input_ids), RESIDUAL_AXES)  # (B, S, E)

    def _logits(self, h: jax.Array) -> jax.Array:
        h = self.norm(h)
        logits = self.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)  # (B, S, Vp)
        if self.cfg.is_vocab_padded:
            # Padding columns (ids >= vocab_size) -> the dtype's lowest finite value: no
            # probability after any softmax (exp underflows to exactly 0), never sampled, and
            # `where` sends them zero gradient (so the zero padding rows stay zero under AdamW).
            # Finite, not -inf, so p * log p (entropy) stays 0 instead of NaN.
            real = jnp.arange(logits.shape[-1]) < self.cfg.vocab_size  # (Vp,)
            logits = jnp.where(real, logits, jnp.finfo(logits.dtype).min)
        return constrain(logits, LOGITS_AXES)

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None,
        positions: jax.Array | None = None,
        allowed: jax.Array | None = None,
        remat: bool = False,
    ) -> jax.Array:
        """Logits [B, S, V] (compute dtype) of right-padded ``input_ids`` [B, S].

        ``attention_mask`` [B, S]: 1 for real tokens, then 0 for padding -- right padding only:
        each row's keys are its first ``attention_mask.sum()`` tokens (``RightPadded``), which
        lets attention run as flash attention on GPU (``causal_attention``).  Padding keys are
        never attended to; padding queries produce finite, meaningless logits.  ``positions``
        [B, S] int defaults to 0..S-1 on every row.

        ``allowed`` [B, S, S] bool (query i may read key j) replaces that mask (``attention_mask``
        is then not read and may be None): packed rows (attention confined to each sequence),
        context parallelism (columns permuted for load balance) and any other padding pass
        the mask of ``core.data.context_parallel.attention_allowed`` with matching ``positions``.

        ``remat``: recompute each decoder layer in the backward pass instead of keeping its
        activations (``jax.checkpoint``; ``policy.jax_cfg.activation_checkpointing``).
        """
        b, s = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, :], (b, s))  # (B, S)
        if allowed is None:
            allowed = RightPadded(jnp.sum(attention_mask.astype(jnp.int32), axis=-1))  # (B,)
        cos, sin = rope_cos_sin(self.cfg, positions, self.dtype)
        h = self._embed(input_ids)
        block = _remat_block if remat else _block
        for layer in self.layers:
            h = block(layer, h, cos, sin, allowed)
        return self._logits(h)

    # -- KV-cache decoding

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """Zeroed cache: one (k, v) pair per layer, each [B, max_len, kv_heads, head_dim]."""
        shape = (batch, max_len, self.cfg.num_kv_heads, self.cfg.head_dim)
        dtype = dtype or self.dtype
        return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(self.cfg.num_layers))

    def decode(
        self, input_ids: jax.Array, positions: jax.Array, cache: KVCache, cache_index, attention_mask_full: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """Run T new tokens per row against the cache: prefill (T = prompt width) or a step (T = 1).

        Args:
            input_ids: [B, T] tokens, written to cache slots ``cache_index .. cache_index+T-1``.
            positions: [B, T] their RoPE positions (with right-padded prompts of length L_b,
                row b's first generated token has position L_b although it sits in slot P).
            cache: from ``init_cache`` (or the previous call).
            cache_index: scalar int (may be traced): the first slot to write.
            attention_mask_full: [B, max_len] 1 for slots holding real tokens, *including*
                the slots written by this call; 0 for prompt padding and unwritten slots.

        Returns:
            (logits [B, T, V], new cache).  Query slot ``cache_index + t`` reads slots
            ``<= cache_index + t`` that the mask marks valid; shapes are static, so one
            compiled program serves every step.
        """
        t = input_ids.shape[1]
        max_len = cache[0][0].shape[1]
        query_slots = cache_index + jnp.arange(t)  # (T,)
        causal = jnp.arange(max_len)[None, :] <= query_slots[:, None]  # (T, L)
        allowed = causal[None] & attention_mask_full.astype(bool)[:, None, :]  # (B, T, L)
        cos, sin = rope_cos_sin(self.cfg, positions, self.dtype)
        h = self._embed(input_ids)
        new_cache = []
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h, layer_cache = layer(h, cos, sin, allowed, layer_cache, cache_index)
            new_cache.append(layer_cache)
        return self._logits(h), tuple(new_cache)


# --------------------------------------------------------------------------- helpers


def params_of(model_or_state: Any) -> nnx.State:
    """The ``nnx.Param`` state of a model (a State is returned as is)."""
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state, nnx.Param)
    return model_or_state


def logical_axes_tree(model_or_state: Any, *, pure: bool = False) -> Any:
    """The logical axes of every parameter, in the structure of the params pytree.

    Default: an ``nnx.State`` shaped exactly like ``nnx.state(model, nnx.Param)`` whose
    Variables hold a tuple of axis names instead of an array (the way
    ``nnx.get_partition_spec`` returns PartitionSpecs).  Because the params tree is a
    prefix of it, ``jax.tree.map(lambda x, axes: ..., params, logical_axes_tree(params))``
    hands each array its tuple.  ``pure=True`` gives nested plain dicts of tuples matching
    ``nnx.to_pure_dict(params)`` instead.  Either form feeds ``sharding.tree_shardings``
    (which treats tuples as leaves).
    """
    state = params_of(model_or_state)

    def axes_of(var):
        axes = var.get_metadata().get("out_sharding")
        if axes is None:
            raise ValueError(f"parameter of shape {var.shape} declares no logical axes")
        return tuple(axes)

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    if pure:
        return _pure_axes(state, axes_of)
    return jax.tree.map(lambda v: v.replace(axes_of(v)), state, is_leaf=is_var)


def _pure_axes(state: nnx.State, axes_of) -> dict:
    """Nested plain dicts (keys as in ``nnx.to_pure_dict``) of each Variable's axes."""
    out: dict = {}
    for path, var in nnx.to_flat_state(state):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = axes_of(var)
    return out


def make_apply_fn(model: CausalLM) -> tuple[Callable, nnx.State]:
    """Split ``model`` into ``(apply_fn, params)`` for pure, jittable steps.

    ``apply_fn(params, input_ids, attention_mask, positions, allowed=None, remat=False) -> logits``
    rebuilds the module from the static graph definition and ``params`` (an ``nnx.State``
    pytree); ``allowed`` and ``remat`` are ``CausalLM.__call__``'s.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def apply_fn(params, input_ids, attention_mask, positions=None, allowed=None, remat=False):
        return nnx.merge(graphdef, params, rest)(input_ids, attention_mask, positions, allowed, remat)

    return apply_fn, params


def abstract_model(cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32) -> CausalLM:
    """A ``CausalLM`` whose params are ``ShapeDtypeStruct``s (no memory, no init compute);
    fill it with ``hf_mapping.load_hf_weights`` or ``nnx.update``."""
    return nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))


def param_shapes(cfg: ModelConfig) -> dict[tuple, tuple[int, ...]]:
    """``{state path: shape}`` of every parameter, e.g. ``("layers", 0, "mlp", "up_proj", "kernel")``."""
    return dict(_param_shapes(cfg))


@functools.lru_cache(maxsize=32)
def _param_shapes(cfg: ModelConfig) -> tuple:
    state = nnx.state(abstract_model(cfg), nnx.Param)
    return tuple((tuple(path), tuple(var.shape)) for path, var in nnx.to_flat_state(state))


__all__ = [
    "ModelConfig",
    "CausalLM",
    "KVCache",
    "constrain",
    "set_activation_constraint",
    "activation_constraint",
    "logical_axes_tree",
    "make_apply_fn",
    "abstract_model",
    "param_shapes",
    "rope_inv_freq",
    "params_of",
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
]
