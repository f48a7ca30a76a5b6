"""The router logits of an HF mixture-of-experts model's forward, for the load-balancing loss.

transformers declares, per MoE family, which module class emits the router logits
(``_can_record_outputs["router_logits"]``: an ``OutputRecorder`` of e.g. Qwen3-MoE's
``Qwen3MoeTopKRouter``, output 0 = logits [tokens, experts]); HF itself collects them with
forward hooks when ``output_router_logits`` is set.  :class:`RouterRecorder` hooks the same
modules for the duration of one micro batch (whatever the wrapper: FSDP1, FSDP2), and for
routing replay replaces their choice of experts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from core.kernels.moe import replayed_routing_weights


def router_classes(model: torch.nn.Module) -> tuple[type, ...]:
    """The module classes the model's HF metadata names as router-logit emitters."""
    found: set[type] = set()
    for module in model.modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        target = getattr(recorder, "target_class", None)
        if isinstance(target, type):
            found.add(target)
    return tuple(found)


class RouterRecorder:
    """Records each router's logits during a forward, in module (= layer) order, and replays
    given expert choices (``policy.moe.routing_replay``)."""

    def __init__(self, model: torch.nn.Module, model_type: str, normalize: bool) -> None:
        classes = router_classes(model)
        self.routers = [m for m in model.modules() if classes and isinstance(m, classes)]
        if not self.routers:
            raise ValueError(
                f"model_type {model_type!r} has a mixture-of-experts config but transformers declares no router "
                "module for it (_can_record_outputs['router_logits']): the load-balancing loss cannot be computed"
            )
        self.model_type = model_type
        self.normalize = normalize  # the model's norm_topk_prob
        #: The list the open ``recording`` appends to (None outside one).
        self.active: list[torch.Tensor] | None = None

    @contextlib.contextmanager
    def recording(self, replay: torch.Tensor | None = None) -> Iterator[list[torch.Tensor]]:
        """Within the block, each router's forward appends its logits [tokens, experts].

        ``replay`` [routers, tokens, top_k]: each router's choice is replaced by these experts,
        weighted by its own probabilities for them (``replayed_routing_weights``).  Keep the
        block open over the backward: a layer recomputed by activation checkpointing routes
        again (and appends again: read what was recorded before the backward)."""
        recorded: list[torch.Tensor] = []

        def hook_of(layer: int):
            def hook(module: torch.nn.Module, _args: object, output: object) -> object:
                logits = output[0] if isinstance(output, tuple) else output
                recorded.append(logits)  # type: ignore[arg-type]
                if replay is None:
                    return None
                if not (isinstance(output, tuple) and len(output) == 3):
                    raise ValueError(
                        f"routing replay: {type(module).__name__} of model_type {self.model_type!r} does not return "
                        "(logits, weights, experts); replay is implemented for that router form only"
                    )
                experts = replay[layer]
                return logits, replayed_routing_weights(logits, experts, self.normalize), experts

            return hook

        handles = [router.register_forward_hook(hook_of(j)) for j, router in enumerate(self.routers)]
        self.active = recorded
        try:
            yield recorded
        finally:
            self.active = None
            for handle in handles:
                handle.remove()

    def stacked(self, recorded: list[torch.Tensor], rows: int) -> torch.Tensor:
        """The logits one forward of ``rows`` rows recorded, as [layers, rows, columns, experts]."""
        if len(recorded) < len(self.routers):
            raise RuntimeError(f"{len(recorded)} router outputs recorded in one forward, expected {len(self.routers)}")
        return torch.stack([r.reshape(rows, -1, r.shape[-1]) for r in recorded[: len(self.routers)]])
