"""GRPO with a mixture of experts on every backend (core/configs/grpo_arithmetic_moe.yaml:
builtin:arithmetic-qwen3-moe, two optimizer steps per rollout batch, the router loss in the
loss, the old-logprob pass's experts replayed): the same step 1 on torch_fsdp, torch_dtensor
(FSDP2) and jax_pjit (fsdp 4 x tp 2) -- rollouts, router loss, routing agreement, loss and
gradient norm.

Slow: the MoE's own warm start (~90 s, once per session) and three runs.  The policy-level
equalities (router loss, replay) are tests/backends/test_moe_router_loss.py.
"""

from __future__ import annotations

import pytest

from core.algorithms.commands import run_grpo
from tests.algorithms.conftest import grpo_config

pytestmark = pytest.mark.slow

#: Two optimizer steps per rollout batch of 16 (micro batch 2: the JAX mesh has 4 fsdp ranks).
MOE_CONFIG_OVERRIDES = (
    "policy.moe.routing_replay.enabled=true",
    "policy.train_global_batch_size=8",
    "policy.train_micro_batch_size=2",
)
#: torch tensor parallelism has no Qwen3-MoE plan: the DTensor run is dp only (FSDP2).
BACKEND_OVERRIDES = {"torch_fsdp": (), "torch_dtensor": ("policy.parallel.tensor_parallel_size=1",), "jax_pjit": ()}


@pytest.fixture(scope="module")
def moe_runs(ray_session, builtin_cache, tmp_path_factory):
    from core.config.loader import DEFAULT_CONFIG_PATH

    path = DEFAULT_CONFIG_PATH.parent / "grpo_arithmetic_moe.yaml"
    runs = {}
    for backend, extra in BACKEND_OVERRIDES.items():
        run_dir = tmp_path_factory.mktemp(f"moe-{backend}")
        cfg = grpo_config(run_dir, backend, *MOE_CONFIG_OVERRIDES, *extra, path=path)
        run = run_grpo(cfg)
        runs[backend] = [r for r in run.logger.history if r["split"] == "train"]
    return runs


def test_moe_grpo_step_one_is_the_same_on_every_backend(moe_runs):
    ref = moe_runs["torch_fsdp"]
    for backend, rows in moe_runs.items():
        assert [r["step"] for r in rows] == [1, 2]
        first = rows[0]
        assert first["old_logprobs_fused"] == 0.0 and 0.0 < first["reward_mean"] < 1.0
        assert first["moe_aux_loss"] >= 2.0 - 1e-6  # >= top_k (its value at a uniform load)
        for key in ("reward_mean", "generated_tokens", "accuracy"):
            assert first[key] == ref[0][key], f"{backend}: {key} (rollouts differ)"
        for key in ("loss", "grad_norm", "moe_aux_loss", "moe_routing_agreement"):
            assert first[key] == pytest.approx(ref[0][key], rel=1e-5, abs=1e-6), f"{backend}: {key}"
        # Replay keeps the old pass's experts; the router's own choice is what agreement measures
        # (the second optimizer step's tokens see weights the first moved: <= 1).
        assert 0.5 < first["moe_routing_agreement"] <= 1.0, backend
        assert 1.0 <= first["token_mult_prob_error"] < 1.001
