"""The policy's preflight: checks of a valid ``policy`` section against what lies outside
the config -- the model's files, its vocabulary, the optimizer and scheduler classes.

They are not part of the schema (a schema reads no files and imports nothing): ``dualrl
config`` and the start of ``dualrl grpo|sft|dpo`` run them after validation
(:func:`preflight_errors`), ``Policy`` runs the model checks again before any worker starts,
and each worker once more on the model it actually loaded.  What cannot be known offline is
skipped: a vocabulary comes from a built-in model's shape or a local ``config.json``, never
from the hub.  Backends are never imported here (``core/`` does not import ``backends/``):
how they resolve class names is mirrored below, and ``tests/unit/config/test_config_honesty.py``
holds the mirror to the backends' own tables.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from typing import TYPE_CHECKING, Any

from core.config import join_path
from core.models.builtin import BUILTIN_MODELS, PREFIX
from core.policy.config import PolicyConfig
from core.policy.exact_numerics import check_exact_model

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase


def preflight_errors(policy: PolicyConfig) -> list[str]:
    """Errors of a valid ``policy`` section against its model and its classes, each starting
    with the dotted path of the field at fault."""
    return _token_id_errors(policy) + _class_errors(policy)


def absolute_model_paths(policy: PolicyConfig) -> PolicyConfig:
    """A copy of the policy section whose local model / tokenizer paths are absolute: Ray
    workers and engines run in their own working directory, so ``models/run1`` must be
    resolved where the user wrote it, on the driver.  Hub ids and built-ins are unchanged."""
    cfg = policy.model_copy(deep=True)
    cfg.model_name = _absolute(cfg.model_name)
    cfg.tokenizer.name = _absolute(cfg.tokenizer.name)
    if cfg.generation is not None and cfg.generation.model_name:
        cfg.generation.model_name = _absolute(cfg.generation.model_name)
    adapter = cfg.lora.adapter_path
    if adapter is not None and os.path.isdir(os.path.expanduser(adapter)):  # a directory here, even "adapter"
        cfg.lora.adapter_path = os.path.abspath(os.path.expanduser(adapter))
    return cfg


def _absolute(name: str) -> str:
    if not name.startswith(PREFIX) and looks_like_local_path(name) and os.path.exists(os.path.expanduser(name)):
        return os.path.abspath(os.path.expanduser(name))
    return name


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


def check_tokenizer_fits(
    tokenizer: PreTrainedTokenizerBase | None, model_config: PreTrainedConfig, model_name: str
) -> None:
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


def check_tensor_parallel_fits(model_config: PreTrainedConfig, tp: int, field: str) -> None:
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


#: The field every backend's tensor-parallel size comes from (what a refusal names).
TENSOR_PARALLEL_FIELD = "policy.parallel.tensor_parallel_size"


def preflight_model_checks(policy: PolicyConfig, tokenizer: PreTrainedTokenizerBase | None) -> PreTrainedConfig:
    """Tokenizer vs vocab and tp vs heads, from the model's config alone; returns the config."""
    from transformers import AutoConfig

    name = policy.model_name
    check_model_path(name, "policy.model_name")
    try:
        model_config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise ValueError(f"policy.model_name={name!r}: cannot read its HF config: {err}") from err
    check_tokenizer_fits(tokenizer, model_config, name)
    check_tensor_parallel_fits(model_config, policy.parallel.tensor_parallel_size, TENSOR_PARALLEL_FIELD)
    check_lora_targets(policy, model_config)
    check_sliding_window_layouts(model_config, policy)
    check_moe_options(model_config, policy)
    check_exact_model(model_config, policy)
    problems = [f"{join_path('policy', p)}: {m}" for p, m in policy.spec.model_checks(policy, model_config)]
    if problems:
        raise ValueError("; ".join(problems))
    return model_config


def check_lora_targets(policy: PolicyConfig, model_config: PreTrainedConfig) -> None:
    """Every ``policy.lora.target_modules`` entry names linears of the model (read from its
    modules on the meta device), and none names a mixture of experts' fused expert
    projections; else a ValueError naming the entry and what the model has."""
    if not policy.lora.enabled:
        return
    from core.models.lora import expert_errors, model_parts, target_errors

    linears, experts = model_parts(model_config)
    all_linear = policy.lora.target_modules == "all-linear"
    model_type = model_config.model_type
    errors = [] if all_linear else expert_errors(experts, policy.lora.targets, model_type)
    errors = errors or target_errors(linears, policy.lora.targets, model_type, all_linear)
    if errors:
        raise ValueError("; ".join(errors))


