"""Checkpoints for the torch backends.

* Resume: torch DCP (``torch.distributed.checkpoint``) -- every rank writes its own shards of
  the model and of the optimizer state, in parallel, and a load reshards them to whatever
  layout the loading job uses.  ``get_model_state_dict``/``get_optimizer_state_dict`` give
  clean HF parameter names for FSDP1 and FSDP2 models alike, so both backends share this.
  The scheduler state and step counter are small Python objects: rank 0 ``torch.save``s
  them next to the optimizer shards.  Saves are atomic and loads verified
  (``core.checkpointing.policy_files``: temp sibling + rename, a manifest with sizes and
  sha256 written last; the DCP metadata is checked against the model before any shard is read).
* Exchange: HF safetensors via ``save_pretrained`` from a gathered full state dict, so
  ``transformers`` (and the JAX backend) load it like any hub checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from core.checkpointing import policy_files as pf
from core.checkpointing.manifest import CheckpointError
from core.distributed.recoverable import before_collectives

T = TypeVar("T")

SCHEDULER_FILE = "scheduler_and_step.pt"
FORMAT = "torch-dcp"  # the manifest's identity.format of a DCP policy checkpoint


def _distributed() -> bool:
    """Whether a process group is up (without one -- a single process -- DCP runs locally)."""
    return dist.is_available() and dist.is_initialized()


def _broadcast(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (a no-op without a process group)."""
    if not _distributed() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rank0(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only; its result (or its CheckpointError, re-raised) on every
    rank, so that no rank goes on to a collective the others will not join."""
    out: Any = None
    cause: BaseException | None = None
    if not _distributed() or dist.get_rank() == 0:
        try:
            out = ("ok", fn())
        except CheckpointError as e:
            out, cause = ("error", str(e)), e
        except Exception as e:  # noqa: BLE001 - an OSError etc. must reach every rank too
            out, cause = ("error", f"{type(e).__name__}: {e}"), e
    out = _broadcast(out)
    if out[0] == "error":
        raise CheckpointError(out[1]) from cause
    return out[1]


def save_dcp(
    model: torch.nn.Module,
    weights_path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_path: str | os.PathLike | None = None,
    extra_state: Mapping[str, Any] | None = None,
    train_step: int = 0,
) -> None:
    """Collective: write the model (and optionally optimizer + ``extra_state``) shards.

    Atomic (``core.checkpointing.policy_files``): every rank writes into temporary siblings;
    once all are done rank 0 writes the manifests and renames the directories into place,
    replacing (and only then deleting) a previous checkpoint at those paths.
    """
    with before_collectives():
        if optimizer_path is not None and optimizer is None:
            raise ValueError("save_checkpoint: optimizer_path given but this policy has no optimizer")
    targets = [(weights_path, pf.KIND_WEIGHTS)]
    if optimizer_path is not None:
        targets.append((optimizer_path, pf.KIND_OPTIMIZER))
    rank0 = not _distributed() or dist.get_rank() == 0

    def prepare() -> tuple[str, list[Path]]:
        pf.check_save_paths({"weights_path": weights_path, "optimizer_path": optimizer_path})
        token = pf.new_token()
        return token, pf.prepare_save([p for p, _ in targets], token)

    with before_collectives():  # _rank0 hands rank 0's error to every rank: all raise together
        token, temps = _rank0(prepare)
    try:
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(temps[0]))
        if optimizer_path is not None and optimizer is not None:  # a path without one was refused above
            dcp.save({"optim": _optimizer_state(model, optimizer)}, checkpoint_id=str(temps[1]))
            if rank0:
                torch.save(dict(extra_state or {}), temps[1] / SCHEDULER_FILE)
        if _distributed():
            dist.barrier()  # every rank's shards (and the scheduler file) are written
        _rank0(
            lambda: pf.finish_save(
                [(tmp, path, kind) for tmp, (path, kind) in zip(temps, targets, strict=True)],
                fmt=FORMAT,
                token=token,
                train_step=train_step,
                required={pf.KIND_OPTIMIZER: (SCHEDULER_FILE,)},
            )
        )
    except BaseException:
        if rank0:
            pf.discard_temps(temps)
        raise


def _optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``get_optimizer_state_dict``, without changing how the next optimizer step trains.

    On an optimizer that has not stepped yet, torch materialises the state with one lr=0 step
    on zero gradients (``torch.distributed.checkpoint.state_dict._init_optim_state``): AdamW's
    ``step`` becomes 1, so the first real step would use the second step's bias correction and
    a policy that saved before training would train differently from one that did not.  Such a
    state is saved with its step counters at 0 (with zero moments: AdamW's own initial state)
    and dropped from the live optimizer, which starts its first step as if nothing happened.
    """
    fresh = not optimizer.state
    state: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer))
    if fresh:
        per_param: dict[str, Any]
        for per_param in state.get("state", {}).values():
            step = per_param.get("step")
            if isinstance(step, torch.Tensor):
                per_param["step"] = torch.zeros_like(step)
            elif step is not None:
                per_param["step"] = 0
        optimizer.state.clear()
    return state


