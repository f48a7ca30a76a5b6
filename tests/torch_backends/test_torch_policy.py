"""Policy over FSDP1 / DTensor workers on Ray (gloo, 2 CPU ranks) vs single-process HF torch.

One policy per layout serves every check of that layout, in order: logprob parity first
(fresh weights), then micro-batch invariance of the loss (eval mode, weights untouched),
then three real AdamW steps against a single-process full-batch reference, then the
reference-policy check.  Each layout trains with a different micro-batch size (1, 2 or 4),
so the first step's loss and global gradient norm matching the full-batch reference at
1e-5 shows gradients do not depend on the micro-batch size, the number of ranks, or how
FSDP/TP shard the parameters (a norm that counted TP-replicated weights twice would not).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.data import BatchedDataDict
from core.distributed import RayVirtualCluster
from core.losses import ClippedPGLossFn
from core.policy import Policy
from core.testing.tiny_models import random_batch
from tests.torch_backends.conftest import SEQ, VOCAB, hf_logprobs, pg_batch, policy_config
from tests.unit.test_losses import BASE_CFG

# (backend, tp, sequence_parallel, model): every torch layout the issue names, on Llama;
# Qwen2 (q/k/v bias) and a tied-embedding model through the TP paths.
# (backend, tp, sequence_parallel, model, train micro batch size)
LAYOUTS = [
    pytest.param(("torch_fsdp", 1, False, "llama", 1), id="fsdp1-dp2-llama"),
    pytest.param(("torch_dtensor", 1, False, "llama", 2), id="dtensor-dp2-llama"),
    pytest.param(("torch_dtensor", 2, False, "llama", 4), id="dtensor-tp2-llama"),
    pytest.param(("torch_dtensor", 2, True, "llama", 1), id="dtensor-tp2-sp-llama"),
    pytest.param(("torch_dtensor", 2, True, "qwen2", 4), id="dtensor-tp2-sp-qwen2"),
    pytest.param(("torch_fsdp", 1, False, "qwen2", 2), id="fsdp1-dp2-qwen2"),
    pytest.param(("torch_dtensor", 2, False, "llama_tied", 2), id="dtensor-tp2-tied"),
]

# The ClippedPG settings of the loss unit tests (PPO clip 0.2, k3 KL 0.05, token level).
PG_CFG = BASE_CFG


@pytest.fixture(scope="module", params=LAYOUTS)
def layout(request, ray_session, model_dirs, tokenizer):
    backend, tp, sp, model, mbs = request.param
    cfg = policy_config(model_dirs[model], backend, tp=tp, sp=sp, train_micro_batch_size=mbs)
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, cfg, tokenizer)
    yield {"policy": policy, "cfg": cfg, "model_dir": model_dirs[model]}
    policy.shutdown()
    cluster.shutdown()


def _ragged(batch: int, seed: int) -> BatchedDataDict:
    ids, lens = random_batch(batch, SEQ, VOCAB, seed=seed)
    return BatchedDataDict(input_ids=ids, input_lengths=lens)


def test_get_logprobs_matches_hf(layout):
    """[0, logp...] with zero padding, equal to a single-process HF forward within 1e-5;
    5 rows on dp=2 also exercises the padding of the batch to a multiple of dp."""
    data = _ragged(5, seed=1)
    out = layout["policy"].get_logprobs(data)["logprobs"]
    ref = hf_logprobs(
        AutoModelForCausalLM.from_pretrained(layout["model_dir"]).eval(), data["input_ids"], data["input_lengths"]
    )
    assert out.shape == (5, SEQ) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert (out[:, 0] == 0).all()
    pad = torch.arange(SEQ)[None] >= data["input_lengths"][:, None]
    assert (out[pad] == 0).all()


def test_eval_loss_independent_of_micro_batch(layout):
    """eval_mode: no update, so every call sees the same weights; the globally normalised
    loss must not depend on the micro-batch size and must equal the full-batch loss."""
    data = pg_batch(4, seed=3)
    loss_fn = ClippedPGLossFn(PG_CFG)
    dp = 1 if layout["cfg"]["dtensor_cfg"]["tensor_parallel_size"] == 2 else 2
    ref_loss, _ = _reference_loss_and_norm(layout["model_dir"], data, loss_fn)
    for mbs in [m for m in (1, 2, 4) if m <= 4 // dp]:
        loss = float(layout["policy"].train(data, loss_fn, eval_mode=True, mbs=mbs)["loss"][0])
        assert math.isclose(loss, ref_loss, rel_tol=1e-5, abs_tol=1e-6), (mbs, loss, ref_loss)


def test_three_adamw_steps_track_single_process(layout):
    policy, cfg = layout["policy"], layout["cfg"]
    batches = [pg_batch(4, seed=10 + i) for i in range(3)]
    loss_fn = ClippedPGLossFn(PG_CFG)
    ours = [policy.train(b, loss_fn) for b in batches]
    ref_losses, ref_first_norm, ref_model = _reference_adamw(layout["model_dir"], cfg, batches, loss_fn)
    # Step 1 runs on the initial weights: loss and gradient norm must match tightly.
    assert math.isclose(float(ours[0]["loss"][0]), ref_losses[0], rel_tol=1e-5, abs_tol=1e-6)
    assert math.isclose(float(ours[0]["grad_norm"][0]), ref_first_norm, rel_tol=1e-5)
    for step, (r, ref) in enumerate(zip(ours, ref_losses, strict=True)):
        assert math.isclose(float(r["loss"][0]), ref, rel_tol=1e-4, abs_tol=1e-5), (step, r["loss"], ref)
    probe = _ragged(4, seed=20)
    after = policy.get_logprobs(probe)["logprobs"]
    torch.testing.assert_close(
        after, hf_logprobs(ref_model, probe["input_ids"], probe["input_lengths"]), rtol=0, atol=1e-4
    )
    assert ours[-1]["lr"] == pytest.approx(cfg["optimizer"]["kwargs"]["lr"])  # LinearLR warm-up done


def test_reference_logprobs_unchanged_by_training(layout):
    data = _ragged(4, seed=30)
    ref = layout["policy"].get_reference_policy_logprobs(data)["reference_logprobs"]
    initial = hf_logprobs(
        AutoModelForCausalLM.from_pretrained(layout["model_dir"]).eval(), data["input_ids"], data["input_lengths"]
    )
    torch.testing.assert_close(ref, initial, rtol=0, atol=1e-5)
    trained = layout["policy"].get_logprobs(data)["logprobs"]
    assert (trained - ref).abs().max() > 1e-3  # the policy itself did move


# ----------------------------------------------------------------------------- references


def _hf_forward_loss(model, data: BatchedDataDict, loss_fn):
    mask = (torch.arange(data["input_ids"].shape[1])[None] < data["input_lengths"][:, None]).long()
    logits = model(input_ids=data["input_ids"], attention_mask=mask).logits
    return loss_fn(logits, data, None, None)[0]


def _reference_loss_and_norm(model_dir, data, loss_fn) -> tuple[float, float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    loss = _hf_forward_loss(model, data, loss_fn)
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    return float(loss.detach()), float(norm)


def _reference_adamw(model_dir, cfg, batches, loss_fn):
    """Plain single-process torch: AdamW + LinearLR + global-norm clipping, one step per batch."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    kw = cfg["optimizer"]["kwargs"]
    opt = torch.optim.AdamW(
        model.parameters(), lr=kw["lr"], weight_decay=kw["weight_decay"], betas=tuple(kw["betas"]), eps=kw["eps"]
    )
    sched = torch.optim.lr_scheduler.LinearLR(opt, **cfg["scheduler"][0]["kwargs"])
    losses, norms = [], []
    for data in batches:
        opt.zero_grad()
        loss = _hf_forward_loss(model, data, loss_fn)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])))
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return losses, norms[0], model.eval()
