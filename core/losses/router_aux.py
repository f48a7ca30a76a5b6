"""The router's auxiliary load-balancing loss of a mixture-of-experts policy (``policy.moe``).

Every backend's training step hands the router logits of its forward to :class:`RouterAux`,
after the configured loss ran: the batch's load-balancing loss (``core.kernels.moe``, mean
over the global batch's valid sequences) is always reported as the ``moe_aux_loss`` metric,
and added to the loss times ``policy.moe.router_aux_loss_coef`` when that is not 0 (RL
recipes usually leave it at 0 and watch the metric; pretraining used ~1e-3).  A batch that
carries the old-logprob pass's expert choices also gets ``moe_routing_agreement``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from core.kernels.moe import router_load_balancing_loss, routing_agreement
from core.kernels.ops import EPS, ops_for
from core.kernels.reductions import masked_sum

#: The metric every MoE policy's training step reports.
AUX_METRIC = "moe_aux_loss"
#: The metric of a training step given the old-logprob pass's expert choices.
AGREEMENT_METRIC = "moe_routing_agreement"


@dataclasses.dataclass(frozen=True)
class RouterAux:
    """What the training step of a MoE policy adds to its loss and metrics: ``coef`` x the
    load-balancing loss of its ``top_k`` router, and, given the old-logprob pass's expert
    choices (``routed_experts``), their agreement with this forward's router."""

    coef: float
    top_k: int

    def add_to(
        self,
        loss,
        metrics: Mapping[str, Any],
        router_logits,
        data: Mapping[str, Any],
        global_valid_seqs,
        global_valid_toks,
    ):
        """``(loss + coef * aux, metrics + {moe_aux_loss, loss[, moe_routing_agreement]})`` for
        one micro batch.

        ``router_logits`` [L, B, S, X] of the micro batch's rows (plain layout), ``data`` its
        batch (``input_lengths``, ``sample_mask``, ``token_mask``, ``routed_experts``);
        ``global_valid_seqs`` / ``_toks`` the global batch's counts, so the sum over micro
        batches and ranks is the batch mean (per sequence / per trained token)."""
        ops = ops_for(router_logits)
        per_row = router_load_balancing_loss(router_logits, data["input_lengths"], self.top_k)
        valid = data.get("sample_mask")
        valid = ops.ones_like(per_row) if valid is None else ops.astype(valid, per_row.dtype)
        term = masked_sum(per_row, valid) / (global_valid_seqs + EPS)
        if self.coef:
            loss = loss + self.coef * term
        out = {**metrics, "loss": ops.stop_gradient(loss), AUX_METRIC: ops.stop_gradient(term)}
        if data.get("routed_experts") is not None and data.get("token_mask") is not None:
            # Over the tokens the loss trains on (the loss's token mask and normaliser).
            agree = routing_agreement(ops.stop_gradient(router_logits), data["routed_experts"])[:, 1:]
            mask = ops.astype(data["token_mask"][:, 1:], agree.dtype) * ops.expand_dims(valid, -1)
            out[AGREEMENT_METRIC] = masked_sum(agree, mask) / (global_valid_toks + EPS)
        return loss, out


def moe_top_k(hf_config: Any) -> int | None:
    """The experts each token is routed to, for a model with a router (HF's
    ``num_experts_per_tok`` with ``num_experts`` / ``num_local_experts`` > 0); None for a
    dense model."""
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    return int(top_k) if experts and top_k else None


def aux_loss_coef(configured: float | None, hf_config: Any) -> float:
    """``policy.moe.router_aux_loss_coef`` resolved: the configured value, or (null) the model
    config's ``router_aux_loss_coef`` when its ``output_router_logits`` is true, else 0."""
    if configured is not None:
        return float(configured)
    if getattr(hf_config, "output_router_logits", False):
        return float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    return 0.0


def router_aux_for(configured_coef: float | None, hf_config: Any) -> RouterAux | None:
    """The ``RouterAux`` of a policy on ``hf_config``: None for a dense model."""
    top_k = moe_top_k(hf_config)
    return None if top_k is None else RouterAux(aux_loss_coef(configured_coef, hf_config), top_k)


def sparse_layers(hf_config: Any) -> int:
    """How many decoder layers of a MoE model route (HF's rule: layer i is sparse unless it is
    in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``; models without those fields,
    e.g. Mixtral, route in every layer)."""
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = int(getattr(hf_config, "decoder_sparse_step", None) or 1)
    return sum(1 for i in range(int(hf_config.num_hidden_layers)) if i not in dense and (i + 1) % step == 0)


def check_routed_experts(data: Mapping[str, Any], replay: bool, hf_config: Any) -> None:
    """A training batch's ``routed_experts`` [B, S, sparse layers, top_k] against the model
    (``ValueError`` naming the key); required when ``policy.moe.routing_replay`` is on."""
    routed = data.get("routed_experts")
    if routed is None:
        if replay:
            raise ValueError(
                "policy.moe.routing_replay.enabled: the training batch has no 'routed_experts' (the experts "
                "get_logprobs chose; with policy.moe.routing_replay on it returns them)"
            )
        return
    top_k = moe_top_k(hf_config)
    if top_k is None:
        raise ValueError("training batch has 'routed_experts' but the model has no mixture-of-experts router")
    rows, width = data["input_ids"].shape[:2]
    want = (rows, width, sparse_layers(hf_config), top_k)
    if tuple(routed.shape) != want:
        raise ValueError(
            f"routed_experts has shape {tuple(routed.shape)}, expected [rows, width, sparse layers, top_k] = {want}"
        )
    experts = int(getattr(hf_config, "num_experts", None) or hf_config.num_local_experts)
    low, high = int(routed.min()), int(routed.max())
    if low < 0 or high >= experts:
        raise ValueError(f"routed_experts holds experts {low}..{high}, outside 0..{experts - 1}")
