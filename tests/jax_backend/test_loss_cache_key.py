"""The JAX worker's compiled grad steps are keyed by the loss's ``cache_key()``: two instances of
a user loss that differ only in a non-scalar setting (an array, a list, a callable) never share
a compiled step -- the step closes over the loss, so sharing would train the second loss with
the first one's setting, silently -- and a copy of one loss, as every ``Policy.train`` call ships
it, reuses its step.  (A list setting was keyed before; its key: tests/unit/test_loss_contract.py.)"""

from __future__ import annotations

import math
import pickle

import cloudpickle
import numpy as np

from core.interfaces import LossType
from core.kernels import ops_for
from core.losses import NLLLoss
from tests.torch_backends.conftest import pg_batch


def _identity(lp):
    return lp


class ScaledNLL:
    """NLL times ``scale`` (an array) times ``sum(weights)`` (a list), on ``transform(logprobs)``."""

    loss_type = LossType.TOKEN_LEVEL

    def __init__(self, scale: np.ndarray, weights: list[float], transform=_identity) -> None:
        self.scale, self.weights, self.transform = scale, weights, transform

    def __call__(self, next_token_logits, data, global_valid_seqs, global_valid_toks):
        raise AssertionError("the JAX backend calls loss_from_logprobs")

    def loss_from_logprobs(self, curr_logprobs, data, global_valid_seqs, global_valid_toks):
        loss, metrics = NLLLoss().loss_from_logprobs(
            self.transform(curr_logprobs), data, global_valid_seqs, global_valid_toks
        )
        loss = loss * float(np.asarray(self.scale)) * sum(self.weights)
        return loss, {**metrics, "loss": ops_for(loss).stop_gradient(loss)}


def test_losses_differing_in_a_non_scalar_setting_get_their_own_compiled_step(qwen2_worker):
    worker, data = qwen2_worker, pg_batch(4, seed=5)
    base = ScaledNLL(np.array(1.0), [1.0])
    variants = {
        "array": (ScaledNLL(np.array(2.0), [1.0]), 2.0),
        "callable": (ScaledNLL(np.array(1.0), [1.0], lambda lp: 2 * lp), 2.0),
    }
    steps_before = len(worker._grad_steps)
    reference = worker.train(data, base, eval_mode=True).loss[0]
    assert len(worker._grad_steps) == steps_before + 1
    copy = pickle.loads(cloudpickle.dumps(base))  # what a worker receives from Policy.train
    assert worker.train(data, copy, eval_mode=True).loss[0] == reference
    assert len(worker._grad_steps) == steps_before + 1  # the copy reused the step
    for name, (loss, factor) in variants.items():
        value = worker.train(data, loss, eval_mode=True).loss[0]
        assert math.isclose(value, factor * reference, rel_tol=1e-6), (name, value, reference)
    assert len(worker._grad_steps) == steps_before + 1 + len(variants)
