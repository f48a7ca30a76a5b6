"""Backend layouts by name: what every benchmark and ``dualrl parity`` / ``dualrl bench`` accept.

Grammar (``D``, ``T``, ``F``: positive integers):

* ``fsdp1-dp<D>``: ``torch_fsdp`` on ``D`` workers (FSDP1 has no tensor parallel);
* ``dtensor-dp<D>``, ``dtensor-tp<T>``, ``dtensor-dp<D>-tp<T>``, each with an optional ``-sp``
  (sequence parallel, needs ``T >= 2``): ``torch_dtensor`` on ``D x T`` workers;
* ``jax-fsdp<F>``, ``jax-tp<T>``, ``jax-fsdp<F>-tp<T>``: ``jax_pjit``, one worker owning
  ``F x T`` devices, mesh ``(fsdp=F, tp=T)``.

A torch worker holds one device (on a CPU machine: one process with a share of the threads);
so a layout needs ``devices`` = ``D x T`` or ``F x T`` of the machine's budget whatever its backend,
which is what :func:`check_fits` compares.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TORCH = re.compile(r"(fsdp1|dtensor)-(?:dp(\d+))?(?:-?tp(\d+))?(-sp)?")
_JAX = re.compile(r"jax-(?:fsdp(\d+))?(?:-?tp(\d+))?")
BACKEND_OF = {"fsdp1": "torch_fsdp", "dtensor": "torch_dtensor", "jax": "jax_pjit"}
GRAMMAR = "fsdp1-dp<D>, dtensor-dp<D>[-tp<T>][-sp], dtensor-tp<T>[-sp], jax-fsdp<F>[-tp<T>], jax-tp<T>"


class LayoutError(ValueError):
    """A layout name that does not parse, or describes no layout the backend has."""


@dataclass(frozen=True)
class Layout:
    name: str
    backend: str
    dp: int = 1  # torch: data-parallel workers; JAX: the mesh's fsdp axis
    tp: int = 1
    sp: bool = False

    @property
    def is_jax(self) -> bool:
        return self.backend == "jax_pjit"

    @property
    def devices(self) -> int:
        return self.dp * self.tp

    @property
    def workers(self) -> int:
        """Ray actors: one per device on torch, one owning all devices on JAX."""
        return 1 if self.is_jax else self.devices


def parse_layout(name: str) -> Layout:
    """``dtensor-tp2-sp`` -> ``Layout("dtensor-tp2-sp", "torch_dtensor", 1, 2, True)``."""
    torch_match, jax_match = _TORCH.fullmatch(name), _JAX.fullmatch(name)
    if torch_match and (torch_match.group(2) or torch_match.group(3)):
        kind, dp, tp, sp = torch_match.groups()
        layout = Layout(name, BACKEND_OF[kind], int(dp or 1), int(tp or 1), bool(sp))
        if kind == "fsdp1" and layout.tp > 1:
            raise LayoutError(f"layout {name!r}: FSDP1 (torch_fsdp) has no tensor parallel; use dtensor-...-tp<T>")
        if layout.sp and layout.tp < 2:
            raise LayoutError(f"layout {name!r}: sequence parallel (-sp) needs tensor parallel tp >= 2")
    elif jax_match and (jax_match.group(1) or jax_match.group(2)):
        layout = Layout(name, "jax_pjit", int(jax_match.group(1) or 1), int(jax_match.group(2) or 1))
    else:
        raise LayoutError(f"unknown layout {name!r}: expected one of {GRAMMAR}")
    if layout.dp < 1 or layout.tp < 1:
        raise LayoutError(f"layout {name!r}: sizes must be >= 1")
    return layout


def check_fits(layout: Layout, budget: int, what: str) -> str | None:
    """Why ``layout`` cannot run with ``budget`` devices (``what`` names the budget), or None."""
    if layout.devices > budget:
        return f"layout {layout.name!r} needs {layout.devices} devices/workers; {what} gives {budget}"
    return None


def check_batch(layout: Layout, batch: int) -> str | None:
    """Why a batch of ``batch`` rows cannot be split over the layout's data-parallel ranks, or None."""
    if batch % layout.dp:
        return f"layout {layout.name!r}: batch {batch} is not divisible by its data-parallel size {layout.dp}"
    return None


def _layout_if(name: str, jax: bool) -> Layout | None:
    try:
        layout = parse_layout(name)
    except LayoutError:
        return None
    return layout if layout.is_jax == jax else None


def torch_layout(name: str) -> Layout | None:
    """The torch layout of that name, or None (a JAX layout, or no layout at all)."""
    return _layout_if(name, jax=False)


def jax_layout(name: str) -> Layout | None:
    """``jax-fsdp4-tp2`` -> its :class:`Layout` (mesh fsdp=4, tp=2); None for any other name."""
    return _layout_if(name, jax=True)


def jax_model_problem(hf_config, model: str) -> str | None:
    """Why the JAX backend cannot run this model (the backend's own check of the HF config), or
    None -- asked on the driver, before any worker starts."""
    from backends.jax_pjit.model import ModelConfig

    try:
        ModelConfig.from_hf(hf_config)
    except ValueError as err:
        return f"model {model!r} is not supported by the JAX backend (jax_pjit): {err}"
    return None
