"""The Tinker API's built-in losses (``forward_backward(data, loss_fn=...)``) as one dualrl loss,
torch or jax.

Tinker's losses are *sums* over the target tokens of every datum, never means: a datum's
``loss_fn_inputs`` hold one value per target token, and the loss of a batch is the sum of the
per-token terms (gradients of several ``forward_backward`` calls add up before one
``optim_step``).  With ``r_t = exp(log p(x_t) - q_t)`` (``q_t``: the sampler's logprob,
``loss_fn_inputs["logprobs"]``) and ``A_t`` the advantages:

* ``cross_entropy``        ``-w_t log p(x_t)``                      (``weights`` w; SFT, and the
  SDK's client-side custom losses, which send ``w = -dC/dlogprobs``)
* ``importance_sampling``  ``-r_t A_t``                             (REINFORCE corrected for the sampler)
* ``ppo``                  ``-min(r_t A_t, clip(r_t, lo, hi) A_t)``  (``lo``/``hi``: the clip thresholds, 0.8 / 1.2)
* ``cispo``                ``-sg(clip(r_t, lo, hi)) A_t log p(x_t)`` (``sg``: no gradient through the weight)

One class computes all four: each row of a batch says which term it uses (``loss_kind``), so
``forward_backward`` calls with different losses can share one optimizer step and one
compiled program.  The same function gives the per-token losses a ``forward`` returns
(:meth:`TinkerLoss.elementwise`, run on the driver on torch tensors) and the training loss the
backends differentiate (:meth:`TinkerLoss.loss_from_logprobs`, inside their jitted / autograd
step), so the numbers of both paths are one computation.

Data layout (``core.interfaces``): per-token keys [B, S] aligned like ``get_logprobs`` output
(column i refers to token i, column 0 unused); ``token_mask`` is 1 on the target tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.interfaces import LossType
from core.kernels import clipped_surrogate_loss, next_token_logprobs, ops_for
from core.losses.checks import LossInputChecker, LossInputError
from core.losses.contract import DeclaredLoss

#: Tinker's loss names this loss computes, in the order of their ``loss_kind`` codes.
TINKER_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")
#: Per-token inputs (``get_logprobs`` layout) and what each Tinker ``loss_fn_inputs`` key fills.
PER_TOKEN_KEYS = ("token_mask", "target_weights", "advantages", "sampling_logprobs", "clip_low", "clip_high")
#: The clip thresholds of ``ppo`` and ``cispo`` when the request names none (Tinker's fixed 0.2).
DEFAULT_CLIP = (0.8, 1.2)


def loss_kind(name: str) -> int:
    """The ``loss_kind`` code of a Tinker loss name (ValueError naming the supported ones)."""
    if name not in TINKER_LOSSES:
        raise ValueError(f"loss_fn {name!r} is not one of {list(TINKER_LOSSES)}")
    return TINKER_LOSSES.index(name)


class TinkerLoss(DeclaredLoss):
    """The sum over every target token of the row's Tinker loss term (module docstring).

    Data keys: ``input_ids`` [B, S], ``sample_mask`` [B], ``loss_kind`` [B] (an index into
    :data:`TINKER_LOSSES`) and the :data:`PER_TOKEN_KEYS` [B, S].  The loss ignores the global
    counts: a sum over micro batches and ranks of per-micro-batch sums is the batch's sum.
    No old-policy or reference logprobs (the sampler's logprobs are an input, ``sampling_logprobs``).
    """

    loss_type = LossType.TOKEN_LEVEL

    def __init__(self) -> None:
        self.check = LossInputChecker("TinkerLoss", PER_TOKEN_KEYS, finite_keys=PER_TOKEN_KEYS[1:])

    @property
    def input_keys(self) -> tuple[str, ...]:
        return (*self.check.required_keys(), "loss_kind")

    def check_inputs(self, data: Mapping[str, Any], vocab_size: int | None) -> None:
        super().check_inputs(data, vocab_size)
        kinds = data.get("loss_kind")
        rows = int(data["input_ids"].shape[0])
        if kinds is None or tuple(kinds.shape) != (rows,):
            raise LossInputError(f"TinkerLoss: data['loss_kind'] must have shape ({rows},)")
        if int(kinds.min()) < 0 or int(kinds.max()) >= len(TINKER_LOSSES):
            raise LossInputError(f"TinkerLoss: data['loss_kind'] must index {list(TINKER_LOSSES)}")

    def __call__(self, next_token_logits, data: Mapping[str, Any], global_valid_seqs, global_valid_toks):
        self.check(next_token_logits, data)
        curr_logprobs = next_token_logprobs(next_token_logits, data["input_ids"])
        return self.loss_from_logprobs(curr_logprobs, data, global_valid_seqs, global_valid_toks)

    def loss_from_logprobs(self, curr_logprobs, data: Mapping[str, Any], global_valid_seqs, global_valid_toks):
        """``(loss, metrics)`` from the next-token logprobs [B, S-1] (differentiable)."""
        ops = ops_for(curr_logprobs)
        per_token = self.elementwise(curr_logprobs, data)
        loss = ops.sum(per_token)
        mask = _mask(ops, data, curr_logprobs.dtype)
        sg = ops.stop_gradient
        return loss, {"loss": sg(loss), "num_target_tokens": sg(ops.sum(mask))}

    def elementwise(self, curr_logprobs, data: Mapping[str, Any]):
        """Each target token's loss term [B, S-1] (0 off the mask), from the next-token
        logprobs [B, S-1]."""
        ops = ops_for(curr_logprobs)
        dtype = curr_logprobs.dtype
        mask = _mask(ops, data, dtype)

        # Zero everything off the mask first: padding never reaches the loss, its gradient or exp().
        def column(key):
            return ops.where(mask > 0, ops.astype(data[key][:, 1:], dtype), 0.0)

        logp = ops.where(mask > 0, curr_logprobs, 0.0)
        weights, advantages = column("target_weights"), column("advantages")
        low, high = column("clip_low"), column("clip_high")
        ratio = ops.exp(logp - column("sampling_logprobs"))
        terms = {
            "cross_entropy": -weights * logp,
            "importance_sampling": -ratio * advantages,
            "ppo": clipped_surrogate_loss(ratio, advantages, 1.0 - low, high - 1.0)[0],
            "cispo": -ops.stop_gradient(ops.clip(ratio, low, high)) * advantages * logp,
        }
        kinds = data["loss_kind"]
        per_token = ops.zeros_like(logp)
        for code, name in enumerate(TINKER_LOSSES):
            selected = ops.expand_dims(ops.astype(kinds == code, dtype), -1)
            per_token = per_token + selected * terms[name]
        return per_token * mask


def _mask(ops, data: Mapping[str, Any], dtype):
    """token_mask x sample_mask, [B, S-1] in ``dtype``."""
    token_mask = ops.astype(data["token_mask"][:, 1:], dtype)
    return token_mask * ops.expand_dims(ops.astype(data["sample_mask"], dtype), -1)
