"""The receiving end of a refit, running inside vLLM's workers (``worker_extension_cls``).

vLLM mixes this class into its worker, so ``self`` is the worker: ``self.model_runner``,
``self.device``, ``self.rank``.  Methods are reached with ``LLM.collective_rpc(name, args)``,
which runs them on every tensor-parallel worker of the engine; arguments are plain data
(dicts, lists, strings), never tensors.

Loading follows vLLM's layer-wise reload protocol for checkpoint-format weights:
``initialize_layerwise_reload`` once, ``model.load_weights`` per bucket (a layer is
processed -- fused, repacked for the CPU kernels -- once all of its parts have arrived, so
buckets may split a layer), ``finalize_layerwise_reload`` at the end.  Calling
``reload_weights`` per bucket instead would process a fused layer (qkv, gate_up) that a
bucket boundary split with half its parts uninitialised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.refit import collective, cuda_ipc, shm
from core.refit.manifest import RefitError, manifest_for_hf_config
from core.refit.receiver import RefitReceiver

if TYPE_CHECKING:
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner


class VllmRefitExtension:
    """Mixed into vLLM's worker class; every method name is prefixed ``dualrl_``."""

    # What vLLM's worker provides (its CPU model runner subclasses the GPU one).
    model_runner: GPUModelRunner
    device: torch.device
    rank: int
    # Set by the methods below (read with getattr until they are).
    _dualrl_rx: RefitReceiver
    _dualrl_layerwise: bool
    _dualrl_group: collective.RefitGroup | None

    # ------------------------------------------------------------------ state
    def _dualrl_receiver(self) -> RefitReceiver:
        receiver = getattr(self, "_dualrl_rx", None)
        if receiver is None:
            model_config = self.model_runner.model_config
            expected = manifest_for_hf_config(model_config.hf_config, model_config.dtype)
            dummy = str(self.model_runner.load_config.load_format) in ("dummy", "LoadFormat.DUMMY")
            receiver = RefitReceiver(expected, weights_valid=not dummy, engine=f"vLLM engine (worker {self.rank})")
            self._dualrl_rx = receiver
            self._dualrl_layerwise = False
        return receiver

    def dualrl_weights_valid(self) -> bool:
        return self._dualrl_receiver().weights_valid

    def dualrl_require_valid(self) -> None:
        self._dualrl_receiver().require_valid()

    # ------------------------------------------------------------------ protocol
    def dualrl_refit_begin(self, info: dict[str, Any]) -> int:
        """Check the manifest against this engine's model; nothing is loaded yet."""
        rx = self._dualrl_receiver()
        if self._dualrl_layerwise:  # an abandoned refit: restore a consistent model first
            self._dualrl_finalize()
        rx.begin(info)
        if rx.manifest is None:  # begin() sets it
            raise RefitError("the refit receiver has no manifest after begin()")
        return len(rx.manifest)

    def dualrl_load_ipc(self, handle: dict[str, Any]) -> int:
        """Load one bucket from a shared-memory segment (CPU) or CUDA IPC handles (GPU)."""
        if handle.get("kind") == shm.KIND:
            items = shm.open_bucket(handle)
        elif handle.get("kind") == cuda_ipc.KIND:
            items = cuda_ipc.open_bucket(handle, self.device)
        else:
            raise ValueError(f"unknown refit handle kind {handle.get('kind')!r}")
        self._dualrl_load(items)
        return len(items)

    def dualrl_refit_finish(self) -> dict[str, Any]:
        """Close the stream: finalize loading, then require that every tensor arrived."""
        rx = self._dualrl_receiver()
        self._dualrl_finalize()
        count = rx.finish()
        return {"tensors": count, "bytes": rx.bytes_received}

    # ------------------------------------------------------------------ collective
    def dualrl_init_collective(
        self, host: str, port: int, world_size: int, rank_offset: int, timeout_s: float = collective.DEFAULT_TIMEOUT_S
    ) -> int:
        """Join the broadcast group as rank ``rank_offset + self.rank``."""
        import torch

        device = self.device if getattr(self.device, "type", "cpu") == "cuda" else torch.device("cpu")
        rank = rank_offset + int(self.rank)
        collective.destroy(getattr(self, "_dualrl_group", None))  # a group with an earlier policy
        self._dualrl_group = collective.init_group(host, port, rank, world_size, device, timeout_s)
        return rank

    def dualrl_receive_collective(self) -> dict[str, Any]:
        """Receive buckets until the end marker, loading each; then finish the refit.

        On a bad bucket the rest of the stream is still received (and dropped), so the
        sender is never left blocked in a broadcast; the error is raised at the end.
        """
        group = getattr(self, "_dualrl_group", None)
        if group is None:
            raise RuntimeError("update_weights_from_collective before init_collective")
        buckets = collective.receive_buckets(group)
        while True:
            try:
                items = next(buckets)
            except StopIteration:
                break
            except BaseException as exc:  # the transport broke: the sender died or left the group
                self._dualrl_abandon(group, f"the weight stream broke ({type(exc).__name__}: {exc})")
                raise
            try:
                self._dualrl_load(items)
            except BaseException:
                collective.drain(buckets)
                raise
        return self.dualrl_refit_finish()

    def _dualrl_abandon(self, group: collective.RefitGroup, reason: str) -> None:
        """A stream that can never finish: make the model whole again (stale weights, marked
        so) and drop the broken group; a later refit forms a new one."""
        self._dualrl_finalize()
        self._dualrl_receiver().abandon(reason)
        collective.destroy(group)
        self._dualrl_group = None

    # ------------------------------------------------------------------ internals
    def _dualrl_load(self, items: list) -> None:
        rx = self._dualrl_receiver()
        try:
            rx.check_bucket(items)
        except BaseException:
            self._dualrl_finalize()
            raise
        model = self.model_runner.get_model()
        if not self._dualrl_layerwise:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(model)
            self._dualrl_layerwise = True
        try:
            # get_model() is typed nn.Module: every vLLM model has load_weights, no vLLM type says so.
            model.load_weights(iter(rx.with_tied_aliases(items)))  # type: ignore[operator]
        finally:
            rx.mark_loaded(items)  # even a failed load has touched the weights

    def _dualrl_finalize(self) -> None:
        """End layer-wise loading (always, also after an error: the model must be whole)."""
        if not getattr(self, "_dualrl_layerwise", False):
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._dualrl_layerwise = False
        finalize_layerwise_reload(self.model_runner.get_model(), self.model_runner.model_config)
        # State derived from the old weights (what vLLM's reload_weights also resets).
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(self.model_runner, reset, None)
            if fn is not None:
                fn()
