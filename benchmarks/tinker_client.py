"""Client programs of the Tinker API written with the unmodified ``tinker`` SDK, run against
``dualrl serve`` by the tests and by ``python -m benchmarks.tinker_e2e``.

* :func:`sft_loop`: supervised fine-tuning on the built-in arithmetic answers (``cross_entropy``).
* :func:`rl_loop`: RL shaped like tinker-cookbook's ``rl/train.py`` step: a sampling client of
  the current weights, groups of samples per prompt, rewards from the task, advantages centred
  within each group (groups of equal rewards dropped), ``forward_backward`` with
  ``importance_sampling`` on the sampler's logprobs, ``optim_step``, then the next sampling
  client (``save_weights_and_get_sampling_client``).
* :func:`first_step`: one ``forward_backward`` + ``optim_step`` on a fixed batch (the numbers
  the backends must agree on).

Prompts and rewards come from dualrl's arithmetic task (``core.environments.arithmetic``), the
same one the built-in models are warm-started on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tinker import types

from core.environments.arithmetic import ArithmeticEnvironment, ArithmeticTask

#: The AdamW settings of tinker-cookbook's RL loop (``rl/train.py``), at our learning rate.
COOKBOOK_BETAS = (0.9, 0.95)
COOKBOOK_EPS = 1e-8
#: The sampling seed of the held-out evaluations.
EVAL_SEED = 12345


def adam(lr: float) -> types.AdamParams:
    return types.AdamParams(learning_rate=lr, beta1=COOKBOOK_BETAS[0], beta2=COOKBOOK_BETAS[1], eps=COOKBOOK_EPS)


def sft_datum(tokenizer: Any, prompt: str, answer: str) -> types.Datum:
    """prompt + answer + eos, the loss on the answer and the eos (targets: the next tokens)."""
    prompt_ids = tokenizer.encode(prompt)
    answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    full = prompt_ids + answer_ids
    weights = [0.0] * (len(prompt_ids) - 1) + [1.0] * len(answer_ids)
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
    )


def problems(seed: int, start: int, count: int) -> list[dict[str, str]]:
    return ArithmeticTask().problems(seed, start, count)


def sft_loop(training_client: Any, tokenizer: Any, steps: int, batch: int = 32, lr: float = 1e-3) -> list[float]:
    """The cross-entropy loss per answer token of each step's batch (before its update)."""
    losses = []
    for step in range(steps):
        rows = problems(seed=7, start=step * batch, count=batch)
        data = [sft_datum(tokenizer, p["prompt"], p["answer"]) for p in rows]
        tokens = sum(sum(d.loss_fn_inputs["weights"].data) for d in data)
        fwd = training_client.forward_backward(data, "cross_entropy")
        opt = training_client.optim_step(adam(lr))
        losses.append(fwd.result().metrics["loss:sum"] / tokens)
        opt.result()
    return losses


@dataclass
class RLStep:
    step: int
    reward: float
    """Mean reward of the step's samples."""
    loss: float
    datums: int
    seconds: float


@dataclass
class RLRun:
    steps: list[RLStep] = field(default_factory=list)
    accuracy_before: float = 0.0
    """Held-out accuracy of samples at temperature 1 (mean over ``eval_samples`` per problem)."""
    accuracy_after: float = 0.0
    greedy_before: float = 0.0
    """Held-out accuracy of greedy completions."""
    greedy_after: float = 0.0


def rl_loop(
    training_client: Any,
    tokenizer: Any,
    steps: int,
    groups: int = 16,
    group_size: int = 16,
    lr: float = 1e-3,
    max_tokens: int = 6,
    eval_problems: int = 64,
    eval_samples: int = 8,
) -> RLRun:
    """The cookbook-shaped RL loop on the arithmetic task; the accuracy on held-out problems
    (another seed than training's) before and after, sampled and greedy."""
    env = ArithmeticEnvironment()
    held_out = problems(seed=1001, start=0, count=eval_problems)
    run = RLRun()
    sampler = training_client.save_weights_and_get_sampling_client().result()
    run.accuracy_before = accuracy(sampler, tokenizer, held_out, max_tokens, eval_samples)
    run.greedy_before = accuracy(sampler, tokenizer, held_out, max_tokens)
    for step in range(steps):
        start = time.perf_counter()
        batch = problems(seed=3, start=step * groups, count=groups)
        params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[tokenizer.eos_token_id])
        futures = [
            sampler.sample(types.ModelInput.from_ints(tokenizer.encode(p["prompt"])), group_size, params) for p in batch
        ]
        data, rewards = [], []
        for problem, future in zip(batch, futures, strict=True):
            sequences = future.result().sequences
            group = [_reward(env, tokenizer, s.tokens, problem["answer"]) for s in sequences]
            rewards += group
            mean = sum(group) / len(group)
            if all(r == group[0] for r in group):
                continue  # no signal: the cookbook drops constant-reward groups
            prompt = tokenizer.encode(problem["prompt"])
            data += [_rl_datum(prompt, s.tokens, s.logprobs, r - mean) for s, r in zip(sequences, group, strict=True)]
        loss = 0.0
        if data:
            fwd = training_client.forward_backward(data, "importance_sampling")
            opt = training_client.optim_step(adam(lr))
            loss = fwd.result().metrics["loss:sum"]
            opt.result()
        sampler = training_client.save_weights_and_get_sampling_client().result()
        run.steps.append(RLStep(step, sum(rewards) / len(rewards), loss, len(data), time.perf_counter() - start))
    run.accuracy_after = accuracy(sampler, tokenizer, held_out, max_tokens, eval_samples)
    run.greedy_after = accuracy(sampler, tokenizer, held_out, max_tokens)
    return run


