"""The torch workers' forward to logprobs, on every row layout (mixed into ``TorchPolicyWorker``).

One logprob path serves ``get_logprobs`` and ``train`` (same temperature, same vocab-parallel
kernel), so a loss sees exactly what ``get_logprobs`` returns.  Plain rows go through HF's own
2-D mask; packed rows become one row of several sequences (positions restarting, attention
confined by segment); context-parallel rows are split over the cp ranks.  Every result is mapped
back onto the micro batch's plain rows.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from backends.torch_common.batches import micro_batches, model_inputs, pad_columns, reshaped_rows, to_device
from backends.torch_common.memory_trade import full_copies_fit, weight_bytes
from core.data.context_parallel import attention_allowed
from core.kernels import apply_temperature, logprobs_to_sequence_layout, next_token_logprobs
from core.kernels.logprobs import logprobs_from_logits
from core.kernels.moe import routed_experts_of
from core.kernels.vocab_parallel import vocab_parallel_logprobs, vocab_parallel_next_token_logprobs

if TYPE_CHECKING:
    from backends.torch_common.moe import RouterRecorder
    from backends.torch_dtensor.context_parallel import ContextParallelRows
    from core.data import BatchedDataDict
    from core.losses.router_aux import RouterAux
    from core.parallel_dims import ParallelDims
    from core.policy.config import PolicyConfig


class TorchLogprobs:
    """Logprobs of one micro batch whatever its layout, and ``get_logprobs``' engine pass."""

    cfg: PolicyConfig
    model: torch.nn.Module
    device: torch.device
    dims: ParallelDims
    hf_config: Any
    temperature: float
    compute_dtype: torch.dtype
    param_meta: dict[str, tuple[tuple[int, ...], torch.dtype]]
    router_aux: RouterAux | None
    _routers: RouterRecorder | None
    _seq_multiple: int
    _cp_rows: ContextParallelRows | None

    if TYPE_CHECKING:  # the worker's (routing.py, worker.py)

        def _routing(self, mb: BatchedDataDict, replay: bool) -> contextlib.AbstractContextManager: ...

        def _router_logits_of(self, mb: BatchedDataDict, recorded: list[torch.Tensor]) -> torch.Tensor: ...

        def _keep_params_gathered(self) -> contextlib.AbstractContextManager: ...

        @property
        def _offloading(self) -> bool: ...

    def _forward_logits(self, mb: BatchedDataDict) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Temperature-scaled logits [b, s', V] (a vocab-sharded DTensor under TP), the
        device input ids and the unpadded width."""
        ids, mask, seq_len = model_inputs(mb, self.device, self._seq_multiple)
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return apply_temperature(logits, self.temperature), ids, seq_len

    @staticmethod
    def _next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[b, s'-1] log p(x_t | x_<t); vocab-parallel when the logits are vocab-sharded."""
        if isinstance(logits, DTensor):
            return vocab_parallel_next_token_logprobs(logits, ids)
        return next_token_logprobs(logits, ids)

    @staticmethod
    def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[b, s] log p(targets) under ``logits`` (vocab-parallel when vocab-sharded)."""
        if isinstance(logits, DTensor):
            return vocab_parallel_logprobs(logits, targets)
        return logprobs_from_logits(logits, targets)

    @property
    def _packing(self) -> bool:
        return self.cfg.sequence_packing.enabled

    @property
    def _shared_prompts(self) -> bool:
        return self.cfg.sequence_packing.shared_prompts

    @property
    def _rows_reshaped(self) -> bool:
        """Whether micro batches leave the plain padded layout (packing or context parallel)."""
        return self._packing or self.dims.cp > 1

    def _micro_batch_next_logprobs(self, mb: BatchedDataDict) -> torch.Tensor:
        """[b, S-1] next-token logprobs of one micro batch (S = its width), whatever the layout."""
        if not self._rows_reshaped:
            logits, ids, seq_len = self._forward_logits(mb)
            return self._next_token_logprobs(logits, ids)[:, : seq_len - 1]
        width = mb["input_ids"].shape[1]
        layout, ids, positions, segments, prefix_segments = reshaped_rows(
            mb, self._packing, self._seq_multiple, self._shared_prompts
        )
        ids, positions = to_device(ids, self.device), to_device(positions, self.device)
        if self.dims.cp > 1:
            if self._cp_rows is None:  # the DTensor worker sets it whenever cp > 1
                raise RuntimeError("context parallelism without ContextParallelRows")
            next_lp = self._cp_rows.next_logprobs(
                self._model_logits, self._token_logprobs, ids, positions, segments, prefix_segments
            )
        elif self._varlen_attention:
            if self._shared_prompts:
                raise ValueError(
                    "policy.sequence_packing.shared_prompts: the model's attention implementation "
                    f"{getattr(self.hf_config, '_attn_implementation', None)!r} finds packed sequences from "
                    "restarting positions and cannot let samples read a shared prompt; load the model with "
                    "'sdpa' or 'eager' attention, or set shared_prompts to false"
                )
            # FlashAttention's varlen kernel: HF finds the sequences from the restarting
            # position ids (no mask), and skips the attention between them.
            logits = self.model(input_ids=ids, position_ids=positions, use_cache=False).logits
            next_lp = self._next_token_logprobs(apply_temperature(logits, self.temperature), ids)
        else:
            cols = np.arange(ids.shape[1])
            mask = attention_allowed(cols, cols, segments, prefix_segments)
            allowed = to_device(torch.from_numpy(mask)[:, None], self.device)
            next_lp = self._next_token_logprobs(self._model_logits(ids, positions, allowed), ids)
        if layout is not None:
            return layout.unpack_next_logprobs(next_lp)
        return next_lp[:, : width - 1]

    @property
    def _varlen_attention(self) -> bool:
        return str(getattr(self.hf_config, "_attn_implementation", "")).startswith("flash_attention")

    def _model_logits(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Temperature-scaled logits with explicit positions and a [rows, 1, q, k] bool mask."""
        logits = self.model(input_ids=ids, position_ids=positions, attention_mask=allowed, use_cache=False).logits
        return apply_temperature(logits, self.temperature)

    def _score_rows(self, data: BatchedDataDict, mbs: int, record_routing: bool) -> tuple[Any, Any]:
        """``get_logprobs``' pass: every micro batch queued on the device, read once at the end;
        with ``record_routing`` each token's experts from the same forward."""
        width = data["input_ids"].shape[1]
        self.model.eval()
        batches = list(micro_batches(data, mbs))
        outs, routed = [], []
        with torch.no_grad(), self._gathered_for(len(batches)):
            for mb in batches:
                with self._routing(mb, replay=False) if record_routing else contextlib.nullcontext() as recorded:
                    next_lp = self._micro_batch_next_logprobs(mb)
                lp = logprobs_to_sequence_layout(next_lp, to_device(mb["input_lengths"], self.device))
                outs.append(pad_columns(lp.float(), width))  # stays on the device: no sync here
                if record_routing and self.router_aux is not None and recorded is not None:
                    experts = routed_experts_of(self._router_logits_of(mb, recorded), self.router_aux.top_k)
                    routed.append(torch.nn.functional.pad(experts.short(), (0, 0, 0, 0, 0, width - experts.shape[1])))
        logprobs = torch.cat(outs).cpu() if outs else torch.zeros(0, width)
        return logprobs, (torch.cat(routed).cpu() if routed else None)

    def _gathered_for(self, n_micro_batches: int) -> contextlib.AbstractContextManager:
        """``_keep_params_gathered`` when it saves work and fits (the kept weights are in the
        compute dtype; ``memory_trade.full_copies_fit``), else nothing."""
        nbytes = weight_bytes(self.param_meta, self.compute_dtype)
        if full_copies_fit(self.device, n_micro_batches, nbytes, self._offloading):
            return self._keep_params_gathered()
        return contextlib.nullcontext()
