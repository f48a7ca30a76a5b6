"""``policy.numerics: exact`` for the torch backends' HF models: layers whose every reduction
runs on fixed shapes (``core.kernels.exact``), swapped into the model in place.

:func:`apply_exact_numerics` turns a Llama / Qwen2 / Qwen3 ``*ForCausalLM`` into its exact
form without changing its parameters, names or state dict:

* every ``nn.Linear`` becomes :class:`ExactLinear`: the rows are cut into tiles of
  ``ROW_TILE`` and multiplied by one ``bmm`` whose every matrix is [ROW_TILE, in] x [in, out]
  in float32 (bf16 operands are widened: their products are exact in float32), so MKL runs
  one blocking whatever the row count (its fp32 GEMM otherwise picks the blocking, and so
  the order of the sum over ``in``, from the number of rows);
* the RMSNorms become :class:`ExactRMSNorm` (HF's arithmetic, its mean taken over a tile of
  rows, so torch never splits one row's sum over threads, which it does for a single row);
* the SiLU becomes ``x / (1 + exp(-x))``: torch's fp32 ``sigmoid`` runs a vectorised and a
  scalar code path that disagree in the last bit, picked by the element's place in the
  tensor, while ``exp`` and division agree on both paths;
* attention is :func:`exact_attention`, registered with transformers' ``AttentionInterface``
  as ``dualrl_exact``: key blocks in a fixed order with an online softmax, keys at their
  absolute positions (the query positions come from ``position_ids``), so a decode step
  with :class:`ExactKVCache` and the training forward give a query the same bits.

Everything else on a token's path (embedding lookup, RoPE, residual adds, the elementwise
products) is elementwise IEEE arithmetic, the same bits on any shape.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from core.kernels import exact as tiles

ATTENTION_NAME = "dualrl_exact"
#: HF ``model_type`` values whose modules the exact layers cover (dense, full attention).
EXACT_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def fixed_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., M, K] x [..., K, N] -> [..., M, N] as one ``bmm`` of same-shape matrices."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return torch.bmm(a3, b3).view(*batch, a.shape[-2], b.shape[-1])


def _row_tiles(rows: torch.Tensor) -> torch.Tensor:
    """[M, K] -> [M' / tiles.ROW_TILE, tiles.ROW_TILE, K], zero rows appended up to M'."""
    m = rows.shape[0]
    extra = tiles.padded(m, tiles.ROW_TILE) - m
    if extra:
        rows = F.pad(rows, (0, 0, 0, extra))
    return rows.view(-1, tiles.ROW_TILE, rows.shape[-1])


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in row tiles, float32 inside, ``x``'s dtype out."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k).float()
    tiles = _row_tiles(rows)
    w = weight.float().t()
    out = torch.bmm(tiles, w.expand(tiles.shape[0], *w.shape)).reshape(-1, w.shape[1])[: rows.shape[0]]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*lead, w.shape[1])


def exact_silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` as ``x / (1 + exp(-x))`` in float32 (see the module doc)."""
    h = x.float()
    return (h / (1.0 + torch.exp(-h))).to(x.dtype)


class ExactLinear(nn.Linear):
    """``nn.Linear`` through :func:`exact_linear` (same parameters and state dict)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        return exact_linear(input, self.weight, self.bias)


class ExactRMSNorm(nn.Module):
    """HF ``LlamaRMSNorm`` (Qwen2 / Qwen3 share it) with the mean taken over row tiles."""

    weight: nn.Parameter
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        lead, size = hidden_states.shape[:-1], hidden_states.shape[-1]
        h = hidden_states.reshape(-1, size).float()
        tiles = _row_tiles(h)
        variance = (tiles * tiles).mean(-1, keepdim=True).reshape(-1, 1)[: h.shape[0]]
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(input_dtype).reshape(*lead, size)


class ExactSiLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exact_silu(x)


class ExactKVCache:
    """Per-layer keys and values [B, kv heads, L, D], a key stored at the column of its
    position (L a multiple of ``tiles.KEY_BLOCK``), passed to the model as ``exact_cache=``.

    Rows at different positions write different columns in the same step, which HF's caches
    (one write position per call) cannot do; zero-initialised, so unwritten columns hold
    finite values that causal masking gives zero weight.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, length: int, head_dim: int, dtype, device) -> None:
        shape = (batch, kv_heads, tiles.padded(length, tiles.KEY_BLOCK), head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor):
        """Write ``key`` / ``value`` [B, kv, T, D] at columns ``positions`` [B or 1, T]; returns
        the layer's whole (keys, values)."""
        b, kv, t, d = key.shape
        index = positions.expand(b, t)[:, None, :, None].expand(b, kv, t, d)
        self.keys[layer].scatter_(2, index, key.to(self.keys[layer].dtype))
        self.values[layer].scatter_(2, index, value.to(self.values[layer].dtype))
        return self.keys[layer], self.values[layer]


