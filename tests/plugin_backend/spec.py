"""The ``eager_torch`` backend's spec: one worker, one unsharded eager torch module.

Imports only core (and the torch backends' option set): the driver validates a config without
importing torch.  What the backend lacks is refused here, by name, on the driver.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from backends.torch_common.spec import TORCH_OPTIONS, lora_dropout_problems
from core.config import Problem
from core.policy.backend_spec import BackendSpec

if TYPE_CHECKING:
    from core.policy.config import PolicyConfig

NAME = "eager_torch"
_UNSHARDED = "eager_torch runs one unsharded module in one process; use torch_dtensor or jax_pjit"


def _checks(policy: PolicyConfig) -> Iterable[Problem]:
    yield from lora_dropout_problems(policy)
    if policy.precision != "float32":
        # No mixed-precision wrapper: the module's parameters are what the optimizer steps.
        yield ("precision", f"{policy.precision!r}: the {NAME} backend computes in float32 only; set float32")


def _one_worker(policy: PolicyConfig, world_size: int) -> Iterable[Problem]:
    if world_size != 1:
        # An unsharded module on several ranks would need every gradient all-reduced: that is
        # what the built-in backends do; this one stays a single process.
        yield ("parallel", f"the {NAME} backend runs on exactly 1 worker, the layout asks for {world_size}")


SPEC = BackendSpec(
    name=NAME,
    worker="tests.plugin_backend.worker:EagerPolicyWorker",
    layout_prefix="eager",
    supports=TORCH_OPTIONS - {"cpu_offload"},
    why_not={
        "parallel.tensor_parallel_size": _UNSHARDED,
        "parallel.sequence_parallel": _UNSHARDED,
        "parallel.context_parallel_size": _UNSHARDED,
        "parallel.expert_parallel_size": _UNSHARDED,
        "cpu_offload": "the module lives on the worker's device; there are no shards to offload",
        "compile": "eager_torch is eager by definition; use torch_dtensor",
        "make_vocab_size_divisible_by": "without tensor parallelism nothing needs a padded vocabulary",
    },
    checks=_checks,
    layout_checks=_one_worker,
)
