"""One Ray instance for the whole test session (starting Ray costs ~4 s on 2 cores).

Tests that need Ray request the ``ray_session`` fixture (directly or through another
fixture); pure-Python tests (e.g. WorkerLayout) do not, and run without starting Ray.
4 logical CPUs on a 2-core machine: the test workers mostly sleep or wait, and 4 lets a
dp=2 x tp=2 group exist.
"""

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from core.distributed import init_ray

    init_ray(num_cpus=4)
    yield ray
    ray.shutdown()
