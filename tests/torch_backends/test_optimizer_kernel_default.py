"""Fused AdamW by default on CUDA (``backends.torch_common.optim.with_default_kernel``):
only when the parameters are on CUDA, the class takes ``fused`` and the user chose neither
``fused`` nor ``foreach``; CPU keeps torch's default (CPU numerics unchanged)."""

from __future__ import annotations

import pytest
import torch

from backends.torch_common.optim import build_optimizer, with_default_kernel


class NoFusedOptimizer(torch.optim.Optimizer):
    """An optimizer class without a ``fused`` argument."""

    def __init__(self, params, lr: float = 1e-3):
        super().__init__(params, {"lr": lr})


@pytest.mark.parametrize(
    "cls, kwargs, device, expected",
    [
        (torch.optim.AdamW, {"lr": 1e-3}, "cuda", {"lr": 1e-3, "fused": True}),
        (
            torch.optim.AdamW,
            {"lr": 1e-3, "fused": None, "foreach": None},
            "cuda",
            {"lr": 1e-3, "fused": True, "foreach": None},
        ),  # null = unset, as for torch
        (torch.optim.AdamW, {"lr": 1e-3}, "cpu", {"lr": 1e-3}),  # host parameters: torch's default
        (torch.optim.AdamW, {"foreach": True}, "cuda", {"foreach": True}),  # the user's choice stays
        (torch.optim.AdamW, {"fused": False}, "cuda", {"fused": False}),
        (torch.optim.SGD, {"lr": 0.1}, "cuda", {"lr": 0.1, "fused": True}),
        (NoFusedOptimizer, {"lr": 0.1}, "cuda", {"lr": 0.1}),  # no such argument: nothing added
    ],
)
def test_with_default_kernel(cls, kwargs, device, expected):
    assert with_default_kernel(cls, kwargs, device) == expected


def test_cpu_optimizer_keeps_torch_defaults():
    opt = build_optimizer(
        {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3, "betas": [0.9, 0.99]}}, torch.nn.Linear(2, 2).parameters()
    )
    group = opt.param_groups[0]
    assert group["fused"] is None and group["foreach"] is None and group["betas"] == (0.9, 0.99)
