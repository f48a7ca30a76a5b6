"""Refit (policy weights -> vLLM engine): the engine, the timed refits and the memcpy baseline.

A layout's Policy (``benchmarks.lib.policy.PolicyRunner``) pushes its weights into one vLLM
engine with :func:`core.refit.refit_policy_generation` over each transport:

* ``ipc`` (CPU: training rank 0 packs each bucket into a ``/dev/shm`` segment the engine maps)
  and ``collective`` (training rank 0 broadcasts each bucket to the engine over a gloo group,
  formed by the first refit of each policy).
* the engine: one :class:`core.generation.VllmGeneration` (one engine, tensor parallel 1) on a
  cluster of its own (1 bundle of ``--threads`` CPUs), started once and reused by every layout:
  it accepts any refit whose manifest matches its model, and all layouts serve the same model
  in the same dtype.  It is restarted only if it died, or when Ray is restarted for another
  XLA device count.

Methodology:

* seconds = :class:`RefitStats` ``.seconds``: wall clock on the driver around the whole
  refit (manifest check, gathers, transport, engine load, end-of-stream check).  Per layout,
  ``--warmup`` untimed refits per transport come first (the first ``collective`` one also
  forms the broadcast group; its seconds are shown as "first s"), then ``--iters`` rounds
  of one refit per transport, alternating, so both transports see the same background
  load; the table gives the median.  After the timed refits the engine must report valid
  weights (``weights_valid()``), else the layout is marked FAILED.
* GB = bytes of the refit stream (the manifest, in the engine's dtype) / 1e9; GB/s = GB /
  seconds; buckets = transport calls of one refit (``refit_buffer_size_gb`` of the policy
  section).
* memcpy: ``dst.copy_(src)`` of two ``torch.uint8`` tensors of the same byte count, in the
  driver process on one thread (``torch.set_num_threads(1)``: a plain memcpy, and immune to
  the stalls a 2-thread copy suffers when another process holds one of the cores), ``dst``
  allocated and touched beforehand (so: memory bandwidth, no page faults); median of 7
  copies, measured right after each layout's refits.  ×memcpy = refit seconds / memcpy
  seconds: what a refit costs over one copy of its bytes.  A "cold" copy (``dst`` freshly
  allocated each time, page faults included) is recorded too, for reference.
* ``-lora`` layouts (``REFIT_LORA``): the same rounds twice, "merged" into the plain engine
  (``W + scale * B @ A`` under the base names) and "adapter" into a second engine started
  with LoRA (``policy.lora.refit: adapter``): its first warm-up refit carries the base too
  (its seconds are "first s"), the timed ones A and B only; memcpy per row of its own bytes.
* Start-up (policy, engine) is reported but is part of no timing.  On a 2-core machine the
  policy's workers and the engine share the same cores (Ray's logical CPUs are sized for
  a policy plus the engine).
"""

from __future__ import annotations

import statistics
import time

from benchmarks.lib.errors import error_text
from benchmarks.lib.layouts import Layout
from benchmarks.lib.models import hf_config
from benchmarks.lib.policy import on_cuda
from benchmarks.lib.workload import policy_config

TRANSPORTS = ("ipc", "collective")
#: ``policy.lora`` of ``-lora`` layouts in the refit section: merged rows (into the plain
#: engine) beside adapter-only rows (into an engine started with LoRA).
REFIT_LORA = {"rank": 8, "alpha": 16.0, "target_modules": "all-linear"}
#: Copies the memcpy baseline takes the median of.
MEMCPY_COPIES = 7


# ----------------------------------------------------------------------------- policy and engine


def engine_config(model_path: str, tokenizer_path: str, args) -> dict:
    """The benchmarks' policy section with a vLLM engine long enough for ``--seq``."""
    cfg = policy_config(
        model_path, tokenizer_path, Layout("engine", "torch_fsdp"), args.batch, args.seq, args.precision
    )
    cfg["generation"]["backend"] = "vllm"
    # long enough for --seq, never longer than the model's positions (vLLM refuses that)
    positions = getattr(hf_config(model_path), "max_position_embeddings", None) or args.seq
    cfg["generation"]["vllm_cfg"]["max_model_len"] = min(
        max(args.seq, cfg["generation"]["vllm_cfg"]["max_model_len"]), max(positions, args.seq)
    )
    return cfg


