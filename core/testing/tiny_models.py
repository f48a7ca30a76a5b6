"""Tiny HF causal LMs and a word-level tokenizer, built from configs on the spot.

Nothing here downloads anything: the models are random-initialised from a config with a
fixed seed and saved with ``save_pretrained``, the tokenizer is assembled with the
``tokenizers`` library.  The saved directory loads with ``AutoModelForCausalLM`` /
``AutoTokenizer`` exactly like a hub checkpoint, so every code path a real user hits
(``from_pretrained`` by path) is the one the tests run.

Sizes are chosen so that tensor parallelism of 2 divides every sharded dimension
(heads 4, kv heads 2, intermediate 128, vocab 256) and a forward pass takes milliseconds.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

_GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
}

#: Qwen3-MoE's tiny shape (the ``qwen3_moe`` entry; ``qwen3_moe_gen`` widens it for vLLM).
_QWEN3_MOE: dict[str, Any] = dict(
    family="qwen3_moe",
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[0],
    tie_word_embeddings=False,
)


#: Named model shapes: ``family`` picks the HF config class, the rest are config fields.
TINY_MODELS: dict[str, dict[str, Any]] = {
    # Llama with grouped-query attention (4 query heads share 2 kv heads).
    "llama": dict(
        family="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    # Qwen2: q/k/v projections carry a bias; GQA as above.
    "qwen2": dict(
        family="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    # Qwen3: per-head q/k RMSNorm before RoPE, and a head_dim (32) that is not hidden / heads
    # (64 / 4 = 16): the projections map 64 -> 4 x 32, o_proj 128 -> 64.  GQA as above.
    "qwen3": dict(
        family="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    ),
    # Qwen3-MoE: 8 experts of width 32, 2 per token (renormalised); layer 0 dense
    # (mlp_only_layers), layer 1 sparse.  tp 2 / fsdp 4 or 8 divide the experts.
    "qwen3_moe": _QWEN3_MOE,
    # The same with 4 experts: fsdp 8 (the default JAX layout on 8 devices) does not divide
    # them, so the JAX backend stores each expert kernel split along its model dimension.
    "qwen3_moe_4e": dict(_QWEN3_MOE, num_experts=4),
    # Llama with the output projection tied to the input embedding.
    "llama_tied": dict(
        family="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    # Shapes vLLM's CPU attention accepts (head_dim 32; it has no kernel for 16): the
    # generation/refit tests run these through a real engine.  GQA as above; a wider init
    # so that greedy continuations vary instead of repeating one near-uniform argmax.
    "llama_gen": dict(
        family="llama",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        initializer_range=0.2,
    ),
    "qwen2_gen": dict(
        family="qwen2",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        initializer_range=0.2,
    ),
    # Gemma 3 text: sandwich norms, q/k norms, GeGLU, tied embeddings; sliding (window 4, shorter
    # than the test sequences, so it binds) and full layers with their own RoPE (the full
    # layers' "linear"-scaled), Gemma's query scale, and a final-logit cap that binds at this
    # init (logits ~1).  attn_logit_softcapping stays unset: HF's Gemma3 never applies it.
    "gemma3": dict(
        family="gemma3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        query_pre_attn_scalar=16,
        final_logit_softcapping=1.0,
        rope_parameters=_GEMMA3_ROPE,
        initializer_range=0.1,
        tie_word_embeddings=True,
    ),
    # Gemma 3 that vLLM's CPU attention serves (head_dim 32); a window of 8 binds in the
    # generation tests' prompt + completion lengths.
    "gemma3_gen": dict(
        family="gemma3",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        query_pre_attn_scalar=32,
        final_logit_softcapping=30.0,
        rope_parameters=_GEMMA3_ROPE,
        initializer_range=0.2,
        tie_word_embeddings=True,
    ),
    # Qwen3-MoE that vLLM's CPU engine serves (head_dim 32; its fused-MoE kernel), with the
    # experts in play: layer 0 dense, layer 1 sparse (8 experts of width 64, 2 per token).
    "qwen3_moe_gen": dict(
        _QWEN3_MOE, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, initializer_range=0.2
    ),
    "qwen3_gen": dict(
        family="qwen3",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        initializer_range=0.2,
    ),
    # Benchmark size (~20M parameters): big enough that compute, not Python, dominates.
    "llama_bench": dict(
        family="llama",
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        vocab_size=8192,
    ),
    # Qwen3 at the benchmark size (llama_bench's shape plus per-head q/k norms): the JAX Qwen3
    # speed against HF eager (``dualrl bench --model qwen3_bench``).
    "qwen3_bench": dict(
        family="qwen3",
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
        vocab_size=8192,
    ),
    # Gemma 3 text at the benchmark size: llama_bench's widths, gemma-3-1b's layout (sliding
    # layers then a global one, query_pre_attn_scalar = head_dim, no soft-capping, tied
    # embeddings); a window of 128 binds at the bench's --seq 256.
    "gemma3_bench": dict(
        family="gemma3",
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        sliding_window=128,
        query_pre_attn_scalar=64,
        rope_parameters=_GEMMA3_ROPE,
        tie_word_embeddings=True,
        vocab_size=8192,
    ),
    # Qwen3-MoE at the benchmark size: 8 experts, top 2, every layer sparse (as 30B-A3B); each
    # token's two experts hold llama_bench's 1408 MLP width between them.
    "qwen3_moe_bench": dict(
        family="qwen3_moe",
        hidden_size=512,
        intermediate_size=1408,
        moe_intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        vocab_size=8192,
    ),
}

TINY_VOCAB_SIZE = 256
MAX_POSITIONS = 512
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)


def tiny_config(name: str):
    """The HF config of the named tiny model (see ``TINY_MODELS``)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if name not in TINY_MODELS:
        raise KeyError(f"unknown tiny model {name!r}; known: {sorted(TINY_MODELS)}")
    fields = dict(TINY_MODELS[name])
    family = fields.pop("family")
    fields.setdefault("vocab_size", TINY_VOCAB_SIZE)
    cls = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "qwen3_moe": Qwen3MoeConfig,
        "gemma3": Gemma3TextConfig,
    }[family]
    if "rope_parameters" in fields:  # nested dicts: a fresh copy per config
        fields["rope_parameters"] = copy.deepcopy(fields["rope_parameters"])
    return cls(
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        rms_norm_eps=1e-6,
        **fields,
    )


def tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE):
    """A word-level ``PreTrainedTokenizerFast``: specials, the letters a-z, and words ``w4..``.

    Whitespace splits words; every in-vocabulary word is one token, so tests can write
    prompts as text and know their token count.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(SPECIAL_TOKENS) + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    words += [f"w{i}" for i in range(len(words), vocab_size)]
    vocab = {w: i for i, w in enumerate(words[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def build_tiny_model(name: str, seed: int = 0, dtype=None):
    """A random-initialised HF causal LM of the named shape (deterministic for a seed)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name), dtype=dtype or torch.float32)
    # Small random biases so the Qwen2 q/k/v bias path is actually exercised (HF inits them to 0),
    # random Gemma norm weights (HF inits them to 0, which would hide a swapped norm), and
    # Qwen3's q/k norm scales away from HF's init of ones (else a swapped or dropped scale
    # would go unseen).
    gemma = TINY_MODELS[name]["family"] == "gemma3"
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("_proj.bias"):
                p.normal_(0.0, 0.02)
            elif gemma and pname.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
            elif pname.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
            elif pname.endswith("mlp.gate.weight"):
                # MoE router: logits far apart, so no token's top-k choice is a near tie that a
                # rounding difference between two implementations could flip.
                p.normal_(0.0, 0.5)
    return model.eval()


def save_tiny_model(name: str, path: str | os.PathLike, seed: int = 0) -> Path:
    """Build the named tiny model and save it to ``path``, its tokenizer to ``path/tokenizer``.

    The tokenizer gets its own directory because transformers 5 ``AutoTokenizer`` picks the
    tokenizer class from a ``config.json`` next to it (Qwen2's BPE tokenizer for a qwen2
    model), which would re-tokenize our word-level vocabulary.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(name, seed=seed)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path / "tokenizer")
    return path


def random_batch(batch: int, seq: int, vocab: int, seed: int = 0, min_len: int = 2):
    """Right-padded random token ids with ragged lengths: ``(input_ids [B,S], input_lengths [B])``.

    The first row always has the full length ``seq`` so the padded width is exercised;
    padding positions hold ``PAD_ID``.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, seq + 1, (batch,), generator=g)
    lengths[0] = seq
    ids = torch.randint(len(SPECIAL_TOKENS), vocab, (batch, seq), generator=g)
    pad = torch.arange(seq)[None, :] >= lengths[:, None]
    return ids.masked_fill(pad, PAD_ID), lengths
