"""``PolicyWorkerBase``: what every backend's policy worker does the same way.

Construction arguments (the seeds' worker signature), the sampling temperature both
``get_logprobs`` and ``train`` apply, the tokenizer copy saved with checkpoints, the shape of
``train``'s result, and the liveness probe.  Engine-specific work stays in the backends.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from core.refit.sender import RefitSender

REFERENCE_MISSING = "this policy was built with init_reference_model=False: no reference weights"
OPTIMIZER_MISSING = "train() needs an optimizer: this policy was built with init_optimizer=False"


class PolicyWorkerBase(RefitSender):
    """Base of ``TorchPolicyWorker`` and ``JaxPolicyWorker``; the refit methods come from
    ``RefitSender`` on top of each backend's ``iter_full_weights``."""

    rank: int = 0

    def __init__(self, config: Mapping[str, Any], tokenizer: Any = None) -> None:
        self.cfg = dict(config)
        self.tokenizer = tokenizer
        # The distribution generation samples from: applied identically by get_logprobs and train.
        self.temperature = float((self.cfg.get("generation") or {}).get("temperature", 1.0))

    def is_alive(self) -> bool:
        return True

    def _save_tokenizer(self, tokenizer_path: str | None) -> None:
        """Rank 0 writes the tokenizer files next to a checkpoint."""
        if tokenizer_path is not None and self.rank == 0 and self.tokenizer is not None:
            self.tokenizer.save_pretrained(tokenizer_path)

    @staticmethod
    def _train_result(losses: Sequence[float], norms: Sequence[float], step_metrics: Sequence[Mapping[str, float]],
                      all_mb: Mapping[str, list[float]], lr: float | None) -> dict[str, Any]:
        """``train``'s return value: per optimizer step ``global_loss``/``grad_norm`` [n] and
        ``metrics`` (whole-batch values), plus this rank's per-micro-batch metrics."""
        import torch

        keys = sorted(step_metrics[0]) if step_metrics else []
        return {
            "global_loss": torch.tensor(list(losses)),
            "grad_norm": torch.tensor(list(norms)),
            "metrics": {k: torch.tensor([m[k] for m in step_metrics]) for k in keys},
            "all_mb_metrics": dict(all_mb),
            "lr": lr,
        }
