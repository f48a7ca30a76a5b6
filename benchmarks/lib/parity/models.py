"""Checking a parity run's arguments and layout names against the machine, and its policy settings.
(Its models: ``benchmarks.lib.models.prepare_model``.)"""

from __future__ import annotations

from typing import Any

from benchmarks.lib import models
from benchmarks.lib.layouts import device_layout, grammar, host_layout, parse_layout
from benchmarks.lib.models import hf_config
from benchmarks.lib.parity.checks import crossload_pairs
from benchmarks.lib.parity.settings import TORCH_LAYOUTS


def jax_devices(name: str) -> int | None:
    """XLA host devices the layout's one actor owns (``None``: a layout of one worker per device)."""
    layout = host_layout(name)
    return layout.devices if layout else None


def check_arguments(layouts: list[str], engine: Any, crossload: str, seq: int, steps: int, batch: int = 8) -> None:
    """``ValueError`` for what makes the whole run meaningless (before anything starts); a bad
    *layout* is not one of them (:func:`layout_problem`: that layout gets an error line)."""
    if not layouts:
        raise ValueError("no layouts given")
    if len(set(layouts)) != len(layouts):
        raise ValueError(f"a layout is given twice: {layouts}")
    if isinstance(engine, (list, tuple)) and (unknown := [n for n in engine if n not in layouts]):
        raise ValueError(f"--engine {' '.join(unknown)}: not among the layouts {layouts}")
    crossload_pairs(layouts, crossload)
    if seq < 2 or steps < 1:
        raise ValueError(f"seq must be >= 2 and steps >= 1, got seq={seq}, steps={steps}")
    if batch < 2:
        raise ValueError(f"batch must be >= 2 (grpo_rloo_step's leave-one-out baseline needs groups of 2), got {batch}")


def layout_problem(name: str, batch: int, threads: int, ray_cpus: float | None) -> str | None:
    """Why ``name`` cannot run here (unknown, does not fit, batch), or ``None``.  See "Bad
    input" in ``benchmarks/parity.py``'s docstring for what *fits* means."""
    host = host_layout(name)
    layout = device_layout(name)
    if host is None and layout is None:
        return f"unknown layout {name!r}: one of {', '.join(TORCH_LAYOUTS)}, or by the grammar {grammar()}"
    cpus = "" if ray_cpus is None else f" (the Ray cluster has {ray_cpus:g} CPUs)"
    if layout is not None:
        if layout.workers > threads:
            return (
                f"does not fit: {name} needs {layout.workers} workers, each with a CPU thread of its own; "
                f"the thread budget --threads {threads} gives at most {threads}{cpus}"
            )
        need = layout.workers * (threads // layout.workers)
        if ray_cpus is not None and need > ray_cpus:
            return f"does not fit: {name} needs {layout.workers} x {threads // layout.workers} CPUs{cpus}"
        if batch % layout.dp:
            return f"batch {batch} is not divisible by its data-parallel size {layout.dp}"
    elif ray_cpus is not None and threads > ray_cpus:
        return f"does not fit: {name} is one actor of --threads {threads} CPUs{cpus}"
    return None


def jax_model_problem(model: str, model_path: str) -> str | None:
    """Why the JAX backend cannot load this model (its own check on the HF config), or ``None``."""
    return models.jax_model_problem(hf_config(model_path), model)


def model_problem(layout: str, model: str, model_path: str) -> str | None:
    """Why the layout's backend cannot load this model, where the benchmarks can tell on the driver."""
    return models.backend_model_problem(parse_layout(layout).backend, hf_config(model_path), model)


def parity_settings(cfg: dict, lr: float) -> dict:
    """The policy section of a parity run: a constant learning rate large enough that 3 steps
    move the weights visibly (the default 5e-6 with a 10-step warm-up barely does), so that the
    loss curve and the cross-loaded export test trained weights, not the initial ones; a
    ``-dynamic`` layout's token budgets halved."""
    cfg["optimizer"]["kwargs"]["lr"] = lr
    cfg["scheduler"] = None
    dynamic = cfg.get("dynamic_batching") or {}
    if dynamic.get("enabled"):
        # a -dynamic layout's budget is one micro batch's padded tokens, which the parity
        # batch's short rows never fill: at half of it a rank's rows are split over micro
        # batches of different widths, whose accumulated gradient must still match hf's
        for key in ("train_mb_tokens", "logprob_mb_tokens"):
            dynamic[key] = max(cfg["max_total_sequence_length"], dynamic[key] // 2)
    return cfg
