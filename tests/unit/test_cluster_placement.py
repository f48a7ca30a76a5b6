"""``cluster.cpus_per_slot``: the bundles a run's training cluster asks Ray for, per backend kind
(one worker per device, or one worker owning the host's devices), and the logical CPUs a CPU run
starts Ray with to hold them."""

from __future__ import annotations

import pytest

from core.algorithms.config import GRPORunConfig
from core.algorithms.placement import cpu_slots_needed, policy_cluster
from core.config import EMBEDDED_CONFIGS, ConfigError, load_config

TORCH = "policy.backend=torch_fsdp"
JAX = "policy.backend=jax_pjit"


def _cfg(*overrides: str) -> GRPORunConfig:
    return load_config(EMBEDDED_CONFIGS["grpo"], list(overrides), schema=GRPORunConfig)


def test_cpus_per_slot_defaults_to_one_and_must_be_positive():
    assert _cfg().cluster.cpus_per_slot == 1
    with pytest.raises(ConfigError, match="cluster.cpus_per_slot"):
        _cfg("cluster.cpus_per_slot=0")


@pytest.mark.parametrize(
    ("overrides", "bundles", "bundle_cpus"),
    [
        ((TORCH,), [2], 1),  # the embedded default: two single-CPU worker slots
        ((TORCH, "cluster.cpus_per_slot=2"), [2], 2),
        ((TORCH, "cluster.gpus_per_node=1", "cluster.cpus_per_slot=2"), [1], 2),  # one worker, both cores
        ((JAX,), [1], 2),  # one host worker holds both devices' CPUs
        ((JAX, "cluster.cpus_per_slot=2"), [1], 4),
    ],
)
def test_policy_cluster_bundles_hold_cpus_per_slot(ray_session, overrides, bundles, bundle_cpus):
    cfg = _cfg(*overrides)
    # the colocated engines share the training bundles: nothing more to ask Ray for
    assert cpu_slots_needed(cfg) == bundles[0] * bundle_cpus
    with policy_cluster(cfg, name="cpus-per-slot") as cluster:
        assert cluster.bundle_ct_per_node_list == bundles
        assert cluster.bundle_resources() == {"CPU": bundle_cpus}
        assert cluster.max_colocated_worker_groups == 2
