"""Per-step AdamW hyperparameters: what ``Policy.set_optimizer_params`` sends to every worker.

A caller that chooses the optimizer's settings step by step (the Tinker API's ``optim_step``
carries its own Adam parameters) sets them before each ``train`` call instead of fixing them
in ``policy.optimizer`` for the whole run.  Every backend applies them the same way: torch's
``AdamW`` param groups, or the JAX backend's optax chain (rebuilt, Adam moments kept, when a
value other than the learning rate changes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: The one optimizer whose hyperparameters can be set per step.
ADAMW = "torch.optim.AdamW"


@dataclass(frozen=True)
class AdamWParams:
    """The settings of the next optimizer steps (torch ``AdamW``'s meaning)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    """Decoupled: ``p <- p - lr * weight_decay * p``."""
    max_grad_norm: float | None
    """Clip the global gradient norm to this before the step; None: no clipping."""

    def problems(self) -> list[str]:
        """What is out of range, one phrase per field (empty: valid)."""
        found = []
        for name in ("lr", "eps", "weight_decay"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                found.append(f"{name}={value!r} must be a finite number >= 0")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            found.append(f"betas={self.betas!r} must be two numbers in [0, 1)")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            found.append(f"max_grad_norm={self.max_grad_norm!r} must be a finite number > 0, or None for no clipping")
        return found

    def constants(self) -> tuple[Any, ...]:
        """Everything but the learning rate (a JAX optimizer recompiles when these change)."""
        return (self.betas, self.eps, self.weight_decay, self.max_grad_norm)

    def optimizer_kwargs(self) -> dict[str, Any]:
        """``policy.optimizer.kwargs`` of an AdamW with these settings."""
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}


def check_optimizer_params(cfg: Any, params: AdamWParams) -> None:
    """``ValueError`` naming the field when ``params`` cannot be applied to the policy of
    ``cfg`` (a ``PolicyConfig``): an optimizer other than AdamW, a learning-rate schedule of
    its own, or a value out of range."""
    if cfg.optimizer is None:
        raise ValueError("set_optimizer_params: this policy has no optimizer (policy.optimizer is null)")
    if cfg.optimizer.name != ADAMW:
        raise ValueError(
            f"set_optimizer_params: policy.optimizer.name is {cfg.optimizer.name!r}; per-step settings are "
            f"AdamW's ({ADAMW})"
        )
    if cfg.scheduler is not None:
        raise ValueError(
            "set_optimizer_params: policy.scheduler is set; with per-step settings the caller gives every "
            "step's learning rate, so policy.scheduler must be null"
        )
    found = params.problems()
    if found:
        raise ValueError("set_optimizer_params: " + "; ".join(found))
