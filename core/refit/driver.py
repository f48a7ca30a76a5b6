"""``refit_policy_generation``: push the policy's current weights into the generation engine.

The whole dance, for either transport:

1. the policy states the stream (``prepare_refit_info``, in the generation dtype) and every
   engine checks it against its model -- a wrong name, shape or dtype stops here, before
   any weight is touched;
2. ``ipc``: the policy gathers one bucket at a time (``get_weights_ipc_handles``), the
   engines load it from shared memory / CUDA IPC, then ``finish_refit`` checks nothing is
   missing.  ``collective``: trainer rank 0 broadcasts the buckets while the engines
   receive, load and check the end of the stream.
3. colocated (``offload=True``): training state leaves the device before, weights after.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import ray
from ray.exceptions import RayError

from core.refit.buckets import bucket_budget, plan_buckets
from core.refit.manifest import RefitError, RefitManifest, RefitPart

if TYPE_CHECKING:
    from core.generation import VllmGeneration
    from core.policy import Policy

Transport = Literal["ipc", "collective"]
TRANSPORTS = ("ipc", "collective")


@dataclass
class RefitStats:
    """What one refit moved and how long it took (wall clock on the driver)."""

    transport: str
    seconds: float
    bytes: int
    tensors: int
    buckets: int
    #: "merged" (every weight, LoRA merged) or "adapter" (LoRA: A and B, plus the base
    #: weights on the first refit into an engine; ``parts`` says which streams ran).
    mode: str = "merged"
    parts: tuple[str, ...] = ("full",)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else float("inf")

    def as_metrics(self, prefix: str = "refit/") -> dict[str, float]:
        return {
            f"{prefix}seconds": self.seconds,
            f"{prefix}bytes": float(self.bytes),
            f"{prefix}gb_per_s": self.gb_per_s,
            f"{prefix}buckets": float(self.buckets),
            f"{prefix}adapter_only": float(self.parts == ("adapter",)),
        }


def refit_policy_generation(
    policy: Policy,
    generation: VllmGeneration,
    transport: Transport = "ipc",
    refit_buffer_size_gb: float | None = None,
    offload: bool = False,
    timeout_s: float | None = None,
) -> RefitStats:
    """Make ``generation`` serve ``policy``'s current weights; returns timing and volume.
    ``timeout_s``: how long the engines' side of a collective refit may take (None: the
    engine's own call time-out, ``policy.generation.vllm_cfg.call_timeout_s``).

    ``offload=True`` (colocated placement) frees the policy's optimizer state before and its
    weights after the refit, and wakes a sleeping GPU engine in two steps (weights, then KV
    cache once the policy's weights have left the device).
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"refit transport must be one of {TRANSPORTS}, got {transport!r}")
    generation.check_alive()
    start = time.perf_counter()
    mode = getattr(generation, "refit_mode", "merged")
    parts = _parts(policy, generation, mode)
    if offload:
        policy.offload_before_refit()
        generation.prepare_for_generation(tags=["weights"])  # a sleeping GPU engine needs its weight memory back
    wait_s = generation.call_timeout_s if timeout_s is None else timeout_s
    moved = [_refit_part(policy, generation, part, transport, refit_buffer_size_gb, wait_s) for part in parts]
    if mode == "adapter":
        generation.base_weights_of = policy.refit_token
    if offload:
        policy.offload_after_refit()
        generation.prepare_for_generation(tags=["kv_cache"])
    nbytes, tensors, buckets = (sum(m[i] for m in moved) for i in range(3))
    return RefitStats(transport, time.perf_counter() - start, nbytes, tensors, buckets, mode, parts)


def _parts(policy: Policy, generation: VllmGeneration, mode: str) -> tuple[RefitPart, ...]:
    """The streams of this refit: ``full`` (merged) mode, or for an adapter-refit engine the
    adapter -- after the unmerged base if the engine does not hold this policy's base yet."""
    if mode != "adapter":
        return ("full",)
    if not policy.cfg.lora.enabled:
        raise RefitError(
            f"the engine refits LoRA adapters only ({generation.refit_mode_reason}) but the policy has no "
            "policy.lora: start the engine from this policy's config"
        )
    holds_base = getattr(generation, "base_weights_of", None) == policy.refit_token and generation.weights_valid()
    return ("adapter",) if holds_base else ("base", "adapter")


