"""The Llama-family decoder: ``model_type`` llama, qwen2, qwen3 and (window-free) mistral.

Pre-norm decoder layers (RMSNorm -> grouped-query attention with RoPE -> residual,
RMSNorm -> SwiGLU MLP -> residual), a final RMSNorm and an output projection (or the tied
embedding), built from ``layers``.  Qwen2 is the same decoder with q/k/v biases; Mistral
is Llama with a sliding window, accepted only where the window never binds.

Qwen3 (dense) is this decoder plus a per-head RMSNorm of queries and keys over ``head_dim``
before RoPE (``ModelConfig.qk_norm``), with ``head_dim`` read from the config rather than
``hidden / heads``.  It is served here, as its own family (own HF table: two more rows),
rather than by a new module: a copy of the layer stack, cache and decode for two norms
would be the drifting duplicate the design warns about.  Its sliding window (``use_sliding_window``
/ ``layer_types``) and ``attention_bias`` (which biases o_proj too) are refused by name.

What a family module provides (the registry in ``backends.jax_pjit.models`` reads it):
``config_from_hf`` (HF config -> ``ModelConfig``, refusing what the model does not
implement), ``CausalLM`` (the flax module) and ``HF_TABLES`` (family -> HF name table).

Layouts (logical axes):
    embed_tokens.embedding       [vocab, embed]
    *.q_proj.kernel / bias       [embed, heads, head_dim] / [heads, head_dim]
    *.k_proj, v_proj .kernel     [embed, kv_heads, head_dim] (bias [kv_heads, head_dim])
    *.o_proj.kernel              [heads, head_dim, embed]
    *.gate_proj, up_proj .kernel [embed, mlp];  down_proj.kernel [mlp, embed]
    *_layernorm.scale, norm.scale [norm]
    *.q_norm.scale, k_norm.scale [norm]   (qwen3: over head_dim, shared by the heads)
    lm_head.kernel               [embed, vocab]   (absent when tied: logits = h @ embedding.T)
The stored vocab dim is ``cfg.padded_vocab_size`` (zero-padded for tensor parallelism; the
padded logits are masked in ``CausalLM._logits``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from backends.jax_pjit.models.banded_attention import Banded
from backends.jax_pjit.models.config import ModelConfig
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
    RMSNorm,
    constrain,
    mask_padded_vocab,
    positions_and_mask,
    rope_cos_sin,
)

__all__ = ["config_from_hf", "CausalLM", "DecoderLayer", "HF_TABLES", "LLAMA_TABLE", "QWEN2_TABLE", "QWEN3_TABLE"]


# --------------------------------------------------------------------------- the HF config


def config_from_hf(hf_config: Any, model_type: str, family: str) -> ModelConfig:
    """Read a transformers 5.x ``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config`` (/ window-free ``MistralConfig``)
    whose ``model_type`` the registry maps to ``family``; ``ValueError`` naming the
    ``model_type`` and the option for options this model does not implement."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"model_type {model_type!r} with hidden_act={act!r} is not supported (only 'silu')")
    for field in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, field, False):
            raise ValueError(f"model_type {model_type!r} with {field}=True is not supported")
    max_pos = int(hf_config.max_position_embeddings)
    _check_no_binding_window(hf_config, model_type, max_pos)
    heads = int(hf_config.num_attention_heads)
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    if "rope_theta" not in rope:  # pre-5.x style configs kept the theta outside
        rope["rope_theta"] = float(getattr(hf_config, "rope_theta", None) or 10000.0)
    return ModelConfig(
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
        qk_norm=family == "qwen3",
        max_position_embeddings=max_pos,
    )


def _check_no_binding_window(hf_config: Any, model_type: str, max_pos: int) -> None:
    """Refuse a sliding window that would change attention; accept one that never binds.

    HF marks windowed layers in ``layer_types`` ("sliding_attention"; Qwen2/Qwen3 derive them
    from ``use_sliding_window`` and ``max_window_layers``); Mistral and Qwen3-MoE window every
    layer through ``sliding_window`` alone (Qwen's configs set it to None unless
    ``use_sliding_window``).  A window of at least ``max_position_embeddings``
    tokens masks nothing, so the full-attention model computes the same thing.
    """
    layer_types = tuple(getattr(hf_config, "layer_types", None) or ())
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"model_type {model_type!r} with layer_types {sorted(unknown)} is not supported")
    # Without layer_types (Mistral, Qwen3-MoE) a window, when set, applies to every layer.
    windowed = "sliding_attention" in layer_types or not layer_types
    window = getattr(hf_config, "sliding_window", None)
    if windowed and window is not None and window < max_pos:
        raise ValueError(
            f"model_type {model_type!r} with sliding_window={window} < max_position_embeddings={max_pos} "
            f"(use_sliding_window={getattr(hf_config, 'use_sliding_window', None)}, layer_types has "
            f"{layer_types.count('sliding_attention')} sliding_attention layers) is not supported "
            "(the window would change attention)"
        )


