"""The inference skeleton of every backend's worker: ``get_logprobs`` (with a mixture-of-experts
policy's routed experts), the reference passes and ``generate``'s argument preparation.

Each checks its input before any collective (a refused call leaves the group usable) and hands
the engine only the work: ``_score_rows`` (logprobs, optionally each token's experts) and
``_generate_rows`` (decoding with resolved arguments).
"""

from __future__ import annotations

import abc
import contextlib
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from core.distributed.recoverable import before_collectives
from core.policy.generation_args import GenerationArgs, batch_generation_args

if TYPE_CHECKING:
    from core.data import BatchedDataDict
    from core.losses.router_aux import RouterAux
    from core.policy.config import PolicyConfig


def host_tensor(array: Any) -> torch.Tensor:
    """A worker's result as the driver receives it: a torch tensor in host memory (numpy arrays
    wrapped without a copy where they are contiguous)."""
    if isinstance(array, torch.Tensor):
        return array.cpu()
    return torch.from_numpy(np.ascontiguousarray(array))


class WorkerInference(abc.ABC):
    """``get_logprobs``, the reference passes and ``generate`` (mixed into ``PolicyWorkerBase``)."""

    cfg: PolicyConfig
    tokenizer: Any
    hf_config: Any  # the model's transformers config (vocabulary, eos ids)
    router_aux: RouterAux | None  # a mixture-of-experts policy's router terms; None for a dense model

    def get_logprobs(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        """``{"logprobs": [B, S] float32}`` in the ``get_logprobs`` layout, on the host; with
        ``policy.moe.records_routing`` also ``routed_experts`` [B, S, sparse layers, top_k]
        (each token's experts, for the training step's agreement metric or replay)."""
        from core.data import BatchedDataDict

        mbs = micro_batch_size or self.cfg.logprob_batch_size
        with before_collectives():
            self._check_batch(data)
            self._check_micro_batch_split(mbs, "micro_batch_size" if micro_batch_size else "policy.logprob_batch_size")
        logprobs, routed = self._score_rows(data, self._micro_batch_rows(mbs), self._records_routing)
        out: BatchedDataDict[Any] = BatchedDataDict(logprobs=host_tensor(logprobs))
        if routed is not None:
            out["routed_experts"] = host_tensor(routed)
        return out

    @property
    def _records_routing(self) -> bool:
        """Whether ``get_logprobs`` returns each token's experts (``policy.moe``)."""
        return self.router_aux is not None and self.cfg.moe.records_routing

    def get_reference_policy_logprobs(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> Any:
        """``get_logprobs`` under the reference weights (``use_reference_model``), as
        ``{"reference_logprobs": [B, S]}``."""
        from core.data import BatchedDataDict

        with self.use_reference_model():
            out = self.get_logprobs(data, micro_batch_size)
        return BatchedDataDict(reference_logprobs=out["logprobs"])

    def get_logprobs_and_reference(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> Any:
        """``get_logprobs`` then ``get_reference_policy_logprobs`` in one call: one dispatch
        from the driver, each pass over the batch once; ``{"logprobs", "reference_logprobs"}``."""
        out = self.get_logprobs(data, micro_batch_size)
        out["reference_logprobs"] = self.get_reference_policy_logprobs(data, micro_batch_size)["reference_logprobs"]
        return out

    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        """Decode this worker's prompts, ``policy.generation_batch_size`` rows at a time, with
        the arguments every backend resolves alike (``batch_generation_args``: stop and pad ids,
        per-row token budgets); ``GenerationOutputSpec`` on the host."""
        with before_collectives():
            self._check_batch(data)
            args = batch_generation_args(self.cfg, self.tokenizer, self.hf_config.eos_token_id, data)
        return self._generate_rows(data, args, greedy)

    # ------------------------------------------------------------------ engine hooks
    @abc.abstractmethod
    def _check_batch(self, data: Any) -> None:
        """The driver's checks of a ``get_logprobs`` / ``generate`` batch, again."""

    def _check_micro_batch_split(self, mbs: int, field: str) -> None:
        """Refuse a micro batch size the engine's layout cannot split (``field`` names it)."""
        return None  # any size: the engine splits rows as they come

    @abc.abstractmethod
    def _micro_batch_rows(self, mbs: int) -> int:
        """Rows of this worker's shard in one micro batch when every data-parallel device runs
        ``mbs`` rows (a batch size's meaning on every backend): ``mbs`` where a worker is one
        device; a worker owning several runs their rows together."""

    @abc.abstractmethod
    def _score_rows(self, data: BatchedDataDict, mbs: int, record_routing: bool) -> tuple[Any, Any]:
        """``(logprobs [B, S], routed experts [B, S, layers, top_k] or None)`` of ``data``, ``mbs``
        rows per micro batch, without gradients (torch tensors or numpy arrays)."""

    @abc.abstractmethod
    def _generate_rows(self, data: BatchedDataDict, args: GenerationArgs, greedy: bool) -> BatchedDataDict:
        """Decode with ``args``; ``GenerationOutputSpec`` as host torch tensors."""

    @abc.abstractmethod
    def use_reference_model(self) -> contextlib.AbstractContextManager[None]:
        """Within the block the model computes with the reference weights."""
