"""Test-session set-up shared by every test.

XLA reads its flags when jax is first imported, so the 8 virtual CPU devices the JAX
backend tests need are requested here, before any test module imports jax.

The session shares one persistent JAX compilation cache (a temporary directory, empty at
the start, removed at the end): every JAX policy is a fresh Ray actor that would otherwise
compile the same programs (same tiny model, same mesh, same shapes) again; the cache key
covers the program, its shardings and the compile options, so a hit is the same executable.
It is on in the test session only (thresholds 0: the tiny programs compile in well under the
default 1 s).  Set before Ray starts, so the actors inherit it.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _jax_cache = tempfile.mkdtemp(prefix="dualrl-test-jax-cache-")
    atexit.register(shutil.rmtree, _jax_cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _jax_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_session():
    """One Ray instance for the whole test session (starting Ray costs ~4 s on 2 cores).

    Tests that need Ray request this fixture (directly or through another fixture);
    pure-Python tests do not, and run without starting Ray.  4 logical CPUs on a 2-core
    machine: the test workers mostly wait, and 4 lets a dp=2 x tp=2 group exist.
    """
    import ray

    from core.distributed import init_ray

    init_ray(num_cpus=4)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Tiny HF models saved to disk once per session (built from configs, no downloads)."""
    from core.testing.tiny_models import save_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {name: save_tiny_model(name, root / name) for name in ("llama", "qwen2", "qwen3", "qwen3_moe", "llama_tied")}


@pytest.fixture(scope="session")
def tokenizer():
    from core.testing.tiny_models import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="session")
def gen_model_dirs(tmp_path_factory):
    """Tiny models vLLM's CPU attention accepts (head_dim 32)."""
    from core.testing.tiny_models import save_tiny_model

    root = tmp_path_factory.mktemp("gen_models")
    return {name: save_tiny_model(name, root / name) for name in ("llama_gen", "qwen2_gen", "qwen3_gen")}
