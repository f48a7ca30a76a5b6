"""Tensor-parallel plans as data: HF module-name patterns -> ``ParallelStyle`` per model family.

Megatron-style: q/k/v and gate/up projections are column-parallel (each rank owns a slice of
the heads / MLP columns), o/down projections row-parallel (their partial outputs are summed).
The lm_head is column-parallel *over the vocabulary* and keeps its output sharded
(``use_local_output=False``): the logprob kernel then works on vocab shards
(``core.kernels.vocab_parallel``) and the full [B, S, V] logits never exist on one rank.

With sequence parallelism the residual stream between blocks is sharded along the sequence
(``Shard(1)``): norms run on sequence shards, and each attention/MLP block all-gathers its
input and reduce-scatters its output instead of all-reducing.  The embedding output is kept
as a DTensor so HF code that reads ``inputs_embeds.shape[1]`` (masks, positions) sees the
full sequence length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

Plan = dict[str, ParallelStyle]


def llama_style_plan(sequence_parallel: bool) -> Plan:
    """Plan for Llama-layout models (Llama, Qwen2, Qwen3, Mistral: same module names)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: Plan = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq, use_local_output=not sequence_parallel
        ),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=not sequence_parallel),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=not sequence_parallel),
    }
    if sequence_parallel:
        plan.update(
            {
                "model.norm": SequenceParallel(),
                "model.layers.*.input_layernorm": SequenceParallel(),
                "model.layers.*.post_attention_layernorm": SequenceParallel(),
                # HF calls attention with keyword arguments: gather the sequence for the block.
                "model.layers.*.self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                "model.layers.*.mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
        )
    return plan


def qwen3_plan(sequence_parallel: bool) -> Plan:
    """The Llama plan plus Qwen3's per-head ``q_norm`` / ``k_norm`` (RMSNorm over head_dim).

    They act on the column-parallel q/k outputs viewed as [B, S, heads / tp, head_dim]: each
    rank normalises its own heads, with or without sequence parallelism (attention's input is
    gathered).  The forward is local, but the scale's gradient is a sum over *all* heads: left
    a plain replicated tensor, each rank would keep the gradient of its own heads only (tiny
    Qwen3 on tp=2: the first step's gradient norm 1.8e-5 relative off the single-process one,
    and the ranks' copies of the scales drift apart).  So the
    norms take their input as a DTensor sharded over the heads dim (``SequenceParallel`` with
    ``sequence_dim=2``: scale replicated over tp, its gradient reduced over tp by DTensor)
    and hand a local tensor back to HF's attention code.
    """
    heads = SequenceParallel(sequence_dim=2, use_local_output=True)
    return llama_style_plan(sequence_parallel) | {
        "model.layers.*.self_attn.q_norm": heads,
        "model.layers.*.self_attn.k_norm": heads,
    }


#: model_type (HF config) -> plan builder.
TP_PLANS: dict[str, Callable[[bool], Plan]] = {
    "llama": llama_style_plan,
    "qwen2": llama_style_plan,
    "qwen3": qwen3_plan,
    "mistral": llama_style_plan,
}


def plan_for(model: torch.nn.Module, sequence_parallel: bool, custom: Any = None) -> Plan:
    """The TP plan for ``model``: ``custom`` (a plan dict, or a callable
    ``(model, sequence_parallel) -> plan``) if given, else the built-in one for its family."""
    if custom is not None:
        plan = custom(model, sequence_parallel) if callable(custom) else custom
        if not isinstance(plan, dict):
            raise ValueError(f"policy.dtensor_cfg.custom_parallel_plan must give a dict, got {type(plan).__name__}")
        return plan
    model_type = getattr(model.config, "model_type", None)
    if model_type not in TP_PLANS:
        raise ValueError(
            f"no tensor-parallel plan for model_type {model_type!r} (known: {sorted(TP_PLANS)}); "
            "set policy.dtensor_cfg.custom_parallel_plan"
        )
    return TP_PLANS[model_type](sequence_parallel)