def _reward(env: ArithmeticEnvironment, tokenizer: Any, tokens: Sequence[int], answer: str) -> float:
    text = tokenizer.decode([t for t in tokens if t != tokenizer.eos_token_id])
    return 1.0 if env.judge(text, answer)[0] else 0.0


def _rl_datum(prompt: list[int], tokens: Sequence[int], logprobs: Sequence[float], advantage: float) -> types.Datum:
    """The cookbook's datum of one sample: the sampled tokens' logprobs and the advantage on
    them, zeros on the prompt (targets: the next tokens)."""
    full = prompt + list(tokens)
    n_prompt = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "logprobs": [0.0] * n_prompt + [float(x) for x in logprobs],
            "advantages": [0.0] * n_prompt + [advantage] * len(tokens),
        },
    )


def accuracy(
    sampler: Any, tokenizer: Any, rows: Sequence[dict[str, str]], max_tokens: int = 6, samples: int | None = None
) -> float:
    """The share of right answers: ``samples`` per problem at temperature 1, or (None) greedy."""
    env = ArithmeticEnvironment()
    # Seeded: the before and after evaluations draw from the same random streams.
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0 if samples is None else 1.0, seed=EVAL_SEED)
    n = samples or 1
    futures = [sampler.sample(types.ModelInput.from_ints(tokenizer.encode(r["prompt"])), n, params) for r in rows]
    right = [
        _reward(env, tokenizer, seq.tokens, r["answer"])
        for f, r in zip(futures, rows, strict=True)
        for seq in f.result().sequences
    ]
    return sum(right) / len(right)


@dataclass(frozen=True)
class FirstStep:
    """One ``forward_backward`` + ``optim_step`` on a fixed batch."""

    loss: float
    grad_norm: float
    logprobs: list[list[float]]
    """Per datum, the targets' logprobs ``forward_backward`` returned."""
    loss_after: float
    """The loss of the same batch after the step (a ``forward``)."""


#: The learning rate of :func:`first_step`.
FIRST_STEP_LR = 1e-3


def first_step(
    training_client: Any, tokenizer: Any, loss_fn: str = "cross_entropy", lr: float = FIRST_STEP_LR
) -> FirstStep:
    rows = problems(seed=11, start=0, count=16)
    data = [sft_datum(tokenizer, r["prompt"], r["answer"]) for r in rows]
    if loss_fn != "cross_entropy":
        data = [_as_policy_gradient(d, i) for i, d in enumerate(data)]
    out = training_client.forward_backward(data, loss_fn).result()
    step = training_client.optim_step(adam(lr)).result()
    after = training_client.forward(data, loss_fn).result()
    return FirstStep(
        loss=out.metrics["loss:sum"],
        grad_norm=step.metrics["grad_norm:mean"],
        logprobs=[o["logprobs"].tolist() for o in out.loss_fn_outputs],
        loss_after=after.metrics["loss:sum"],
    )


def _as_policy_gradient(datum: types.Datum, index: int) -> types.Datum:
    """The SFT datum as an RL one: sampler logprobs a little off the policy's, ±1 advantages."""
    weights = datum.loss_fn_inputs["weights"].data
    sign = 1.0 if index % 2 == 0 else -1.0
    return types.Datum(
        model_input=datum.model_input,
        loss_fn_inputs={
            "target_tokens": datum.loss_fn_inputs["target_tokens"],
            "logprobs": [-2.5 * w for w in weights],
            "advantages": [sign * w for w in weights],
        },
    )