# --------------------------------------------------------------------------- the model


class DecoderLayer(nnx.Module):
    """``mlp`` builds the layer's MLP from ``(cfg, dtype=, param_dtype=, rngs=)``: the dense
    SwiGLU ``MLP`` here, a mixture of experts on Qwen3-MoE's sparse layers."""

    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs, mlp: Callable[..., nnx.Module] = MLP):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = Attention(cfg, rngs=rngs, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = mlp(cfg, rngs=rngs, **kw)

    def __call__(self, x, cos, sin, allowed, cache=None, cache_index=None, replay=None):
        """``replay`` [B, S, top_k]: the experts a sparse layer's tokens go to (routing replay)."""
        h, new_cache = self.self_attn(self.input_layernorm(x), cos, sin, allowed, cache, cache_index)
        x = constrain(x + h, RESIDUAL_AXES)
        h = self.post_attention_layernorm(x)
        x = constrain(x + (self.mlp(h) if replay is None else self.mlp(h, replay)), RESIDUAL_AXES)
        return x, new_cache


def _block(layer: DecoderLayer, h, cos, sin, allowed, replay=None) -> jax.Array:
    """One decoder layer of the full forward (no cache)."""
    return layer(h, cos, sin, allowed, replay=replay)[0]


#: ``_block`` rematerialised: its activations are recomputed in the backward pass, so a
#: layer keeps only its input alive between forward and backward (``jax.checkpoint``, no
#: saveable intermediates; ``prevent_cse`` stays on, as a Python loop of layers needs).
_remat_block = nnx.remat(_block)


class CausalLM(CachedDecoding, nnx.Module):
    """Llama / Qwen2 / Qwen3 decoder-only LM.

    ``dtype`` is the compute dtype (activations, matmuls; logits are returned in it),
    ``param_dtype`` the storage dtype of the parameters.
    """

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        self.param_dtype = param_dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        stored_vocab = cfg.padded_vocab_size
        if stored_vocab is None:  # ModelConfig.__post_init__ sets it (to vocab_size by default)
            raise ValueError("ModelConfig.padded_vocab_size is not set")
        self.embed_tokens = Embed(stored_vocab, cfg.hidden_size, rngs=rngs, **kw)
        # A Python loop over per-layer modules, not an ``nnx.scan`` over stacked layer params.
        # Scanning needs the layers stacked: stored stacked, every user of the per-layer
        # layout changes (hf_mapping's ``layers/{i}/...`` rows, the sharding rules, orbax
        # checkpoints -- old ones no longer load -- and refit); stacked inside each step, every
        # layer's weights and gradients are copied once more per micro batch.  The loop's cost
        # is compile time linear in depth, and small at the depths RL trains (a 1B Llama has 16
        # layers): docs/results.md#jax-compile-time-by-depth.
        self.layers = nnx.List(
            [DecoderLayer(cfg, rngs=rngs, mlp=self.mlp_class(cfg, i), **kw) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        # Tied models have no lm_head: logits = h @ embedding.T.
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Dense((cfg.hidden_size,), (stored_vocab,), ("embed",), ("vocab",), use_bias=False, rngs=rngs, **kw)
        )

    @staticmethod
    def mlp_class(cfg: ModelConfig, layer: int) -> Callable[..., nnx.Module]:
        """The MLP of decoder layer ``layer``: dense SwiGLU in every layer (a family with
        sparse layers overrides this)."""
        return MLP

    # -- pieces shared by the full forward and decoding

    def _embed(self, input_ids: jax.Array) -> jax.Array:
        return constrain(self.embed_tokens(input_ids), RESIDUAL_AXES)  # (B, S, E)

    def _logits(self, h: jax.Array) -> jax.Array:
        h = self.norm(h)
        logits = self.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)  # (B, S, Vp)
        if self.cfg.is_vocab_padded:
            logits = mask_padded_vocab(logits, self.cfg.vocab_size)
        return constrain(logits, LOGITS_AXES)

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None,
        positions: jax.Array | None = None,
        allowed: jax.Array | Banded | None = None,
        remat: bool = False,
        routing: jax.Array | None = None,
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
        the mask of ``core.data.context_parallel.attention_allowed`` with matching ``positions``;
        packed rows of short sequences may pass its band instead (``Banded``).

        ``remat``: recompute each decoder layer in the backward pass instead of keeping its
        activations (``jax.checkpoint``; ``policy.activation_checkpointing``).

        ``routing`` [sparse layers, B, S, top_k] int: routing replay -- the sparse layers send
        every token to these experts instead of their router's top-k (a mixture of experts only).
        """
        positions, mask = positions_and_mask(input_ids, attention_mask, positions, allowed)
        cos, sin = rope_cos_sin(self.cfg, positions, self.dtype)
        h = self._embed(input_ids)
        block = _remat_block if remat else _block
        for layer, replay in zip(self.layers, self._replays(routing), strict=True):
            h = block(layer, h, cos, sin, mask, replay)
        return self._logits(h)

    def _replays(self, routing: jax.Array | None) -> list[jax.Array | None]:
        """Each layer's slice of ``routing`` (None for dense layers, or without routing)."""
        replays: list[jax.Array | None] = [None] * len(self.layers)
        if routing is None:
            return replays
        sparse = [i for i, layer in enumerate(self.layers) if not isinstance(layer.mlp, MLP)]
        if routing.shape[0] != len(sparse):
            raise ValueError(
                f"routing replay: {routing.shape[0]} layers of expert choices for a model with {len(sparse)} "
                f"sparse layers (model_type family {self.cfg.family!r})"
            )
        for j, i in enumerate(sparse):
            replays[i] = routing[j]
        return replays

    # -- KV-cache decoding

    def decode_hidden(
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
            (hidden states [B, T, E] before the final norm, new cache).  Query slot ``cache_index + t`` reads slots
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
        return h, tuple(new_cache)


# --------------------------------------------------------------------------- HF names

_LAYER = "model.layers.{i}."
_JLAYER = "layers/{i}/"

LLAMA_TABLE: tuple[Row, ...] = (
    Row("model.embed_tokens.weight", "embed_tokens/embedding", "embedding", vocab_dim=0),
    Row(_LAYER + "input_layernorm.weight", _JLAYER + "input_layernorm/scale", "norm"),
    Row(_LAYER + "self_attn.q_proj.weight", _JLAYER + "self_attn/q_proj/kernel", "linear"),
    Row(_LAYER + "self_attn.k_proj.weight", _JLAYER + "self_attn/k_proj/kernel", "linear"),
    Row(_LAYER + "self_attn.v_proj.weight", _JLAYER + "self_attn/v_proj/kernel", "linear"),
    Row(_LAYER + "self_attn.o_proj.weight", _JLAYER + "self_attn/o_proj/kernel", "linear_heads_in"),
    Row(_LAYER + "post_attention_layernorm.weight", _JLAYER + "post_attention_layernorm/scale", "norm"),
    Row(_LAYER + "mlp.gate_proj.weight", _JLAYER + "mlp/gate_proj/kernel", "linear"),
    Row(_LAYER + "mlp.up_proj.weight", _JLAYER + "mlp/up_proj/kernel", "linear"),
    Row(_LAYER + "mlp.down_proj.weight", _JLAYER + "mlp/down_proj/kernel", "linear"),
    Row("model.norm.weight", "norm/scale", "norm"),
    Row("lm_head.weight", "lm_head/kernel", "linear", untied_only=True, vocab_dim=1),
)

QWEN2_TABLE: tuple[Row, ...] = LLAMA_TABLE + (
    Row(_LAYER + "self_attn.q_proj.bias", _JLAYER + "self_attn/q_proj/bias", "bias_heads"),
    Row(_LAYER + "self_attn.k_proj.bias", _JLAYER + "self_attn/k_proj/bias", "bias_heads"),
    Row(_LAYER + "self_attn.v_proj.bias", _JLAYER + "self_attn/v_proj/bias", "bias_heads"),
)

QWEN3_TABLE: tuple[Row, ...] = LLAMA_TABLE + (
    Row(_LAYER + "self_attn.q_norm.weight", _JLAYER + "self_attn/q_norm/scale", "norm"),
    Row(_LAYER + "self_attn.k_norm.weight", _JLAYER + "self_attn/k_norm/scale", "norm"),
)

#: Family -> its HF name table (``hf_mapping``: import, export, refit).
HF_TABLES: dict[str, tuple[Row, ...]] = {"llama": LLAMA_TABLE, "qwen2": QWEN2_TABLE, "qwen3": QWEN3_TABLE}
