"""Test-session set-up shared by every test.

XLA reads its flags when jax is first imported, so the 8 virtual CPU devices the JAX
backend tests need are requested here, before any test module imports jax.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
