"""Checks of config values against what lies outside the config: the model's vocabulary and
the optimizer / scheduler classes the policy names.

They run with the rest of the validation (``validate_master_config``: ``dualrl config`` and
the start of ``dualrl grpo|sft|dpo``), so a value the workers would die on -- or, worse,
silently ignore -- is reported on the driver before any worker starts.

What cannot be known offline is skipped: the vocabulary comes from a built-in model's shape
or a local model directory's ``config.json``, never from the hub.  Backends are never imported
here (``core/`` does not import ``backends/``): how they resolve class names is mirrored
below, and ``tests/unit/test_config_honesty.py`` holds the mirror to the backends' own tables.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["JAX_OPTIMIZERS", "JAX_SCHEDULERS", "external_errors", "model_vocab_size", "import_error"]

#: The torch optimizers / schedulers the jax_pjit backend reproduces with optax
#: (``backends.jax_pjit.optim.SUPPORTED_OPTIMIZERS`` / ``SUPPORTED_SCHEDULERS``).
JAX_OPTIMIZERS = ("torch.optim.AdamW", "torch.optim.Adam", "torch.optim.SGD")
JAX_SCHEDULERS = ("torch.optim.lr_scheduler.LinearLR", "torch.optim.lr_scheduler.ConstantLR")


def external_errors(cfg: Mapping[str, Any]) -> list[str]:
    """Errors of a well-typed config's ``policy`` section against its model and its classes."""
    policy = cfg.get("policy")
    if not isinstance(policy, Mapping):
        return []
    return _token_id_errors(policy) + _class_errors(policy)


# ----------------------------------------------------------------------------- vocabulary
def model_vocab_size(name: Any) -> int | None:
    """``vocab_size`` of model ``name`` when it is known offline -- a built-in model, or a
    local directory with a ``config.json`` (``text_config`` included) -- else None."""
    from core.models.builtin import BUILTIN_MODELS, PREFIX

    if not isinstance(name, str):
        return None
    if name.startswith(PREFIX):
        spec = BUILTIN_MODELS.get(name[len(PREFIX) :])
        return None if spec is None else int(spec[0]["vocab_size"])
    config_file = os.path.join(os.path.expanduser(name), "config.json")
    if not os.path.isfile(config_file):
        return None  # a hub id (or a bad path, which the run's own path check names)
    try:
        with open(config_file) as f:
            hf_config = json.load(f)
    except (OSError, ValueError):
        return None  # unreadable here: the workers' loader reports it with its own message
    vocab = hf_config.get("vocab_size", (hf_config.get("text_config") or {}).get("vocab_size"))
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def _token_id_errors(policy: Mapping[str, Any]) -> list[str]:
    """Stop / pad token ids the generation model cannot produce or embed.

    A stop id beyond the vocabulary can never be sampled, so it would never stop a row (HF
    and JAX ignore it silently); a pad id beyond it breaks the logprob pass over the outputs.
    """
    gen = policy.get("generation")
    if not isinstance(gen, Mapping):
        return []
    name = gen.get("model_name") or policy.get("model_name")
    vocab = model_vocab_size(name)
    if vocab is None:
        return []
    stop_ids = gen.get("stop_token_ids")
    stop_ids = stop_ids if isinstance(stop_ids, list) else []  # a wrong type is the type walk's to report
    ids = [(f"policy.generation.stop_token_ids[{i}]", t) for i, t in enumerate(stop_ids)]
    ids.append(("policy.generation.pad_token_id", gen.get("pad_token_id")))
    return [
        f"{path}: {token} is outside the vocabulary of {name} (vocab_size {vocab}, ids 0..{vocab - 1})"
        for path, token in ids
        if isinstance(token, int) and not isinstance(token, bool) and token >= vocab
    ]


# ----------------------------------------------------------------------------- classes
def _class_errors(policy: Mapping[str, Any]) -> list[str]:
    """Optimizer and scheduler names resolved the way the configured backend resolves them:
    the torch backends import the dotted path; jax_pjit accepts only the classes it reproduces."""
    named = []
    optimizer = policy.get("optimizer")
    if isinstance(optimizer, Mapping) and isinstance(optimizer.get("name"), str):
        named.append(("policy.optimizer.name", optimizer["name"], JAX_OPTIMIZERS))
    scheduler = policy.get("scheduler")
    for i, entry in enumerate(scheduler if isinstance(scheduler, list) else []):
        if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
            named.append((f"policy.scheduler[{i}].name", entry["name"], JAX_SCHEDULERS))
    errors = []
    for path, name, jax_names in named:
        if policy.get("backend") == "jax_pjit":
            problem = (
                None
                if name in jax_names
                else (f"{name!r} is not supported by the jax_pjit backend; choose among {list(jax_names)}")
            )
        else:
            problem = import_error(name)
        if problem is not None:
            errors.append(f"{path}: {problem}")
    return errors


def import_error(path: str) -> str | None:
    """Why ``"pkg.module.Name"`` cannot be imported (None when it can): the torch backends'
    ``import_object`` rule, run on the driver."""
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        return f"{path!r} is not a dotted import path like 'torch.optim.AdamW'"
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        return f"cannot import {path!r}: {err}"
    except Exception as err:  # noqa: BLE001 - a user's module failing at import is reported, not raised
        return f"cannot import {path!r}: importing {module_name!r} raised {type(err).__name__}: {err}"
    if not hasattr(module, attr):
        return f"cannot import {path!r}: module {module_name!r} has no attribute {attr!r}"
    return None
