"""Optimizer and learning-rate schedule from the policy config (NeMo RL's format).

``optimizer: {name: "torch.optim.AdamW", kwargs: {...}}`` and a scheduler *list*: the
schedulers in order plus one ``{milestones: [...]}`` entry, chained with ``SequentialLR``
(a single scheduler is used as is).  The schedule is stepped once per ``train`` call.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from core.policy.config import OptimizerConfig, SchedulerEntry, scheduler_chain
from core.policy.optimizer_params import AdamWParams


def import_object(path: str, what: str) -> Any:
    """``"pkg.module.Name"`` -> the object; a clear error naming ``what`` otherwise."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{what}: {path!r} is not a dotted import path like 'torch.optim.AdamW'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{what}: cannot import {path!r}: {err}") from err


def build_optimizer(
    cfg: OptimizerConfig | Mapping[str, Any], params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """The optimizer named by ``policy.optimizer`` over ``params``."""
    cfg = OptimizerConfig.coerce(cfg, "policy.optimizer")
    cls = import_object(cfg.name, "policy.optimizer.name")
    params = list(params)
    kwargs = dict(cfg.kwargs)
    if "betas" in kwargs:  # YAML gives a list; torch wants a tuple
        kwargs["betas"] = tuple(kwargs["betas"])
    kwargs = with_default_kernel(cls, kwargs, params[0].device.type if params else "cpu")
    try:
        return cls(params, **kwargs)
    except TypeError as err:
        raise ValueError(f"policy.optimizer.kwargs {sorted(kwargs)} rejected by {cfg.name}: {err}") from err


def with_default_kernel(cls: type, kwargs: Mapping[str, Any], param_device_type: str) -> dict[str, Any]:
    """``kwargs`` plus ``fused=True`` when that is the fast, safe default: the parameters live
    on CUDA, ``cls`` takes a ``fused`` argument (torch's Adam/AdamW/SGD do) and the user set
    neither ``fused`` nor ``foreach`` (null counts as unset, as it does for torch; a value is
    a choice we keep).

    Why: torch's own default on CUDA is the multi-tensor ``foreach`` kernel; the fused one does
    the whole update in a few kernels (the H100 reference run of DESIGN.md, HF + per-block
    compile + fused AdamW, used it).  Parameters on the host (CPU workers, FSDP CPU offload)
    keep torch's default, so CPU numerics are unchanged.
    """
    out = dict(kwargs)
    if param_device_type != "cuda" or out.get("fused") is not None or out.get("foreach") is not None:
        return out
    try:
        accepts = "fused" in inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a builtin or C-implemented class without a signature
        accepts = False
    if accepts:
        out["fused"] = True
    return out


def build_scheduler(
    entries: Sequence[SchedulerEntry | Mapping[str, Any]] | None, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LRScheduler:
    """The schedule of ``policy.scheduler``; ``None``/empty gives a constant learning rate."""
    if not entries:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: 1.0)
    chain, milestones = scheduler_chain(entries)
    schedulers = [
        import_object(entry.name, f"policy.scheduler[{i}].name")(optimizer, **entry.kwargs)
        for i, entry in chain
        if entry.name is not None  # scheduler_chain: every chained entry has a name
    ]
    if len(schedulers) == 1:
        return schedulers[0]
    return torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers, milestones=milestones)


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every tensor of the optimizer state (exp_avg, ...) to ``device`` in place."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)


def set_adamw_params(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None, params: AdamWParams
) -> None:
    """Every param group of ``optimizer`` (an AdamW) takes ``params``; its state (moments, step
    counts) is kept.  The constant schedule a policy without ``policy.scheduler`` has
    (``build_scheduler``: base lr x 1) then keeps this learning rate when it steps."""
    for group in optimizer.param_groups:
        group.update(lr=params.lr, initial_lr=params.lr, betas=params.betas, eps=params.eps)
        group["weight_decay"] = params.weight_decay
    if scheduler is not None:
        scheduler.base_lrs = [params.lr] * len(optimizer.param_groups)