def blocked_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal grouped-query attention, batch invariant: [B, H, T, D] queries at ``positions``
    [B or 1, T], keys / values [B, KV, S, D] at positions 0..S-1 -> [B, T, H, D] float32."""
    b, h, t, d = query.shape
    kv = key.shape[1]
    g = h // kv
    rows = t * g
    # Rows of a kv head: its g query heads at each position, position-major.
    q = query.float().view(b, kv, g, t, d).transpose(2, 3).reshape(b, kv, rows, d)
    q_pos = positions.expand(b, t).repeat_interleave(g, dim=1)[:, None, :].expand(b, kv, rows)
    extra = tiles.padded(rows, tiles.QUERY_TILE) - rows
    q = F.pad(q, (0, 0, 0, extra)).view(b, kv, -1, tiles.QUERY_TILE, d)  # padding rows: position 0
    q_pos = F.pad(q_pos, (0, extra)).reshape(b, kv, -1, tiles.QUERY_TILE)
    s = key.shape[2]
    keys = F.pad(key.float(), (0, 0, 0, tiles.padded(s, tiles.KEY_BLOCK) - s))
    values = F.pad(value.float(), (0, 0, 0, tiles.padded(s, tiles.KEY_BLOCK) - s))
    carry = tiles.online_softmax_init(q)
    for start in range(0, keys.shape[2], tiles.KEY_BLOCK):
        k_t = keys[:, :, None, start : start + tiles.KEY_BLOCK].transpose(-1, -2)  # (B, KV, 1, D, KB)
        scores = tiles.block_scores(q, k_t, q_pos, start, scale, fixed_matmul)
        carry = tiles.online_softmax_update(
            carry, scores, values[:, :, None, start : start + tiles.KEY_BLOCK], fixed_matmul
        )
    out = tiles.online_softmax_result(carry).reshape(b, kv, -1, d)[:, :, :rows]
    return out.view(b, kv, t, g, d).permute(0, 2, 1, 3, 4).reshape(b, t, h, d)


def exact_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers ``AttentionInterface`` function ``dualrl_exact``.

    The mask is not read (transformers passes none to an implementation without a mask
    function): attention is causal by position, and right-tiles.padded rows never let a real
    query read a padding key.  ``position_ids`` must reach it (HF passes them through).
    """
    positions = kwargs.get("position_ids")
    if positions is None:
        raise ValueError(f"{ATTENTION_NAME} attention needs position_ids (the query positions)")
    if dropout:
        raise ValueError(f"{ATTENTION_NAME} attention has no dropout (got {dropout})")
    cache: ExactKVCache | None = kwargs.get("exact_cache")
    if cache is not None:
        key, value = cache.update(module.layer_idx, key, value, positions)
    scale = module.head_dim**-0.5 if scaling is None else scaling
    return blocked_attention(query, key, value, positions, scale).to(query.dtype), None


def apply_exact_numerics(model: Any) -> Any:
    """Swap ``model``'s layers for their exact forms in place (parameters untouched); a
    ValueError naming the model type or module this mode does not cover."""
    from transformers import AttentionInterface

    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in EXACT_MODEL_TYPES:
        raise ValueError(
            f"policy.numerics=exact: model_type {model_type!r} is not covered (exact layers exist for "
            f"{', '.join(EXACT_MODEL_TYPES)})"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"policy.numerics=exact: hidden_act {config.hidden_act!r} is not covered (only silu)")
    AttentionInterface.register(ATTENTION_NAME, exact_attention)
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear:
            module.__class__ = ExactLinear
        elif type(module).__name__.endswith("RMSNorm"):
            module.__class__ = ExactRMSNorm
        elif hasattr(module, "act_fn"):
            module.act_fn = ExactSiLU()
        _check_covered(name, module)
    model.set_attn_implementation(ATTENTION_NAME)
    return model


def _check_covered(name: str, module: nn.Module) -> None:
    """Refuse a module with its own parameters that no exact layer replaced."""
    own = [p for p, _ in module.named_parameters(recurse=False)]
    if own and not isinstance(module, (ExactLinear, ExactRMSNorm, nn.Embedding)):
        raise ValueError(
            f"policy.numerics=exact: module {name!r} ({type(module).__name__}, parameters {own}) has no exact form"
        )
