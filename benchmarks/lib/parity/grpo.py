"""GRPO on the parity batch, per layout and on HF: step 0 (old log-probs from a separate pass,
two optimizer steps) and then the fused step (old log-probs from the training forward itself,
one optimizer step: what a GRPO run with one optimizer step per rollout batch does)."""

from __future__ import annotations

from benchmarks.lib.parity.settings import GRPO_METRICS, GRPO_SEED, GRPO_STEPS


def grpo_loss_fn(old_logprobs: str = "batch", overrides: dict | None = None):
    """``ClippedPGLossFn`` as ``core/configs/default.yaml``'s ``loss_fn`` section configures it
    (with ``overrides`` of its keys); ``old_logprobs="forward"``: the fused path
    (``prev_logprobs`` = the forward's, detached)."""
    from core.config.loader import DEFAULT_CONFIG_PATH, load_raw_config
    from core.losses import ClippedPGLossFn

    cfg = {**load_raw_config(DEFAULT_CONFIG_PATH)["loss_fn"], **(overrides or {})}
    return ClippedPGLossFn(cfg, old_logprobs=old_logprobs)


def grpo_batch(data, generation_logprobs, seed: int = GRPO_SEED):
    """The GRPO train batch of the parity batch, keyed and masked as
    ``core.algorithms.rollouts.training_batch`` builds one: the first third of each ragged row
    (at least one token) is its "prompt", the rest its "response" (``token_mask`` = 1 there),
    and rows 2k and 2k+1 share row 2k's prompt (one prompt's two samples);
    advantages: a seeded normal draw per row; ``generation_logprobs``: given (``hf``'s)."""
    import torch

    from core.data import BatchedDataDict

    ids, lengths = data["input_ids"].clone(), data["input_lengths"]
    prompt = (lengths // 3).clamp_min(1)
    # As in a GRPO batch, a prompt's samples are adjacent rows: row 2k+1 takes row 2k's prompt
    # (when it is longer than that prompt), so -shared layouts hold it once.
    for row in range(1, len(ids), 2):
        p = int(prompt[row - 1])
        if int(lengths[row]) > p:
            ids[row, :p], prompt[row] = ids[row - 1, :p], p
    cols = torch.arange(ids.shape[1])[None]
    mask = ((cols >= prompt[:, None]) & (cols < lengths[:, None])).float()
    advantages = torch.randn(len(ids), generator=torch.Generator().manual_seed(seed))
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths.clone(),
        token_mask=mask,
        sample_mask=torch.ones(len(ids)),
        advantages=advantages[:, None] * mask,
        generation_logprobs=generation_logprobs.float() * mask,
    )


def grpo_summary(losses, norms, metrics: dict[str, list[float]]) -> dict:
    """The JSON-able GRPO step-0 numbers: per optimizer step loss, grad norm and the compared metrics."""
    return {
        "loss": [float(x) for x in losses],
        "grad_norm": [float(x) for x in norms],
        "metrics": {k: [float(x) for x in metrics[k]] for k in GRPO_METRICS if k in metrics and k != "loss"},
    }


def grpo_policy(runner, base, steps: int = GRPO_STEPS) -> dict:
    """``{"grpo": step 0, "grpo_fused": the fused step after it}`` on a layout's policy."""
    return {"grpo": grpo_step0_policy(runner, base, steps), "grpo_fused": grpo_fused_policy(runner, base)}


def grpo_step0_policy(runner, base, steps: int = GRPO_STEPS, loss_fn=None) -> dict:
    """The training part of ``core.algorithms.grpo.grpo_step`` on a layout at its initial weights:
    prev and reference logprobs from the policy itself, then one ``train`` call of ``steps``
    global batches (``mbs`` = one micro batch per data-parallel rank) with ``loss_fn``
    (default: :func:`grpo_loss_fn`)."""
    from core.data import BatchedDataDict

    policy = runner.policy
    rows, dp = base["input_ids"].shape[0], policy.data_parallel_size
    if rows % (steps * dp):
        raise ValueError(f"grpo_step0 needs the batch ({rows}) divisible by {steps} steps x dp {dp}")
    gbs = rows // steps
    data = BatchedDataDict(dict(base))
    policy.prepare_for_lp_inference()
    data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
    data["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    policy.prepare_for_training()
    result = policy.train(data, loss_fn or grpo_loss_fn(), gbs=gbs, mbs=gbs // dp)
    policy.finish_training()
    return grpo_summary(result.loss, result.grad_norm, result.metrics)


def grpo_fused_policy(runner, base) -> dict:
    """The fused GRPO step on a layout (after step 0's updates): the whole batch as one global
    batch, no ``prev_logprobs`` in it -- the loss takes them from its own forward --, the
    reference's logprobs from the policy (the initial weights).  ``hf`` computes this step
    both ways on the same weights (``HFReference.grpo_fused``), so ``grpo_fused_vs_separate``
    holds every layout's fused step to the separate-pass path."""
    from core.data import BatchedDataDict

    policy = runner.policy
    rows, dp = base["input_ids"].shape[0], policy.data_parallel_size
    if rows % dp:
        raise ValueError(f"grpo_fused needs the batch ({rows}) divisible by dp {dp}")
    data = BatchedDataDict(dict(base))
    policy.prepare_for_lp_inference()
    data["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    policy.prepare_for_training()
    result = policy.train(data, grpo_loss_fn("forward"), gbs=rows, mbs=rows // dp)
    policy.finish_training()
    return grpo_summary(result.loss, result.grad_norm, result.metrics)
