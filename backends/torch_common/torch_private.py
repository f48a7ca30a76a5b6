"""Every private torch API the torch backends use, behind one module.

torch is pinned exactly (``torch==2.13.0``), and these names carry no compatibility promise:
a torch upgrade may rename, move or re-sign any of them without a deprecation period.  So no
other module of the backends touches them; each is wrapped here, with why no public API
serves, and ``tests/torch_backends/test_torch_private.py`` checks every one against the
installed torch (it exists, has the signature called here) and fails naming the torch version
and the symbol -- the place to look when a torch upgrade breaks the FSDP1 or compile paths.

FSDP1 (``torch_fsdp``): its flat-parameter handles, the sharding strategy a handle reshards
with, the reshard step and the flat parameter's records of the original weights.  DTensor
(``torch_dtensor``): flattening two mesh dims into one, a DTensor's local tensor without
waiting, the async-collective tensor type, ring attention's rotate method, and the compiled
call ``nn.Module.compile`` installs.  CPU linears (``torch_common.cpu_linear``): oneDNN's
linear op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

# The attribute FSDP1 inserts between a wrapper and the module it wraps (in parameter names).
from torch.distributed.fsdp._common_utils import FSDP_WRAPPED_MODULE

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

__all__ = [
    "FSDP_WRAPPED_MODULE",
    "REDISTRIBUTE_LOGGER",
    "AsyncCollectiveTensor",
    "compiled_call",
    "flat_param_handles",
    "flatten_mesh",
    "handles_kept_gathered",
    "local_tensor_of",
    "onednn_linear",
    "has_onednn_linear_op",
    "reshard_gathered",
    "set_compiled_call",
    "set_ring_attention_rotate_method",
    "unit_weight_records",
]

#: DTensor's redistribution logger (it warns on every step about the 2-D mesh's grad norm).
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


# ----------------------------------------------------------------------------- FSDP1
def flat_param_handles(model: FSDP) -> list[Any]:
    """The ``FlatParamHandle`` of every FSDP unit of ``model`` that holds parameters
    (``FullyShardedDataParallel._handle``: FSDP1 exposes no public accessor)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [m._handle for m in FullyShardedDataParallel.fsdp_modules(model) if m._handle is not None]


@contextlib.contextmanager
def handles_kept_gathered(handles: list[Any]) -> Iterator[None]:
    """While inside, ``handles`` reshard like ``SHARD_GRAD_OP`` (gathered once per forward,
    kept after it), then their own strategy is restored.  FSDP1 has no public switch for
    resharding after forward; its post-forward hook frees a unit only under the
    reshard-after-forward strategies, and reads the handle's ``_sharding_strategy``."""
    from torch.distributed.fsdp._flat_param import HandleShardingStrategy

    saved = [h._sharding_strategy for h in handles]
    for h in handles:
        h._sharding_strategy = HandleShardingStrategy.SHARD_GRAD_OP
    try:
        yield
    finally:
        for h, strategy in zip(handles, saved, strict=True):
            h._sharding_strategy = strategy


def reshard_gathered(model: FSDP) -> None:
    """Free every sharded unit's gathered parameters (FSDP1 never reshards the root after
    forward and has no public reshard call; this is the step its post-backward hook runs,
    ``_runtime_utils._reshard``).  A unit not initialised yet (no forward: nothing gathered)
    or already resharded is left alone."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._runtime_utils import _reshard

    for module in FullyShardedDataParallel.fsdp_modules(model):
        handle = module._handle
        if handle is None or not handle.uses_sharded_strategy:
            continue
        if not hasattr(handle.flat_param, "_full_param_padded"):
            continue  # FSDP initialises lazily: before the first forward nothing is gathered
        if not handle.needs_unshard():
            _reshard(module, handle, True)


def unit_weight_records(unit: FSDP) -> list[tuple[str, torch.nn.Module, str]]:
    """``(module name under the unit, owning module, attribute)`` of every original weight the
    unit's flat parameter holds, tied aliases after the rest (``FlatParameter._param_infos`` /
    ``_shared_param_infos``; ``named_parameters`` loses a unit whose weights are all frozen)."""
    handle = unit._handle
    if handle is None:
        return []
    flat = handle.flat_param
    records = [(i.module_name, i.module, i.param_name) for i in flat._param_infos]
    return records + [(i.module_name, i.module, i.param_name) for i in flat._shared_param_infos]


# ----------------------------------------------------------------------------- oneDNN
def has_onednn_linear_op() -> bool:
    """Whether this build has oneDNN's linear op (``torch.ops.mkldnn._linear_pointwise``, the op
    inductor emits for CPU linears: torch has no public oneDNN matmul)."""
    try:
        _ = torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return False
    return True


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` by oneDNN's linear op, no post-op (``attr "none"``)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# ----------------------------------------------------------------------------- DTensor, compile
def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh``'s dims as one dim called ``name`` (``DeviceMesh._flatten``: FSDP2 over dp x cp
    needs one mesh dim, and torch has no public way to make it from a sub-mesh)."""
    return mesh._flatten(name)


def local_tensor_of(tensor: DTensor) -> torch.Tensor:
    """A DTensor's local tensor as stored (``DTensor._local_tensor``): ``to_local()`` would
    wait on a pending collective, which is what the caller wants to see first."""
    return tensor._local_tensor


def set_ring_attention_rotate_method(method: str) -> None:
    """Ring attention's KV rotation (``"allgather"`` / ``"alltoall"``): context parallelism's
    only switch, in ``torch.distributed.tensor.experimental._attention``."""
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(method)


def compiled_call(module: torch.nn.Module) -> Callable[..., Any] | None:
    """The compiled call ``module.compile()`` installed (``nn.Module._compiled_call_impl``,
    what ``__call__`` runs instead of ``_call_impl``); None before ``compile()``."""
    return module._compiled_call_impl


def set_compiled_call(module: torch.nn.Module, call: Callable[..., Any]) -> None:
    """Make ``module.__call__`` run ``call`` (a wrapper of :func:`compiled_call`'s)."""
    module._compiled_call_impl = call
