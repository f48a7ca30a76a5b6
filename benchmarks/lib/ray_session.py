"""Ray for a benchmark run: one session, XLA host devices for JAX on a CPU, restarts between layouts.

Host devices: ``make_mesh`` uses *all* devices a JAX actor sees, so a layout's ``F x C x T``
must equal that count, which XLA takes from ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
when the actor first initialises its backend.  ``Policy`` passes no env vars to its workers;
Ray actors inherit the environment of the process that started Ray.  So :class:`RaySession`
sets the count before it starts Ray -- through :func:`core.distributed.ray_init.start_ray`, the
project's one Ray starter (quiet workers, Eigen's pool off for JAX on a CPU, as ``dualrl grpo``)
-- with N = the device count of the first JAX layout, and restarts Ray (child processes are not
part of Ray and live on) before a JAX layout that needs another N; the restarts and their
seconds are recorded and are no part of any timing.  When Ray was started by the caller
(tests), it is not touched: the N its actors see is read once with a Ray task, and
:meth:`RaySession.fits` says which layouts cannot run on it.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from benchmarks.lib.layouts import Layout

DEVICE_FLAG = "--xla_force_host_platform_device_count"


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


def ray_cpus(layouts: list[Layout], threads: int, floor: int = 4) -> int:
    """Logical CPUs for Ray: room for the largest layout that fits the thread budget (one is alive
    at a time; a torch layout's workers get ``threads // workers`` CPUs each, a JAX layout one
    bundle of ``threads``)."""
    need = [lay.workers * max(1, threads // lay.workers) for lay in layouts if lay.workers <= threads]
    return max([floor, threads, *need])


class RaySession:
    """Ray whose actors get a given number of XLA host devices (see the module docstring).

    ``num_cpus``: Ray's logical CPUs (None: the cores).  ``host_devices=False`` on a GPU: JAX
    actors get GPUs there, the host device count plays no part.  ``worker_log``: the file the
    workers' own output goes to (vLLM's and the libraries' start-up chatter, as a training run's
    ``workers.log``; errors still reach the driver); None: the console."""

    def __init__(self, num_cpus: int | None, host_devices: bool = True, worker_log: Path | None = None) -> None:
        import ray

        self.num_cpus, self.host_devices, self.worker_log = num_cpus, host_devices, worker_log
        self.owned = not ray.is_initialized()
        self.devices: int | None = None if self.owned or not host_devices else actor_device_count()
        self.restarts: list[tuple[int, float]] = []  # (new device count, seconds)

    def devices_for(self, layout: Layout) -> int | None:
        """The host devices ``layout`` needs from Ray (None: any)."""
        return layout.devices if layout.per_host and self.host_devices else None

    def fits(self, devices: int | None) -> bool:
        return self.owned or devices is None or not self.host_devices or self.devices == devices

    def restarts_for(self, devices: int | None) -> bool:
        """Whether :meth:`start` would restart Ray (anything living in Ray goes with it)."""
        return self.owned and devices not in (None, self.devices)

    def start(self, devices: int | None = None) -> None:
        """Ray whose actors get ``devices`` host devices (``None``: any, e.g. for torch layouts)."""
        import ray

        if not self.host_devices:
            devices = None
        if not self.owned:
            if not self.fits(devices):
                raise RuntimeError(
                    f"Ray was started by the caller with {self.devices} XLA host device(s) "
                    f"per actor; this layout needs {devices}"
                )
            return
        if ray.is_initialized() and devices in (None, self.devices):
            return
        t0, restart = time.perf_counter(), ray.is_initialized()
        if restart:
            ray.shutdown()
        self._set_environment(devices)
        from core.distributed.ray_init import start_ray

        start_ray(num_cpus=self.num_cpus, jax_cpu_devices=devices, worker_log=self.worker_log)
        if restart:
            self.restarts.append((devices, time.perf_counter() - t0))

    def _set_environment(self, devices: int | None) -> None:
        """What a benchmark's workers inherit beyond the starter's defaults."""
        if devices is not None:
            # This session picks the count per layout: replace any count already in XLA_FLAGS
            # (the starter keeps one it finds there, as a user's choice).
            os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS"), devices)
            os.environ.pop("JAX_NUM_CPU_DEVICES", None)  # it would override the flag
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
            self.devices = devices
        if not self.host_devices:
            # JAX would take 75 % of the GPU at its first allocation, next to torch layouts and HF children
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        # Ray starts its workers at niceness 15 (its worker_niceness), while the baselines a layout
        # is paired with (HF eager, TRL) and the roofline's children run at the driver's: on a
        # machine shared with other work the baselines would get the cores first.
        os.environ.setdefault("RAY_worker_niceness", "0")
        # Ray sets an actor's OMP_NUM_THREADS to its CPU count only where the variable is unset;
        # an exported value would be inherited by every worker and oversubscribe the cores.
        os.environ.pop("OMP_NUM_THREADS", None)
