"""``policy.lora.adapter_path``: a PEFT adapter as the starting point of LoRA training.

The driver resolves and checks the adapter before any worker starts (``check_lora_adapter``,
from ``Policy``): its config against ``policy.lora`` (r, lora_alpha, target_modules,
use_rslora must be equal -- the config stays the one description of the run, and an
ablation cannot silently pick up another rank), its base model against ``policy.model_name``,
the PEFT features it uses, and its tensors against the model's linears (names and shapes).
Each worker then reads the arrays (``starting_adapters``) and lays them out as it lays out
the seeded init, so sharding (TP, FSDP, JAX mesh) needs nothing new.  A resumed run reads
its adapters from the checkpoint, never from this file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from core.models.builtin import PREFIX
from core.models.lora import adapter_shapes, init_adapter, linear_module_shapes
from core.models.peft_adapter import (
    CONFIG_FILE,
    PICKLE_FILE,
    WEIGHTS_FILE,
    AdapterFiles,
    feature_errors,
    local_files,
    no_weights,
    read_adapters,
    read_config,
    read_shapes,
    tensor_errors,
)
from core.policy.config import LORA_TARGETS, LoRAConfig, PolicyConfig
from core.policy.preflight import check_model_path, looks_like_local_path

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

FIELD = "policy.lora.adapter_path"
#: ``(module, in_features, out_features) -> (A [r, in], B [out, r])`` float32.
AdapterSource = Callable[[str, int, int], tuple[np.ndarray, np.ndarray]]


def adapter_files(name: str) -> AdapterFiles:
    """The local files of adapter ``name``: a directory here, or a hub id fetched through
    transformers' ``cached_file`` (what ``from_pretrained`` resolves a model with)."""
    check_model_path(name, FIELD)
    path = os.path.expanduser(name)
    if looks_like_local_path(name) or os.path.isdir(path):
        files = local_files(path)
        if files is None:
            raise FileNotFoundError(f"{FIELD}: {name}: no {CONFIG_FILE} (not a PEFT adapter directory)")
        return files
    from transformers.utils import cached_file

    try:
        config = cached_file(name, CONFIG_FILE)
        weights = cached_file(name, WEIGHTS_FILE, _raise_exceptions_for_missing_entries=False)
        if weights is None:
            pickled = cached_file(name, PICKLE_FILE, _raise_exceptions_for_missing_entries=False) is not None
            no_weights(name, pickled)
    except OSError as err:
        raise ValueError(f"{FIELD}={name!r}: cannot fetch the adapter: {err}") from err
    assert config is not None and weights is not None  # cached_file raised otherwise
    return AdapterFiles(config, weights)


def config_errors(adapter: dict[str, Any], lora: LoRAConfig, where: str) -> list[str]:
    """``policy.lora`` fields that differ from the adapter's, and the PEFT features it uses."""
    errors = feature_errors(adapter, where)
    rank, alpha, rslora = adapter.get("r"), adapter.get("lora_alpha"), adapter.get("use_rslora", False)
    alpha_ok = isinstance(alpha, (int, float)) and math.isclose(float(alpha), lora.alpha, rel_tol=1e-9)
    checks = [
        ("rank", lora.rank, "r", rank, rank == lora.rank),
        ("alpha", lora.alpha, "lora_alpha", alpha, alpha_ok),
        ("use_rslora", lora.use_rslora, "use_rslora", rslora, rslora == lora.use_rslora),
    ]
    errors += [
        f"policy.lora.{ours}={mine!r} but {where} has {theirs}={value!r}: set policy.lora.{ours} to the adapter's"
        for ours, mine, theirs, value, ok in checks
        if not ok
    ]
    targets = adapter.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        errors.append(f"{where}: target_modules={targets!r} (a regular expression) is not supported: list module names")
    elif targets is not None:
        theirs = set(LORA_TARGETS) if targets == "all-linear" else set(targets)
        if theirs != set(lora.targets):
            errors.append(
                f"policy.lora.target_modules={sorted(lora.targets)} but {where} has target_modules={sorted(theirs)}: "
                "set policy.lora.target_modules to the adapter's"
            )
    return errors


