"""Qwen3-MoE (``model_type`` qwen3_moe): the Qwen3 decoder of ``llama`` whose sparse layers'
MLP is a mixture of experts.

Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``
is not 0 (HF ``Qwen3MoeDecoderLayer``); the other layers keep the dense SwiGLU MLP of
``intermediate_size``.  A sparse MLP (HF ``Qwen3MoeSparseMoeBlock``):

* router: logits = x @ gate [embed, experts]; softmax in float32; the ``num_experts_per_tok``
  largest probabilities (renormalised to sum 1 when ``norm_topk_prob``), cast back to the
  compute dtype, are the token's expert weights, every other expert's weight is 0;
* experts: SwiGLU MLPs of ``moe_intermediate_size``, their kernels stacked
  ``gate_proj`` / ``up_proj`` [experts, embed, mlp], ``down_proj`` [experts, mlp, embed];
  out = sum over experts of weight x down(silu(gate(x)) * up(x)).

How the experts run is ``MoEConfig.dispatch`` (``policy.jax_cfg.moe_dispatch``;
``moe_dispatch``): ``dense`` (every expert on every token, the zero weights drop the others:
``num_experts / num_experts_per_tok`` times the routed FLOPs), ``blocked`` (each token through
its top-k experts only, expert-sorted blocks scanned with plain dots: the CPU default) or
``grouped`` (``jax.lax.ragged_dot``, for accelerators with a grouped kernel).  All exact, the
same sum as HF's per-expert gather / index_add up to rounding.  Experts are stored sharded over
``fsdp`` (``logical_axes``: whole experts per rank); with ``MoEConfig.expert_parallel``
(``policy.parallel.expert_parallel_size`` = the fsdp size) they also *run* there: a
``shard_map`` over that axis gathers every rank's tokens, each rank runs its own experts
(blocked, empty blocks skipped) and the outputs are reduce-scattered back
(``moe_dispatch.expert_parallel_experts``), instead of every rank gathering every expert.

The router's logits are recorded for the training step's load-balancing loss
(``core.losses.router_aux``; ``policy.moe``, which reads ``output_router_logits`` /
``router_aux_loss_coef`` as HF trains them): inside ``nnx.capture`` each sparse layer sows them
as an ``nnx.Intermediate`` named ``ROUTER_LOGITS`` (``models.make_apply_fn(...,
capture_router=True)`` collects them), and nowhere else (decoding records nothing).

Parameters beyond the Qwen3 decoder (logical axes):
    *.mlp.gate.kernel                       [expert_embed, expert]   (the router)
    *.mlp.experts.gate_proj / up_proj       [expert, expert_embed, mlp]
    *.mlp.experts.down_proj                 [expert, mlp, expert_embed]
HF checkpoints hold one tensor per expert (``mlp.experts.{j}.gate_proj.weight``, as vLLM
loads them; transformers 5 fuses them in memory and splits them again on save).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from backends.jax_pjit.models import llama
from backends.jax_pjit.models.config import ModelConfig
from backends.jax_pjit.models.hf_table import Row
from backends.jax_pjit.models.layers import MLP, Dense, _param, placement
from backends.jax_pjit.models.moe_dispatch import DISPATCHES, blocked_rule, expert_parallel_experts
from core.kernels.moe import replayed_routing_weights, top_k_experts

__all__ = [
    "ROUTER_LOGITS",
    "MoEConfig",
    "config_from_hf",
    "layer_kind",
    "SparseMoE",
    "CausalLM",
    "HF_TABLES",
    "QWEN3_MOE_TABLE",
]


#: The ``nnx.Intermediate`` each sparse layer sows its router logits [B, S, experts] under.
ROUTER_LOGITS = "router_logits"


@dataclasses.dataclass(frozen=True)
class MoEConfig(ModelConfig):
    """``ModelConfig`` plus the Qwen3-MoE fields (HF names)."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    #: How the sparse layers run their experts (``moe_dispatch.DISPATCHES``; not an HF field:
    #: ``policy.jax_cfg.moe_dispatch`` resolved, see ``hf_mapping.from_pretrained``).
    dispatch: str = "dense"
    #: Expert parallelism (``policy.parallel.expert_parallel_size``; not an HF field): 1, or the
    #: size of the mesh axis the experts are stored over, whose ranks then each run their own
    #: experts on every rank's tokens (``moe_dispatch.expert_parallel_experts``).
    expert_parallel: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        if self.expert_parallel < 1 or self.num_experts % self.expert_parallel:
            raise ValueError(
                f"policy.parallel.expert_parallel_size={self.expert_parallel} must be >= 1 and divide "
                f"num_experts={self.num_experts} (each expert-parallel rank runs whole experts)"
            )

    def unpadded(self) -> MoEConfig:
        """As the HF checkpoint describes it: the vocabulary unpadded, the dispatch and expert
        parallelism (run choices, not HF fields) at their defaults."""
        return dataclasses.replace(self, padded_vocab_size=self.vocab_size, dispatch="dense", expert_parallel=1)

    def is_sparse(self, layer: int) -> bool:
        """HF ``Qwen3MoeDecoderLayer``'s choice of a sparse MLP for layer ``layer``."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def config_from_hf(hf_config: Any, model_type: str, family: str) -> MoEConfig:
    """A transformers ``Qwen3MoeConfig`` -> ``MoEConfig``: the decoder read (and its options
    refused) by ``llama.config_from_hf``, the MoE fields added here."""
    num_experts = int(hf_config.num_experts)
    if num_experts < 1:
        raise ValueError(f"model_type {model_type!r} with num_experts={num_experts} is not supported (no experts)")
    base = llama.config_from_hf(hf_config, model_type, family)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
    return MoEConfig(
        **(fields | {"qk_norm": True}),
        num_experts=num_experts,
        num_experts_per_tok=int(hf_config.num_experts_per_tok),
        moe_intermediate_size=int(hf_config.moe_intermediate_size),
        norm_topk_prob=bool(hf_config.norm_topk_prob),
        decoder_sparse_step=int(hf_config.decoder_sparse_step),
        mlp_only_layers=tuple(hf_config.mlp_only_layers or ()),
    )


def layer_kind(cfg: ModelConfig, layer: int) -> str:
    """ "moe" or "dense": which ``Row.layers`` rows of the HF table apply to ``layer``."""
    return "moe" if isinstance(cfg, MoEConfig) and cfg.is_sparse(layer) else "dense"


# --------------------------------------------------------------------------- the model


class SparseMoE(nnx.Module):
    """Router + stacked experts (see the module docstring); x [B, S, E] -> [B, S, E]."""

    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        assert isinstance(cfg, MoEConfig), cfg
        e, m, x = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate = Dense((e,), (x,), ("expert_embed",), ("expert",), use_bias=False, **kw)
        self.experts = Experts(x, e, m, param_dtype=param_dtype, rngs=rngs)
        self.dispatch = DISPATCHES[cfg.dispatch]
        self.per_device = cfg.dispatch == "blocked"
        self.expert_parallel = cfg.expert_parallel

    def route(self, x: jax.Array, replay: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """``(experts [B, S, K], weights [B, S, K])`` of every token: the router's top-k of its
        float32 softmax (renormalised when ``norm_topk_prob``), cast to the compute dtype -- or,
        given ``replay`` [B, S, K], those experts with the router's weights for them
        (``core.kernels.moe.replayed_routing_weights``: the router still gets a gradient)."""
        logits = self.gate(x)  # (B, S, X) compute dtype
        # Only inside nnx.capture (the training step asks for them): a sow outside one would
        # store the logits on the module (flax deprecates it) during decoding too.
        if hasattr(self, "__captures__"):
            self.sow(nnx.Intermediate, ROUTER_LOGITS, logits)
        if replay is not None:
            return replay, replayed_routing_weights(logits, replay, self.norm_topk_prob)
        index = top_k_experts(logits, self.top_k)
        return index, replayed_routing_weights(logits, index, self.norm_topk_prob)

    def __call__(self, x: jax.Array, replay: jax.Array | None = None) -> jax.Array:
        x = x.astype(self.dtype)
        index, weight = self.route(x, replay)
        kernels = tuple(self.experts.kernel(n, self.dtype) for n in ("gate_proj", "up_proj", "down_proj"))
        b, s, e = x.shape
        tokens = (x, index, weight)
        experts = placement("expert") if self.expert_parallel > 1 else None
        if experts is not None:
            return self.expert_parallel_call(experts, tokens, kernels).reshape(b, s, e)
        rows = placement("batch") if self.per_device else None
        devices = 1 if rows is None else int(rows[0].shape[rows[1]])
        if devices == 1 or b % devices:
            return self.dispatch(*_flat(tokens), *kernels).reshape(b, s, e)
        # The blocked dispatch sorts and gathers tokens: over a batch split across devices that
        # would be one global gather computed everywhere, so each device's rows dispatch alone,
        # in a shard_map over the batch's mesh axis (the experts gathered once per layer, not
        # once per block inside the scan).  Not a vmap over row groups: under vmap each block's
        # kernel slice becomes a batched gather, whose gradient is a general scatter-add into
        # the whole [X, E, M] kernel every block (a large share of qwen3_moe_bench's training
        # step on CPU: docs/results.md#kernels-attention-and-moe-dispatch).
        assert rows is not None
        return _over_tokens(self.dispatch, rows, tokens, kernels, kernel_spec=PartitionSpec()).reshape(b, s, e)

    def expert_parallel_call(self, experts: tuple[Any, str], tokens: tuple, kernels: tuple) -> jax.Array:
        """The experts run expert-parallel over the mesh axis they are stored on (``experts``:
        ``(mesh, axis)``): the tokens split over its ranks, each rank's experts run on every
        rank's tokens (``expert_parallel_experts``), the outputs summed back; [B * S, E].
        (Without a mesh -- no constraint installed -- ``__call__`` runs the layer's dispatch on
        one device instead: the same sum.)"""
        mesh, axis = experts
        ranks = int(mesh.shape[axis])
        if ranks != self.expert_parallel:
            raise ValueError(
                f"policy.parallel.expert_parallel_size={self.expert_parallel}: the experts are stored over "
                f"the mesh axis {axis!r} of size {ranks}; expert parallelism runs over that axis"
            )
        block = int(blocked_rule(jax.default_backend())["block"])
        run = functools.partial(expert_parallel_experts, axis=axis, block=block)
        return _over_tokens(run, experts, tokens, kernels, kernel_spec=PartitionSpec(axis))


def _flat(tokens: tuple) -> tuple[jax.Array, ...]:
    """[B, S, n] arrays -> [B * S, n]."""
    return tuple(a.reshape(-1, a.shape[-1]) for a in tokens)


def _over_tokens(
    fn: Callable[..., jax.Array], where: tuple[Any, str], tokens: tuple, kernels: tuple, *, kernel_spec: PartitionSpec
) -> jax.Array:
    """``fn(x, index, weight, gate, up, down)`` in a ``shard_map`` manual over the mesh axis of
    ``where`` (``(mesh, axis)``; the other axes stay automatic): the layer's B * S tokens split
    evenly over its ranks (padded with weight-0 tokens to a multiple; a batch split by whole
    rows needs none), the kernels as ``kernel_spec`` gives them.  Returns [B * S, E]."""
    mesh, axis = where
    flat = _flat(tokens)
    count, pad = flat[0].shape[0], -flat[0].shape[0] % int(mesh.shape[axis])
    padded = [jnp.pad(a, ((0, pad), (0, 0))) for a in flat]
    split = PartitionSpec(axis)
    run = jax.shard_map(fn, mesh=mesh, in_specs=(split,) * 3 + (kernel_spec,) * 3, out_specs=split, axis_names={axis})
    return run(*padded, *kernels)[:count]


class Experts(nnx.Module):
    """The experts' stacked SwiGLU kernels (paths ``experts/gate_proj`` ...)."""

    def __init__(self, experts: int, embed: int, mlp: int, *, param_dtype, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(0.02)
        in_axes, out_axes = ("expert", "expert_embed", "mlp"), ("expert", "mlp", "expert_embed")
        self.gate_proj = _param(init(rngs.params(), (experts, embed, mlp), param_dtype), in_axes)
        self.up_proj = _param(init(rngs.params(), (experts, embed, mlp), param_dtype), in_axes)
        self.down_proj = _param(init(rngs.params(), (experts, mlp, embed), param_dtype), out_axes)

    def kernel(self, name: str, dtype) -> jax.Array:
        return getattr(self, name)[...].astype(dtype)


class CausalLM(llama.CausalLM):
    """The Qwen3 decoder with ``SparseMoE`` in the sparse layers (``MoEConfig.is_sparse``)."""

    @staticmethod
    def mlp_class(cfg: ModelConfig, layer: int) -> Callable[..., nnx.Module]:
        return SparseMoE if layer_kind(cfg, layer) == "moe" else MLP


# --------------------------------------------------------------------------- HF names

_LAYER = "model.layers.{i}."
_JLAYER = "layers/{i}/"
_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")

QWEN3_MOE_TABLE: tuple[Row, ...] = tuple(
    row._replace(layers="dense") if row.hf.removeprefix(_LAYER) in _DENSE_MLP else row for row in llama.QWEN3_TABLE
) + (
    Row(_LAYER + "mlp.gate.weight", _JLAYER + "mlp/gate/kernel", "linear", layers="moe"),
    Row(_LAYER + "mlp.experts.{j}.gate_proj.weight", _JLAYER + "mlp/experts/gate_proj", "linear", layers="moe"),
    Row(_LAYER + "mlp.experts.{j}.up_proj.weight", _JLAYER + "mlp/experts/up_proj", "linear", layers="moe"),
    Row(_LAYER + "mlp.experts.{j}.down_proj.weight", _JLAYER + "mlp/experts/down_proj", "linear", layers="moe"),
)

#: Family -> its HF name table (``hf_mapping``: import, export, refit).
HF_TABLES: dict[str, tuple[Row, ...]] = {"qwen3_moe": QWEN3_MOE_TABLE}
