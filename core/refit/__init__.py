"""The refit adapter: training weights -> generation engine, one path for every backend.

Backends yield ``(hf_name, full tensor)`` (``iter_full_weights``); ``core.refit`` does the
rest: the manifest the engine checks first (``manifest``), byte-bounded buckets
(``buckets``), packing (``packing``), the transports (``shm`` and ``cuda_ipc`` for ``ipc``,
``collective`` for gloo/NCCL broadcast), the policy-worker side (``sender.RefitSender``), the
engine side's rules (``receiver.RefitReceiver``) and the driver (``refit_policy_generation``).
"""

from core.refit.buckets import buffer_bytes, plan_buckets
from core.refit.driver import TRANSPORTS, RefitStats, refit_policy_generation
from core.refit.manifest import RefitError, RefitManifest, TensorSpec, dtype_name
from core.refit.receiver import RefitReceiver
from core.refit.sender import RefitSender

__all__ = [
    "TRANSPORTS",
    "RefitError",
    "RefitManifest",
    "RefitReceiver",
    "RefitSender",
    "RefitStats",
    "TensorSpec",
    "buffer_bytes",
    "dtype_name",
    "plan_buckets",
    "refit_policy_generation",
]
