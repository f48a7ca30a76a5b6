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

import fnmatch
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
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


def gemma3_plan(sequence_parallel: bool) -> Plan:
    """Plan for Gemma 3 text (``Gemma3ForCausalLM``): Llama's module names plus sandwich norms.

    The projections shard as in Llama.  q_norm / k_norm normalise each rank's own heads
    ([B, heads, S, D] after HF's transpose): their weight must be a replicated DTensor and
    their input marked head-sharded (``Shard(1)``), so that the weight's gradient -- a sum over
    all heads -- is reduced over the TP group; as plain replicated parameters each rank kept
    the gradient of its own heads only (measured: grad norm off by 1.2e-4, trained logprobs by
    9e-3).  ``SequenceParallel(sequence_dim=1)`` is exactly that style (dim 1 is the heads here).
    With sequence parallelism every residual norm runs on sequence shards: the attention and
    MLP outputs leave o_proj / down_proj reduce-scattered (``Shard(1)``) into
    ``post_attention_layernorm`` / ``post_feedforward_layernorm``, and
    ``pre_feedforward_layernorm`` feeds the MLP's gather.  The scaled embedding multiplies its
    partial output by a scalar (linear: exact before the reduction), the final-logit cap is
    elementwise on vocabulary shards.
    """
    plan = llama_style_plan(sequence_parallel)
    per_head = SequenceParallel(sequence_dim=1, use_local_output=True)
    plan.update({"model.layers.*.self_attn.q_norm": per_head, "model.layers.*.self_attn.k_norm": per_head})
    if sequence_parallel:
        plan.update(
            {
                "model.layers.*.pre_feedforward_layernorm": SequenceParallel(),
                "model.layers.*.post_feedforward_layernorm": SequenceParallel(),
            }
        )
    return plan


#: model_type (HF config) -> plan builder.
TP_PLANS: dict[str, Callable[[bool], Plan]] = {
    "llama": llama_style_plan,
    "qwen2": llama_style_plan,
    "qwen3": qwen3_plan,
    "mistral": llama_style_plan,
    "gemma3_text": gemma3_plan,
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


# ----------------------------------------------------------------------------- LoRA
def _distribute(module: torch.nn.Module, name: str, placement: Any, mesh: Any, src_data_rank: Any) -> None:
    param = getattr(module, name, None)
    if param is None:
        return
    dist_param = torch.nn.Parameter(
        distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank), requires_grad=param.requires_grad
    )
    module.register_parameter(name, dist_param)


class LoRAColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a ``LoRALinear``: the base weight (and bias) ``Shard(0)`` as
    usual; the adapter follows the base's output split -- B [out, r] ``Shard(0)``, A [r, in]
    replicated -- so ``x A^T`` is computed whole on every rank and ``(x A^T) B^T`` lands in
    the same column shard as ``x W^T``."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name:  # distribute_module visits lora_A / lora_B too: the LoRALinear ("") placed them
            return
        _distribute(module, "weight", Shard(0), device_mesh, self.src_data_rank)
        _distribute(module, "bias", Shard(0), device_mesh, self.src_data_rank)
        _distribute(module.lora_A, "weight", Replicate(), device_mesh, self.src_data_rank)
        _distribute(module.lora_B, "weight", Shard(0), device_mesh, self.src_data_rank)


class LoRARowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for a ``LoRALinear``: the base weight ``Shard(1)`` (bias
    replicated); A [r, in] ``Shard(1)`` on the same input split, B replicated: both paths give
    partial sums, added before the one reduction the style already does."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name:  # distribute_module visits lora_A / lora_B too: the LoRALinear ("") placed them
            return
        _distribute(module, "weight", Shard(1), device_mesh, self.src_data_rank)
        _distribute(module, "bias", Replicate(), device_mesh, self.src_data_rank)
        _distribute(module.lora_A, "weight", Shard(1), device_mesh, self.src_data_rank)
        _distribute(module.lora_B, "weight", Replicate(), device_mesh, self.src_data_rank)


_LORA_STYLES: dict[type, type[ParallelStyle]] = {
    ColwiseParallel: LoRAColwiseParallel,
    RowwiseParallel: LoRARowwiseParallel,
}


def with_lora(plan: Plan, lora_modules: list[str]) -> Plan:
    """``plan`` with the column / row-wise entries that match LoRA-adapted modules switched to
    their LoRA styles (same layouts).  An adapted module under any other style is refused:
    its adapter would not be sharded consistently with the base."""
    out = dict(plan)
    for pattern, style in plan.items():
        matched = [m for m in lora_modules if fnmatch.fnmatchcase(m, pattern)]
        if not matched:
            continue
        lora_style = _LORA_STYLES.get(type(style))
        if lora_style is None:
            raise ValueError(
                f"policy.lora: module {matched[0]!r} is adapted but the TP plan gives it {type(style).__name__} "
                "(LoRA composes with ColwiseParallel / RowwiseParallel entries only)"
            )
        new = lora_style.__new__(lora_style)
        new.__dict__.update(style.__dict__)
        out[pattern] = new
    return out
