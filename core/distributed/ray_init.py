"""Start (or join) Ray once per process, quietly and with a small footprint.

Every entry point (CLI, tests, benchmarks) calls :func:`init_ray` instead of ``ray.init``
so that they all get the same settings: no dashboard (it costs start time and memory and
is useless on CI), a small object store (the default reserves 30 % of RAM), no usage-stats
reporting, and ``RAY_AUTH_MODE=disabled`` (Ray >= 2.5x otherwise asks for a token on
some setups).  Worker stdout/stderr are forwarded to the driver, unless ``worker_log`` names
a file for them (a training run's ``workers.log``: :mod:`core.distributed.worker_output`).

A local Ray started here also gets a watchdog (:mod:`core.distributed.ray_reaper`): if the
driver is killed hard, Ray's own fate-sharing stops the GCS, the raylet and the workers,
but the raylet's dashboard and runtime-env agents outlive it for over a minute (they block
reporting the raylet's death to the dead GCS); the watchdog kills them within a second.
Clean-up by hand (a session whose watchdog was killed too, or a cluster from ``ray start``)
is described in docs/troubleshooting.md, "Leftovers of a killed run".
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import ray

from core.distributed.worker_output import worker_log_runtime_env
from core.reporting import get_logger

__all__ = ["init_ray", "start_ray", "jax_cpu_flags", "DEFAULT_OBJECT_STORE_MEMORY", "QUIET_WORKER_ENV"]

#: 256 MiB: enough for the batches and metrics the driver exchanges with workers; weights
#: travel through collectives / shared memory, never through the object store.
DEFAULT_OBJECT_STORE_MEMORY = 256 * 1024 * 1024

# Env vars read by Ray when it starts its processes.  setdefault: a value the user exported
# on purpose (e.g. a real auth mode on a shared cluster) wins.
_RAY_ENV_DEFAULTS = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}

XLA_DEVICE_FLAG = "--xla_force_host_platform_device_count"
XLA_EIGEN_FLAG = "--xla_cpu_multi_thread_eigen"
QUIET_WORKER_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def start_ray(
    num_cpus: int | None = None, jax_cpu_devices: int | None = None, worker_log: str | os.PathLike | None = None
) -> None:
    """Start (or join) Ray with the environment a run's workers need; a no-op when Ray is up.

    The one starter of runs (``core.algorithms.placement.start_ray``) and benchmarks.  Ray's
    workers inherit the environment of the process that starts Ray, so it is set first:
    quiet logs (vLLM's per-call INFO lines and HF's weight-loading bars would bury a run's
    own output; a value the user exported wins) and, for JAX workers on a CPU machine,
    ``jax_cpu_devices`` XLA host devices (:func:`jax_cpu_flags`: a count already in
    ``XLA_FLAGS`` wins).  ``worker_log``: see :func:`init_ray`.
    """
    if ray.is_initialized():
        return
    for key, value in QUIET_WORKER_ENV.items():
        os.environ.setdefault(key, value)
    if jax_cpu_devices is not None:
        os.environ["XLA_FLAGS"] = jax_cpu_flags(os.environ.get("XLA_FLAGS", ""), jax_cpu_devices)
    init_ray(num_cpus=num_cpus, worker_log=worker_log)


def jax_cpu_flags(flags: str, devices: int) -> str:
    """``XLA_FLAGS`` for a JAX worker on a CPU machine: ``devices`` host devices, and Eigen's
    intra-op pool off.  With it on, the devices' programs and their in-process collectives
    share one small pool, and a 400-step GRPO run on 2 devices / 2 cores died twice (steps
    ~36 and ~140) in an all-reduce / all-gather rendezvous whose second participant never
    arrived; each device still runs on its own thread.  Flags already set are kept."""
    for name, value in ((XLA_DEVICE_FLAG, devices), (XLA_EIGEN_FLAG, "false")):
        if name not in flags:
            flags = f"{flags} {name}={value}".strip()
    return flags


def init_ray(
    num_cpus: int | None = None,
    object_store_memory: int = DEFAULT_OBJECT_STORE_MEMORY,
    address: str | None = None,
    worker_log: str | os.PathLike | None = None,
) -> None:
    """Make sure this process is connected to Ray; return immediately if it already is.

    * ``address`` (or, when ``None``, the ``RAY_ADDRESS`` env var) given: connect to that
      existing cluster; ``num_cpus`` and ``object_store_memory`` are then ignored, since
      the cluster's own nodes define its resources (Ray refuses them on connect).
    * otherwise start a local single-node cluster with ``num_cpus`` CPUs (``None``: all
      cores) and an object store of ``object_store_memory`` bytes -- even when this
      machine already runs a Ray cluster (``ray start``, another test session's
      ``ray.cluster_utils.Cluster``).  To join that one, pass its address or ``"auto"``.

    ``worker_log``: every worker process of this driver writes its stdout/stderr to that
    file instead of the driver's console (errors still reach the driver as exceptions).

    Idempotent: a second call (with any arguments) does nothing, so library code may call
    it defensively without fighting an initialisation done by the caller.

    A local cluster dies with this process, even on SIGKILL: see the module doc (watchdog).
    Left-overs of a session whose watchdog died too::

        python -m core.distributed.ray_reaper /tmp/ray/session_<date>_<driver pid>

    kills that session's Ray processes only (``ray stop --force`` kills every Ray process of
    the user on the machine, other runs' included).
    """
    if ray.is_initialized():
        return
    for key, value in _RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)

    common: dict = dict(log_to_driver=True, logging_level=logging.WARNING)
    if worker_log is not None:
        common["runtime_env"] = worker_log_runtime_env(worker_log)
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        ray.init(address=address, **common)
        return
    ray.init(
        # "local", not None: with None, Ray joins the cluster named in
        # /tmp/ray/ray_current_cluster (written by `ray start` and by cluster_utils.Cluster,
        # left behind by a killed one) and then rejects num_cpus / object_store_memory.
        address="local",
        num_cpus=num_cpus,
        object_store_memory=int(object_store_memory),
        include_dashboard=False,
        **common,
    )
    _start_reaper()


def _start_reaper() -> None:
    """Start the watchdog of the local session just started (Linux: it reads /proc).

    It reads the session directory and the raylet's pid from Ray's node object, which is not
    public API: if a Ray version moves them, Ray runs without a watchdog (logged), as before.
    """
    if not os.path.isdir("/proc"):
        return
    try:
        node = ray._private.worker.global_worker.node
        session_dir = node.get_session_dir_path()
        raylet_pid = node.all_processes[ray._private.ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    except (AttributeError, KeyError, IndexError) as exc:
        get_logger(__name__).warning(
            "no Ray watchdog (Ray's node layout changed: %r); after a hard kill "
            "see docs/troubleshooting.md 'Leftovers of a killed run'",
            exc,
        )
        return
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_reaper.py")
    # A session of its own: the signal that kills the driver's process group spares it.
    # Run by path: imports nothing but the standard library.
    proc = subprocess.Popen(
        [sys.executable, script, "--watch", str(os.getpid()), str(raylet_pid), session_dir],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    # Reap it when it exits after a ray.shutdown() (else a zombie until this process ends).
    threading.Thread(target=proc.wait, name="ray-reaper-wait", daemon=True).start()