def _refit_part(
    policy: Policy,
    generation: VllmGeneration,
    part: RefitPart,
    transport: Transport,
    refit_buffer_size_gb: float | None,
    timeout_s: float,
) -> tuple[int, int, int]:
    """One stream, checked, sent and finished: ``(bytes, tensors, buckets)``."""
    if part != "full" or policy.cfg.lora.enabled:  # "full" too: an earlier adapter refit left another part set
        policy.set_refit_part(part)
    info = policy.prepare_refit_info()
    if info is None:
        raise RefitError("the policy reported no refit info")
    manifest = RefitManifest.from_info(info)
    if part == "adapter":
        generation.prepare_adapter_refit(info)
    else:
        generation.prepare_refit_info(info)
    if transport == "ipc":
        buckets = _refit_ipc(policy, generation, refit_buffer_size_gb)
    else:
        _refit_collective(policy, generation, refit_buffer_size_gb, timeout_s)
        buckets = len(plan_buckets(manifest, bucket_budget(policy.cfg.refit_buffer_size_gb, refit_buffer_size_gb)))
    return manifest.nbytes, len(manifest), buckets


def _refit_ipc(policy: Policy, generation: VllmGeneration, refit_buffer_size_gb: float | None) -> int:
    plan = policy.prepare_weights_for_ipc(refit_buffer_size_gb)
    try:
        for keys in plan:
            generation.update_weights_from_ipc_handles(policy.get_weights_ipc_handles(keys))
    finally:
        policy.finish_refit_stream()  # unlink the last segment, also after a failure
    generation.finish_refit()
    return len(plan)


def _refit_collective(
    policy: Policy, generation: VllmGeneration, refit_buffer_size_gb: float | None, timeout_s: float
) -> None:
    ensure_collective(policy, generation, timeout_s)
    sending = policy.broadcast_weights_for_collective(refit_buffer_size_gb)
    receiving = generation.update_weights_from_collective()
    _wait_both(policy, generation, sending, receiving, timeout_s)


def ensure_collective(policy: Policy, generation: VllmGeneration, timeout_s: float | None = None) -> None:
    """Form the broadcast group once per (policy, generation) pair (``timeout_s`` None: the
    engine's call time-out)."""
    if getattr(policy, "_refit_peer", None) is generation:
        return
    ip, port = policy.refit_rendezvous()
    world = 1 + generation.num_engines * generation.workers_per_engine
    joins_policy = policy.init_collective(ip, port, world)
    joins_engine = generation.init_collective(ip, port, world)
    _wait_both(
        policy, generation, joins_policy, joins_engine, generation.call_timeout_s if timeout_s is None else timeout_s
    )
    policy._refit_peer = generation


def _wait_both(
    policy: Policy, generation: VllmGeneration, policy_refs: list, engine_refs: list, timeout_s: float
) -> None:
    """Wait for both sides of a collective and classify a failure on either side.

    An engine that failed is probed (``generation.engine_failed``: ``EngineDeadError`` if it
    is dead or wedged, else its own error).  The policy's side is then waited for too: its
    sending rank notices the lost receiver, finishes the gathers its peers are in and raises
    a recoverable error, so the policy survives the engine.  A deadline with engine calls
    still pending kills those engines (``EngineDeadError``); a fatal policy failure is a
    ``WorkerGroupError`` as anywhere else.
    """
    from core.distributed import RecoverableCallError

    pending = list(policy_refs) + list(engine_refs)
    engine_index = {ref.hex(): i for i, ref in enumerate(engine_refs)}
    deadline = time.monotonic() + timeout_s
    policy_error: RecoverableCallError | None = None
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = [engine_index[r.hex()] for r in pending if r.hex() in engine_index]
            if late:
                generation.engines_timed_out(late, f"refit (collective) within {timeout_s:.0f} s")
            raise RuntimeError(
                f"refit collective did not finish within {timeout_s:.0f} s (the policy side had not answered)"
            )
        ref = ready[0]
        if ref.hex() not in engine_index:
            try:
                policy.worker_group.get_all_worker_results([ref])
            except RecoverableCallError as exc:  # the sender lost its receiver; the policy is fine
                policy_error = policy_error or exc
            continue
        try:
            ray.get(ref)
        except RayError as exc:
            try:
                generation.engine_failed(engine_index[ref.hex()], exc, "refit (collective)")
            finally:
                _settle_policy(policy, [r for r in pending if r.hex() not in engine_index], deadline)
            raise
    if policy_error is not None:
        raise policy_error


def _settle_policy(policy: Policy, policy_refs: list, deadline: float) -> None:
    """After the engine side failed: let the policy's ranks finish the stream (recoverable)."""
    from core.distributed import RecoverableCallError

    if not policy_refs:
        return
    try:
        policy.worker_group.get_all_worker_results(policy_refs, timeout=max(1.0, deadline - time.monotonic()))
    except RecoverableCallError:
        pass  # the sender lost its receiver and kept the training ranks in step
