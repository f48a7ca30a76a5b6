"""torch's float32 matmul / TF32 switches, set from ``policy.matmul_precision``.

The value is resolved once for every backend by ``core.policy.matmul_precision`` (fp32 runs
default to ``highest``: no TF32 anywhere); this module applies it inside a torch worker,
before the model is built, so every matmul and convolution of the run sees it.

torch 2.13 has two APIs for TF32: ``torch.set_float32_matmul_precision`` plus the
``allow_tf32`` booleans, and the per-op ``fp32_precision`` strings.  They must not be mixed:
once a string was written, reading ``torch.backends.cudnn.allow_tf32`` raises (2.13 checks
the legacy flag against the strings), and torch itself still reads it (inductor's conv
lowering, ``torch.backends.cudnn.flags()``).  So only the first API is written here; neither
call warns in 2.13, and torch maps them onto the strings (``allow_tf32 = False`` leaves
cuDNN's strings unset, which resolves to IEEE fp32).  cuDNN (convolutions, RNNs) has its own
switch, on by default: it is turned off for ``highest`` so "fp32 means fp32" holds for every
kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.torch_common.cpu_linear import linear_path
from core.policy.config import PolicyConfig
from core.policy.matmul_precision import torch_float32_matmul


def apply_matmul_precision(policy_cfg: PolicyConfig) -> str:
    """Set torch's float32 matmul precision and cuDNN's TF32 switch from the policy
    section; returns the ``torch.set_float32_matmul_precision`` value applied."""
    value = torch_float32_matmul(policy_cfg)
    torch.set_float32_matmul_precision(value)
    torch.backends.cudnn.allow_tf32 = value != "highest"
    return value


def matmul_precision_state() -> dict[str, Any]:
    """What this process runs with (reported by ``get_gpu_info``): the float32 matmul
    precision, CUDA matmul's resulting fp32 string (``ieee`` = true fp32, ``tf32``),
    cuDNN's TF32 switch, and the path of the model's linear layers on a CPU (``cpu_linear``)."""
    return {
        **linear_path(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_fp32_precision": torch.backends.cuda.matmul.fp32_precision,
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
    }
