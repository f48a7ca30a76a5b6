"""LoRA's math, once for every backend: initialisation, scale, merge, names, PEFT files.

An adapted linear computes ``y = x W^T + scale * (x A^T) B^T`` with A [r, in] and B [out, r]
(HF / PEFT layout, whatever a backend stores).  What must be identical on every backend
lives here and imports no backend:

* the initial adapters -- PEFT's default: A ~ kaiming-uniform(a=sqrt(5)) as ``nn.Linear``
  initialises its weight, i.e. U(-1/sqrt(in), 1/sqrt(in)); B = 0 -- drawn with numpy from
  ``(init_seed, module name)``, so every backend starts from the same
  arrays whatever their ranks, meshes or parameter order;
* the scale ``alpha / rank`` (``alpha / sqrt(rank)`` with rsLoRA);
* the merge ``W' = W + scale * B @ A`` (in float32, cast once), and a stream transform that
  merges ``(name, tensor)`` pairs on the fly for refit and export;
* the names: a backend names an adapter ``<module>.lora_A.weight`` / ``.lora_B.weight`` (HF
  module path); a PEFT adapter file names it ``base_model.model.<module>.lora_A.weight``.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

#: The suffixes of an adapter's two weights under its module's path.
LORA_A, LORA_B = "lora_A.weight", "lora_B.weight"
#: What PEFT puts before a module path in ``adapter_model.safetensors``.
PEFT_PREFIX = "base_model.model."
#: Modules LoRA never adapts, even under "all-linear" (PEFT leaves the output layer alone).
NEVER_ADAPTED = ("lm_head",)
#: Module paths inside a mixture of experts' expert container are never adapted: transformers 5
#: fuses each layer's experts into 3-D parameters (Qwen3-MoE: ``mlp.experts.gate_up_proj``
#: [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]), not linears, so the torch backends cannot
#: wrap them; HF checkpoints -- and so the JAX backend's weight table -- still name them per
#: expert (``mlp.experts.0.gate_proj``): without this rule JAX alone picked those as targets.
EXPERTS = ".experts."
#: The MLP projections a user who names them on a mixture of experts means the experts by.
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def lora_scale(alpha: float, rank: int, use_rslora: bool = False) -> float:
    """PEFT's ``scaling``: ``alpha / rank``, or ``alpha / sqrt(rank)`` (rsLoRA)."""
    return float(alpha) / (math.sqrt(rank) if use_rslora else rank)


