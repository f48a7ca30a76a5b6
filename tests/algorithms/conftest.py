"""GRPO run configs for the tests: the embedded default, shrunk to seconds.

The policy is the built-in ``builtin:arithmetic-llama`` (built once per session into a
temporary cache by the project's own warm start, a ``dualrl sft`` run), so rewards are neither all 0 nor all 1
and the advantages, losses and gradients compared across backends are not trivially zero.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from core.algorithms.config import GRPORunConfig
from core.config import load_config
from core.models.builtin import WARM_START_SFT_OVERRIDES
from dualrl.cli import GRPO_DEFAULT_CONFIG_PATH

#: The embedded reasoning-gym recipe (core/configs/grpo_reasoning_gym.yaml).
REASONING_GYM_CONFIG_PATH = GRPO_DEFAULT_CONFIG_PATH.with_name("grpo_reasoning_gym.yaml")
#: The test session's warm start of builtin:reasoning-gym-llama: the recipe's own SFT run, shorter
#: (a model of its own in the cache), still far enough for rewards that are neither all 0 nor all 1
#: (60 steps were not: every step-1 reward was 0).
REASONING_GYM_TEST_WARM_START = ("sft.max_num_steps=100",)

SMALL_RUN = [
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_num_steps=2",
    "grpo.val_period=0",
    "grpo.val_at_start=false",
    "grpo.val_at_end=true",
    "grpo.max_val_samples=8",
    "grpo.val_batch_size=8",
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=4",
    "policy.logprob_batch_size=8",
    # The runs keep a reference pass and a KL term, which the embedded default no longer has
    # (its KL penalty is 0): the backends must agree on them too.
    "loss_fn.reference_policy_kl_penalty=0.01",
    "logger.progress_bar=false",
    "logger.plot_enabled=false",
    "logger.tensorboard_enabled=false",
    "checkpointing.enabled=false",
]
LAYOUTS = {
    "torch_fsdp": [],
    "torch_dtensor": ["policy.parallel.tensor_parallel_size=2"],
    # The test session's JAX actors see 8 XLA host devices (tests/conftest.py): fsdp 4 x tp 2.
    # Batch sizes are per data-parallel device: 4 x 2 scores the 8 rows of a call at once.
    "jax_pjit": ["policy.parallel.tensor_parallel_size=2", "policy.logprob_batch_size=2"],
}
SEPARATE_ENGINE = [
    "policy.generation.colocated.enabled=false",
    "policy.generation.colocated.resources.gpus_per_node=1",
    "policy.generation.colocated.resources.num_nodes=1",
]


@pytest.fixture(scope="session")
def builtin_cache(ray_session, tmp_path_factory):
    """A session-wide cache for the built-in model (built by the first run that needs it, with
    a `dualrl sft` run: on the session's Ray, which must be up first -- a run that finds no Ray
    starts its own, sized for itself)."""
    path = tmp_path_factory.mktemp("dualrl_cache")
    old = os.environ.get("DUALRL_CACHE_DIR")
    os.environ["DUALRL_CACHE_DIR"] = str(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(WARM_START_SFT_OVERRIDES, "reasoning-gym-llama", REASONING_GYM_TEST_WARM_START)
        yield path
    if old is None:
        os.environ.pop("DUALRL_CACHE_DIR", None)
    else:
        os.environ["DUALRL_CACHE_DIR"] = old


def grpo_config(run_dir: Path, backend: str, *overrides: str, path: Path = GRPO_DEFAULT_CONFIG_PATH) -> GRPORunConfig:
    """The embedded default (or the config at ``path``) on ``backend``, small, logging under ``run_dir``."""
    paths = [f"logger.log_dir={run_dir / 'logs'}", f"checkpointing.checkpoint_dir={run_dir / 'ckpt'}"]
    return load_config(
        path,
        SMALL_RUN + LAYOUTS[backend] + paths + list(overrides),
        backend=backend,
        schema=GRPORunConfig,
    )
