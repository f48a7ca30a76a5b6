"""One setting for the precision of float32 matmuls on every backend.

On NVIDIA GPUs neither engine does true float32 matmuls by default in every case: JAX's
``default`` precision is TF32-class there, and torch allows TF32 once asked to.  The first
GPU run showed what that costs: fp32 JAX training diverged from torch by 0.3 % in loss after
one step, and ``highest`` restored agreement to 1e-6.  So ``policy.matmul_precision`` decides
for all backends at once, and a ``--backend`` switch keeps the numerics:

==========  ===========================  =============================================
value       JAX (``jax_default_matmul_   torch (``torch.set_float32_matmul_precision``)
            precision``)
==========  ===========================  =============================================
highest     ``highest`` (fp32)           ``highest`` (TF32 off for matmul and cuDNN)
high        ``high`` (bf16_3x / TF32)    ``high`` (TF32 allowed)
default     ``default`` (TF32 on GPU)    ``high`` (TF32 allowed: the same fast path)
==========  ===========================  =============================================

Left out or null it is ``highest`` when ``policy.precision`` is float32 (fp32 means fp32)
and ``default`` otherwise (bf16 / fp16 compute: only the few fp32 matmuls are affected).
On CPU every value computes in fp32.

Nothing here imports torch or jax: the backends apply the resolved value themselves.
"""

from __future__ import annotations

from core.policy.config import PolicyConfig

#: ``torch.set_float32_matmul_precision`` argument for each value.
TORCH_FLOAT32_MATMUL = {"highest": "highest", "high": "high", "default": "high"}


def default_matmul_precision(precision: str) -> str:
    """The matmul precision a left-out ``policy.matmul_precision`` means for compute in
    ``precision`` (``highest`` for float32, ``default`` otherwise)."""
    return "highest" if precision == "float32" else "default"


def resolve_matmul_precision(policy_cfg: PolicyConfig) -> str:
    """``policy.matmul_precision`` with its default filled in (see the module docstring)."""
    if policy_cfg.matmul_precision is None:
        return default_matmul_precision(policy_cfg.precision)
    return policy_cfg.matmul_precision


def torch_float32_matmul(policy_cfg: PolicyConfig) -> str:
    """What the torch backends pass to ``torch.set_float32_matmul_precision``."""
    return TORCH_FLOAT32_MATMUL[resolve_matmul_precision(policy_cfg)]
