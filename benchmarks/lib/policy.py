"""The Policy side of every benchmark: a layout's :class:`core.policy.Policy` on a Ray cluster of
its own, its calls timed on the driver.

* :class:`PolicyCase`: a Policy and its cluster (one bundle per worker), started and closed
  together; ``dualrl bench --gpu``, the soak and the TRL comparison build on it.
* :class:`PolicyRunner`: a layout's Policy on the benchmark's batch (:func:`make_batch`), loss
  :class:`core.losses.NLLLoss`, one optimizer step per ``train`` call (``gbs = batch``), one
  micro batch per rank unless ``--micro``; ``logprobs`` / ``train`` return the driver's wall
  seconds around ``policy.get_logprobs`` / ``policy.train`` (Ray dispatch, sharding and result
  collection included: what a user sees).  ``dualrl bench``, ``dualrl parity`` and
  ``benchmarks.packing`` measure through it.

Threads: ``--threads T`` is each case's total.  A torch layout's workers get Ray bundles of
``T / workers`` CPUs (Ray sets ``OMP_NUM_THREADS`` to an actor's CPU count, which torch
follows); the threads each worker really has (``get_gpu_info()[i]["torch_num_threads"]``) are
reported.  On a 2-core machine dp2/tp2 are *not* more hardware, only the same two cores split
into two single-threaded processes plus gloo collectives.

A JAX layout (``jax-fsdp{F}[-cp{C}][-tp{T}]``) is one actor (one bundle of ``T`` CPUs) owning
``F x C x T`` XLA host devices (``benchmarks.lib.ray_session``), mesh ``(fsdp=F, cp=C, tp=T)``.
XLA:CPU runs every device's program on one intra-op Eigen pool (``tf_XLAEigen`` threads) sized
to the CPUs the process may run on (its affinity mask); it ignores ``OMP_NUM_THREADS``.  With
fewer ``--threads`` than the machine's cores, every thread of the JAX actor is pinned to
``--threads`` CPUs (``sched_setaffinity``) after construction (the pool keeps its size, but the
threads share that many cores).  ``get_compile_counts()`` of the worker is reported.
"""

from __future__ import annotations

import os
import statistics
import time

from benchmarks.lib.layouts import Layout, parse_layout
from benchmarks.lib.models import vocab_size
from benchmarks.lib.proc import XLA_POOL_THREAD, pin_process, thread_names
from benchmarks.lib.workload import make_batch, policy_config


def on_cuda(args) -> bool:
    """Whether this run measures on a CUDA GPU (``--device cuda``) rather than the CPU."""
    return getattr(args, "device", "cpu") == "cuda"


