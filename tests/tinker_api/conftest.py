"""``dualrl serve`` in the test process: the server in a thread on a free port of 127.0.0.1,
its policy on the session's Ray, clients from the unmodified tinker SDK.

One server holds one policy at a time, and a policy start is the expensive part (Ray
workers, model load), so each module starts its server once (``serving``) and its tests share
a training client where they can.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

#: The key every test client sends (the server enforces it: api_key_env is set).
API_KEY = "tml-dualrl-test"
KEY_ENV = "DUALRL_TEST_SERVE_KEY"
#: Small limits, so that the refusal tests stay cheap.
SERVER_OVERRIDES = [
    "serve.port=0",
    f"serve.api_key_env={KEY_ENV}",
    "serve.max_request_mb=0.25",
    "serve.max_datums_per_request=64",
    "serve.poll_s=5",
    "policy.max_total_sequence_length=32",
    "policy.generation.max_new_tokens=8",
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=8",
    "policy.logprob_batch_size=16",
]
#: Per backend: the layout the tests serve with.  The session's JAX actors see 8 host devices,
#: and batch sizes are per data-parallel device: 2 rows on each of the 8 is 16 a micro batch.
CLUSTERS = {"torch_fsdp": ["cluster.gpus_per_node=2"], "torch_dtensor": ["cluster.gpus_per_node=2"],
            "jax_pjit": ["cluster.gpus_per_node=2", "policy.train_micro_batch_size=2",
                         "policy.logprob_batch_size=2"]}  # fmt: skip


def server_config(backend: str, model: str, checkpoint_dir: Any, *extra: str) -> Any:
    from core.tinker_api.config import load_serve_config

    overrides = [*SERVER_OVERRIDES, *CLUSTERS[backend], f"serve.checkpoint_dir={checkpoint_dir}"]
    overrides += [f"policy.model_name={model}", f"policy.tokenizer.name={model}", *extra]
    return load_serve_config(None, overrides, backend)


@contextlib.contextmanager
def serving(backend: str, model: str, checkpoint_dir: Any, *extra: str) -> Iterator[Any]:
    """A started server (``ServerThread``); closed (models, cluster) on exit."""
    from core.tinker_api.serve import ServerThread

    os.environ[KEY_ENV] = API_KEY
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    server = ServerThread(server_config(backend, model, checkpoint_dir, *extra))
    try:
        yield server
    finally:
        server.close()


def service_client(server: Any) -> Any:
    import tinker

    return tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)


@pytest.fixture(scope="session")
def serve_cache(ray_session, tmp_path_factory):
    """A session-wide cache for built-in models (a warm start builds once, on the session's Ray)."""
    path = tmp_path_factory.mktemp("dualrl_serve_cache")
    old = os.environ.get("DUALRL_CACHE_DIR")
    os.environ["DUALRL_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("DUALRL_CACHE_DIR", None)
    else:
        os.environ["DUALRL_CACHE_DIR"] = old
