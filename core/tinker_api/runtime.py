"""What the server loads once: the base model (a built-in one built or found in the cache),
its tokenizer, Ray and the training cluster; and how it builds a policy for a model."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.tinker_api.config import ServeRunConfig
from core.tinker_api.model import ModelSpec


@dataclass(frozen=True)
class BaseModel:
    """The one base model this server trains."""

    name: str
    """As configured (``policy.model_name``: a built-in name or a path)."""
    path: str
    """The loadable local directory (what ``get_info`` reports: the SDK loads its tokenizer from it)."""
    vocab_size: int
    eos_ids: tuple[int, ...]
    pad_id: int

    def matches(self, requested: str | None) -> bool:
        return requested is not None and requested in (self.name, self.path)


class PolicyRuntime:
    """Ray, the cluster and the base model; ``build`` starts a policy for one model."""

    def __init__(self, cfg: ServeRunConfig):
        from core.algorithms.placement import policy_cluster, start_ray
        from core.algorithms.run_setup import load_tokenizer
        from core.algorithms.warm_start import resolve_model

        resolved = resolve_model(cfg, [])
        self.cfg = resolved
        self.tokenizer = load_tokenizer(resolved.policy)
        self.base = _base_model(cfg.policy.model_name, resolved.policy.model_name, self.tokenizer)
        start_ray(resolved)
        self.cluster = policy_cluster(resolved, name="tinker-api")

    def build(self, spec: ModelSpec, weights_path: str | None = None, optimizer_path: str | None = None) -> Any:
        """A policy of the base model with ``spec``'s LoRA (from a saved state with the paths)."""
        from core.policy import Policy

        return Policy(
            self.cluster,
            spec.policy_config(self.cfg.policy),
            self.tokenizer,
            name_prefix="tinker_api",
            init_reference_model=False,
            weights_path=weights_path,
            optimizer_path=optimizer_path,
        )

    def shutdown(self) -> None:
        self.cluster.shutdown()


def _base_model(name: str, path: str, tokenizer: Any) -> BaseModel:
    from transformers import AutoConfig

    local = os.path.abspath(path) if Path(path).is_dir() else path
    config = AutoConfig.from_pretrained(local)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    eos_ids = tuple(e for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    return BaseModel(name, local, int(config.vocab_size), eos_ids, int(pad))
