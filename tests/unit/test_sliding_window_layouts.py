"""Sliding-window models (Gemma 3) on the torch row layouts that would drop the window --
sequence packing, DTensor context parallelism -- are refused on the driver, in the preflight a
``Policy`` runs before any worker starts; plain rows and jax_pjit (which bands sliding layers
by token positions in every layout) pass.  Config only: the real gemma-3-1b-it config.json."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.policy.config import PolicyConfig
from core.policy.preflight import preflight_model_checks
from tests.torch_backends.conftest import policy_config

GEMMA3_1B = Path(__file__).parents[1] / "data" / "hf_configs" / "gemma-3-1b-it"


def _policy(backend: str, packing: bool = False, cp: int = 1) -> PolicyConfig:
    cfg = policy_config(GEMMA3_1B, backend)
    cfg["sequence_packing"]["enabled"] = packing
    cfg["parallel"]["context_parallel_size"] = cp
    cfg["parallel"]["context_parallel_size"] = cp
    if cp > 1:
        cfg["make_sequence_length_divisible_by"] = 2 * cp
    return PolicyConfig.checked(cfg)


@pytest.mark.parametrize("backend", ["torch_fsdp", "torch_dtensor"])
def test_packing_with_sliding_window_is_refused(backend):
    with pytest.raises(ValueError, match=r"policy\.sequence_packing\.enabled: model_type 'gemma3_text'.*sliding"):
        preflight_model_checks(_policy(backend, packing=True), None)


def test_dtensor_context_parallel_with_sliding_window_is_refused():
    with pytest.raises(ValueError, match=r"context_parallel_size=2: model_type 'gemma3_text'.*sliding"):
        preflight_model_checks(_policy("torch_dtensor", cp=2), None)


@pytest.mark.parametrize(
    "policy", [("torch_dtensor", False, 1), ("torch_fsdp", False, 1), ("jax_pjit", True, 2)], ids=str
)
def test_exact_layouts_pass(policy):
    backend, packing, cp = policy
    assert preflight_model_checks(_policy(backend, packing, cp), None).model_type == "gemma3_text"
