"""Gemma 3 text decoder (HF ``model_type`` gemma3_text, ``Gemma3ForCausalLM``), matching
transformers 5.19's ``modeling_gemma3.py``.

What differs from the Llama decoder (``llama``):

* the token embedding is scaled by sqrt(hidden) (the factor rounded to the compute dtype);
* RMSNorm scales by ``1 + weight`` and casts after the scaling (``GemmaRMSNorm``; weights init 0);
* sandwich norms: attention and MLP outputs are normalised (``post_attention_layernorm``,
  ``post_feedforward_layernorm``) before the residual add, the MLP input by
  ``pre_feedforward_layernorm``;
* per-head ``q_norm`` / ``k_norm`` before RoPE; scores scaled by ``query_pre_attn_scalar**-0.5``;
* GeGLU MLP (tanh-approximated GELU, HF ``gelu_pytorch_tanh``);
* ``layer_types``: "sliding_attention" layers read only the last ``sliding_window`` tokens
  (query position - key position < window) and use their own RoPE parameters
  (``rope_parameters["sliding_attention"]``); "full_attention" layers are causal over all
  tokens with ``rope_parameters["full_attention"]`` ("default" or "linear");
* optional final-logit soft-capping ``cap * tanh(logits / cap)``.

The window is measured in token *positions*, so it stays exact wherever the model is given
positions: packed rows (positions restart per sequence, the mask keeps sequences apart),
context-parallel column permutations, and KV-cache decoding (a valid cache slot's position is
the count of valid slots before it, the layout ``generate`` writes).

Refused by name: the multimodal ``model_type`` "gemma3", ``attn_logit_softcapping`` (HF's
Gemma3 attention stores but never applies it, vLLM's ignores it: there is nothing to match),
bidirectional attention, attention biases, other activations and RoPE types.

Parameter layouts are Llama's (see ``llama``) plus ``self_attn.{q,k}_norm.scale`` [norm] and
the two feed-forward norms.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from backends.jax_pjit.models.banded_attention import Banded
from backends.jax_pjit.models.config import ModelConfig, _freeze
from backends.jax_pjit.models.hf_table import Row
from backends.jax_pjit.models.layers import (
    LOGITS_AXES,
    MLP,
    RESIDUAL_AXES,
    Attention,
    CachedDecoding,
    Dense,
    Embed,
    KVCache,
    RightPadded,
    _param,
    apply_rope,
    constrain,
    mask_padded_vocab,
    positions_and_mask,
)

__all__ = ["Gemma3Config", "config_from_hf", "CausalLM", "DecoderLayer", "HF_TABLES", "GEMMA3_TABLE"]

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
GEMMA3_ROPE_TYPES = ("default", "linear")
MULTIMODAL_REFUSAL = (
    "Gemma3ForConditionalGeneration (a vision tower) is not supported: the JAX backend serves "
    "the Gemma 3 text model only (model_type 'gemma3_text', Gemma3ForCausalLM)"
)


# --------------------------------------------------------------------------- the config


def _rope_pairs(rope: Any) -> tuple:
    """A rope-parameter dict as sorted (key, value) pairs (hashable; ``None`` -> default)."""
    rope = dict(rope or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return tuple(sorted((k, _freeze(v)) for k, v in rope.items()))


@dataclasses.dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    """``ModelConfig`` plus Gemma 3's fields.  ``rope_scaling`` / ``rope_theta`` are the
    full-attention layers' RoPE; ``sliding_rope`` the sliding layers' (sorted pairs, like
    ``rope_scaling``)."""

    supported_rope_types: ClassVar[tuple[str, ...]] = GEMMA3_ROPE_TYPES

    layer_types: tuple[str, ...] = ()
    sliding_window: int = 4096
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None
    sliding_rope: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "sliding_rope", _rope_pairs(self.sliding_rope))
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(
                f"model_type 'gemma3_text' needs layer_types: {self.num_layers} entries of {LAYER_TYPES}, "
                f"got {self.layer_types}"
            )
        sliding_type = dict(self.sliding_rope)["rope_type"]
        if sliding_type not in GEMMA3_ROPE_TYPES:
            raise ValueError(
                f"model_type 'gemma3_text' with rope_parameters['sliding_attention'] rope_type {sliding_type!r} "
                f"is not supported (the JAX model implements {GEMMA3_ROPE_TYPES})"
            )
        if self.sliding_window < 1:
            raise ValueError(f"model_type 'gemma3_text' with sliding_window={self.sliding_window} is not supported")

    def rope_of(self, layer_type: str) -> tuple:
        """The RoPE parameters (sorted pairs) of a layer type."""
        return self.sliding_rope if layer_type == SLIDING else self.rope_scaling


def _refuse(model_type: str, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"model_type {model_type!r} with {field}={value!r} is not supported: {why}")


def config_from_hf(hf_config: Any, model_type: str, family: str) -> Gemma3Config:
    """Read a transformers 5.x ``Gemma3TextConfig``; ``ValueError`` naming the ``model_type``
    and the field for options this model does not implement."""
    if model_type != "gemma3_text":
        raise ValueError(f"model_type {model_type!r}: {MULTIMODAL_REFUSAL}")
    act = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise _refuse(model_type, "hidden_activation", act, "only 'gelu_pytorch_tanh'")
    if getattr(hf_config, "attention_bias", False):
        raise _refuse(model_type, "attention_bias", True, "Gemma 3 has no attention biases")
    if getattr(hf_config, "attn_logit_softcapping", None) is not None:
        raise _refuse(
            model_type,
            "attn_logit_softcapping",
            hf_config.attn_logit_softcapping,
            "transformers' Gemma3 attention never applies it and vLLM's ignores it; set it to null",
        )
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise _refuse(model_type, "use_bidirectional_attention", True, "the JAX model is causal only")
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    full_rope, sliding_rope = dict(rope.get(FULL) or {}), dict(rope.get(SLIDING) or {})
    if "rope_theta" not in full_rope or "rope_theta" not in sliding_rope:
        raise _refuse(model_type, "rope_parameters", rope, "needs a rope_theta per layer type")
    heads = int(hf_config.num_attention_heads)
    softcap = getattr(hf_config, "final_logit_softcapping", None)
    return Gemma3Config(
        family=family,
        vocab_size=int(hf_config.vocab_size),
        hidden_size=int(hf_config.hidden_size),
        intermediate_size=int(hf_config.intermediate_size),
        num_layers=int(hf_config.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=float(full_rope["rope_theta"]),
        rope_scaling=full_rope,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        layer_types=tuple(hf_config.layer_types),
        sliding_window=int(hf_config.sliding_window),
        query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar),
        final_logit_softcapping=None if softcap is None else float(softcap),
        sliding_rope=sliding_rope,
    )


# --------------------------------------------------------------------------- RoPE


@functools.cache
def rope_inv_freq(rope: tuple, head_dim: int) -> np.ndarray:
    """``inv_freq`` [head_dim // 2] float32 of one layer type, as HF computes it ("default":
    the float32 torch expression mirrored in numpy; "linear": that divided by ``factor``)."""
    params = dict(rope)
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (np.arange(0, head_dim, 2).astype(np.float32) / head_dim))
    if params["rope_type"] == "linear":
        inv_freq = inv_freq / np.float32(params["factor"])
    return inv_freq.astype(np.float32)


def rope_cos_sin(rope: tuple, head_dim: int, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, S, head_dim] in ``dtype`` for integer ``positions`` [B, S] (attention
    scaling is 1.0 for both supported types)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(rope, head_dim))
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # (B, S, D)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


# --------------------------------------------------------------------------- layers


class GemmaRMSNorm(nnx.Module):
    """HF ``Gemma3RMSNorm``: normalise in float32, scale by ``1 + weight`` in float32, then cast.

    The weight is rounded to the compute dtype first (as the torch backends' bf16 params are);
    its gradient is summed in float32 (see ``layers.per_feature``)."""

    def __init__(self, size: int, eps: float, *, dtype, param_dtype):
        self.eps = eps
        self.dtype = dtype
        self.scale = _param(jnp.zeros((size,), param_dtype), ("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        w = self.scale[...].astype(jnp.result_type(x.dtype, self.dtype)).astype(jnp.float32)
        return (h * (1.0 + w)).astype(x.dtype)


class GemmaMLP(MLP):
    """GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``."""

    activation = staticmethod(functools.partial(jax.nn.gelu, approximate=True))


class GemmaAttention(Attention):
    """Grouped-query attention with per-head q/k RMSNorm before RoPE and Gemma's score scale."""

    def __init__(self, cfg: Gemma3Config, *, dtype, param_dtype, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # nnx.data: the base class left these slots None (static) -- its q/k norms are Qwen3's.
        self.q_norm = nnx.data(GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype))
        self.k_norm = nnx.data(GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype))
        self.scale = cfg.query_pre_attn_scalar**-0.5

    def project_qk(self, x, cos, sin):
        q = apply_rope(self.q_norm(self.q_proj(x)), cos, sin)
        return q, apply_rope(self.k_norm(self.k_proj(x)), cos, sin)


