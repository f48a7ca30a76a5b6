"""LoRA on the torch backends: ``LoRALinear`` replaces each targeted ``nn.Linear`` of the HF
model before any sharding; the arrays and the scale come from ``core.models.lora``.

Why our own wrapper and not PEFT's ``LoraModel``: PEFT renames every adapted weight
(``base_layer.weight`` under ``base_model.model.``), which would change the state-dict names
the refit manifest, the DCP checkpoints and the reference swap are keyed by, and its modules
are not written for FSDP2's ``fully_shard`` per block / FSDP1's flat parameters with frozen
members.  ``LoRALinear`` *is* an ``nn.Linear`` (same ``weight`` / ``bias`` names, so the base
names do not move) with two child linears ``lora_A`` / ``lora_B``: state-dict names
``<module>.lora_A.weight`` are PEFT's adapter names minus its prefix.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from backends.torch_common import cpu_linear
from core.models.lora import adapted_modules, is_adapter_name, lora_scale
from core.policy.config import LoRAConfig
from core.policy.lora_adapter import starting_adapters


class LoRALinear(torch.nn.Linear):
    """``y = x W^T + b + scale * B(A(dropout(x)))``; W and b frozen, A and B trained.

    Dropout draws from ``generator`` (seeded per worker from ``policy.lora.init_seed`` and
    the rank), not from torch's global RNG, so a run's dropout masks are reproducible."""

    def __init__(
        self,
        base: torch.nn.Linear,
        a: torch.Tensor,
        b: torch.Tensor,
        scale: float,
        dropout: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> None:
        torch.nn.Module.__init__(self)  # keep base's parameters, do not allocate new ones
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        rank = a.shape[0]
        self.lora_A = torch.nn.Linear(self.in_features, rank, bias=False, device=a.device, dtype=a.dtype)
        self.lora_B = torch.nn.Linear(rank, self.out_features, bias=False, device=b.device, dtype=b.dtype)
        with torch.no_grad():
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.copy_(b)
        self.scale = scale
        self.dropout = dropout
        self.generator = generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu_linear.linear(x, self.weight, self.bias)
        h = x
        if self.training and self.dropout > 0:
            keep = torch.rand(x.shape, generator=self.generator, device=x.device) >= self.dropout
            h = x * keep.to(x.dtype) / (1.0 - self.dropout)
        return out + self.lora_B(self.lora_A(h)) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.out_features}, scale={self.scale}"


def apply_lora(
    model: torch.nn.Module,
    cfg: LoRAConfig,
    rank: int = 0,
    device: torch.device | None = None,
    resume: bool = False,
) -> list[str]:
    """Replace every targeted ``nn.Linear`` of ``model`` by a ``LoRALinear`` with the starting
    adapters (``policy.lora.adapter_path``'s, else the seeded init; ``resume``: the seeded
    init, a checkpoint overwrites it) and freeze every other parameter.  Returns the adapted
    module paths (HF names)."""
    linears = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    modules = adapted_modules(linears, cfg.targets)
    scale = lora_scale(cfg.alpha, cfg.rank, cfg.use_rslora)
    source = starting_adapters(cfg, resume)
    freeze_all_but_adapters(model)  # none exist yet: everything frozen
    generator = None
    if cfg.dropout > 0:
        # On the device the forward runs on (the model moves there when it is sharded).
        generator = torch.Generator(device=device or "cpu").manual_seed(cfg.init_seed + 7919 * rank)
    for name in modules:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, child)
        a, b = source(name, base.in_features, base.out_features)
        dev, dtype = base.weight.device, base.weight.dtype
        wrapped = LoRALinear(
            base, torch.from_numpy(a).to(dev, dtype), torch.from_numpy(b).to(dev, dtype), scale, cfg.dropout, generator
        )
        setattr(parent, child, wrapped)
    return modules


def freeze_all_but_adapters(model: torch.nn.Module) -> None:
    """``requires_grad=False`` on every parameter but the adapters.  Again after tensor
    parallelism: styles that re-wrap parameters (``SequenceParallel`` on the norms) create
    them trainable."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))


def trainable_parameters(model: torch.nn.Module) -> Iterator[torch.nn.Parameter]:
    """The parameters that train (after ``apply_lora``: the adapters only; else all)."""
    return (p for p in model.parameters() if p.requires_grad)
