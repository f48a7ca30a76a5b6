"""The fused old-logprob path (``ClippedPGLossFn(cfg, old_logprobs="forward")``) trains exactly
like the separate pass it replaces, on every layout.

GRPO takes the PPO ratio's denominator from the training forward itself when a rollout batch is
one optimizer step (``core.algorithms.old_logprobs.old_logprobs_source``).  Today's path runs
``get_logprobs`` over the batch first and feeds it as ``prev_logprobs``.  On fp32 CPU both give
the same loss, gradient norm and updated weights, up to the float rounding between the inference
and the training forward (the ratio is exp(0) = 1 either way; the separate pass is the same
weights run through a different micro-batching).  A loss in the fused mode given a batch of
several optimizer steps is refused by name before any worker trains.
"""

from __future__ import annotations

import pytest
import torch

from core.losses import ClippedPGLossFn
from tests.backends.conftest import ragged
from tests.hf_reference import PG_CFG
from tests.torch_backends.conftest import pg_batch

# The importance correction and the KL term on, so that every input of the loss takes part.
CFG = {**PG_CFG, "use_importance_sampling_correction": True}


def _step(policy, data, loss_fn):
    result = policy.train(data, loss_fn)
    return result, policy.get_logprobs(ragged(4, seed=61))["logprobs"]


def test_fused_old_logprobs_train_like_the_separate_pass(fresh_policy):
    policy = fresh_policy.policy
    separate = pg_batch(4, seed=60)
    separate["prev_logprobs"] = policy.get_logprobs(separate)["logprobs"]
    expected, expected_lp = _step(policy, separate, ClippedPGLossFn(CFG))
    fresh_policy.reset()

    fused_data = pg_batch(4, seed=60)
    del fused_data["prev_logprobs"]  # the fused loss must not need them
    got, got_lp = _step(policy, fused_data, ClippedPGLossFn(CFG, old_logprobs="forward"))

    assert got.skipped_steps == expected.skipped_steps == 0
    # The driver's breakdown of the call (train_call/* in the run's metrics).
    assert got.timing is not None and 0 < got.timing.worker_s <= got.timing.call_s
    torch.testing.assert_close(torch.as_tensor(got.loss), torch.as_tensor(expected.loss), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        torch.as_tensor(got.grad_norm), torch.as_tensor(expected.grad_norm), rtol=1e-5, atol=1e-6
    )
    # The updated weights, seen through the logprobs they give on other rows.
    torch.testing.assert_close(got_lp, expected_lp, rtol=0, atol=2e-5)
    # ...and the step really moved them (an equality of two no-ops proves nothing).
    fresh_policy.reset()
    initial_lp = policy.get_logprobs(ragged(4, seed=61))["logprobs"]
    assert (got_lp - initial_lp).abs().max() > 1e-3


def test_fused_old_logprobs_refused_for_several_optimizer_steps(fresh_policy):
    policy = fresh_policy.policy
    data = pg_batch(8, seed=62)  # two global batches of 4
    with pytest.raises(ValueError, match=r"old_logprobs='forward'.*8 rows is 2 optimizer steps"):
        policy.train(data, ClippedPGLossFn(CFG, old_logprobs="forward"), gbs=4)
