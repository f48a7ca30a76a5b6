"""Policy side of a refit, shared by every backend's worker.

A backend contributes one thing: ``iter_full_weights(dtype)``, a generator of
``(hf_name, full tensor)`` in manifest order, called on *every* rank because gathering a
full tensor is a collective (a sharded state dict, a distributed tensor's ``full_tensor()``, a
JAX device_get).
Everything else -- the bucket plan, packing, the transports, which rank ships -- lives here.

Training rank 0 ships on CPU (one shared-memory segment or one broadcast serves every
engine worker on the host).  On GPU every rank exports CUDA IPC handles for its own GPU,
because each colocated engine worker must read the copy on the device it runs on.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

import core.refit.collective as collective
from core.distributed.recoverable import RefitPeerLostError
from core.refit.buckets import bucket_budget, plan_buckets, take_bucket
from core.refit.cuda_ipc import CudaIpcBucketWriter, merge_handles
from core.refit.manifest import REFIT_PARTS, RefitError, RefitManifest, RefitPart, dtype_name
from core.refit.packing import as_torch
from core.refit.shm import ShmBucketWriter

if TYPE_CHECKING:
    from core.policy.config import PolicyConfig


class RefitSender(abc.ABC):
    """Mixin for policy workers (``PolicyWorkerBase`` subclasses: ``self.cfg``, ``self.rank``)."""

    # Set by the worker this is mixed into.
    cfg: PolicyConfig
    rank: int
    # Set by the methods below (read with getattr until they are).
    _refit_part: RefitPart
    _refit_stream: Iterator[tuple[str, torch.Tensor]] | None
    _refit_group: collective.RefitGroup | None

    # -- backend hooks ---------------------------------------------------------------------
    @abc.abstractmethod
    def iter_full_weights(self, dtype: Any = None) -> Iterator[tuple[str, Any]]:
        """Collective: ``(hf_name, full tensor or numpy array)`` in ``dtype``, on every rank."""

    @abc.abstractmethod
    def prepare_refit_info(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """HF name -> (full shape, training dtype), in the order ``_refit_weights`` yields."""

    def _refit_weights(self, dtype: Any = None) -> Iterator[tuple[str, Any]]:
        """Collective: the refit stream; ``iter_full_weights`` unless a backend leaves some
        of its weights out (torch: tied aliases, which the receiver fills in)."""
        return self.iter_full_weights(dtype)

    # LoRA adapter-only refit (``policy.lora.refit``): the engine holds the unmerged base once
    # and then receives only the adapters.  A backend that has LoRA implements both.
    def _iter_base_weights(self, dtype: Any = None) -> Iterator[tuple[str, Any]]:
        """Collective: the refit stream's names with the base (unmerged) weights."""
        raise RefitError(f"{type(self).__name__} cannot send unmerged base weights (adapter-only refit)")

    def _adapter_refit_info(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """PEFT adapter name (``base_model.model.<module>.lora_A.weight``) -> (shape, dtype)."""
        raise RefitError(f"{type(self).__name__} has no LoRA adapters to refit")

    def _iter_adapter_weights(self, dtype: Any = None) -> Iterator[tuple[str, Any]]:
        """Collective: ``(PEFT adapter name, full A [r, in] or B [out, r])`` in ``dtype``."""
        raise RefitError(f"{type(self).__name__} has no LoRA adapters to refit")

    def set_refit_part(self, part: RefitPart) -> None:
        """What the next refit streams: ``full`` (every weight, LoRA merged: the default),
        ``base`` (LoRA's frozen base weights, unmerged) or ``adapter`` (A and B only)."""
        if part not in REFIT_PARTS:
            raise ValueError(f"refit part must be one of {REFIT_PARTS}, got {part!r}")
        if part != "full" and not self.cfg.lora.enabled:
            raise RefitError(f"refit part {part!r} needs policy.lora.enabled (adapter-only refit)")
        self._refit_part = part

    def _part_stream(self, dtype: Any) -> Iterator[tuple[str, Any]]:
        part = getattr(self, "_refit_part", "full")
        if part == "adapter":
            return self._iter_adapter_weights(dtype)
        return self._iter_base_weights(dtype) if part == "base" else self._refit_weights(dtype)

    def _refit_devices(self) -> list[torch.device]:
        """Devices whose colocated engine workers read this rank's IPC buckets."""
        return [getattr(self, "device", torch.device("cpu"))]

    # -- manifest ----------------------------------------------------------------------------
    def refit_manifest(self) -> RefitManifest:
        """The stream in the generation dtype (``generation.vllm_cfg.precision``)."""
        part = getattr(self, "_refit_part", "full")
        info = self._adapter_refit_info() if part == "adapter" else self.prepare_refit_info()
        return RefitManifest.from_info(info).cast(dtype_name(self.cfg.generation_dtype))

    def _start_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._close_stream()
        dtype = dtype_name(self.cfg.generation_dtype)
        self._refit_stream = ((n, as_torch(t)) for n, t in self._part_stream(dtype))
        return self._refit_stream

    def _close_stream(self) -> None:
        stream = getattr(self, "_refit_stream", None)
        if stream is not None:
            stream.close()
        self._refit_stream = None

    # -- ipc -----------------------------------------------------------------------------------
    def prepare_weights_for_ipc(self, refit_buffer_size_gb: float | None = None) -> list[list[str]]:
        """Start the weight stream; returns the bucket plan (lists of HF names, in order)."""
        plan = plan_buckets(self.refit_manifest(), bucket_budget(self.cfg.refit_buffer_size_gb, refit_buffer_size_gb))
        self._start_stream()
        return plan

    def get_weights_ipc_handles(self, keys: list[str]) -> dict[str, Any] | None:
        """Gather the next bucket (collective) and export it; ``None`` on ranks that do not ship."""
        stream = getattr(self, "_refit_stream", None)
        if stream is None:
            raise RefitError("get_weights_ipc_handles before prepare_weights_for_ipc")
        items = take_bucket(stream, keys)
        devices = self._refit_devices()
        if devices[0].type == "cuda":
            writers = getattr(self, "_ipc_writers", None) or [CudaIpcBucketWriter() for _ in devices]
            self._ipc_writers = writers
            return merge_handles(
                [w.write([(n, t.to(d)) for n, t in items], d) for w, d in zip(writers, devices, strict=True)]
            )
        if self.rank != 0:
            return None
        writer = getattr(self, "_shm_writer", None) or ShmBucketWriter()
        self._shm_writer = writer
        return writer.write(items)

    def finish_refit_stream(self) -> None:
        """Release the last exported bucket and the stream (after the engine loaded it, or on abort)."""
        self._close_stream()
        for writer in [getattr(self, "_shm_writer", None)] + list(getattr(self, "_ipc_writers", None) or []):
            if writer is not None:
                writer.release()

    # -- collective ----------------------------------------------------------------------------
    def init_collective(
        self, ip: str, port: int, world_size: int, timeout_s: float = collective.DEFAULT_TIMEOUT_S
    ) -> int | None:
        """Training rank 0 joins the broadcast group as its rank 0; other ranks do not."""
        if self.rank != 0:
            return None
        device = self._refit_devices()[0]
        collective.destroy(getattr(self, "_refit_group", None))  # a group with an earlier engine
        self._refit_group = collective.init_group(ip, port, 0, world_size, device, timeout_s)
        return 0

    def broadcast_weights_for_collective(self, refit_buffer_size_gb: float | None = None) -> int:
        """Stream every weight in buckets; rank 0 broadcasts them (others only help gather)."""
        group: collective.RefitGroup | None = getattr(self, "_refit_group", None)
        if self.rank == 0 and group is None:
            raise RefitError("broadcast_weights_for_collective before init_collective")
        plan = self.prepare_weights_for_ipc(refit_buffer_size_gb)
        stream = self._refit_stream
        if stream is None:  # prepare_weights_for_ipc started it
            raise RefitError("the refit stream did not start")
        buckets = (take_bucket(stream, keys) for keys in plan)
        try:
            if self.rank == 0 and group is not None:  # rank 0 without a group was refused above
                return collective.send_buckets(group, buckets)
            for _ in buckets:
                pass
            return 0
        except collective.ReceiverLost as exc:
            # Every gather ran on every training rank: the policy is intact, only the group
            # with the engine is gone (a new engine forms a new one through init_collective).
            collective.destroy(self._refit_group)
            self._refit_group = None
            raise RefitPeerLostError(
                f"{exc}; the training ranks finished the stream and are in step", "ReceiverLost"
            ) from exc
        finally:
            self._close_stream()
