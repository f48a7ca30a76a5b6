"""Backend layouts by name: what every benchmark and ``dualrl parity`` / ``dualrl bench`` accept.

The grammar is learnt from the registered backends' specs (``core.policy.registry``), so a
backend plugged in from outside has its layouts too.  For a backend whose spec has
``layout_prefix`` P and ``data_axis`` A (``D``, ``C``, ``T``: positive integers; bracketed
parts optional, at least one size)::

    P-[A<D>][-cp<C>][-tp<T>][-sp][-ep][-packed][-shared][-dynamic][-lora][-compiled]

on ``D x C x T`` devices: ``D`` data-parallel (sharded) ranks, the sequence split over ``C``
(context parallel), the weights over ``T`` (tensor parallel); ``-sp`` sequence parallel
(needs ``T >= 2``); ``-ep`` a mixture of experts' experts expert-parallel over the data axis
(``policy.parallel.expert_parallel_size = D``, needs ``D >= 2``); ``-packed`` sequence
packing (rows of at most one padded micro batch's tokens); ``-shared`` sequence packing with
shared prompts (``policy.sequence_packing.shared_prompts``: the samples of one prompt hold it
once; implies packing); ``-dynamic`` dynamic batching
(rows sorted by length into micro batches of at most one padded micro batch's tokens, each as
wide as its longest row; not with ``-packed`` or ``-shared``); ``-lora`` ``policy.lora.enabled``
at the settings the caller passes (``dualrl parity``: ``benchmarks.lib.parity.settings.LORA``;
a benchmark that passes none refuses the layout by name, :func:`benchmarks.lib.workload.
policy_config`); ``-compiled`` ``policy.compile`` (each transformer block under
``torch.compile``, so ``P-dp2 P-dp2-compiled`` measures eager against compiled side by side).
Each part is accepted only on a backend whose spec supports the option behind it
(:data:`PARTS`); :data:`GRAMMAR` spells out what each registered backend takes.

A worker holds one device (on a CPU machine: one process with a share of the threads), or,
on a backend whose workers own a host (``per_host``), all of them; either way a layout needs
``devices`` = ``D x C x T`` of the machine's budget, which is what :func:`check_fits` compares.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from core.policy.backend_spec import BackendSpec
from core.policy.options import option
from core.policy.registry import all_specs

#: Each optional part of a layout name -> the policy option a backend must support to take it.
PARTS = {
    "cp": "parallel.context_parallel_size",
    "tp": "parallel.tensor_parallel_size",
    "sp": "parallel.sequence_parallel",
    "ep": "parallel.expert_parallel_size",
    "packed": "sequence_packing.enabled",
    "shared": "sequence_packing.shared_prompts",
    "dynamic": "dynamic_batching.enabled",
    "lora": "lora.enabled",
    "compiled": "compile",
}
_FLAGS = ("sp", "ep", "packed", "shared", "dynamic", "lora", "compiled")
#: A ``-dynamic`` layout pads each micro batch to a multiple of this (times its sequence multiple).
DYNAMIC_ROUND = 4


class LayoutError(ValueError):
    """A layout name that does not parse, or describes no layout the backend has."""


@dataclass(frozen=True)
class Layout:
    name: str
    backend: str
    dp: int = 1  # data-parallel (sharded) ranks: the mesh's fsdp axis
    tp: int = 1
    sp: bool = False
    cp: int = 1  # context parallel: the sequence split over this many devices
    packed: bool = False  # sequence packing on (also with -shared)
    compiled: bool = False  # policy.compile on
    lora: bool = False  # policy.lora.enabled (at the caller's LoRA settings)
    ep: bool = False  # policy.parallel.expert_parallel_size = the fsdp size
    dynamic: bool = False  # dynamic batching on (token-budget micro batches)
    shared: bool = False  # sequence packing with shared prompts
    per_host: bool = field(default=False, compare=False)  # one worker owns all the devices (its spec says)
    checkpoint_format: str = field(default="torch-dcp", compare=False)  # its spec's save_checkpoint format

    @property
    def devices(self) -> int:
        return self.dp * self.cp * self.tp

    @property
    def sequence_multiple(self) -> int:
        """What ``make_sequence_length_divisible_by`` must be a multiple of on this layout."""
        return 2 * self.cp * (self.tp if self.sp else 1) if self.cp > 1 else 1

    @property
    def workers(self) -> int:
        """Ray actors: one per device, or one owning all of them (``per_host``)."""
        return 1 if self.per_host else self.devices

    def policy_settings(self) -> dict[str, Any]:
        """The policy keys (dotted below ``policy``) that put a run on this layout, LoRA aside
        (its settings are the caller's), and so are dynamic batching's token budgets (the
        config refuses ``dynamic_batching.enabled`` without them)."""
        out: dict[str, Any] = {
            "backend": self.backend,
            "parallel.fsdp_size": self.dp,
            "parallel.tensor_parallel_size": self.tp,
            "parallel.context_parallel_size": self.cp,
            "parallel.sequence_parallel": self.sp,
            "parallel.expert_parallel_size": self.dp if self.ep else 1,
            "compile": self.compiled,
        }
        if self.cp > 1:
            out["make_sequence_length_divisible_by"] = self.sequence_multiple
        if self.packed:
            out["sequence_packing.enabled"] = True
        if self.shared:
            out["sequence_packing.shared_prompts"] = True
        if self.dynamic:
            out["dynamic_batching.enabled"] = True
        return out

    def dynamic_batching(self, budget: int) -> dict[str, Any]:
        """``policy.dynamic_batching`` of this ``-dynamic`` layout: micro batches of at most
        ``budget`` tokens (training and logprobs), each padded to a multiple of its round."""
        if not self.dynamic:
            raise LayoutError(f"layout {self.name!r} has no -dynamic: it runs micro batches of fixed rows")
        return {
            "enabled": True,
            "train_mb_tokens": budget,
            "logprob_mb_tokens": budget,
            "sequence_length_round": math.lcm(DYNAMIC_ROUND, self.sequence_multiple),
        }


def apply_settings(policy: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """``policy`` (a raw policy section, edited in place) with dotted ``settings`` set."""
    for key, value in settings.items():
        *parents, leaf = key.split(".")
        node = policy
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return policy


def _pattern(spec: BackendSpec) -> re.Pattern[str]:
    flags = "".join(f"(-{flag})?" for flag in _FLAGS)
    axis = re.escape(spec.data_axis)
    return re.compile(rf"{re.escape(spec.layout_prefix)}-(?:{axis}(\d+))?(?:-?cp(\d+))?(?:-?tp(\d+))?{flags}")


def _grammar(spec: BackendSpec) -> str:
    sizes = [f"[{spec.data_axis}<D>]"] + [f"[-{p}<{p[0].upper()}>]" for p in ("cp", "tp") if PARTS[p] in spec.supports]
    flags = [f"[-{flag}]" for flag in _FLAGS if PARTS[flag] in spec.supports]
    return f"{spec.layout_prefix}-{''.join(sizes)}{''.join(flags)}"


def grammar() -> str:
    """Every registered backend's layout grammar, comma separated."""
    return ", ".join(_grammar(spec) for spec in all_specs())


def parse_layout(name: str) -> Layout:
    """A layout name -> its :class:`Layout` (``P-tp2-sp``: backend P's, tp 2, sequence parallel);
    :class:`LayoutError` naming the grammar, or the part the backend does not support."""
    for spec in all_specs():
        match = _pattern(spec).fullmatch(name)
        if match and any(match.group(i) for i in (1, 2, 3)):
            return _layout(name, spec, match)
    raise LayoutError(f"unknown layout {name!r}: expected one of {grammar()}")


def _layout(name: str, spec: BackendSpec, match: re.Match[str]) -> Layout:
    dp, cp, tp, *flags = match.groups()
    on = dict(zip(_FLAGS, (bool(f) for f in flags), strict=True))
    layout = Layout(
        name, spec.name, int(dp or 1), int(tp or 1), on["sp"], int(cp or 1), on["packed"] or on["shared"],
        on["compiled"], on["lora"], on["ep"], on["dynamic"], on["shared"], per_host=not spec.one_worker_per_device,
        checkpoint_format=spec.checkpoint_format,
    )  # fmt: skip
    asked = {"cp": layout.cp > 1, "tp": layout.tp > 1, **on}
    for part, key in PARTS.items():
        if asked[part] and key not in spec.supports:
            why = spec.why_not.get(key)
            raise LayoutError(
                f"layout {name!r}: -{part} asks for {option(key).what} (policy.{key}), which the {spec.name} backend "
                "does not support" + (f": {why}" if why else "")
            )
    if layout.packed and layout.dynamic:
        raise LayoutError(
            f"layout {name!r}: -{'shared' if layout.shared else 'packed'} and -dynamic are two ways of batching by "
            "tokens (sequence packing, dynamic batching); a layout takes one"
        )
    if on["packed"] and on["shared"]:
        raise LayoutError(f"layout {name!r}: -shared is sequence packing with shared prompts; drop -packed")
    if layout.sp and layout.tp < 2:
        raise LayoutError(f"layout {name!r}: sequence parallel (-sp) needs tensor parallel tp >= 2")
    if layout.ep and layout.dp < 2:
        raise LayoutError(
            f"layout {name!r}: -ep runs the experts expert-parallel over {spec.data_axis}; it needs "
            f"{spec.data_axis} >= 2"
        )
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


def _layout_if(name: str, per_host: bool) -> Layout | None:
    try:
        layout = parse_layout(name)
    except LayoutError:
        return None
    return layout if layout.per_host == per_host else None


def dcp_layouts(names: list[str]) -> list[str]:
    """The names (in order) whose backend checkpoints in torch DCP: they load each other's."""
    out = []
    for name in names:
        try:
            if parse_layout(name).checkpoint_format == "torch-dcp":
                out.append(name)
        except LayoutError:
            continue
    return out


def device_layout(name: str) -> Layout | None:
    """The layout of that name if its backend runs one worker per device, else None."""
    return _layout_if(name, per_host=False)


def host_layout(name: str) -> Layout | None:
    """The layout of that name if its backend runs one worker owning all the devices, else None."""
    return _layout_if(name, per_host=True)