def check_sliding_window_layouts(model_config: PreTrainedConfig, policy: PolicyConfig) -> None:
    """Refuse the row layouts that would drop a model's sliding window on a backend whose spec
    says its packed and context-parallel rows do not keep it (``sliding_window_rows``).

    The torch backends' packed and context-parallel rows reach HF as one explicit 4-D mask,
    which HF uses as is for every layer (its per-layer-type masks are built only from a 2-D
    mask), so sliding-window layers (``layer_types`` "sliding_attention", e.g. Gemma 3) would
    attend past their window; a backend that bands its sliding layers by token positions in
    every layout is not refused.
    """
    spec = policy.spec
    if spec.sliding_window_rows or "sliding_attention" not in (getattr(model_config, "layer_types", None) or ()):
        return
    model_type = getattr(model_config, "model_type", None)
    why = f"model_type {model_type!r} has sliding-window layers (layer_types 'sliding_attention'), which"
    if policy.sequence_packing.enabled:
        raise ValueError(
            f"policy.sequence_packing.enabled: {why} the {spec.name} backend's packed rows would attend "
            "past the window; disable packing"
        )
    cp = policy.parallel.context_parallel_size
    if cp > 1:
        raise ValueError(
            f"policy.parallel.context_parallel_size={cp}: {why} the {spec.name} backend's context-parallel rows "
            "would attend past the window; use context_parallel_size=1"
        )


def check_moe_options(model_config: PreTrainedConfig, policy: PolicyConfig) -> None:
    """``policy.moe`` against the model: router options on a dense model are refused, and an
    expert-parallel size that does not divide a MoE's experts."""
    from core.losses.router_aux import moe_top_k

    ep = policy.parallel.expert_parallel_size
    if moe_top_k(model_config) is not None:
        experts = getattr(model_config, "num_experts", None)
        if isinstance(experts, int) and experts % ep:
            raise ValueError(
                f"policy.parallel.expert_parallel_size={ep} does not divide the model's num_experts={experts} "
                "(each expert-parallel rank runs whole experts)"
            )
        return
    moe = policy.moe
    asked = [
        f"{field}={value}"
        for field, value, on in (
            ("moe.router_aux_loss_coef", moe.router_aux_loss_coef, bool(moe.router_aux_loss_coef)),
            ("moe.log_routing_agreement", "true", moe.log_routing_agreement),
            ("moe.routing_replay.enabled", "true", moe.routing_replay.enabled),
            ("parallel.expert_parallel_size", ep, ep != 1),
        )
        if on
    ]
    if asked:
        model_type = getattr(model_config, "model_type", None)
        raise ValueError(
            f"policy.{asked[0]}: model_type {model_type!r} has no mixture-of-experts router (num_experts_per_tok)"
        )


# ----------------------------------------------------------------------------- vocabulary
def model_vocab_size(name: str) -> int | None:
    """``vocab_size`` of model ``name`` when it is known offline -- a built-in model, or a
    local directory with a ``config.json`` (``text_config`` included) -- else None."""
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


def _token_id_errors(policy: PolicyConfig) -> list[str]:
    """Stop / pad token ids the generation model cannot produce or embed.

    A stop id beyond the vocabulary can never be sampled, so it would never stop a row (HF
    and JAX ignore it silently); a pad id beyond it breaks the logprob pass over the outputs.
    """
    gen = policy.generation
    if gen is None:
        return []
    name = gen.model_name or policy.model_name
    vocab = model_vocab_size(name)
    if vocab is None:
        return []
    ids: list[tuple[str, int | None]] = [
        (f"policy.generation.stop_token_ids[{i}]", t) for i, t in enumerate(gen.stop_token_ids or [])
    ]
    ids.append(("policy.generation.pad_token_id", gen.pad_token_id))
    return [
        f"{path}: {token} is outside the vocabulary of {name} (vocab_size {vocab}, ids 0..{vocab - 1})"
        for path, token in ids
        if token is not None and token >= vocab
    ]


# ----------------------------------------------------------------------------- classes
def _class_errors(policy: PolicyConfig) -> list[str]:
    """Optimizer and scheduler names resolved the way the configured backend resolves them: a
    backend whose spec lists the classes it maps (``optimizers`` / ``schedulers``) accepts only
    those; the others import the dotted path."""
    spec = policy.spec
    named: list[tuple[str, str, tuple[str, ...] | None]] = []
    if policy.optimizer is not None:
        named.append(("policy.optimizer.name", policy.optimizer.name, spec.optimizers))
    for i, entry in enumerate(policy.scheduler or []):
        if entry.name is not None:
            named.append((f"policy.scheduler[{i}].name", entry.name, spec.schedulers))
    errors = []
    for path, name, mapped in named:
        if mapped is not None:
            problem = (
                None
                if name in mapped
                else f"{name!r} is not supported by the {spec.name} backend; choose among {list(mapped)}"
            )
        else:
            problem = import_error(name)
        if problem is not None:
            errors.append(f"{path}: {problem}")
    return errors


def import_error(path: str) -> str | None:
    """Why ``"pkg.module.Name"`` cannot be imported (None when it can): the rule of a backend
    that imports its classes by path (``import_object``), run on the driver."""
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
