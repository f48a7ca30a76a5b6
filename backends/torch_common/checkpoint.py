"""Checkpoints for the torch backends.

* Resume: torch DCP (``torch.distributed.checkpoint``) -- every rank writes its own shards of
  the model and of the optimizer state, in parallel, and a load reshards them to whatever
  layout the loading job uses.  ``get_model_state_dict``/``get_optimizer_state_dict`` give
  clean HF parameter names for FSDP1 and FSDP2 models alike, so both backends share this.
  The scheduler state and step counter are small Python objects: rank 0 ``torch.save``s
  them next to the optimizer shards.
* Exchange: HF safetensors via ``save_pretrained`` from a gathered full state dict, so
  ``transformers`` (and the JAX backend) load it like any hub checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

SCHEDULER_FILE = "scheduler_and_step.pt"


def save_dcp(
    model: torch.nn.Module,
    weights_path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_path: str | os.PathLike | None = None,
    extra_state: Mapping[str, Any] | None = None,
) -> None:
    """Collective: write the model (and optionally optimizer + ``extra_state``) shards."""
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(weights_path))
    if optimizer_path is None:
        return
    if optimizer is None:
        raise ValueError("save_checkpoint: optimizer_path given but this policy has no optimizer")
    dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(optimizer_path))
    if dist.get_rank() == 0:
        torch.save(dict(extra_state or {}), Path(optimizer_path) / SCHEDULER_FILE)
    dist.barrier()


def load_dcp(
    model: torch.nn.Module,
    weights_path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_path: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Collective: load shards written by :func:`save_dcp`; returns the extra state (or {})."""
    _require_dcp_dir(weights_path, "weights_path")
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(weights_path))
    set_model_state_dict(model, state["model"])
    if optimizer_path is None:
        return {}
    if optimizer is None:
        raise ValueError("load_checkpoint: optimizer_path given but this policy has no optimizer")
    _require_dcp_dir(optimizer_path, "optimizer_path")
    optim_state = {"optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(optim_state, checkpoint_id=str(optimizer_path))
    set_optimizer_state_dict(model, optimizer, optim_state["optim"])
    extra = Path(optimizer_path) / SCHEDULER_FILE
    return torch.load(extra, weights_only=False) if extra.exists() else {}


def _require_dcp_dir(path: str | os.PathLike, what: str) -> None:
    if not (Path(path) / ".metadata").is_file():
        raise FileNotFoundError(f"{what}={str(path)!r} is not a DCP checkpoint (no .metadata file)")


def write_hf_checkpoint(hf_module, state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike,
                        tokenizer=None) -> None:
    """Rank-local: ``save_pretrained`` the gathered ``state_dict`` (safetensors) + config."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_module.save_pretrained(path, state_dict=dict(state_dict), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