def model_shapes(state_dict: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Full (global) shape per key of a model state dict (plain, DTensor or ShardedTensor)."""
    return {k: tuple(v.size()) for k, v in state_dict.items() if hasattr(v, "size")}


def check_dcp_weights(weights_path: str | os.PathLike, expected: Mapping[str, tuple[int, ...]], what: str) -> None:
    """The DCP metadata of ``weights_path`` against the model's keys and shapes (before any
    shard is read): a CheckpointError naming the differing keys and both shapes."""
    try:
        metadata = dcp.FileSystemReader(str(weights_path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is one clear error
        raise CheckpointError(f"weights_path={str(weights_path)!r}: cannot read its DCP .metadata: {e}") from e
    entries = metadata.state_dict_metadata
    found = {
        k[len("model.") :]: tuple(v.size) for k, v in entries.items() if k.startswith("model.") and hasattr(v, "size")
    }
    if not found and any(k.startswith("optim.") for k in entries):
        raise CheckpointError(
            f"weights_path={str(weights_path)!r} holds optimizer state, not model weights "
            "(an optimizer checkpoint: pass it as optimizer_path)"
        )
    problem = pf.describe_mismatch(weights_path, expected, found, what=what)
    if problem:
        raise CheckpointError(problem)


def load_dcp(
    model: torch.nn.Module,
    weights_path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_path: str | os.PathLike | None = None,
    *,
    checksums: bool = True,
    what: str = "this model",
) -> dict[str, Any]:
    """Collective: load shards written by :func:`save_dcp`; returns the extra state.

    Before any shard is read, rank 0 verifies the manifests (sizes, and sha256 unless
    ``checksums=False`` -- the driver already did), the kinds, the optimizer's scheduler /
    step file, and the DCP metadata against the model's keys and shapes.
    """
    if optimizer_path is not None and optimizer is None:
        raise ValueError("load_checkpoint: optimizer_path given but this policy has no optimizer")
    state = {"model": get_model_state_dict(model)}
    expected = model_shapes(state["model"])

    def check() -> None:
        pf.check_load_paths(
            weights_path, optimizer_path, fmt=FORMAT, checksums=checksums, optimizer_required=(SCHEDULER_FILE,)
        )
        check_dcp_weights(weights_path, expected, what)

    _rank0(check)
    dcp.load(state, checkpoint_id=str(weights_path))
    set_model_state_dict(model, state["model"])
    if optimizer_path is None or optimizer is None:  # a path without an optimizer was refused above
        return {}
    optim_state = {"optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(optim_state, checkpoint_id=str(optimizer_path))
    set_optimizer_state_dict(model, optimizer, optim_state["optim"])
    return torch.load(Path(optimizer_path) / SCHEDULER_FILE, weights_only=False)


def write_hf_checkpoint(
    hf_module, state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike, tokenizer=None
) -> None:
    """Rank-local: ``save_pretrained`` the gathered ``state_dict`` (safetensors) + config."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_module.save_pretrained(path, state_dict=dict(state_dict), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
