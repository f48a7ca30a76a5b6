"""A short supervised warm start on the built-in arithmetic task (the project's own SFT step).

GRPO learns from the differences between samples of one prompt: a policy that never
answers right gets no signal.  So the embedded default starts from a tiny model that was
taught the answer format and, partly, the arithmetic, by a few hundred steps of next-token
training on problems of the same task -- never on the held-out validation prompts, so the
validation accuracy GRPO reports is measured on problems neither stage has seen.

It runs in the driver process on plain torch (a sub-million-parameter model trains here in
seconds; starting Ray workers would cost more than the training) with the project's
``NLLLoss`` -- the same loss ``dualrl sft`` will use -- on the prompt/answer token layout
the policy workers use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from core.losses import NLLLoss


@dataclass(frozen=True)
class WarmStartConfig:
    steps: int = 300
    batch_size: int = 128
    lr: float = 1e-3
    seed: int = 1234  # problem stream of the warm start (distinct from GRPO's train / val seeds)


def example_batch(tokenizer: Any, rows: list[dict[str, str]]) -> dict[str, torch.Tensor]:
    """``<s>prompt answer</s>`` rows, right-padded; ``token_mask`` covers the answer and ``</s>``."""
    seqs, masks = [], []
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        answer = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    token_mask = torch.zeros(len(seqs), width)
    for i, (seq, mask) in enumerate(zip(seqs, masks)):
        ids[i, :len(seq)] = torch.tensor(seq)
        token_mask[i, :len(mask)] = torch.tensor(mask, dtype=torch.float32)
    return {"input_ids": ids, "token_mask": token_mask, "sample_mask": torch.ones(len(seqs))}


def problem_stream(task: Any, seed: int, exclude: frozenset[str]) -> Iterable[dict[str, str]]:
    """The task's problems for ``seed`` in order, skipping the held-out prompts."""
    index = 0
    while True:
        row = task.problem(seed, index)
        index += 1
        if row["prompt"] not in exclude:
            yield row


def warm_start(model: torch.nn.Module, tokenizer: Any, task: Any, exclude: frozenset[str],
               cfg: WarmStartConfig = WarmStartConfig(), log: Callable[[str], None] = print) -> list[float]:
    """Train ``model`` in place for ``cfg.steps`` AdamW steps; returns the loss per step."""
    torch.manual_seed(cfg.seed)
    stream = iter(problem_stream(task, cfg.seed, exclude))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    loss_fn, losses, start = NLLLoss(), [], time.perf_counter()
    model.train()
    for step in range(cfg.steps):
        batch = example_batch(tokenizer, [next(stream) for _ in range(cfg.batch_size)])
        logits = model(input_ids=batch["input_ids"]).logits
        loss, _ = loss_fn(logits, batch, None, None)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if (step + 1) % max(cfg.steps // 5, 1) == 0:
            log(f"  warm start step {step + 1}/{cfg.steps}: loss {losses[-1]:.3f} "
                f"({time.perf_counter() - start:.0f} s)")
    model.eval()
    return losses
