"""``PolicyWorkerBase``: what every backend's policy worker does the same way.

Construction arguments (the seeds' worker signature), the sampling temperature both
``get_logprobs`` and ``train`` apply, the tokenizer copy saved with checkpoints, the shape of
``train``'s result, and the liveness probe.  Engine-specific work stays in the backends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from core.policy.checks import check_loss_fn, check_model_inputs, check_sequence_lengths, check_train_batch
from core.policy.config import PolicyConfig
from core.refit.sender import RefitSender

REFERENCE_MISSING = "this policy was built with init_reference_model=False: no reference weights"
OPTIMIZER_MISSING = "train() needs an optimizer: this policy was built with init_optimizer=False"


class PolicyWorkerBase(RefitSender):
    """Base of ``TorchPolicyWorker`` and ``JaxPolicyWorker``; the refit methods come from
    ``RefitSender`` on top of each backend's ``iter_full_weights``."""

    rank: int = 0

    def __init__(self, config: PolicyConfig | Mapping[str, Any], tokenizer: Any = None) -> None:
        self.cfg = PolicyConfig.coerce(config, path="policy")
        self.tokenizer = tokenizer
        # The distribution generation samples from: applied identically by get_logprobs and train.
        self.temperature = self.cfg.generation.temperature if self.cfg.generation is not None else 1.0

    def is_alive(self) -> bool:
        return True

    # The driver's checks again, for a caller that went past it; callers run these inside
    # ``before_collectives()`` so that a failure here leaves the group usable.
    def _check_batch(self, data: Mapping[str, Any], vocab_size: int) -> None:
        """``get_logprobs`` / ``generate`` input: lengths within the limit, ids and masks valid."""
        check_sequence_lengths(data, self.cfg.max_total_sequence_length)
        check_model_inputs(data, vocab_size)

    def _check_train_call(
        self,
        data: Mapping[str, Any],
        loss_fn: Any,
        gbs: int,
        mbs: int,
        dp: int,
        vocab_size: int,
        eval_mode: bool,
        has_optimizer: bool,
    ) -> int:
        """``train`` input; returns this rank's rows per global batch."""
        local_gbs = check_train_batch(data, gbs, mbs, dp, self.cfg.max_total_sequence_length)
        check_model_inputs(data, vocab_size)
        check_loss_fn(loss_fn)
        if not eval_mode and not has_optimizer:
            raise RuntimeError(OPTIMIZER_MISSING)
        return local_gbs

    def _save_tokenizer(self, tokenizer_path: str | None) -> None:
        """Rank 0 writes the tokenizer files next to a checkpoint."""
        if tokenizer_path is not None and self.rank == 0 and self.tokenizer is not None:
            self.tokenizer.save_pretrained(tokenizer_path)

    @staticmethod
    def _train_result(
        losses: Sequence[float],
        norms: Sequence[float],
        step_metrics: Sequence[Mapping[str, float]],
        all_mb: Mapping[str, list[float]],
        lr: float | None,
        skip_reasons: Sequence[str | None] | None = None,
    ) -> dict[str, Any]:
        """``train``'s return value: per optimizer step ``global_loss``/``grad_norm`` [n] and
        ``metrics`` (whole-batch values), plus this rank's per-micro-batch metrics, and per
        step whether the optimizer step was skipped (``skipped`` [n] bool) and why
        (``skip_reasons``: None for an applied step, else a ``core.interfaces.SKIP_REASONS`` key)."""
        import torch

        keys = sorted(step_metrics[0]) if step_metrics else []
        reasons = list(skip_reasons) if skip_reasons is not None else [None] * len(losses)
        return {
            "global_loss": torch.tensor(list(losses)),
            "grad_norm": torch.tensor(list(norms)),
            "metrics": {k: torch.tensor([m[k] for m in step_metrics]) for k in keys},
            "all_mb_metrics": dict(all_mb),
            "lr": lr,
            "skipped": torch.tensor([r is not None for r in reasons], dtype=torch.bool),
            "skip_reasons": reasons,
        }


def step_skip_reason(global_seqs: float, global_toks: float, loss: float, grad_norm: float) -> str | None:
    """Whether an optimizer step must be skipped, from *globally reduced* values (so every
    rank decides the same): no valid sequence / token in the global batch, a non-finite
    global loss, or a non-finite global gradient norm.  None: apply the step; else the
    ``core.interfaces.SKIP_REASONS`` key."""
    import math

    if not (global_seqs > 0 and global_toks > 0):
        return "no_valid_tokens"
    if not math.isfinite(loss):
        return "non_finite_loss"
    if not math.isfinite(grad_norm):
        return "non_finite_grad_norm"
    return None