class PolicyCase:
    """A Policy on a cluster of its own: ``workers`` bundles of ``cpus_per_worker`` CPUs (and one
    GPU each with ``use_gpus``); ``policy_kwargs`` go to :class:`core.policy.Policy`."""

    def __init__(
        self,
        cfg: dict,
        tokenizer,
        name: str,
        workers: int,
        cpus_per_worker: int,
        use_gpus: bool = False,
        **policy_kwargs,
    ) -> None:
        from core.distributed import RayVirtualCluster
        from core.policy import Policy

        self.cluster = RayVirtualCluster([workers], use_gpus=use_gpus, num_cpus_per_bundle=cpus_per_worker, name=name)
        self.policy = None
        try:
            t0 = time.perf_counter()
            self.policy = Policy(self.cluster, cfg, tokenizer, name_prefix=name, **policy_kwargs)
            self.startup_s = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            if self.policy is not None:
                self.policy.shutdown()
        finally:
            self.cluster.shutdown()

    def __enter__(self) -> PolicyCase:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def layout_case(layout: Layout, cfg: dict, tokenizer, name: str, threads: int, use_gpus: bool = False, **kwargs):
    """The :class:`PolicyCase` of a layout within a budget of ``threads`` CPUs: a torch worker per
    device with ``threads / workers`` CPUs, or one JAX actor with all of them."""
    return PolicyCase(cfg, tokenizer, name, layout.workers, max(1, threads // layout.workers), use_gpus, **kwargs)


def noop_round_trip(policy, calls: int = 5) -> float:
    """Median seconds of a call that does nothing on the workers: Ray dispatch + collection."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        policy.report_device_id()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compile_counts(policy) -> dict[str, int]:
    """The JAX worker's ``get_compile_counts()``."""
    group = policy.worker_group
    return group.get_all_worker_results(group.run_all_workers_single_data("get_compile_counts"))[0]


class JaxActor:
    """What one JAX actor runs on, checked and pinned after start-up (see the module docstring)."""

    def __init__(self, policy, layout: Layout, threads: int, pin: bool = True) -> None:
        info = policy.get_gpu_info()[0]
        if info["local_devices"] != layout.devices:
            raise RuntimeError(f"the actor sees {info['local_devices']} devices, {layout.name} needs {layout.devices}")
        self.mesh, self.pid, self.pinned = info["mesh"], info["pid"], None
        cpus = sorted(os.sched_getaffinity(self.pid))
        if pin and threads < len(cpus):  # XLA sized its pool to the affinity mask: shrink the mask
            self.pinned = set(cpus[:threads])
            pin_process(self.pid, self.pinned)
        self.threads = [thread_names(self.pid)[XLA_POOL_THREAD] or None]


class PolicyRunner:
    """A layout's Policy on its own cluster; each call timed on the driver (Ray dispatch included).

    ``args``: ``batch``, ``seq``, ``precision``, ``threads`` and optionally ``micro``, ``packing``,
    ``device``, ``tag`` (tells apart two Policies of one layout), ``lora`` (the ``policy.lora``
    settings of ``-lora`` layouts).  ``settings`` edits the policy
    section; ``policy_kwargs`` go to :class:`core.policy.Policy` (e.g. ``weights_path``)."""

    def __init__(
        self,
        layout: Layout | str,
        model_path: str,
        tokenizer_path: str,
        tokenizer,
        args,
        settings=None,
        **policy_kwargs,
    ) -> None:
        from core.losses import NLLLoss

        layout = parse_layout(layout) if isinstance(layout, str) else layout
        self.name, self.layout, self.workers = layout.name, layout, layout.workers
        cfg = policy_config(
            model_path,
            tokenizer_path,
            layout,
            args.batch,
            args.seq,
            args.precision,
            getattr(args, "micro", None),
            getattr(args, "packing", None),
            getattr(args, "lora", None),
        )
        cfg = settings(cfg) if settings else cfg
        self.data = make_batch(args.batch, args.seq, vocab_size(cfg["model_name"]))
        self.loss, self.gbs, self.mbs = NLLLoss(), args.batch, cfg["train_micro_batch_size"]
        name = f"bench-{layout.name}{getattr(args, 'tag', '')}"
        self.case = layout_case(layout, cfg, tokenizer, name, args.threads, on_cuda(args), **policy_kwargs)
        self.policy, self.startup_s, self.jax = self.case.policy, self.case.startup_s, None
        try:
            self.noop_s = noop_round_trip(self.policy)
            infos = self.policy.get_gpu_info()
            self.pids = [info["pid"] for info in infos]
            self.threads = [info.get("torch_num_threads") for info in infos]
            if layout.per_host:
                self.jax = JaxActor(self.policy, layout, args.threads, pin=not on_cuda(args))
                self.threads = self.jax.threads
        except BaseException:
            self.close()
            raise

    def logprobs(self) -> float:
        t0 = time.perf_counter()
        self.policy.get_logprobs(self.data)
        return time.perf_counter() - t0

    def train(self) -> float:
        t0 = time.perf_counter()
        self.policy.train(self.data, self.loss, gbs=self.gbs, mbs=self.mbs)
        return time.perf_counter() - t0

    def jax_facts(self) -> dict:
        """The JAX actor's compile counts, mesh and pinned CPUs (empty for a torch layout)."""
        if self.jax is None:
            return {}
        pinned = sorted(self.jax.pinned) if self.jax.pinned else None
        return {"compile_counts": compile_counts(self.policy), "mesh": self.jax.mesh, "pinned": pinned}

    def close(self) -> None:
        self.case.close()
