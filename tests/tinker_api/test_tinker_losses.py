"""TinkerLoss: Tinker's built-in losses (sums over target tokens), the same numbers and
gradients on torch tensors and jax arrays, against the formulas written out per token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.interfaces import LogprobLossFunction
from core.losses.checks import LossInputError
from core.losses.contract import LossContract
from core.losses.tinker_losses import TINKER_LOSSES, TinkerLoss

B, S = 4, 7


def batch(kind: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Rows of one loss kind; row 3 is padding (sample_mask 0), row 1 shorter (token_mask)."""
    rng = np.random.default_rng(seed)
    token_mask = np.zeros((B, S), np.float32)
    token_mask[:, 1:] = 1.0
    token_mask[1, 5:] = 0.0
    return {
        "input_ids": rng.integers(0, 11, (B, S)).astype(np.int64),
        "sample_mask": np.array([1, 1, 1, 0], np.float32),
        "loss_kind": np.full(B, TINKER_LOSSES.index(kind), np.int64),
        "token_mask": token_mask,
        "target_weights": rng.uniform(-1, 1, (B, S)).astype(np.float32),
        "advantages": rng.normal(size=(B, S)).astype(np.float32),
        "sampling_logprobs": -rng.uniform(0.1, 3, (B, S)).astype(np.float32),
        "clip_low": np.full((B, S), 0.8, np.float32),
        "clip_high": np.full((B, S), 1.2, np.float32),
    }


def reference(kind: str, logp: np.ndarray, data: dict[str, np.ndarray]) -> float:
    """The per-token formulas of the Tinker docs, summed over every valid target token."""
    total = 0.0
    for b in range(B):
        for t in range(S - 1):
            if data["sample_mask"][b] == 0 or data["token_mask"][b, t + 1] == 0:
                continue
            lp, q = float(logp[b, t]), float(data["sampling_logprobs"][b, t + 1])
            a, w = float(data["advantages"][b, t + 1]), float(data["target_weights"][b, t + 1])
            ratio = np.exp(lp - q)
            total += {
                "cross_entropy": -w * lp,
                "importance_sampling": -ratio * a,
                "ppo": -min(ratio * a, float(np.clip(ratio, 0.8, 1.2)) * a),
                "cispo": -float(np.clip(ratio, 0.8, 1.2)) * a * lp,
            }[kind]
    return total


def test_the_loss_contract():
    loss = TinkerLoss()
    assert isinstance(loss, LogprobLossFunction)
    contract = LossContract.of(loss)
    assert contract.from_logprobs and contract.old_logprobs is None and not contract.uses_reference
    assert {"loss_kind", "sampling_logprobs", "token_mask"} <= set(contract.input_keys)
    assert loss.cache_key() == TinkerLoss().cache_key()  # one compiled step for every copy
    data = {k: torch.from_numpy(v) for k, v in batch("ppo").items()}
    loss.check_inputs(data, vocab_size=11)
    data["loss_kind"] = torch.full((B,), 7)
    with pytest.raises(LossInputError, match="loss_kind"):
        loss.check_inputs(data, vocab_size=11)


@pytest.mark.parametrize("kind", TINKER_LOSSES)
def test_torch_and_jax_give_the_formula_and_the_same_gradient(kind):
    import jax
    import jax.numpy as jnp

    data = batch(kind)
    logp = -np.random.default_rng(1).uniform(0.05, 2.5, (B, S - 1)).astype(np.float32)
    loss_fn = TinkerLoss()

    logp_t = torch.tensor(logp, requires_grad=True)
    loss_t, metrics = loss_fn.loss_from_logprobs(logp_t, {k: torch.from_numpy(v) for k, v in data.items()}, None, None)
    loss_t.backward()

    def jax_loss(x):
        return loss_fn.loss_from_logprobs(x, {k: jnp.asarray(v) for k, v in data.items()}, None, None)[0]

    loss_j, grad_j = jax.value_and_grad(jax_loss)(jnp.asarray(logp))
    expected = reference(kind, logp, data)
    assert float(loss_t.detach()) == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert float(loss_j) == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert float(metrics["loss"]) == pytest.approx(expected, rel=1e-5, abs=1e-5)
    np.testing.assert_allclose(logp_t.grad.numpy(), np.asarray(grad_j), rtol=1e-5, atol=1e-6)
    # Padding rows and positions past a row's targets get no gradient.
    assert not logp_t.grad[3].any() and not logp_t.grad[1, 4:].any()


def test_cispo_weight_has_no_gradient():
    """CISPO's clipped ratio is a constant weight: d loss / d logp = -clip(r) * A exactly."""
    data = batch("cispo")
    logp = torch.full((B, S - 1), -1.0, requires_grad=True)
    TinkerLoss().loss_from_logprobs(logp, {k: torch.from_numpy(v) for k, v in data.items()}, None, None)[0].backward()
    ratio = np.exp(-1.0 - data["sampling_logprobs"][0, 1:])
    expected = -np.clip(ratio, 0.8, 1.2) * data["advantages"][0, 1:]
    np.testing.assert_allclose(logp.grad[0].numpy(), expected, rtol=1e-5)


def test_micro_batches_sum_to_the_batch():
    """A sum loss: micro batches' losses (with whatever global counts) add up to the batch's."""
    data = {k: torch.from_numpy(v) for k, v in batch("ppo").items()}
    logp = -torch.rand(B, S - 1)
    loss_fn = TinkerLoss()
    whole = loss_fn.loss_from_logprobs(logp, data, torch.tensor(3.0), torch.tensor(14.0))[0]
    parts = [
        loss_fn.loss_from_logprobs(logp[i : i + 2], {k: v[i : i + 2] for k, v in data.items()}, 3.0, 14.0)[0]
        for i in (0, 2)
    ]
    assert float(sum(parts)) == pytest.approx(float(whole), rel=1e-6)


def test_rows_of_different_losses_share_a_batch():
    kinds = ("cross_entropy", "ppo", "importance_sampling", "cispo")
    rows = [batch(k) for k in kinds]
    mixed = {k: np.stack([rows[i][k][i] for i in range(B)]) for k in rows[0]}
    mixed["sample_mask"] = np.ones(B, np.float32)
    logp = -np.random.default_rng(2).uniform(0.05, 2.5, (B, S - 1)).astype(np.float32)
    per_token = TinkerLoss().elementwise(torch.from_numpy(logp), {k: torch.from_numpy(v) for k, v in mixed.items()})
    for i, kind in enumerate(kinds):
        alone = {k: v.copy() for k, v in mixed.items()}
        alone["sample_mask"] = (np.arange(B) == i).astype(np.float32)
        alone["loss_kind"] = np.full(B, TINKER_LOSSES.index(kind), np.int64)
        assert float(per_token[i].sum()) == pytest.approx(reference(kind, logp, alone), rel=1e-5, abs=1e-6)