def base_model_error(adapter_base: Any, model_name: str, where: str) -> str | None:
    """Why an adapter trained on ``adapter_base`` does not belong to ``model_name`` (None if it
    does, or if the adapter names no base).  Hub ids compare case-insensitively; two local
    paths by their real path; a local path and a hub id ``org/name`` match when the path is
    the hub cache of that id (``models--org--name``) or a directory called ``name``."""
    if not adapter_base or _same_model(str(adapter_base), model_name):
        return None
    return (
        f"{where}: base_model_name_or_path={adapter_base!r} but policy.model_name={model_name!r}; "
        "set policy.lora.adapter_check_base_model=false to load it on this model anyway"
    )


def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    if a.startswith(PREFIX) or b.startswith(PREFIX):
        return False
    local_a, local_b = looks_like_local_path(a), looks_like_local_path(b)
    if local_a and local_b:
        return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))
    if not local_a and not local_b:
        return a.lower() == b.lower()
    path, hub_id = (a, b) if local_a else (b, a)
    parts = os.path.normpath(os.path.realpath(os.path.expanduser(path))).split(os.sep)
    cache_dir = "models--" + hub_id.replace("/", "--")
    return cache_dir.lower() in (p.lower() for p in parts) or parts[-1].lower() == hub_id.rsplit("/", 1)[-1].lower()


def adapter_errors(files: AdapterFiles, policy: PolicyConfig, linears: dict[str, tuple[int, int]]) -> list[str]:
    """Every reason the adapter ``files`` cannot start ``policy``'s LoRA on a model with
    ``linears`` (``{module: (out, in)}``)."""
    lora = policy.lora
    adapter = read_config(files.config)
    errors = config_errors(adapter, lora, files.config)
    if lora.adapter_check_base_model:
        mismatch = base_model_error(adapter.get("base_model_name_or_path"), policy.model_name, files.config)
        errors += [mismatch] if mismatch else []
    expected = adapter_shapes(linears, lora.targets, lora.rank)
    return errors + tensor_errors(read_shapes(files.weights), expected, files.weights)


def check_lora_adapter(policy: PolicyConfig, model_config: PreTrainedConfig) -> None:
    """On the driver, before any worker starts: a ValueError listing every problem of
    ``policy.lora.adapter_path`` against the config and the model (nothing when unset)."""
    if not policy.lora.enabled or policy.lora.adapter_path is None:
        return
    errors = adapter_errors(adapter_files(policy.lora.adapter_path), policy, linear_module_shapes(model_config))
    if errors:
        raise ValueError(f"{FIELD}={policy.lora.adapter_path!r}:\n  " + "\n  ".join(errors))


def starting_adapters(lora: LoRAConfig, resume: bool = False) -> AdapterSource:
    """Where each adapter starts: ``policy.lora.adapter_path``'s arrays, else the seeded init.
    ``resume``: the checkpoint about to be loaded overwrites them, so the file is not read."""
    if lora.adapter_path is None or resume:
        return lambda module, n_in, n_out: init_adapter(module, n_in, n_out, lora.rank, lora.init_seed)
    files = adapter_files(lora.adapter_path)
    arrays = read_adapters(files.weights)

    def from_file(module: str, n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
        if module not in arrays:  # the driver's check makes this unreachable unless the file changed
            raise ValueError(f"{files.weights}: no adapter for module {module}")
        a, b = arrays[module]
        if a.shape != (lora.rank, n_in) or b.shape != (n_out, lora.rank):
            raise ValueError(
                f"{files.weights}: {module}: expected A {[lora.rank, n_in]} and B {[n_out, lora.rank]}, "
                f"found {list(a.shape)} and {list(b.shape)}"
            )
        return a, b

    return from_file