class DecoderLayer(nnx.Module):
    """Sandwich-norm decoder layer: x + post_attn(attn(input(x))), then x + post_ff(mlp(pre_ff(x)))."""

    def __init__(self, cfg: Gemma3Config, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        norm = functools.partial(GemmaRMSNorm, cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.input_layernorm = norm()
        self.self_attn = GemmaAttention(cfg, rngs=rngs, **kw)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GemmaMLP(cfg, rngs=rngs, **kw)
        self.post_feedforward_layernorm = norm()

    def __call__(self, x, cos, sin, allowed, cache=None, cache_index=None):
        h, new_cache = self.self_attn(self.input_layernorm(x), cos, sin, allowed, cache, cache_index)
        x = constrain(x + self.post_attention_layernorm(h), RESIDUAL_AXES)
        h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return constrain(x + h, RESIDUAL_AXES), new_cache


def _block(layer: DecoderLayer, h, cos, sin, allowed) -> jax.Array:
    return layer(h, cos, sin, allowed)[0]


_remat_block = nnx.remat(_block)


def _explicit(mask: jax.Array | RightPadded | Banded, width: int) -> jax.Array:
    """A ``RightPadded`` mask (causal, keys < length) or a ``Banded`` one as the [B, S, S] bool
    it stands for: Gemma's sliding-window layers combine it with their window."""
    if isinstance(mask, Banded):
        return mask.dense(width)
    if not isinstance(mask, RightPadded):
        return mask
    causal = jnp.tril(jnp.ones((width, width), bool))  # (S, S)
    keys = jnp.arange(width)[None, :] < mask.lengths[:, None]  # (B, S)
    return causal[None] & keys[:, None, :]


def _in_window(query_pos: jax.Array, key_pos: jax.Array, window: int) -> jax.Array:
    """[B, T, S] bool: key within the last ``window`` positions of the query (HF's
    ``kv_idx > q_idx - sliding_window``); causality comes from the mask it is combined with."""
    return (query_pos[:, :, None] - key_pos[:, None, :]) < window


# --------------------------------------------------------------------------- the model


class CausalLM(CachedDecoding, nnx.Module):
    """Gemma 3 decoder-only LM (tied embeddings unless the config unties them).

    Same interface as ``llama.CausalLM`` (``__call__``, ``init_cache``, ``decode``,
    ``decode_hidden`` and the ``_embed`` / ``_logits`` pieces); per layer it picks the mask and
    RoPE of the layer's type.
    """

    def __init__(self, cfg: Gemma3Config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        self.param_dtype = param_dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        stored_vocab = cfg.padded_vocab_size
        if stored_vocab is None:
            raise ValueError("ModelConfig.padded_vocab_size is not set")
        self.embed_tokens = Embed(stored_vocab, cfg.hidden_size, rngs=rngs, **kw)
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs, **kw) for _ in range(cfg.num_layers)])
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Dense((cfg.hidden_size,), (stored_vocab,), ("embed",), ("vocab",), use_bias=False, rngs=rngs, **kw)
        )

    def _embed(self, input_ids: jax.Array) -> jax.Array:
        # HF multiplies by sqrt(hidden) rounded to the embedding's dtype (55.4256 -> 55.5 in bf16).
        normalizer = jnp.asarray(self.cfg.hidden_size**0.5, self.dtype)
        return constrain(self.embed_tokens(input_ids) * normalizer, RESIDUAL_AXES)

    def _logits(self, h: jax.Array) -> jax.Array:
        h = self.norm(h)
        logits = self.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)  # (B, S, Vp)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = jnp.tanh(logits / cap) * cap
        if self.cfg.is_vocab_padded:  # after the cap, or padding would read -cap
            logits = mask_padded_vocab(logits, self.cfg.vocab_size)
        return constrain(logits, LOGITS_AXES)

    def _per_type(self, positions: jax.Array, full_mask, sliding_mask) -> dict[str, tuple[jax.Array, jax.Array, Any]]:
        """layer type -> (cos, sin, mask)."""
        d = self.cfg.head_dim
        out = {}
        for layer_type, mask in ((FULL, full_mask), (SLIDING, sliding_mask)):
            if layer_type in self.cfg.layer_types:
                out[layer_type] = (*rope_cos_sin(self.cfg.rope_of(layer_type), d, positions, self.dtype), mask)
        return out

    def __call__(self, input_ids, attention_mask, positions=None, allowed=None, remat: bool = False) -> jax.Array:
        """Logits [B, S, V]; the arguments are ``llama.CausalLM.__call__``'s.  Sliding layers
        read keys whose position is within ``sliding_window`` of the query's."""
        positions, mask = positions_and_mask(input_ids, attention_mask, positions, allowed)
        sliding = None
        if SLIDING in self.cfg.layer_types:
            sliding = _explicit(mask, input_ids.shape[1]) & _in_window(positions, positions, self.cfg.sliding_window)
        per_type = self._per_type(positions, mask, sliding)
        h = self._embed(input_ids)
        block = _remat_block if remat else _block
        for layer, layer_type in zip(self.layers, self.cfg.layer_types, strict=True):
            h = block(layer, h, *per_type[layer_type])
        return self._logits(h)

    def decode_hidden(
        self, input_ids: jax.Array, positions: jax.Array, cache: KVCache, cache_index, attention_mask_full: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """``llama.CausalLM.decode_hidden`` with sliding layers: a valid slot's position is the
        number of valid slots before it (prompt tokens from 0, then the generated tokens, as
        ``generate`` lays them out), and sliding layers read the slots within the window."""
        t = input_ids.shape[1]
        max_len = cache[0][0].shape[1]
        query_slots = cache_index + jnp.arange(t)  # (T,)
        causal = jnp.arange(max_len)[None, :] <= query_slots[:, None]  # (T, L)
        valid = attention_mask_full.astype(jnp.int32)
        allowed = causal[None] & valid.astype(bool)[:, None, :]  # (B, T, L)
        key_pos = jnp.cumsum(valid, axis=1) - 1  # (B, L)
        sliding = allowed & _in_window(positions, key_pos, self.cfg.sliding_window)
        per_type = self._per_type(positions, allowed, sliding)
        h = self._embed(input_ids)
        new_cache = []
        for layer, layer_type, layer_cache in zip(self.layers, self.cfg.layer_types, cache, strict=True):
            cos, sin, mask = per_type[layer_type]
            h, layer_cache = layer(h, cos, sin, mask, layer_cache, cache_index)
            new_cache.append(layer_cache)
        return h, tuple(new_cache)


# --------------------------------------------------------------------------- HF names

_LAYER = "model.layers.{i}."
_JLAYER = "layers/{i}/"


def _norm_row(hf: str, jax_path: str) -> Row:
    return Row(_LAYER + hf + ".weight", _JLAYER + jax_path + "/scale", "norm")


GEMMA3_TABLE: tuple[Row, ...] = (
    Row("model.embed_tokens.weight", "embed_tokens/embedding", "embedding", vocab_dim=0),
    _norm_row("input_layernorm", "input_layernorm"),
    Row(_LAYER + "self_attn.q_proj.weight", _JLAYER + "self_attn/q_proj/kernel", "linear"),
    Row(_LAYER + "self_attn.k_proj.weight", _JLAYER + "self_attn/k_proj/kernel", "linear"),
    Row(_LAYER + "self_attn.v_proj.weight", _JLAYER + "self_attn/v_proj/kernel", "linear"),
    Row(_LAYER + "self_attn.o_proj.weight", _JLAYER + "self_attn/o_proj/kernel", "linear_heads_in"),
    _norm_row("self_attn.q_norm", "self_attn/q_norm"),
    _norm_row("self_attn.k_norm", "self_attn/k_norm"),
    _norm_row("post_attention_layernorm", "post_attention_layernorm"),
    _norm_row("pre_feedforward_layernorm", "pre_feedforward_layernorm"),
    Row(_LAYER + "mlp.gate_proj.weight", _JLAYER + "mlp/gate_proj/kernel", "linear"),
    Row(_LAYER + "mlp.up_proj.weight", _JLAYER + "mlp/up_proj/kernel", "linear"),
    Row(_LAYER + "mlp.down_proj.weight", _JLAYER + "mlp/down_proj/kernel", "linear"),
    _norm_row("post_feedforward_layernorm", "post_feedforward_layernorm"),
    Row("model.norm.weight", "norm/scale", "norm"),
    Row("lm_head.weight", "lm_head/kernel", "linear", untied_only=True, vocab_dim=1),
)

#: Family -> its HF name table (``hf_mapping``: import, export, refit).
HF_TABLES: dict[str, tuple[Row, ...]] = {"gemma3": GEMMA3_TABLE}
