"""The router's load-balancing loss trains alike on every backend that runs Qwen3-MoE: with
``policy.moe.router_aux_loss_coef`` > 0 the first step's loss, its ``moe_aux_loss`` metric and
the gradient norm equal a single-process HF reference (HF's ``load_balancing_loss_func`` on each
sequence, averaged over the batch's sequences, times the weight, added to the PG loss).

Slow: a MoE policy of its own per layout.  The fast suite checks the loss against HF in
process (tests/unit/test_router_aux.py) and the router logits each backend records
(tests/jax_backend/test_model_parity.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.lib.layouts import parse_layout
from benchmarks.lib.parity.hf_reference import hf_router_aux
from core.data import BatchedDataDict
from core.losses import ClippedPGLossFn
from tests.backends.conftest import layout_config, started_policy
from tests.hf_reference import PG_CFG
from tests.torch_backends.conftest import pg_batch

pytestmark = pytest.mark.slow

COEF = 0.05


def _reference(model_dir, data, loss_fn) -> tuple[float, float, float]:
    """(PG loss + COEF x aux, aux, gradient norm) of one full-batch HF backward."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    width = data["input_ids"].shape[1]
    mask = (torch.arange(width)[None] < data["input_lengths"][:, None]).long()
    out = model(input_ids=data["input_ids"], attention_mask=mask, output_router_logits=True)
    aux = hf_router_aux(out.router_logits, data, model.config)
    loss = loss_fn(out.logits, data, None, None)[0] + COEF * aux
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    return float(loss.detach()), float(aux.detach()), float(norm)


# Plain, packed and context-parallel rows (the router logits are unpacked / gathered onto the
# rows as the logprobs are) on each engine; torch tensor parallelism has no Qwen3-MoE plan.
# JAX's expert parallelism (-ep) with tensor and with context parallelism.
LAYOUTS = [
    "fsdp1-dp2",
    "fsdp1-dp2-packed",
    "dtensor-dp2",
    "dtensor-cp2",
    "dtensor-cp2-packed",
    "jax-fsdp4-tp2",
    "jax-fsdp4-cp2",
    "jax-fsdp8-packed",
    "jax-fsdp4-tp2-ep",
    "jax-fsdp4-cp2-ep",
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_router_loss_trains_as_hf_on_every_backend(layout, ray_session, model_dirs, tokenizer):
    lay = parse_layout(layout)
    model_dir = model_dirs["qwen3_moe"]
    cfg = layout_config(lay, model_dir, moe={"router_aux_loss_coef": COEF})
    data, loss_fn = pg_batch(4, seed=5), ClippedPGLossFn(PG_CFG)
    ref_loss, ref_aux, ref_norm = _reference(model_dir, data, loss_fn)
    with started_policy(lay, cfg, tokenizer, f"moe_aux_{lay.backend}") as policy:
        result = policy.train(data, loss_fn)
    aux = result.metrics["moe_aux_loss"][0]
    assert math.isclose(aux, ref_aux, rel_tol=1e-5), (aux, ref_aux)
    assert math.isclose(result.loss[0], ref_loss, rel_tol=1e-5, abs_tol=1e-6), (result.loss, ref_loss)
    assert math.isclose(result.grad_norm[0], ref_norm, rel_tol=1e-5), (result.grad_norm, ref_norm)


def _replayed_reference(model_dir, data, loss_fn, routed) -> tuple[float, float, torch.Tensor]:
    """(loss, gradient norm, HF's own top-k [B, S, L, K]) of one HF backward whose
    routers are sent to ``routed`` [B, S, L, K] (hooks written here, independent of the
    backends': the router's float32 softmax at those experts, renormalised)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows, width = data["input_ids"].shape
    routers = [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]
    own = []

    def hook_of(layer):
        def hook(module, args, out):
            logits = out[0]
            own.append(out[2].reshape(rows, width, -1))
            index = routed[:, :, layer].reshape(rows * width, -1).long()
            weights = torch.softmax(logits.float(), -1).gather(-1, index)
            return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), index

        return hook

    handles = [r.register_forward_hook(hook_of(j)) for j, r in enumerate(routers)]
    mask = (torch.arange(width)[None] < data["input_lengths"][:, None]).long()
    logits = model(input_ids=data["input_ids"], attention_mask=mask).logits
    for h in handles:
        h.remove()
    loss = loss_fn(logits, data, None, None)[0]
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    return float(loss.detach()), float(norm), torch.stack(own, 2)


@pytest.mark.parametrize("layout", ["fsdp1-dp2", "dtensor-dp2", "jax-fsdp4-tp2", "jax-fsdp4-tp2-ep"])
def test_routing_replay_trains_as_hf_on_every_backend(layout, ray_session, model_dirs, tokenizer):
    """``get_logprobs`` returns HF's expert choices; a training step given them agrees fully
    (``moe_routing_agreement`` 1); given other experts it routes to those: its loss and gradient
    norm are HF's with replayed routers, its agreement the share of HF's own experts kept."""
    lay = parse_layout(layout)
    model_dir = model_dirs["qwen3_moe"]
    cfg = layout_config(lay, model_dir, moe={"routing_replay": {"enabled": True}})
    data, loss_fn = pg_batch(4, seed=6), ClippedPGLossFn(PG_CFG)
    with started_policy(lay, cfg, tokenizer, f"moe_replay_{lay.backend}") as policy:
        routed = policy.get_logprobs(data)["routed_experts"]
        _, _, hf_own = _replayed_reference(model_dir, data, loss_fn, routed)
        valid = torch.arange(data["input_ids"].shape[1])[None] < data["input_lengths"][:, None]
        assert routed.dtype == torch.int16 and routed.shape == hf_own.shape
        assert torch.equal(routed.long()[valid], hf_own[valid])

        with pytest.raises(ValueError, match="no 'routed_experts'"):
            policy.train(data, loss_fn, eval_mode=True)  # refused on the driver
        same = policy.train(BatchedDataDict({**data, "routed_experts": routed}), loss_fn, eval_mode=True)
        assert same.metrics["moe_routing_agreement"][0] == pytest.approx(1.0)

        other = ((routed.long() + 3) % 8).short()
        ref_loss, ref_norm, _ = _replayed_reference(model_dir, data, loss_fn, other)
        result = policy.train(BatchedDataDict({**data, "routed_experts": other}), loss_fn)
    mask = data["token_mask"][:, 1:]
    kept = (hf_own.unsqueeze(-1) == other.long().unsqueeze(-2)).sum((-1, -2)).float().mean(-1) / 2  # (B, S)
    want = float((kept[:, 1:] * mask).sum() / mask.sum())
    assert result.metrics["moe_routing_agreement"][0] == pytest.approx(want, rel=1e-6)
    assert math.isclose(result.loss[0], ref_loss, rel_tol=1e-5, abs_tol=1e-6), (result.loss, ref_loss)
    assert math.isclose(result.grad_norm[0], ref_norm, rel_tol=1e-5), (result.grad_norm, ref_norm)