def init_adapter(
    module: str, in_features: int, out_features: int, rank: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(A [rank, in], B [out, rank])`` float32 of module ``module`` (its HF path, e.g.
    ``model.layers.0.self_attn.q_proj``): A uniform in +-1/sqrt(in) (kaiming-uniform with
    a=sqrt(5), PEFT's default), B zeros, so the adapted model starts as the base model.
    The stream is seeded by ``seed`` and the name alone (crc32: stable across processes)."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, zlib.crc32(module.encode())]))
    bound = 1.0 / math.sqrt(in_features)
    a = rng.uniform(-bound, bound, size=(rank, in_features)).astype(np.float32)
    return a, np.zeros((out_features, rank), np.float32)


def merge(weight: Any, a: Any, b: Any, scale: float) -> Any:
    """``W + scale * B @ A`` for torch tensors or numpy / jax arrays, in the weight's dtype."""
    return weight + scale * (b @ a)


# ----------------------------------------------------------------------------- names
def adapter_names(module: str) -> tuple[str, str]:
    """The backend (state-dict) names of a module's A and B."""
    return f"{module}.{LORA_A}", f"{module}.{LORA_B}"


def peft_name(name: str) -> str:
    """``model.layers.0.self_attn.q_proj.lora_A.weight`` -> PEFT's adapter-file key."""
    return PEFT_PREFIX + name


def split_adapter_name(name: str) -> tuple[str, str] | None:
    """``(module, "A" | "B")`` of an adapter weight's name, None for any other name."""
    for suffix, part in ((LORA_A, "A"), (LORA_B, "B")):
        if name.endswith("." + suffix):
            return name[: -len(suffix) - 1], part
    return None


def is_adapter_name(name: str) -> bool:
    return split_adapter_name(name) is not None


def adapted_modules(linear_names: Iterable[str], targets: Sequence[str]) -> list[str]:
    """The module paths among ``linear_names`` whose last part is one of ``targets`` (never an
    expert's: see ``EXPERTS``)."""
    return [
        n
        for n in linear_names
        if n.rsplit(".", 1)[-1] in targets and n.rsplit(".", 1)[-1] not in NEVER_ADAPTED and EXPERTS not in n
    ]


def target_errors(
    linear_names: Iterable[str], targets: Sequence[str], model_type: str, all_linear: bool = False
) -> list[str]:
    """``policy.lora.target_modules`` entries that name no linear of the model, each listing the
    linear module names the model does have.  ``all_linear``: "all-linear" means every linear
    of the model (PEFT's meaning: lm_head and fused experts aside), so a model that lacks some
    of ``targets`` passes (Qwen3-MoE without dense layers: attention only) and one with a
    linear outside ``targets`` (Phi's ``fc1``) is refused, naming it."""
    names = list(linear_names)
    have = sorted({n.rsplit(".", 1)[-1] for n in names if EXPERTS not in n} - set(NEVER_ADAPTED))
    if all_linear:
        left = [h for h in have if h not in targets]
        if left:
            return [
                f"policy.lora.target_modules: 'all-linear' on model_type {model_type!r} cannot adapt its linears "
                f"{left} (LoRA adapts {list(targets)}); list the modules to adapt"
            ]
        if not adapted_modules(names, targets):  # GPT-2: Conv1D layers, no nn.Linear but lm_head
            return [f"policy.lora.target_modules: 'all-linear' adapts nothing in model_type {model_type!r}: "
                    f"it has no linear module but lm_head"]  # fmt: skip
        return []
    return [
        f"policy.lora.target_modules: {t!r} is not a linear module of model_type {model_type!r}; "
        f"its linear modules are {have}"
        for t in targets
        if not adapted_modules(names, [t])
    ]


def expert_errors(experts: dict[str, tuple[int, ...]], targets: Sequence[str], model_type: str) -> list[str]:
    """Refuse naming an MLP projection on a model whose experts are fused (``experts``: the
    fused tensors by name, from :func:`model_parts`): the user means the experts, which
    LoRA cannot adapt here, and adapting only the dense layers' MLPs instead would be a silent
    change of meaning.  "all-linear" is not refused (PEFT's meaning: the linears there are)."""
    asked = [t for t in targets if t in EXPERT_PROJECTIONS]
    if not experts or not asked:
        return []
    first = next(iter(experts)).split(EXPERTS)[0]  # the first sparse layer's block: one example
    shown = ", ".join(f"{n} {list(shape)}" for n, shape in experts.items() if n.startswith(first + EXPERTS))
    return [
        f"policy.lora.target_modules: {asked} on model_type {model_type!r}, a mixture of experts: its experts "
        f"are fused 3-D parameters ({shown}, and so on per layer), not linears, so LoRA cannot adapt them; "
        "target the attention projections (q_proj, k_proj, v_proj, o_proj), or 'all-linear' (PEFT's meaning: "
        "attention and any dense MLP layers; experts and router are not adapted)"
    ]


def linear_module_names(hf_config: Any) -> list[str]:
    """Module paths of every ``nn.Linear`` of the HF causal LM ``hf_config`` describes, built
    on the meta device (no memory, no weights read)."""
    return list(linear_module_shapes(hf_config))


def linear_module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """``{module path: (out_features, in_features)}`` of every ``nn.Linear`` of the HF causal
    LM ``hf_config`` describes, built on the meta device."""
    return model_parts(hf_config)[0]


def model_parts(hf_config: Any) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, ...]]]:
    """``({linear module path: (out, in)}, {fused expert tensor name: shape})`` of the HF causal
    LM ``hf_config`` describes, from one meta-device build (no memory, no weights read); the
    second is empty for a dense model."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    linears = {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    experts = {n: tuple(p.shape) for n, p in model.named_parameters() if p.ndim == 3 and EXPERTS in n}
    return linears, experts


def adapter_shapes(
    linears: dict[str, tuple[int, int]], targets: Sequence[str], rank: int
) -> dict[str, tuple[int, ...]]:
    """``{backend name: shape}`` of every adapter weight a model with these linears has: A
    ``[rank, in]`` and B ``[out, rank]`` of each targeted module."""
    shapes: dict[str, tuple[int, ...]] = {}
    for module in adapted_modules(linears, targets):
        out_features, in_features = linears[module]
        name_a, name_b = adapter_names(module)
        shapes[name_a], shapes[name_b] = (rank, in_features), (out_features, rank)
    return shapes


# ----------------------------------------------------------------------------- merged streams
def merge_adapter_stream(
    stream: Iterable[tuple[str, Any]], modules: Iterable[str], scale: float, finish: Callable[[Any], Any]
) -> Iterator[tuple[str, Any]]:
    """The ``(hf_name, tensor)`` stream with every adapted ``<module>.weight`` replaced by its
    merge and the adapter weights dropped.  ``finish`` casts each outgoing tensor (the merge
    runs on what the stream carries: gather it in float32).  A base weight waits only for its
    own A and B (the backends gather them together), so little is held at a time."""
    modules = set(modules)
    held: dict[str, dict[str, Any]] = {}
    for name, tensor in stream:
        split = split_adapter_name(name)
        if split is None and not (name.endswith(".weight") and name[: -len(".weight")] in modules):
            yield name, finish(tensor)
            continue
        module, part = split if split is not None else (name[: -len(".weight")], "W")
        parts = held.setdefault(module, {})
        parts[part] = tensor
        if len(parts) == 3:
            del held[module]
            yield f"{module}.weight", finish(merge(parts["W"], parts["A"], parts["B"], scale))
    if held:
        raise RuntimeError(f"LoRA merge: incomplete adapters at the end of the stream: {sorted(held)}")


# ----------------------------------------------------------------------------- PEFT files
def peft_adapter_config(
    base_model: str, rank: int, alpha: float, dropout: float, targets: Sequence[str], use_rslora: bool
) -> dict[str, Any]:
    """``adapter_config.json`` of a plain LoRA adapter on a causal LM (PEFT's field names)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(rank),
        "lora_alpha": float(alpha),
        "lora_dropout": float(dropout),
        "target_modules": sorted(targets),
        "use_rslora": bool(use_rslora),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def write_peft_adapter(path: str | os.PathLike, config: dict[str, Any], adapters: dict[str, Any]) -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT key names) into
    ``path``; ``adapters`` maps backend names (``<module>.lora_A.weight``) to torch tensors."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {peft_name(n): t.detach().to("cpu").contiguous() for n, t in adapters.items()}
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
