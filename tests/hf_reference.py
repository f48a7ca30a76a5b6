"""Single-process plain-HF references the backend tests compare against.

Shared by the contract suite (tests/backends) and the engine-specific tests: the loss, gradient
norm and AdamW trajectory of one unsharded ``transformers`` model on the whole batch, with the
policy's optimizer, scheduler and clipping settings.
"""

from __future__ import annotations

from pathlib import Path

import torch

from core.data import BatchedDataDict
from tests.unit.test_losses import BASE_CFG

# The ClippedPG settings of the loss unit tests (PPO clip 0.2, k3 KL 0.05, token level).
PG_CFG = BASE_CFG


def hf_forward_loss(model, data: BatchedDataDict, loss_fn) -> torch.Tensor:
    """``loss_fn`` on the full-batch logits of ``model`` (right padding masked)."""
    mask = (torch.arange(data["input_ids"].shape[1])[None] < data["input_lengths"][:, None]).long()
    logits = model(input_ids=data["input_ids"], attention_mask=mask).logits
    return loss_fn(logits, data, None, None)[0]


def reference_loss_and_norm(model_dir: Path, data: BatchedDataDict, loss_fn) -> tuple[float, float]:
    """(loss, global gradient norm before clipping) of one full-batch backward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    loss = hf_forward_loss(model, data, loss_fn)
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    return float(loss.detach()), float(norm)


def reference_adamw(model_dir: Path, cfg: dict, batches, loss_fn, steps: bool = True):
    """Plain single-process torch: AdamW + the config's first (LinearLR) scheduler + global-norm
    clipping, one step per batch -> (losses, grad norms, model in eval mode).

    ``steps=False``: the losses of the batches on the initial weights, no update."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    kw = cfg["optimizer"]["kwargs"]
    opt = torch.optim.AdamW(
        model.parameters(), lr=kw["lr"], weight_decay=kw["weight_decay"], betas=tuple(kw["betas"]), eps=kw["eps"]
    )
    sched = torch.optim.lr_scheduler.LinearLR(opt, **cfg["scheduler"][0]["kwargs"])
    losses, norms = [], []
    for data in batches:
        opt.zero_grad()
        loss = hf_forward_loss(model, data, loss_fn)
        losses.append(float(loss.detach()))
        if not steps:
            continue
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])))
        opt.step()
        sched.step()
    return losses, norms, model.eval()
