"""Start (or join) Ray once per process, quietly and with a small footprint.

Every entry point (CLI, tests, benchmarks) calls :func:`init_ray` instead of ``ray.init``
so that they all get the same settings: no dashboard (it costs ~1 s and ~100 MB and is
useless on CI), a small object store (the default reserves 30 % of RAM), no usage-stats
reporting, and ``RAY_AUTH_MODE=disabled`` (Ray >= 2.5x otherwise asks for a token on
some setups).  Worker stdout/stderr are still forwarded to the driver, because that is
where a failing worker's traceback shows up first.
"""

from __future__ import annotations

import logging
import os

import ray

__all__ = ["init_ray", "DEFAULT_OBJECT_STORE_MEMORY"]

#: 256 MiB: enough for the batches and metrics the driver exchanges with workers; weights
#: travel through collectives / shared memory, never through the object store.
DEFAULT_OBJECT_STORE_MEMORY = 256 * 1024 * 1024

# Env vars read by Ray when it starts its processes.  setdefault: a value the user exported
# on purpose (e.g. a real auth mode on a shared cluster) wins.
_RAY_ENV_DEFAULTS = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def init_ray(
    num_cpus: int | None = None,
    object_store_memory: int = DEFAULT_OBJECT_STORE_MEMORY,
    address: str | None = None,
) -> None:
    """Make sure this process is connected to Ray; return immediately if it already is.

    * ``address`` (or, when ``None``, the ``RAY_ADDRESS`` env var) given: connect to that
      existing cluster; ``num_cpus`` and ``object_store_memory`` are then ignored, since
      the cluster's own nodes define its resources (Ray refuses them on connect).
    * otherwise start a local single-node cluster with ``num_cpus`` CPUs (``None``: all
      cores) and an object store of ``object_store_memory`` bytes.

    Idempotent: a second call (with any arguments) does nothing, so library code may call
    it defensively without fighting an initialisation done by the caller.
    """
    if ray.is_initialized():
        return
    for key, value in _RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)

    common = dict(log_to_driver=True, logging_level=logging.WARNING)
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        ray.init(address=address, **common)
        return
    ray.init(
        num_cpus=num_cpus,
        object_store_memory=int(object_store_memory),
        include_dashboard=False,
        **common,
    )
