"""The loss contract (``core.interfaces.LogprobLossFunction``) is what the backends and the
algorithms use: the built-in losses declare all of it, a user loss with only a logits-level
``__call__`` gets the documented defaults (``core.losses.contract``), and the compile-cache key
tells apart any two losses that differ in a setting -- a tensor, a list or a callable included --
while copies shipped to the workers share it."""

from __future__ import annotations

import pickle

import cloudpickle
import numpy as np
import pytest
import torch

from core.interfaces import LogprobLossFunction, LossFunction, LossType
from core.losses import ClippedPGLossFn, DPOLossFn, NLLLoss
from core.losses.contract import LossContract, LossContractError, check_loss_inputs, loss_cache_key, state_key
from core.policy.checks import check_loss_fn
from tests.backends.conftest import LogitsOnlyNLL as LogitsOnly
from tests.hf_reference import PG_CFG
from tests.torch_backends.conftest import pg_batch

DPO_CFG = {
    "reference_policy_kl_penalty": 0.1,
    "preference_loss_weight": 1.0,
    "sft_loss_weight": 0.0,
    "preference_average_log_probs": False,
    "sft_average_log_probs": False,
}


def test_the_builtins_declare_the_whole_contract():
    pg, fused = ClippedPGLossFn(PG_CFG), ClippedPGLossFn(PG_CFG, old_logprobs="forward")
    no_kl = ClippedPGLossFn({**PG_CFG, "reference_policy_kl_penalty": 0.0})
    for loss in (pg, fused, no_kl, NLLLoss(), DPOLossFn(DPO_CFG)):
        assert isinstance(loss, LogprobLossFunction) and isinstance(loss, LossFunction)
    losses = {"pg": pg, "fused": fused, "no_kl": no_kl, "nll": NLLLoss(), "dpo": DPOLossFn(DPO_CFG)}
    contracts = {name: LossContract.of(loss) for name, loss in losses.items()}
    assert [(c.old_logprobs, c.uses_reference) for c in contracts.values()] == [
        ("batch", True),
        ("forward", True),
        ("batch", False),
        (None, False),
        (None, True),
    ]
    assert all(c.from_logprobs for c in contracts.values())
    assert set(contracts["pg"].input_keys) == {
        "input_ids", "advantages", "generation_logprobs", "prev_logprobs", "reference_policy_logprobs",
        "token_mask", "sample_mask",
    }  # fmt: skip
    assert "prev_logprobs" not in contracts["fused"].input_keys
    assert "reference_policy_logprobs" not in contracts["no_kl"].input_keys
    assert contracts["nll"].input_keys == ("input_ids", "token_mask", "sample_mask")


def test_a_logits_only_loss_gets_the_defaults_and_is_refused_by_name_where_it_cannot_run():
    loss = LogitsOnly()
    contract = check_loss_fn(loss)
    assert contract == LossContract("LogitsOnlyNLL", LossType.TOKEN_LEVEL, False, None, False, ())
    contract.refuse_logits_only(None)  # a layout that holds full logits: it runs
    with pytest.raises(LossContractError, match=r"^loss LogitsOnlyNLL has no loss_from_logprobs: no full logits here"):
        contract.refuse_logits_only("no full logits here")
    check_loss_inputs(loss, pg_batch(2, seed=0), 64)  # declares no inputs: nothing to miss


def test_declared_input_keys_are_checked_on_the_host():
    class Declares(LogitsOnly):
        input_keys = ("input_ids", "my_rewards")

    with pytest.raises(LossContractError, match=r"loss Declares: data is missing key\(s\) \['my_rewards'\]"):
        check_loss_inputs(Declares(), pg_batch(2, seed=0), 64)
    with pytest.raises(LossContractError, match="input_keys must be a sequence of key names"):
        LossContract.of(type("Bad", (LogitsOnly,), {"input_keys": "input_ids"})())
    with pytest.raises(LossContractError, match="loss Odd: old_logprobs must be one of"):
        LossContract.of(type("Odd", (LogitsOnly,), {"old_logprobs": "sometimes"})())


@pytest.mark.parametrize(
    "a, b",
    [
        (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0])),
        (np.array([1.0, 2.0]), np.array([1.0, 3.0])),
        ([1.0, 2.0], [1.0, 3.0]),
        (lambda lp: lp, lambda lp: 2 * lp),
        (np.square, np.sqrt),
        ({"w": torch.ones(2)}, {"w": torch.zeros(2)}),
    ],
    ids=["tensor", "numpy", "list", "lambda", "function", "nested tensor"],
)
def test_losses_differing_only_in_a_non_scalar_setting_never_share_a_key(a, b):
    assert loss_cache_key(LogitsOnly(a)) != loss_cache_key(LogitsOnly(b))
    # A copy as a worker receives it (Ray pickles with cloudpickle) keeps the key: no recompile.
    assert loss_cache_key(pickle.loads(cloudpickle.dumps(LogitsOnly(a)))) == loss_cache_key(LogitsOnly(a))


def test_builtin_keys_are_by_value():
    assert loss_cache_key(ClippedPGLossFn(PG_CFG)) == loss_cache_key(ClippedPGLossFn(dict(PG_CFG)))
    assert loss_cache_key(ClippedPGLossFn(PG_CFG)) != loss_cache_key(ClippedPGLossFn({**PG_CFG, "ratio_clip_c": 3.0}))
    assert loss_cache_key(NLLLoss()) == loss_cache_key(pickle.loads(pickle.dumps(NLLLoss())))
    assert loss_cache_key(NLLLoss()) != loss_cache_key(LogitsOnly())


def test_state_key_tells_values_apart_exactly():
    assert state_key(1) != state_key(True) and state_key(1.0) != state_key(1)
    assert state_key(float("nan")) == state_key(float("nan")) and state_key(0.0) != state_key(-0.0)
    assert state_key(torch.zeros(2)) != state_key(torch.zeros(2, dtype=torch.float64))
    assert state_key(torch.zeros(2)) != state_key(torch.zeros(1, 2))
    assert state_key(torch.zeros(2, dtype=torch.bfloat16)) == state_key(torch.zeros(2, dtype=torch.bfloat16))
    cyclic = LogitsOnly()
    cyclic.setting = cyclic
    assert state_key(cyclic) == state_key(cyclic)
