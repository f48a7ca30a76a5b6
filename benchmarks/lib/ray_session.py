"""The JAX Policy runner of ``dualrl bench``: XLA host devices, Ray, threads, and per-process facts.

    python -m benchmarks.jax_backend [dualrl bench options]
        = dualrl bench --sections throughput --layouts fsdp1-dp1 dtensor-dp2 jax-fsdp2 jax-tp2 jax-fsdp1 --seq 256

The methodology, the ``hf`` baseline, the batch, the policy config, the Ray set-up and the
pairing of every Policy call with an ``hf`` call are those of :mod:`benchmarks.torch_backends`
(imported, not repeated; its docstring has the details), so all ratios come from one run:

* ``hf``, ``fsdp1-*``, ``dtensor-*``: exactly the cases of ``benchmarks.torch_backends``.
* ``jax-fsdp{F}[-tp{T}]`` / ``jax-tp{T}``: a ``jax_pjit`` :class:`core.policy.Policy`: one Ray
  actor (one bundle of ``--threads`` CPUs) owning ``F x T`` XLA host devices, mesh
  ``(fsdp=F, tp=T)``.  One micro batch (``train_micro_batch_size = logprob_batch_size =
  batch``; its rows are split over ``fsdp`` inside the actor), one AdamW step per ``train``
  call, loss ``NLLLoss``.  Defaults: ``jax-fsdp2``, ``jax-tp2``, ``jax-fsdp1``.

JAX-specific points:

* First call = compile + run.  The first call of each operation is the first of the
  ``--warmup`` untimed calls (so ``--warmup >= 1``); its seconds are reported on their own
  ("first call s"), and "compile ~ s" = first call - median warm call.  For the torch cases
  and ``hf`` the same columns show their (compile-free) first call.  ``get_compile_counts()``
  of the worker is printed at the end of every JAX case.
* Host devices: ``make_mesh`` uses *all* devices the actor's jax sees, so ``F x T`` must equal
  that count, which XLA takes from ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` when
  the actor first initialises its backend.  ``Policy`` passes no env vars to its workers; Ray
  actors inherit the environment of the raylet, i.e. of the process that started Ray.  So
  this driver sets ``XLA_FLAGS`` (and ``JAX_PLATFORMS=cpu``) before it starts Ray, with N =
  the device count of the first JAX case, and restarts Ray (the ``hf`` child is not part of
  Ray and lives on) before a JAX case that needs another N.  The default order needs one
  restart (2 devices, then 1); its cost is reported and is no part of any timing.  When Ray
  was started by the caller (tests), it is not touched: the N its actors see is read once
  with a Ray task, and JAX cases needing another N are listed as skipped.
* Threads: XLA:CPU runs every device's program on one intra-op Eigen pool
  (``tf_XLAEigen`` threads) sized to the CPUs the process may run on (its affinity mask);
  it ignores ``OMP_NUM_THREADS`` (which Ray sets to the bundle's CPUs) and, in this jaxlib,
  ``--xla_cpu_multi_thread_eigen=false``.  With ``--threads`` equal to the cores of the
  machine (the default on the 2-core dev box) the pool is exactly the budget; with fewer,
  this driver pins every thread of the JAX actor to ``--threads`` CPUs
  (``sched_setaffinity``) after construction (the pool keeps its size, but the threads
  share that many cores).  What every case really used is measured, not assumed: the
  compute threads of each process (torch: ``torch.get_num_threads()``; JAX: the size of the
  XLA pool), its OS threads, and the cores it kept busy during the timed calls (CPU seconds
  of its processes from ``/proc`` / wall seconds of the calls).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

from benchmarks import torch_backends as tb
from benchmarks.layouts import Layout, jax_layout, parse_layout  # noqa: F401 -- jax_layout: used as jb.jax_layout

OPS = tb.OPS
DEVICE_FLAG = "--xla_force_host_platform_device_count"
#: Name of the threads of XLA:CPU's intra-op pool (where the compiled programs run).
XLA_POOL_THREAD = "tf_XLAEigen"


JAX_LAYOUTS: dict[str, Layout] = {name: parse_layout(name) for name in ("jax-fsdp2", "jax-tp2", "jax-fsdp1")}
CASES = ["hf", "fsdp1-dp1", "dtensor-dp2", *JAX_LAYOUTS]


def _case(name: str) -> str:
    if name in tb.CASES or jax_layout(name) is not None:
        return name
    raise argparse.ArgumentTypeError(f"{name!r}: one of {tb.CASES} or jax-fsdp<F>[-tp<T>] / jax-tp<T>")


def _workers(name: str) -> int:
    return tb.LAYOUTS[name].workers if name in tb.LAYOUTS else 1


def _devices(name: str) -> int:
    """Devices per worker (a torch worker or the hf process: one)."""
    layout = jax_layout(name)
    return layout.devices if layout else 1


# ----------------------------------------------------------------------------- XLA host devices / Ray


def with_device_count(flags: str | None, n: int) -> str:
    """``XLA_FLAGS`` with the host device count set to ``n`` (other flags kept)."""
    kept = [f for f in (flags or "").split() if not f.startswith(DEVICE_FLAG)]
    return " ".join([*kept, f"{DEVICE_FLAG}={n}"])


def device_count_of(flags: str | None, jax_num_cpu_devices: str | None = None) -> int:
    """XLA host devices a fresh jax process gets from these env values (jax's default: 1)."""
    if jax_num_cpu_devices not in (None, "", "-1"):
        return int(jax_num_cpu_devices)
    counts = re.findall(DEVICE_FLAG + r"=(\d+)", flags or "")
    return int(counts[-1]) if counts else 1


def actor_device_count() -> int:
    """Host devices a new Ray actor's jax would see, read from its environment by a task."""
    import ray

    @ray.remote(num_cpus=0)
    def env():
        return os.environ.get("XLA_FLAGS"), os.environ.get("JAX_NUM_CPU_DEVICES")

    return device_count_of(*ray.get(env.remote()))


class RaySession:
    """Ray with a given XLA host device count in its actors' environment.

    Started here (and restarted for another count) unless the caller already runs Ray:
    then its count is read once and cannot change (``fits`` says which cases can run).
    """

    def __init__(self, args) -> None:
        import ray

        self.args, self.owned = args, not ray.is_initialized()
        self.devices: int | None = None if self.owned else actor_device_count()
        self.restarts: list[tuple[int, float]] = []  # (new device count, seconds)

    def fits(self, devices: int) -> bool:
        return self.owned or self.devices == devices

    def start(self, devices: int | None) -> None:
        """Ray whose actors get ``devices`` host devices (``None``: any, for torch cases)."""
        import ray

        from core.algorithms.placement import jax_cpu_flags
        from core.distributed import init_ray

        if not self.owned:
            if devices is not None and devices != self.devices:
                raise RuntimeError(
                    f"Ray was started by the caller with {self.devices} XLA host device(s) "
                    f"per actor; this case needs {devices}"
                )
            return
        if ray.is_initialized() and devices in (None, self.devices):
            return
        t0, restart = time.perf_counter(), ray.is_initialized()
        if restart:
            ray.shutdown()
        if devices is not None:
            # and Eigen's intra-op pool off, as `dualrl grpo` runs JAX on a CPU: with it on, a long
            # run died in an in-process all-reduce rendezvous (core.algorithms.placement.jax_cpu_flags)
            os.environ["XLA_FLAGS"] = jax_cpu_flags(with_device_count(os.environ.get("XLA_FLAGS"), devices), devices)
            os.environ.pop("JAX_NUM_CPU_DEVICES", None)  # it would override the flag
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
            self.devices = devices
        # As torch_backends.start_ray (an exported OMP_NUM_THREADS would reach every worker),
        # with room for a JAX case's one bundle of --threads CPUs too.
        os.environ.pop("OMP_NUM_THREADS", None)
        init_ray(num_cpus=getattr(self.args, "ray_cpus", None) or max(tb.ray_cpus(self.args), self.args.threads))
        if restart:
            self.restarts.append((devices, time.perf_counter() - t0))


# ----------------------------------------------------------------------------- per-process facts (/proc)


def cpu_seconds(pids) -> float | None:
    """User + system CPU seconds of these processes (all their threads) so far."""
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    except (OSError, IndexError, ValueError):
        return None
    return total / os.sysconf("SC_CLK_TCK")


def thread_names(pid: int) -> collections.Counter:
    """``{thread name: how many}`` of a process (empty when it cannot be read)."""
    names: collections.Counter = collections.Counter()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    names[f.read().strip()] += 1
            except OSError:
                pass  # thread gone meanwhile
    except OSError:
        pass
    return names


def allowed_cpus(pid: int) -> int | None:
    try:
        return len(os.sched_getaffinity(pid))
    except OSError:
        return None


def pin_process(pid: int, cpus: set[int]) -> None:
    """Restrict every current thread of ``pid`` to ``cpus`` (new threads inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # thread gone meanwhile


# ----------------------------------------------------------------------------- JAX case


class JaxPolicyRunner(tb.PolicyRunner):
    """A ``jax_pjit`` Policy on its own one-bundle cluster; calls timed on the driver
    (``logprobs`` / ``train`` / ``close`` are ``torch_backends.PolicyRunner``'s)."""

    def __init__(self, name: str, model_path: str, tokenizer_path: str, tokenizer, args) -> None:
        layout = jax_layout(name)
        self.name, self.workers, self.layout = name, 1, layout
        # torch_backends' policy section for one data-parallel rank: one micro batch of `batch`.
        micro = args.micro * layout.dp if getattr(args, "micro", None) else None  # rows split over fsdp
        host = Layout(name, "jax_pjit", cp=layout.cp, packed=layout.packed)  # the host's rows: all of them
        cfg = tb.policy_config(
            model_path,
            tokenizer_path,
            host,
            args.batch,
            args.seq,
            args.precision,
            micro,
            getattr(args, "packing", None),
        )
        cfg["jax_cfg"].update(fsdp_size=layout.dp, tensor_parallel_size=layout.tp, context_parallel_size=layout.cp)
        self._start(name, cfg, tokenizer, args, 1, args.threads, cfg["train_micro_batch_size"])
        try:
            info = self._policy.get_gpu_info()[0]
            if info["local_devices"] != layout.devices:
                raise RuntimeError(f"the actor sees {info['local_devices']} devices, {name} needs {layout.devices}")
            self.mesh, self.pids = info["mesh"], [info["pid"]]
            self.pinned = None
            cpus = sorted(os.sched_getaffinity(info["pid"]))
            if args.threads < len(cpus) and not tb.on_cuda(
                args
            ):  # XLA sized its pool to the affinity mask: shrink the mask
                self.pinned = set(cpus[: args.threads])
                pin_process(info["pid"], self.pinned)
            self.threads = [thread_names(info["pid"])[XLA_POOL_THREAD] or None]
        except BaseException:
            self.close()
            raise

    def compile_counts(self) -> dict[str, int]:
        group = self._policy.worker_group
        return group.get_all_worker_results(group.run_all_workers_single_data("get_compile_counts"))[0]


# ----------------------------------------------------------------------------- probe around any runner


class Probe:
    """Wraps an ``hf`` / Policy runner for ``torch_backends.run_cases``: the same calls, plus
    per call the driver-side wall seconds and the CPU seconds of the case's processes, the
    first call of each operation, and what the processes ran on (read before ``close``)."""

    def __init__(self, runner, pids) -> None:
        self._runner, self.pids = runner, list(pids)
        self.calls: dict[str, list[tuple[float, float, float | None]]] = {op: [] for op in OPS}
        self.facts: dict = {}

    def __getattr__(self, key):  # name, workers, threads, startup_s, noop_s, params
        return getattr(self._runner, key)

    def _call(self, op: str) -> float:
        c0, t0 = cpu_seconds(self.pids), time.perf_counter()
        seconds = getattr(self._runner, op)()
        wall, c1 = time.perf_counter() - t0, cpu_seconds(self.pids)
        self.calls[op].append((seconds, wall, None if c0 is None or c1 is None else c1 - c0))
        return seconds

    def logprobs(self) -> float:
        return self._call("logprobs")

    def train(self) -> float:
        return self._call("train")

    def close(self) -> None:
        try:
            names = [thread_names(pid) for pid in self.pids]
            self.facts = {
                "os_threads": [sum(n.values()) for n in names],
                "xla_pool_threads": [n[XLA_POOL_THREAD] for n in names],
                "allowed_cpus": [allowed_cpus(pid) for pid in self.pids],
            }
            if isinstance(self._runner, JaxPolicyRunner):
                self.facts.update(
                    compile_counts=self._runner.compile_counts(),
                    mesh=self._runner.mesh,
                    pinned=sorted(self._runner.pinned) if self._runner.pinned else None,
                )
        finally:
            self._runner.close()

    def summary(self, skip: int) -> dict:
        """First-call seconds and cores used per operation (calls after the first ``skip``)."""
        out = {"first_s": {op: calls[0][0] for op, calls in self.calls.items() if calls}, **self.facts}
        for op, calls in self.calls.items():
            timed = [c for c in calls[skip:] if c[2] is not None]
            wall = sum(c[1] for c in timed)
            out[f"{op}_cores"] = sum(c[2] for c in timed) / wall if timed and wall > 0 else None
        return out


# ----------------------------------------------------------------------------- driver


def main(argv=None) -> int:
    """``dualrl bench`` on HF, two torch layouts and the JAX layouts, throughput only."""
    from benchmarks import compare

    return compare.main(
        [
            "--sections",
            "throughput",
            "--layouts",
            *CASES[1:],
            "--model",
            "llama_bench",
            "--seq",
            "256",
            *(argv if argv is not None else sys.argv[1:]),
        ],
        prog="python -m benchmarks.jax_backend",
    )


if __name__ == "__main__":
    sys.exit(main())
