"""Adapter-only LoRA refit (``policy.lora.refit``): what the engine expects and how it
installs the adapter.

The engine holds the frozen base weights, sent once (a ``base`` stream: the normal refit
protocol, unmerged weights under the HF names), and serves every request with one LoRA
adapter that later refits replace in place (an ``adapter`` stream: A [r, in] and B [out, r]
under PEFT's names, ``base_model.model.<module>.lora_A.weight``).  The adapter travels over
the same transports and buckets as weights do; the engine collects the whole stream and
installs it at the end of the refit (between generate calls, never half-updated), without
a file: vLLM's ``LoRAModel.from_lora_tensors`` on the tensors received.

Engine-side code (vLLM imported inside the functions): runs in vLLM's workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from core.models.lora import adapted_modules, adapter_names, peft_name
from core.refit.manifest import RefitError, RefitManifest, TensorSpec, dtype_name

#: The one adapter an adapter-refit engine serves: vLLM's ``LoRARequest`` name and id.
ADAPTER_NAME = "dualrl-policy"
ADAPTER_ID = 1
#: ``LoRARequest.lora_path`` must be non-empty; vLLM reads it only for an adapter it has not
#: loaded, and the engine refuses to generate before the first adapter is installed.
ADAPTER_PATH = "dualrl-in-memory-adapter"


def adapter_manifest(hf_config: Any, rank: int, targets: Sequence[str], dtype: Any) -> RefitManifest:
    """The adapter stream of a model of ``hf_config``: A and B of every targeted linear."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    name = dtype_name(dtype)
    specs: dict[str, TensorSpec] = {}
    for module in adapted_modules(linears, targets):
        name_a, name_b = adapter_names(module)
        specs[peft_name(name_a)] = TensorSpec((rank, linears[module].in_features), name)
        specs[peft_name(name_b)] = TensorSpec((linears[module].out_features, rank), name)
    if not specs:
        raise RefitError(f"adapter refit: no linear of model_type {hf_config.model_type!r} matches {list(targets)}")
    return RefitManifest(specs)


def install_adapter(model_runner: Any, tensors: Mapping[str, Any], peft_config: Mapping[str, Any]) -> None:
    """Replace the engine's adapter (id ``ADAPTER_ID``) by ``tensors`` (PEFT names), what
    vLLM's ``WorkerLoRAManager.add_adapter`` does with ``load_inplace=True``, from memory.

    Called between generate calls: the next request activates the new adapter."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = getattr(model_runner, "lora_manager", None)
    if manager is None:
        raise RefitError("adapter refit into an engine started without LoRA (enable_lora)")
    helper = PEFTHelper.from_dict(dict(peft_config, vllm_max_position_embeddings=manager.max_position_embeddings))
    helper.validate_legal(manager.lora_config)  # rank within max_lora_rank, no unsupported features
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        ADAPTER_ID,
        dict(tensors),
        helper,
        device="cpu",  # as vLLM's own loader: activation copies it into the engine's LoRA buffers
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    manager._adapter_manager.remove_adapter(ADAPTER_ID)  # deactivates it: its slot is rewritten
    manager._adapter_manager.add_adapter(lora)
