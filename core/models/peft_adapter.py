"""Reading a PEFT LoRA adapter directory: its files, the PEFT features we refuse, its tensors.

A PEFT adapter directory holds ``adapter_config.json`` (PEFT's ``LoraConfig`` fields) and
``adapter_model.safetensors`` with keys ``base_model.model.<module>.lora_A.weight`` (A [r, in])
and ``...lora_B.weight`` (B [out, r]).  This module knows the format only; comparing the adapter
with ``policy.lora`` and the model is ``core.policy.lora_adapter``'s job.  Every message names
the file (and the tensor) at fault.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, NamedTuple, NoReturn

import numpy as np

from core.models.lora import PEFT_PREFIX, split_adapter_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: PEFT's older pickle format: refused by name (unpickling a downloaded file runs its code).
PICKLE_FILE = "adapter_model.bin"

#: ``adapter_config.json`` fields of PEFT features that change what the adapter computes (or
#: which modules / layers it covers) and that the backends do not implement.  A field that is
#: absent or off (null, false, "none", empty) is fine; any other value is refused by name.
UNSUPPORTED_FEATURES = (
    "use_dora",
    "bias",
    "lora_bias",
    "modules_to_save",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "exclude_modules",
    "fan_in_fan_out",
    "layer_replication",
    "trainable_token_indices",
    "target_parameters",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
    "velora_config",
    "monteclora_config",
)


class AdapterFiles(NamedTuple):
    """The two files of an adapter directory, as local paths."""

    config: str
    weights: str


def feature_errors(config: Mapping[str, Any], where: str) -> list[str]:
    """The unsupported PEFT features ``config`` (an ``adapter_config.json``) turns on, and a
    ``peft_type`` other than LORA, each naming the field and ``where`` (the file)."""
    errors = []
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        errors.append(f"{where}: peft_type {peft_type!r} is not supported (LoRA adapters only: 'LORA')")
    for field in UNSUPPORTED_FEATURES:
        value = config.get(field)
        if not _is_off(value):
            errors.append(f"{where}: {field}={value!r} is not supported (only plain LoRA on linear modules)")
    return errors


def _is_off(value: Any) -> bool:
    """null, false, ``"none"`` (``bias``) or empty; not ``0`` (``layers_to_transform: 0`` is layer 0)."""
    return value is None or value is False or (isinstance(value, (str, list, dict)) and value in ("", "none", [], {}))


def tensor_errors(
    found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], where: str
) -> list[str]:
    """Differences between the adapter file's tensors (``found``: PEFT key -> shape) and the
    adapter weights the model and ``policy.lora`` call for (``expected``: backend name ->
    shape): missing, unexpected and wrongly shaped tensors, each named with both shapes."""
    have = {key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key: key for key in found}
    errors = []
    missing = [PEFT_PREFIX + n for n in expected if n not in have]
    if missing:
        errors.append(f"{where}: {len(missing)} adapter tensor(s) missing: {_some(missing)}")
    extra = [key for name, key in have.items() if name not in expected]
    if extra:
        errors.append(
            f"{where}: {len(extra)} unexpected tensor(s) (not an adapter of a targeted module): {_some(extra)}"
        )
    for name, shape in expected.items():
        key = have.get(name)
        if key is not None and tuple(found[key]) != tuple(shape):
            errors.append(f"{where}: tensor {key}: expected shape {list(shape)}, found {list(found[key])}")
    return errors


def _some(names: list[str], n: int = 4) -> str:
    shown = ", ".join(names[:n])
    return shown + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def read_config(path: str) -> dict[str, Any]:
    """``adapter_config.json`` as a dict; a ValueError naming the file if it is not one."""
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot read the adapter config: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def read_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of a safetensors file, from its header alone (no tensor is read)."""
    from safetensors import safe_open

    with safe_open(path, framework="np") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}


def read_adapters(path: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{module path: (A [r, in], B [out, r])}`` float32 from an ``adapter_model.safetensors``
    (read through torch: PEFT writes bf16 / fp16 files numpy cannot hold)."""
    from safetensors.torch import load_file

    parts: dict[str, dict[str, np.ndarray]] = {}
    for key, tensor in load_file(path).items():
        split = split_adapter_name(key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key)
        if split is None:
            raise ValueError(f"{path}: tensor {key} is not a LoRA A / B weight")
        parts.setdefault(split[0], {})[split[1]] = tensor.float().numpy()
    incomplete = sorted(m for m, p in parts.items() if len(p) != 2)
    if incomplete:
        raise ValueError(f"{path}: modules with only one of lora_A / lora_B: {_some(incomplete)}")
    return {module: (p["A"], p["B"]) for module, p in parts.items()}


def local_files(directory: str) -> AdapterFiles | None:
    """The adapter files in a local ``directory``: None when it has no ``adapter_config.json``."""
    config = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(config):
        return None
    weights = os.path.join(directory, WEIGHTS_FILE)
    return AdapterFiles(
        config,
        weights
        if os.path.isfile(weights)
        else no_weights(directory, pickled=os.path.isfile(os.path.join(directory, PICKLE_FILE))),
    )


def no_weights(where: str, pickled: bool) -> NoReturn:
    """Raise why ``where`` (a directory or hub id) has no usable weights file."""
    if pickled:
        raise ValueError(
            f"{where}/{PICKLE_FILE}: pickled adapter weights are not read (loading a pickle runs code); "
            f"save the adapter as {WEIGHTS_FILE} (PEFT: save_pretrained(..., safe_serialization=True))"
        )
    raise FileNotFoundError(f"{where}: no {WEIGHTS_FILE} beside {CONFIG_FILE}")
