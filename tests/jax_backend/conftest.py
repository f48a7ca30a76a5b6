"""An in-process JAX worker shared by the engine-specific tests of this folder."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def qwen2_worker(model_dirs, tokenizer):
    """A ``JaxPolicyWorker`` in this process: tiny Qwen2 (biases: every HF transform) on
    fsdp 4 x tp 2 of the 8 virtual devices, so every tensor is sharded.  Tests that train it
    or move its state must not depend on its weights."""
    import jax

    if jax.device_count() < 8:
        pytest.skip("needs 8 (virtual) jax devices")
    from backends.jax_pjit.worker import JaxPolicyWorker
    from core.policy.config import PolicyConfig
    from tests.torch_backends.conftest import policy_config

    cfg = policy_config(model_dirs["qwen2"], "jax_pjit")
    cfg["parallel"].update(fsdp_size=4, tensor_parallel_size=2)
    return JaxPolicyWorker(PolicyConfig.checked(cfg), tokenizer, init_reference_model=False)


def mesh_config(fsdp: int, tp: int, cp: int = 1, backend: str = "jax_pjit") -> dict:
    """The test policy section on a JAX mesh, for what reads the layout only (``make_mesh``,
    ``ParallelDims``): the model path is never opened."""
    from pathlib import Path

    from tests.torch_backends.conftest import policy_config

    cfg = policy_config(Path("unused-model"), backend)
    cfg["parallel"].update(fsdp_size=fsdp, tensor_parallel_size=tp, context_parallel_size=cp)
    return cfg