class Engine:
    """One vLLM engine (``VllmGeneration``) on a one-bundle cluster of its own."""

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str,
        tokenizer,
        args,
        cfg: dict | None = None,
        name: str = "bench-refit-vllm",
    ) -> None:
        """``cfg``: the policy section it serves (default: :func:`engine_config`)."""
        from core.distributed import RayVirtualCluster
        from core.generation.vllm_generation import VllmGeneration

        self._cluster = RayVirtualCluster([1], use_gpus=on_cuda(args), num_cpus_per_bundle=args.threads, name=name)
        self.generation = None
        try:
            t0 = time.perf_counter()
            self.generation = VllmGeneration(
                self._cluster,
                cfg or engine_config(model_path, tokenizer_path, args),
                tokenizer,
                name_prefix=name,
                engines_per_bundle=1,  # the refit and generation rows measure one engine on all the threads
            )
            self.startup_s = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise

    def alive(self) -> bool:
        try:
            self.generation.check_alive()
            return True
        except Exception:  # noqa: BLE001 -- a dead engine is replaced, not reported here
            return False

    def close(self) -> None:
        try:
            if self.generation is not None:
                self.generation.shutdown()
        finally:
            self._cluster.shutdown()


# ----------------------------------------------------------------------------- memcpy baseline


def memcpy_seconds(nbytes: int, threads: int = 1, copies: int = MEMCPY_COPIES) -> dict:
    """Median seconds of ``dst.copy_(src)`` over ``nbytes`` uint8: warm (``dst`` allocated and
    touched once) and cold (a fresh ``torch.empty`` per copy: page faults included)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)  # touch every page once
        warm, cold = [], []
        for _ in range(copies):
            t0 = time.perf_counter()
            dst.copy_(src)
            warm.append(time.perf_counter() - t0)
        for _ in range(copies):
            t0 = time.perf_counter()
            fresh = torch.empty(nbytes, dtype=torch.uint8)
            fresh.copy_(src)
            cold.append(time.perf_counter() - t0)
            del fresh
        return {"warm_s": statistics.median(warm), "cold_s": statistics.median(cold), "threads": threads}
    finally:
        torch.set_num_threads(previous)


# ----------------------------------------------------------------------------- one layout


def _refit(policy, engine: Engine, transport: str, args):
    from core.refit import refit_policy_generation

    return refit_policy_generation(policy, engine.generation, transport, refit_buffer_size_gb=args.bucket_gb)


def measure(policy, engine: Engine, transports, args) -> dict[str, dict]:
    """Warm-up refits per transport, then ``args.repeats`` (``dualrl bench``: ``--iters``) alternating rounds;
    one result per transport (a transport that fails is dropped from the later rounds)."""
    out = {t: {"seconds": [], "first_s": None} for t in transports}
    live = list(transports)
    for t in transports:
        try:
            for i in range(args.warmup):
                stats = _refit(policy, engine, t, args)
                if i == 0:
                    out[t].update(
                        first_s=stats.seconds, bytes=stats.bytes, tensors=stats.tensors, buckets=stats.buckets
                    )
        except Exception as err:  # noqa: BLE001 -- report it, go on with the other transport
            out[t]["error"] = error_text(err)
            live.remove(t)
    for _ in range(args.repeats):
        for t in list(live):
            try:
                stats = _refit(policy, engine, t, args)
            except Exception as err:  # noqa: BLE001
                out[t]["error"] = error_text(err)
                live.remove(t)
                continue
            out[t]["seconds"].append(stats.seconds)
            out[t].update(bytes=stats.bytes, tensors=stats.tensors, buckets=stats.buckets)
    if live and not engine.generation.weights_valid():
        for t in live:
            out[t]["error"] = "the engine does not report valid weights after the timed refits"
    return out
