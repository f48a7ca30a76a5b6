"""What every training algorithm does before its first step: seeds, tokenizer, model
resolution, the run's identity for checkpoints.  Backend-free (the policy is built by the
algorithm through ``core.policy.Policy``)."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from core.algorithms.config import MasterConfig
from core.models.builtin import builtin_tokenizer, is_builtin
from core.policy.config import PolicyConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

M = TypeVar("M", bound=MasterConfig)


def seed_everything(seed: int) -> None:
    """Python, numpy and torch RNGs of the driver (workers seed from the data they get)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_tokenizer(policy_cfg: PolicyConfig) -> PreTrainedTokenizerBase:
    """``policy.tokenizer.name`` (a built-in, a local path or a hub id), with the config's
    chat template if given and a pad token (the eos) if the tokenizer has none."""
    tok_cfg = policy_cfg.tokenizer
    name = tok_cfg.name
    if is_builtin(name):
        tokenizer = builtin_tokenizer(name)
    else:
        from transformers import AutoTokenizer

        from core.policy.preflight import check_model_path

        check_model_path(name, "policy.tokenizer.name")
        tokenizer = AutoTokenizer.from_pretrained(name)
    if tok_cfg.chat_template:
        tokenizer.chat_template = tok_cfg.chat_template
    if tokenizer.pad_token_id is None:
        # Generation pads finished rows; any id works since padding is masked, and the eos
        # is what HF models without a pad token use.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class ModelResolver(Protocol):
    """How a run gets a loadable ``policy.model_name``: ``(cfg, held-out prompts) -> a copy of
    cfg`` (:func:`core.algorithms.warm_start.resolve_model` builds built-in models, running a
    warm-start SFT where one is needed; the set-up functions take it as an argument so that the
    warm start, itself an SFT run, sits above them instead of in a cycle with them)."""

    def __call__(self, cfg: M, exclude_prompts: Iterable[str]) -> M: ...


def model_fingerprint(model_name: str) -> str:
    """A hash of the model's ``config.json`` (architecture and shapes), so a resume into
    another model is refused; hub models not on disk hash their name."""
    path = Path(model_name) / "config.json"
    if path.is_file():
        fields = json.loads(path.read_text())
        fields.pop("transformers_version", None)
        text = json.dumps(fields, sort_keys=True)
    else:
        text = model_name
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_identity(algorithm: str, configured_cfg: MasterConfig, resolved_cfg: MasterConfig) -> dict[str, str]:
    """What a checkpoint of this run must match to be resumed by it."""
    name = configured_cfg.policy.model_name
    if is_builtin(name):  # the cache directory's name carries the hash of the task and warm start
        name = f"{name}@{Path(resolved_cfg.policy.model_name).name}"
    return {
        "algorithm": algorithm,
        "backend": resolved_cfg.policy.backend,
        "model_name": name,
        "model_fingerprint": model_fingerprint(resolved_cfg.policy.model_name),
    }
