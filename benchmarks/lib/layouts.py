"""Backend layouts by name: what every benchmark and ``dualrl parity`` / ``dualrl bench`` accept.

Grammar (``D``, ``C``, ``T``, ``F``: positive integers; bracketed parts optional, at least one size):

* ``fsdp1-dp<D>``: ``torch_fsdp`` on ``D`` workers (FSDP1 has no tensor or context parallel);
* ``dtensor-[dp<D>][-cp<C>][-tp<T>][-sp]``: ``torch_dtensor`` on ``D x C x T`` workers, context
  parallel over ``C``, sequence parallel (``-sp``) needs ``T >= 2``;
* ``jax-[fsdp<F>][-cp<C>][-tp<T>][-ep]``: ``jax_pjit``, one worker owning ``F x C x T`` devices,
  mesh ``(fsdp=F, cp=C, tp=T)``; ``-ep``: a mixture of experts' experts run expert-parallel
  over fsdp (``policy.jax_cfg.expert_parallel_size = F``);
* any of them with ``-packed``: sequence packing on (rows of at most one padded micro
  batch's tokens);
* any of them with ``-lora`` (after ``-packed``): ``policy.lora.enabled`` at the settings the
  caller passes (``dualrl parity``: ``benchmarks.lib.parity.settings.LORA``); a benchmark that
  passes none refuses the layout by name (:func:`benchmarks.lib.workload.policy_config`);
* a ``dtensor-`` layout with ``-compiled`` (last): ``policy.dtensor_cfg.compile`` on (each
  transformer block under ``torch.compile``), so ``dtensor-dp2 dtensor-dp2-compiled`` measures
  eager against compiled side by side in one run.

A torch worker holds one device (on a CPU machine: one process with a share of the threads);
so a layout needs ``devices`` = ``D x C x T`` or ``F x C x T`` of the machine's budget whatever
its backend, which is what :func:`check_fits` compares.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TORCH = re.compile(r"(fsdp1|dtensor)-(?:dp(\d+))?(?:-?cp(\d+))?(?:-?tp(\d+))?(-sp)?(-packed)?(-lora)?(-compiled)?")
_JAX = re.compile(r"jax-(?:fsdp(\d+))?(?:-?cp(\d+))?(?:-?tp(\d+))?(-ep)?(-packed)?(-lora)?")
BACKEND_OF = {"fsdp1": "torch_fsdp", "dtensor": "torch_dtensor", "jax": "jax_pjit"}
GRAMMAR = (
    "fsdp1-dp<D>[-packed][-lora], dtensor-[dp<D>][-cp<C>][-tp<T>][-sp][-packed][-lora][-compiled], "
    "jax-[fsdp<F>][-cp<C>][-tp<T>][-ep][-packed][-lora]"
)


#: The torch layouts the benchmarks' help texts list (any other by the grammar).
TORCH_LAYOUTS = ("fsdp1-dp1", "dtensor-dp1", "fsdp1-dp2", "dtensor-dp2", "dtensor-tp2", "dtensor-tp2-sp")


class LayoutError(ValueError):
    """A layout name that does not parse, or describes no layout the backend has."""


@dataclass(frozen=True)
class Layout:
    name: str
    backend: str
    dp: int = 1  # torch: data-parallel workers; JAX: the mesh's fsdp axis
    tp: int = 1
    sp: bool = False
    cp: int = 1  # context parallel: the sequence split over this many devices
    packed: bool = False  # sequence packing on
    compiled: bool = False  # torch_dtensor: policy.dtensor_cfg.compile on
    lora: bool = False  # policy.lora.enabled (at the caller's LoRA settings)
    ep: bool = False  # jax_pjit: policy.jax_cfg.expert_parallel_size = the fsdp size

    @property
    def is_jax(self) -> bool:
        return self.backend == "jax_pjit"

    @property
    def devices(self) -> int:
        return self.dp * self.cp * self.tp

    @property
    def sequence_multiple(self) -> int:
        """What ``make_sequence_length_divisible_by`` must be a multiple of on this layout."""
        return 2 * self.cp * (self.tp if self.sp else 1) if self.cp > 1 else 1

    @property
    def workers(self) -> int:
        """Ray actors: one per device on torch, one owning all devices on JAX."""
        return 1 if self.is_jax else self.devices


def parse_layout(name: str) -> Layout:
    """``dtensor-tp2-sp`` -> ``Layout("dtensor-tp2-sp", "torch_dtensor", 1, 2, True)``."""
    torch_match, jax_match = _TORCH.fullmatch(name), _JAX.fullmatch(name)
    if torch_match and any(torch_match.group(i) for i in (2, 3, 4)):
        kind, dp, cp, tp, sp, packed, lora, compiled = torch_match.groups()
        layout = Layout(
            name,
            BACKEND_OF[kind],
            int(dp or 1),
            int(tp or 1),
            bool(sp),
            int(cp or 1),
            bool(packed),
            bool(compiled),
            bool(lora),
        )
        if kind == "fsdp1" and layout.compiled:
            raise LayoutError(
                f"layout {name!r}: -compiled is policy.dtensor_cfg.compile, a torch_dtensor "
                "setting; use dtensor-...-compiled"
            )
        if kind == "fsdp1" and (layout.tp > 1 or layout.cp > 1):
            raise LayoutError(f"layout {name!r}: FSDP1 (torch_fsdp) has no tensor or context parallel; use dtensor-...")
        if layout.sp and layout.tp < 2:
            raise LayoutError(f"layout {name!r}: sequence parallel (-sp) needs tensor parallel tp >= 2")
    elif jax_match and any(jax_match.group(i) for i in (1, 2, 3)):
        fsdp, cp, tp, ep, packed, lora = jax_match.groups()
        layout = Layout(
            name,
            "jax_pjit",
            int(fsdp or 1),
            int(tp or 1),
            False,
            int(cp or 1),
            bool(packed),
            lora=bool(lora),
            ep=bool(ep),
        )
        if layout.ep and layout.dp < 2:
            raise LayoutError(f"layout {name!r}: -ep runs the experts expert-parallel over fsdp; it needs fsdp >= 2")
    else:
        raise LayoutError(f"unknown layout {name!r}: expected one of {GRAMMAR}")
    if layout.dp < 1 or layout.tp < 1 or layout.cp < 1:
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
    from backends.jax_pjit.models import config_from_hf

    try:
        config_from_hf(hf_config)
    except ValueError as err:
        return f"model {model!r} is not supported by the JAX backend (jax_pjit): {err}"
    return None
