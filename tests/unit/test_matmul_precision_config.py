"""``policy.matmul_precision``: one setting for every backend, fp32 meaning fp32 by default."""

from __future__ import annotations

import pytest

from core.algorithms.config import GRPORunConfig
from core.config import EMBEDDED_CONFIGS, ConfigError, load_config
from core.policy.matmul_precision import resolve_matmul_precision, torch_float32_matmul


def _policy(*overrides: str):
    return load_config(EMBEDDED_CONFIGS["grpo"], list(overrides), schema=GRPORunConfig).policy


@pytest.mark.parametrize(
    "precision, given, jax_value, torch_value",
    [
        ("float32", None, "highest", "highest"),  # fp32 means fp32: no TF32 on either engine
        ("bfloat16", None, "default", "high"),  # bf16 compute: the device's fast path
        ("float32", "high", "high", "high"),
        ("float32", "default", "default", "high"),
        ("bfloat16", "highest", "highest", "highest"),
    ],
)
def test_defaults_follow_the_training_precision(precision, given, jax_value, torch_value):
    policy = _policy(f"policy.precision={precision}", f"policy.matmul_precision={given or 'null'}")
    assert resolve_matmul_precision(policy) == jax_value
    assert torch_float32_matmul(policy) == torch_value


def test_an_unknown_value_is_refused_by_the_config_and_cannot_reach_the_resolver():
    with pytest.raises(ConfigError) as info:
        _policy("policy.matmul_precision=tf32")
    line = next(e for e in info.value.errors if e.startswith("policy.matmul_precision: "))
    assert "'tf32'" in line and "highest" in line and "policy.matmul_precision=tf32" in line
    policy = _policy()
    with pytest.raises(ValueError, match="matmul_precision"):  # a validated section stays valid
        policy.matmul_precision = "tf32"
    assert resolve_matmul_precision(policy) == "highest"


def test_the_embedded_configs_leave_it_to_the_default():
    policy = _policy()
    assert policy.matmul_precision is None
    assert resolve_matmul_precision(policy) == "highest"
