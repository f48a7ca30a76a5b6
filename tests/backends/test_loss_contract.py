"""The loss contract on every layout: a user loss with only a logits-level ``__call__``
(``LogitsOnlyNLL``) trains where the backend holds a micro batch's full logits, giving the
built-in's loss; where it does not (JAX: no full-logits path; torch with sequence packing or
context parallelism: tests/torch_backends/test_context_parallel_and_packing.py), it is refused by
name on the driver -- a ``LossContractError`` raised by ``Policy.train`` itself, before any worker
call -- and the same policy then trains as before.  The compile-cache key: tests/unit/test_loss_contract.py
and tests/jax_backend/test_loss_cache_key.py."""

from __future__ import annotations

import math

import pytest

from core.losses import NLLLoss
from core.losses.contract import LossContractError
from tests.backends.conftest import LogitsOnlyNLL
from tests.torch_backends.conftest import pg_batch


def test_a_logits_only_loss_runs_where_logits_exist_or_is_refused_on_the_driver(layout_policy):
    policy, layout = layout_policy.policy, layout_policy.layout
    data = pg_batch(4, seed=7)
    builtin = policy.train(data, NLLLoss(), eval_mode=True).loss[0]
    if layout.backend != "jax_pjit":  # plain torch rows: the loss gets the full (gathered) logits
        assert math.isclose(policy.train(data, LogitsOnlyNLL(), eval_mode=True).loss[0], builtin, rel_tol=1e-5)
        return
    with pytest.raises(LossContractError, match=r"^loss LogitsOnlyNLL has no loss_from_logprobs: the jax_pjit backend"):
        policy.train(data, LogitsOnlyNLL())
    after = policy.train(data, NLLLoss())  # the group is alive and trains
    assert after.skip_reasons == [None] and math.isclose(after.loss[0], builtin, rel_tol=1e-6)
