"""Non-finite and all-masked optimizer steps are skipped on every rank, never applied.

For each backend layout one scenario (``run_non_finite_scenario``, shared with the JAX test):
a policy with ``policy.non_finite_step: error`` is given a batch whose advantages are 1e30
(finite, so the driver's input checks pass; its gradient norm overflows to inf): the driver
raises ``NonFiniteStepError`` naming the field and the value, the weights did not move and
the policy still serves ``get_logprobs``.  The same policy then, in ``skip`` mode (the choice
is the driver's: the workers skip either way), reports the skipped step, then skips two
all-masked global batches (token_mask all 0; sample_mask all 0) in one call, logprobs equal
to the initial ones exactly; a normal step after all that equals the first step of a fresh
policy that never saw a bad batch (weights, optimizer state and LR schedule untouched).
"""

from __future__ import annotations

import math

import pytest
import torch

from core.algorithms.training_run import train_metrics
from core.data import BatchedDataDict
from core.distributed import RayVirtualCluster
from core.losses import ClippedPGLossFn
from core.policy import NonFiniteStepError, Policy
from core.testing.tiny_models import random_batch
from tests.torch_backends.conftest import SEQ, VOCAB, pg_batch, policy_config
from tests.unit.test_losses import BASE_CFG


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


def _probe() -> BatchedDataDict:
    return BatchedDataDict(zip(("input_ids", "input_lengths"), random_batch(4, SEQ, VOCAB, seed=20), strict=True))


def run_non_finite_scenario(make_policy) -> None:
    """``make_policy(name_prefix, non_finite_step) -> (policy, close)``; see the module doc."""
    loss_fn = ClippedPGLossFn(BASE_CFG)
    good, probe = pg_batch(4, seed=10), _probe()

    # The reference: a fresh policy's first (normal) step.
    fresh, close = make_policy("fresh", "skip")
    try:
        expected = fresh.train(good, loss_fn)
        expected_lp = fresh.get_logprobs(probe)["logprobs"]
    finally:
        close()
    assert expected["skipped_steps"] == 0 and expected["skip_reasons"] == [None]

    policy, close = make_policy("bad", "error")
    try:
        before = policy.get_logprobs(probe)["logprobs"]
        with pytest.raises(NonFiniteStepError, match=r"non-finite grad norm \(loss=.*grad_norm=(inf|nan)\)") as err:
            policy.train(huge_advantage_batch(), loss_fn)
        assert "policy.non_finite_step" in str(err.value) and "optimizer step 1 of 1" in str(err.value)
        assert torch.equal(policy.get_logprobs(probe)["logprobs"], before)  # still serves, nothing moved

        policy.cfg["non_finite_step"] = "skip"  # the driver's choice; the workers skip in both modes
        out = policy.train(huge_advantage_batch(), loss_fn)
        assert out["skipped"].tolist() == [True] and out["skip_reasons"] == ["non_finite_grad_norm"]
        assert out["skipped_steps"] == 1 and not math.isfinite(float(out["grad_norm"][0]))
        assert train_metrics(out)["skipped_steps"] == 1.0
        assert out["lr"] == pytest.approx(0.5 * 1e-2)  # LinearLR's start (0.5 x lr): the schedule did not advance
        assert torch.equal(policy.get_logprobs(probe)["logprobs"], before)

        masked = policy.train(all_masked_batches(), loss_fn, gbs=4)
        assert masked["skip_reasons"] == ["no_valid_tokens", "no_valid_tokens"] and masked["skipped_steps"] == 2
        assert torch.equal(policy.get_logprobs(probe)["logprobs"], before)

        # Optimizer state (AdamW moments, step count, weight decay) and LR schedule untouched:
        # the next normal step is the fresh policy's first step.
        after = policy.train(good, loss_fn)
        assert after["skipped_steps"] == 0
        assert math.isclose(float(after["loss"][0]), float(expected["loss"][0]), rel_tol=1e-6, abs_tol=1e-7)
        assert math.isclose(float(after["grad_norm"][0]), float(expected["grad_norm"][0]), rel_tol=1e-6)
        assert after["lr"] == pytest.approx(expected["lr"], rel=1e-9)
        torch.testing.assert_close(policy.get_logprobs(probe)["logprobs"], expected_lp, rtol=0, atol=1e-6)
    finally:
        close()


# Two policies on 2 CPU ranks each: ~45-70 s per layout on the shared 2-core machine.
@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,tp", [pytest.param("torch_fsdp", 1, id="fsdp1-dp2"), pytest.param("torch_dtensor", 2, id="dtensor-tp2")]
)
def test_non_finite_and_masked_steps_are_skipped(backend, tp, ray_session, model_dirs, tokenizer):
    def make_policy(name, mode):
        cfg = policy_config(model_dirs["llama"], backend, tp=tp, non_finite_step=mode)
        cluster = RayVirtualCluster([2], use_gpus=False)
        policy = Policy(cluster, cfg, tokenizer, name_prefix=f"nonfinite_{name}")

        def close():
            policy.shutdown()
            cluster.shutdown()

        return policy, close

    run_non_finite_scenario(make_policy)
