"""Non-finite and all-masked optimizer steps are skipped on every rank, never applied.

A batch whose advantages are 1e30 (finite, so the driver's input checks pass; its gradient
norm overflows to inf): with ``policy.non_finite_step: error`` the driver raises
``NonFiniteStepError`` naming the field and the value, the weights did not move and the policy
still serves ``get_logprobs``.  In ``skip`` mode (the choice is the driver's: the workers skip
either way) the step is reported skipped, then two all-masked global batches (token_mask all 0;
sample_mask all 0) in one call are skipped, logprobs equal to the initial ones exactly; a
normal step after all that equals the first step from the initial state (weights, optimizer
state and LR schedule untouched).

The driver side alone (skip decision, messages, the run loop): tests/unit/test_non_finite_steps.py;
the JAX jitted update's own skip: tests/jax_backend/test_non_finite_steps.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from core.algorithms.training_run import train_metrics
from core.data import BatchedDataDict
from core.losses import ClippedPGLossFn
from core.policy import NonFiniteStepError
from tests.backends.conftest import ragged
from tests.hf_reference import PG_CFG
from tests.torch_backends.conftest import pg_batch


def huge_advantage_batch(seed: int = 40) -> BatchedDataDict:
    """Advantages of 1e30 on every trained token: finite (the driver accepts them), but the
    gradient's squared norm overflows float32, so the global grad norm is inf."""
    data = pg_batch(4, seed=seed)
    data["advantages"] = torch.where(data["token_mask"] > 0, 1e30, 0.0)
    return data


def all_masked_batches(seed: int = 41) -> BatchedDataDict:
    """Two global batches of 4 rows: every token_mask 0, then every sample_mask 0."""
    no_tokens, no_samples = pg_batch(4, seed=seed), pg_batch(4, seed=seed + 1)
    no_tokens["token_mask"] = torch.zeros_like(no_tokens["token_mask"])
    no_samples["sample_mask"] = torch.zeros_like(no_samples["sample_mask"])
    return BatchedDataDict.from_batches([no_tokens, no_samples])


def test_non_finite_and_masked_steps_are_skipped(fresh_policy):
    loss_fn = ClippedPGLossFn(PG_CFG)
    good, probe = pg_batch(4, seed=10), ragged(4, seed=20)

    # The reference: the first (normal) step from the initial state.
    policy = fresh_policy.policy
    expected = policy.train(good, loss_fn)
    expected_lp = policy.get_logprobs(probe)["logprobs"]
    assert expected.skipped_steps == 0 and expected.skip_reasons == [None]
    fresh_policy.reset()

    policy.cfg.non_finite_step = "error"  # the driver's setting (reset() restores it)
    before = policy.get_logprobs(probe)["logprobs"]
    with pytest.raises(NonFiniteStepError, match=r"non-finite grad norm \(loss=.*grad_norm=(inf|nan)\)") as err:
        policy.train(huge_advantage_batch(), loss_fn)
    assert "policy.non_finite_step" in str(err.value) and "optimizer step 1 of 1" in str(err.value)
    assert torch.equal(policy.get_logprobs(probe)["logprobs"], before)  # still serves, nothing moved

    policy.cfg.non_finite_step = "skip"  # the workers skip in both modes
    out = policy.train(huge_advantage_batch(), loss_fn)
    assert out.skipped == [True] and out.skip_reasons == ["non_finite_grad_norm"]
    assert out.skipped_steps == 1 and not math.isfinite(float(out.grad_norm[0]))
    assert train_metrics(out)["skipped_steps"] == 1.0
    assert out.lr == pytest.approx(0.5 * 1e-2)  # LinearLR's start (0.5 x lr): the schedule did not advance
    assert torch.equal(policy.get_logprobs(probe)["logprobs"], before)

    masked = policy.train(all_masked_batches(), loss_fn, gbs=4)
    assert masked.skip_reasons == ["no_valid_tokens", "no_valid_tokens"] and masked.skipped_steps == 2
    assert torch.equal(policy.get_logprobs(probe)["logprobs"], before)

    # Optimizer state (AdamW moments, step count, weight decay) and LR schedule untouched:
    # the next normal step is the first step from the initial state.
    after = policy.train(good, loss_fn)
    assert after.skipped_steps == 0
    assert math.isclose(float(after.loss[0]), float(expected.loss[0]), rel_tol=1e-6, abs_tol=1e-7)
    assert math.isclose(float(after.grad_norm[0]), float(expected.grad_norm[0]), rel_tol=1e-6)
    assert after.lr == pytest.approx(expected.lr, rel=1e-9)
    torch.testing.assert_close(policy.get_logprobs(probe)["logprobs"], expected_lp, rtol=0, atol=1e-6)
