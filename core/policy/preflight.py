"""Checks against the model's HF config that must fail before any worker starts.

They read only ``config.json`` (``AutoConfig``), so a tokenizer that does not fit the model,
or a tensor-parallel size that does not divide its heads, is reported in milliseconds by the
driver -- and again by each worker, which also runs them on the model it actually loaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any


def absolute_model_paths(policy_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the policy section whose local model / tokenizer paths are absolute: Ray
    workers and engines run in their own working directory, so ``models/run1`` must be
    resolved where the user wrote it, on the driver.  Hub ids and built-ins are unchanged."""
    cfg = dict(policy_cfg)

    def resolve(name: Any) -> Any:
        if isinstance(name, (str, os.PathLike)) and not os.fspath(name).startswith("builtin:"):
            name = os.fspath(name)
            if looks_like_local_path(name) and os.path.exists(os.path.expanduser(name)):
                return os.path.abspath(os.path.expanduser(name))
        return name

    cfg["model_name"] = resolve(cfg.get("model_name"))
    for section in ("tokenizer", "generation"):
        key = "name" if section == "tokenizer" else "model_name"
        if isinstance(cfg.get(section), Mapping) and cfg[section].get(key):
            cfg[section] = {**cfg[section], key: resolve(cfg[section][key])}
    return cfg


def looks_like_local_path(name: str) -> bool:
    """Whether ``name`` (a ``model_name`` / tokenizer name) means a directory on this machine
    rather than a hub id (``"gpt2"``, ``"org/name"``).

    Local: it starts with ``/``, ``./``, ``../`` or ``~`` (or is ``.`` / ``..``); it has more
    than two ``/``-separated parts (a hub id has at most ``org/name``); or its first part
    exists here (``models/my-run`` next to a ``models`` directory).  ``org/name`` whose
    ``org`` is not a local directory stays a hub id.
    """
    if name in (".", "..") or name.startswith(("/", "./", "../", "~")):
        return True
    seps = [os.sep] + ([os.altsep] if os.altsep else [])
    if not any(sep in name for sep in seps):
        return False
    parts = [p for p in re.split("|".join(re.escape(s) for s in seps), name) if p]
    return len(parts) > 2 or (bool(parts) and os.path.exists(parts[0]))


def check_model_path(name: Any, field: str) -> None:
    """``{field}: no such directory: PATH`` for a local-looking ``name`` that does not exist
    (instead of transformers' "Repo id must be in the form 'repo_name' or
    'namespace/repo_name'", or a worker dying on it).  Built-ins and hub ids pass."""
    if not isinstance(name, (str, os.PathLike)):
        return
    name = os.fspath(name)
    if name.startswith("builtin:") or not looks_like_local_path(name):
        return
    path = os.path.expanduser(name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{field}: no such directory: {name}")
    if not os.path.isdir(path):
        raise NotADirectoryError(f"{field}: not a directory: {name}")


def check_tokenizer_fits(tokenizer: Any, model_config: Any, model_name: str) -> None:
    """A tokenizer that can emit ids >= the model's vocab_size would index out of the
    embedding (a device assert on GPU, garbage or a crash on CPU): refuse it up front."""
    if tokenizer is None:
        return
    n_tokens = len(tokenizer)
    if n_tokens > model_config.vocab_size:
        raise ValueError(
            f"tokenizer has {n_tokens} tokens but model {model_name!r} has vocab_size "
            f"{model_config.vocab_size}: token ids >= {model_config.vocab_size} cannot be embedded"
        )


def check_tensor_parallel_fits(model_config: Any, tp: int, field: str) -> None:
    """Every dimension tensor parallelism shards must be divisible by ``tp``.

    Except the vocabulary: the backends pad it (``core.policy.vocab_padding``), so a
    vocab_size such as GPT-2's 50257 trains under any tp.
    """
    if tp <= 1:
        return
    dims = {
        "num_attention_heads": getattr(model_config, "num_attention_heads", None),
        "num_key_value_heads": getattr(model_config, "num_key_value_heads", None),
        "intermediate_size": getattr(model_config, "intermediate_size", None),
    }
    bad = {k: v for k, v in dims.items() if v is not None and v % tp}
    if bad:
        raise ValueError(f"{field}={tp} does not divide the model's " + ", ".join(f"{k}={v}" for k, v in bad.items()))


#: backend -> (config section, field) of its tensor-parallel size.
TP_FIELDS = {"torch_dtensor": ("dtensor_cfg", "tensor_parallel_size"), "jax_pjit": ("jax_cfg", "tensor_parallel_size")}


def preflight_model_checks(policy_cfg: Mapping[str, Any], tokenizer: Any) -> Any:
    """Tokenizer vs vocab and tp vs heads, from the model's config alone; returns the config."""
    from transformers import AutoConfig

    name = policy_cfg["model_name"]
    check_model_path(name, "policy.model_name")
    try:
        model_config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise ValueError(f"policy.model_name={name!r}: cannot read its HF config: {err}") from err
    check_tokenizer_fits(tokenizer, model_config, name)
    if policy_cfg["backend"] in TP_FIELDS:
        section, key = TP_FIELDS[policy_cfg["backend"]]
        check_tensor_parallel_fits(model_config, policy_cfg[section][key], f"policy.{section}.{key}")
    return model_config
