"""A torch mixture-of-experts policy's routers during a micro batch (mixed into ``TorchPolicyWorker``):
recorded for the load-balancing loss and ``get_logprobs``' routed experts, replayed for
``policy.moe.routing_replay``, and mapped from the layout's rows back onto the plain rows."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from backends.torch_common.batches import packed_layout, to_device

if TYPE_CHECKING:
    from backends.torch_common.moe import RouterRecorder
    from backends.torch_dtensor.context_parallel import ContextParallelRows
    from core.data import BatchedDataDict
    from core.parallel_dims import ParallelDims


class TorchRouting:
    """``_routing`` and ``_router_logits_of`` over the worker's ``RouterRecorder``."""

    device: torch.device
    dims: ParallelDims
    _routers: RouterRecorder | None
    _seq_multiple: int
    _cp_rows: ContextParallelRows | None

    if TYPE_CHECKING:  # logprob_pass.py's

        @property
        def _packing(self) -> bool: ...

        @property
        def _shared_prompts(self) -> bool: ...

    def _routing(self, mb: BatchedDataDict, replay: bool) -> contextlib.AbstractContextManager:
        """The routers of a MoE model recorded over one micro batch (``RouterRecorder``), and,
        with ``replay``, sent to the batch's ``routed_experts`` (plain rows: the config check
        keeps replay off packed and context-parallel rows)."""
        if self._routers is None:
            return contextlib.nullcontext()
        if not replay:
            return self._routers.recording()
        routed = to_device(mb["routed_experts"], self.device).long()  # (B, S, L, K)
        rows, width = routed.shape[:2]
        forward_width = -(-width // self._seq_multiple) * self._seq_multiple  # model_inputs' padding
        routed = torch.nn.functional.pad(routed, (0, 0, 0, 0, 0, forward_width - width))
        return self._routers.recording(routed.movedim(2, 0).reshape(routed.shape[2], rows * forward_width, -1))

    def _router_logits_of(self, mb: BatchedDataDict, recorded: list[torch.Tensor]) -> torch.Tensor:
        """The routers' logits of ``mb``'s forward on its rows: [layers, B, S, experts].

        The forward ran the layout's rows: packed (one row of every sequence) and/or this
        context-parallel rank's columns; gathered over cp and unpacked here, as the logprobs
        are (``_micro_batch_next_logprobs``)."""
        if self._routers is None:
            raise RuntimeError("router logits of a model without routers")
        rows, width = mb["input_ids"].shape
        packed = packed_layout(mb, self._seq_multiple, self._shared_prompts) if self._packing else None
        logits = self._routers.stacked(recorded, 1 if packed is not None else rows)  # (L, rows', cols', X)
        if self.dims.cp > 1 and self._cp_rows is not None:
            logits = self._cp_rows.gather_columns(logits, logits.shape[2] * self.dims.cp, dim=2)
        if packed is None:
            return logits[:, :, :width]
        index, _ = packed.token_index()  # padding columns read token 0: masked by the lengths
        return logits[:, 0][:, to_device(torch.from_numpy(index), logits.device)]
