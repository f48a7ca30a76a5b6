"""Full weights of an FSDP1 model, one FSDP unit at a time (refit, HF export, generation).

FSDP1 communicates a unit's parameters as one flat parameter, so the unit (one transformer
block, or the root's embeddings + final norm + lm_head) is the smallest gather there is.
``FSDP.summon_full_params(unit, recurse=False)`` gathers exactly that unit; each of its
weights is copied out and the unit is freed before the next one is gathered.  Peak extra
memory is one unit plus what the consumer still holds, instead of the whole model that a
full state dict materialises (and on CPU no ``offload_to_cpu``, which segfaults there).

The stream's order is the units' order (root first: its lazy initialisation must run
before any inner unit is touched), so the refit manifest lists names in that order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

#: The attribute path FSDP1 inserts between a wrapper and the module it wraps.
WRAPPED = "_fsdp_wrapped_module"


def hf_name(*parts: str) -> str:
    """Join name parts and drop FSDP's wrapper segments: the HF state-dict name."""
    return ".".join(p for part in parts if part for p in part.split(".") if p != WRAPPED)


class UnitPlan:
    """Which FSDP unit holds which HF-named weight, in stream order."""

    def __init__(self, model: FSDP, names: Mapping[str, object]) -> None:
        """``names``: every HF name the stream must carry (the model's state-dict keys)."""
        self.units: list[tuple[FSDP, list[tuple[str, str]]]] = []
        for path, module in model.named_modules():
            if isinstance(module, FSDP):
                own = [
                    (raw, hf_name(path, raw))
                    for raw, _ in module.module.named_parameters(remove_duplicate=False)
                    if WRAPPED not in raw.split(".")
                ]  # a nested unit's weights are its own
                self.units.append((module, own))
        covered = {name for _, own in self.units for _, name in own}
        # Weights FSDP does not shard (persistent buffers) are read where they live.
        self.buffers = {hf_name(n): b for n, b in model.named_buffers() if hf_name(n) in names}
        unknown = set(names) - covered - set(self.buffers)
        if unknown:
            raise RuntimeError(f"FSDP1 full-weight plan: state-dict names {sorted(unknown)} are held by no FSDP unit")
        self.order = [name for _, own in self.units for _, name in own if name in names] + sorted(self.buffers)

    def iter_weights(
        self, dtype: torch.dtype | None = None, skip: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: ``(hf_name, full tensor)`` in ``self.order`` minus ``skip``, each a
        fresh copy (the gathered storage is freed when its unit is left)."""
        for unit, own in self.units:
            with FSDP.summon_full_params(unit, recurse=False, writeback=False):
                params = dict(unit.module.named_parameters(remove_duplicate=False))
                for raw, name in own:
                    if name not in skip:
                        yield name, _copy(params[raw], dtype)
        for name in sorted(set(self.buffers) - skip):
            yield name, _copy(self.buffers[name], dtype)


def _copy(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.detach().to(dtype=dtype or t.dtype, copy=True)
