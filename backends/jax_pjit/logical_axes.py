"""The logical axis names of the JAX backend, and the one rules table mapping them to mesh axes.

Every parameter and every constrained activation names its dimensions with the logical
names below (maxtext/levanter style); ``RULES`` decides which mesh axis, if any, shards
each of them.  A different layout is a different table, not different model code.

Mesh axes are those of ``core.parallel_dims``: ``fsdp`` (data parallel with sharded
parameters / optimizer state), ``cp`` (context parallel: the sequence of activations is
split; the rows are permuted first so every ``cp`` rank holds a head and a tail chunk, see
``core.data.context_parallel``) and ``tp`` (tensor parallel).

Parameters (storage layout):
    vocab     -- vocabulary rows of the embedding / lm_head         -> tp
    embed     -- the model (hidden) dimension of a weight           -> fsdp (ZeRO-3 style)
    heads     -- query heads                                         -> tp
    kv_heads  -- key/value heads (GQA)                               -> tp
    head_dim  -- per-head feature dimension                          -> replicated
    mlp       -- the MLP's intermediate dimension                    -> tp
    norm      -- the feature dimension of an RMSNorm scale           -> replicated
    lora_rank -- the rank dimension of a LoRA adapter (A, B)         -> replicated
    expert    -- the experts of a stacked MoE kernel / the router     -> fsdp (each rank holds whole experts;
                 with expert parallelism each rank also runs only its own)
    expert_embed -- the model dimension of MoE expert / router weights -> replicated (fsdp holds the experts)
Activations:
    batch     -- the batch dimension                                 -> fsdp (data parallel)
    seq       -- the sequence dimension (queries, residual stream)   -> cp (context parallel)
    kv_seq    -- the sequence dimension of attention keys / values   -> replicated (gathered over cp)
    act_embed -- the hidden dimension of activations                 -> replicated
    act_heads -- the heads dimension of attention activations        -> tp
    act_mlp   -- the MLP's intermediate activations                  -> tp
    act_vocab -- the vocabulary dimension of logits                  -> tp
"""

from __future__ import annotations

from core.parallel_dims import CP, FSDP, TP

PARAM_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm", "lora_rank", "expert", "expert_embed")
ACTIVATION_AXES = (
    "batch",
    "seq",
    "kv_seq",
    "act_embed",
    "act_heads",
    "act_mlp",
    "act_vocab",
)

#: logical name -> mesh axis (None = replicated).  Names not listed are replicated.
RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", TP),
    ("embed", FSDP),
    ("heads", TP),
    ("kv_heads", TP),
    ("head_dim", None),
    ("mlp", TP),
    ("norm", None),
    ("lora_rank", None),
    # Experts are sharded over fsdp (whole experts per rank: expert parallelism runs over this
    # axis, policy.parallel.expert_parallel_size), so their model dim cannot be fsdp too.
    ("expert", FSDP),
    ("expert_embed", None),
    ("batch", FSDP),
    ("seq", CP),
    ("kv_seq", None),
    ("act_embed", None),
    ("act_heads", TP),
    ("act_mlp", TP),
    ("act_vocab", TP),
)

#: KV-cache decoding: the same table with the sequence replicated.  A decode step feeds one
#: token per row, which cannot be split over ``cp``; the ``cp`` ranks of a data-parallel
#: group then decode the same rows redundantly (the prefill too) -- correct, not faster.
DECODE_RULES: tuple[tuple[str, str | None], ...] = tuple(
    (name, None if name == "seq" else axis) for name, axis in RULES
)
