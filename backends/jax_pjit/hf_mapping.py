"""HF <-> JAX parameter names and layouts, declared once per family as a table.

Each family module declares its tables (``HF_TABLES``, e.g. ``models/llama.py``); each row
(``models.hf_table.Row``) is ``(HF name pattern, JAX state path pattern, transform)``; ``{i}``
stands for the layer index.  The same rows drive checkpoint import (``load_hf_weights``,
``from_pretrained``), export (``save_hf_checkpoint``) and refit (``jax_to_hf_tensors``
yields HF names and layouts).  Transforms are exact (transposes and reshapes only), so
``jax_to_hf_tensors(hf_to_jax_state(x, cfg), cfg) == x`` bit for bit.

Mixtures of experts: a row with ``{j}`` maps the checkpoint's one tensor per expert to row
``j`` of the stacked JAX kernel (``Entry.expert``; ``entry_value`` reads it).

Padded vocabulary: when ``cfg.padded_vocab_size > cfg.vocab_size`` (tensor parallelism
over a vocabulary it does not divide), the rows with a ``vocab_dim`` (embedding, lm_head)
are zero-padded along that JAX dim on import and cut back to ``vocab_size`` on export and
refit, so HF names *and shapes* never see the padding.

Transforms (HF layout -> JAX layout, JAX shapes from ``models.param_shapes(cfg)``):
    embedding        [V, E]           -> [V, E]             (identity)
    norm             [E]              -> [E]                (identity)
    linear           [out, in]        -> [in, *out_dims]    (q/k/v: out = heads x head_dim)
    linear_heads_in  [out, H*D]       -> [H, D, out]        (o_proj: input split into heads)
    bias_heads       [H*D]            -> [H, D]

Reading checkpoints: ``safetensors.safe_open(..., framework="np")`` (safetensors >= 0.6)
returns bf16 tensors as ``ml_dtypes.bfloat16`` numpy arrays, which ``jnp.asarray``
accepts directly; no torch involved.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from backends.jax_pjit.models import ModelConfig, abstract_model, config_from_hf, family_module, param_shapes, params_of
from backends.jax_pjit.models.hf_table import Row
from backends.jax_pjit.models.moe_dispatch import resolve_dispatch
from backends.jax_pjit.models.qwen3_moe import MoEConfig

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from backends.jax_pjit.models.llama import CausalLM

#: HF buffers that may sit in a checkpoint but are not parameters (recomputed from config).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
TIED_HF_NAME = "lm_head.weight"
EMBED_HF_NAME = "model.embed_tokens.weight"


# --------------------------------------------------------------------------- transforms


class Transform(NamedTuple):
    to_jax: Callable[[np.ndarray, tuple], np.ndarray]  # (hf array, jax shape) -> jax array
    # Reshapes and transposes only (no copy): the same function lays out a numpy array on
    # the host and a jax array on the devices (``hf_layout``, the refit stream).
    to_hf: Callable[[Any], Any]
    hf_shape: Callable[[tuple], tuple]  # jax shape -> hf shape


def _identity_shape(s: tuple) -> tuple:
    return tuple(s)


TRANSFORMS: dict[str, Transform] = {
    "embedding": Transform(lambda x, s: x, lambda x: x, _identity_shape),
    "norm": Transform(lambda x, s: x, lambda x: x, _identity_shape),
    # HF [out, in]  <->  JAX [in, *out_dims]
    "linear": Transform(
        lambda x, s: np.ascontiguousarray(x.T).reshape(s),
        lambda x: x.reshape(x.shape[0], -1).T,  # (in, out) -> (out, in)
        lambda s: (math.prod(s[1:]), s[0]),
    ),
    # HF [out, H*D]  <->  JAX [H, D, out]
    "linear_heads_in": Transform(
        lambda x, s: np.ascontiguousarray(x.T).reshape(s),
        lambda x: x.reshape(-1, x.shape[-1]).T,  # (H*D, out) -> (out, H*D)
        lambda s: (s[-1], math.prod(s[:-1])),
    ),
    # HF [H*D]  <->  JAX [H, D]
    "bias_heads": Transform(lambda x, s: x.reshape(s), lambda x: x.reshape(-1), lambda s: (math.prod(s),)),
}


class Entry(NamedTuple):
    hf_name: str
    jax_path: tuple  # e.g. ("layers", 0, "self_attn", "q_proj", "kernel")
    transform: str
    jax_shape: tuple  # as stored (vocab dim padded to cfg.padded_vocab_size); an expert's slice
    hf_shape: tuple  # as in the checkpoint (vocab dim = cfg.vocab_size)
    vocab_dim: int | None = None  # JAX dim padded from cfg.vocab_size to cfg.padded_vocab_size
    expert: int | None = None  # this HF tensor is row ``expert`` of the stacked JAX parameter


def entry_value(flat: Mapping[tuple, Any], e: Entry) -> Any:
    """The (numpy or jax) array ``e`` maps from a ``flat_values`` dict: the parameter, or its
    expert's row of a stacked expert kernel."""
    value = flat[e.jax_path]
    return value if e.expert is None else value[e.expert]


def _jax_path(pattern: str, i: int | None) -> tuple:
    parts = pattern.format(i=i).split("/")
    return tuple(int(p) if p.isdigit() else p for p in parts)


def table_for(cfg: ModelConfig) -> tuple[Row, ...]:
    """The family's rows that apply to ``cfg`` (no lm_head row when embeddings are tied)."""
    table = family_module(cfg.family).HF_TABLES[cfg.family]
    return tuple(r for r in table if not (r.untied_only and cfg.tie_word_embeddings))


def _unpadded_shape(jax_shape: tuple, vocab_dim: int | None, cfg: ModelConfig) -> tuple:
    """``jax_shape`` with its vocab dim (if any) at the real ``cfg.vocab_size``."""
    if vocab_dim is None:
        return tuple(jax_shape)
    return tuple(cfg.vocab_size if d == vocab_dim else n for d, n in enumerate(jax_shape))


def _to_jax(e: Entry, value: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """HF array -> the JAX layout, zero-padded along the vocab dim to ``cfg.padded_vocab_size``."""
    out = TRANSFORMS[e.transform].to_jax(value, _unpadded_shape(e.jax_shape, e.vocab_dim, cfg))
    if e.vocab_dim is not None and out.shape != e.jax_shape:
        pad = [(0, 0)] * out.ndim
        pad[e.vocab_dim] = (0, e.jax_shape[e.vocab_dim] - out.shape[e.vocab_dim])
        out = np.pad(out, pad)
    return out


def _to_hf(e: Entry, value: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """JAX array -> the HF layout, cut along the vocab dim to the real ``cfg.vocab_size``."""
    return np.ascontiguousarray(hf_layout(value, e.transform, e.vocab_dim, cfg.vocab_size))


def hf_layout(value: Any, transform: str, vocab_dim: int | None, vocab_size: int, dtype: Any = None) -> Any:
    """One parameter in the JAX layout -> the HF layout (a view where numpy can make one):
    cut along ``vocab_dim`` (if any) to ``vocab_size`` rows, reshaped/transposed by
    ``TRANSFORMS[transform]``, cast to ``dtype`` (None: kept).  Traceable: jitted on the
    devices it serves the refit stream (``JaxPolicyWorker.iter_full_weights``); the static
    arguments are an ``Entry``'s, so every layer's copy of a tensor shares one program."""
    if vocab_dim is not None and value.shape[vocab_dim] != vocab_size:
        value = value[(slice(None),) * vocab_dim + (slice(0, vocab_size),)]
    value = TRANSFORMS[transform].to_hf(value)
    return value if dtype is None else value.astype(dtype)


def _layers(row: Row, cfg: ModelConfig) -> Iterator[int | None]:
    """The layer indices ``row`` applies to (None once for a row outside the layers)."""
    if "{i}" not in row.hf:
        yield None
        return
    layer_kind = getattr(family_module(cfg.family), "layer_kind", None)
    for i in range(cfg.num_layers):
        if row.layers is None or (layer_kind is not None and layer_kind(cfg, i) == row.layers):
            yield i


def expected_entries(cfg: ModelConfig) -> list[Entry]:
    """Every parameter of ``cfg``'s model: HF name, JAX path, transform and both shapes (one
    entry per expert for the rows of stacked expert kernels)."""
    shapes = param_shapes(cfg)
    entries = []
    for row in table_for(cfg):
        for i in _layers(row, cfg):
            path = _jax_path(row.jax, i)
            for j in range(getattr(cfg, "num_experts", 0)) if "{j}" in row.hf else (None,):
                jax_shape = shapes[path] if j is None else shapes[path][1:]
                hf_shape = TRANSFORMS[row.transform].hf_shape(_unpadded_shape(jax_shape, row.vocab_dim, cfg))
                name = row.hf.format(i=i, j=j)
                entries.append(Entry(name, path, row.transform, jax_shape, tuple(hf_shape), row.vocab_dim, j))
    mapped = {e.jax_path for e in entries}
    if mapped != set(shapes):  # the table and the model must describe the same parameters
        raise AssertionError(
            f"HF table / model mismatch: unmapped {set(shapes) - mapped}, unknown {mapped - set(shapes)}"
        )
    return entries


# --------------------------------------------------------------------------- checks and conversion


def check_hf_tensors(hf_tensors: Mapping[str, Any], cfg: ModelConfig) -> list[Entry]:
    """Raise ``ValueError`` unless ``hf_tensors`` holds exactly ``cfg``'s parameters.

    Every expected HF name must be present with the expected shape; no other names are
    allowed, except rotary ``inv_freq`` buffers and, on tied models, an ``lm_head.weight``
    equal to the embedding.  Messages name the HF parameter (and both shapes).
    """
    entries = expected_entries(cfg)
    expected = {e.hf_name for e in entries}
    missing = [e.hf_name for e in entries if e.hf_name not in hf_tensors]
    if missing:
        raise ValueError(
            f"checkpoint is missing HF parameter(s) {missing} ({cfg.family}, {len(missing)} of {len(entries)} missing)"
        )
    unexpected = []
    for name in hf_tensors:
        if name in expected or name.endswith(IGNORED_HF_SUFFIXES):
            continue
        if name == TIED_HF_NAME and cfg.tie_word_embeddings:
            if not np.array_equal(np.asarray(hf_tensors[name]), np.asarray(hf_tensors[EMBED_HF_NAME])):
                raise ValueError(
                    f"HF parameter {TIED_HF_NAME!r} differs from {EMBED_HF_NAME!r} but the "
                    "config ties word embeddings (tie_word_embeddings=True)"
                )
            continue
        unexpected.append(name)
    if unexpected:
        raise ValueError(
            f"unexpected HF parameter(s) {sorted(unexpected)} for a {cfg.family} model "
            f"(tie_word_embeddings={cfg.tie_word_embeddings})"
        )
    for e in entries:
        got = tuple(hf_tensors[e.hf_name].shape)
        if got != e.hf_shape:
            raise ValueError(
                f"HF parameter {e.hf_name!r} has shape {got} in the checkpoint, expected {e.hf_shape} from the config"
            )
    return entries


def hf_to_jax_state(hf_tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict:
    """HF tensors -> nested dict keyed like ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``.

    Values are numpy arrays in the checkpoint's dtype (validated by ``check_hf_tensors``).
    """
    out: dict = {}
    shapes = param_shapes(cfg)
    for e in check_hf_tensors(hf_tensors, cfg):
        value = _to_jax(e, np.asarray(hf_tensors[e.hf_name]), cfg)
        node = out
        for key in e.jax_path[:-1]:
            node = node.setdefault(key, {})
        if e.expert is None:
            node[e.jax_path[-1]] = value
        else:  # stack the experts' tensors (check_hf_tensors saw every one of them)
            stacked = node.setdefault(e.jax_path[-1], np.empty(shapes[e.jax_path], value.dtype))
            stacked[e.expert] = value
    return out


def flat_values(state: Any) -> dict[tuple, Any]:
    """``{path: array}`` from a CausalLM, an ``nnx.State`` or a nested pure dict."""
    if isinstance(state, (nnx.Module, nnx.State)):
        return {
            tuple(p): v.get_value() if isinstance(v, nnx.Variable) else v
            for p, v in nnx.to_flat_state(params_of(state))
        }
    flat: dict[tuple, Any] = {}

    def walk(node, prefix):
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, prefix + (k,))
        else:
            flat[prefix] = node

    walk(state, ())
    return flat


def jax_to_hf_tensors(state: Any, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """JAX params (model, ``nnx.State`` or pure dict) -> ``{hf_name: numpy array}`` in HF layout.

    Arrays keep their dtype (bf16 -> ``ml_dtypes.bfloat16``).  Sharded jax arrays are
    gathered by ``np.asarray`` (they must be fully addressable from this process).
    """
    return dict(iter_hf_tensors(state, cfg))


def iter_hf_tensors(state: Any, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """``(hf_name, numpy array)`` one parameter at a time, in table order (for streaming
    refit: only one converted tensor is alive at a time)."""
    flat = flat_values(state)
    for e in expected_entries(cfg):
        if e.jax_path not in flat:
            raise ValueError(f"JAX state has no parameter {'/'.join(map(str, e.jax_path))} (HF {e.hf_name!r})")
        value = np.asarray(entry_value(flat, e))
        if tuple(value.shape) != e.jax_shape:
            raise ValueError(
                f"JAX parameter {'/'.join(map(str, e.jax_path))} has shape {value.shape}, "
                f"expected {e.jax_shape} (HF {e.hf_name!r})"
            )
        yield e.hf_name, _to_hf(e, value, cfg)


# --------------------------------------------------------------------------- files


def read_hf_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of an HF checkpoint as numpy arrays (bf16 as ``ml_dtypes.bfloat16``).

    ``path`` is a ``.safetensors`` file, or a directory with ``model.safetensors`` or a
    sharded ``model.safetensors.index.json``.
    """
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [path / f for f in sorted(set(weight_map.values()))]
        elif (path / "model.safetensors").exists():
            files = [path / "model.safetensors"]
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    else:
        files = [path]
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        with safe_open(str(f), framework="np") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def load_hf_weights(model: CausalLM, path_or_hf_state: str | os.PathLike | Mapping[str, Any]) -> CausalLM:
    """Fill ``model``'s params (in place; also returned) from an HF checkpoint dir/file or a
    ``{hf_name: array}`` mapping, cast to the model's ``param_dtype``.

    Works on an abstract model from ``models.abstract_model`` (nothing is initialised
    twice).  Raises ``ValueError`` naming the HF parameter on missing / unexpected names
    and shape mismatches.
    """
    if isinstance(path_or_hf_state, (str, os.PathLike)):
        hf_tensors = read_hf_safetensors(path_or_hf_state)
    else:
        hf_tensors = {k: _to_numpy(v) for k, v in path_or_hf_state.items()}
    values = hf_to_jax_state(hf_tensors, model.cfg)
    state = nnx.state(model, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        node = values
        for key in path:
            node = node[key]
        var.set_value(jnp.asarray(node, dtype=model.param_dtype))
    nnx.update(model, state)
    return model


def _to_numpy(x: Any) -> np.ndarray:
    """numpy view of a numpy / jax / torch tensor (torch bf16 goes through float32 -> bf16)."""
    if type(x).__module__.startswith("torch"):
        import ml_dtypes
        import torch

        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            return x.float().numpy().astype(ml_dtypes.bfloat16)
        return x.numpy()
    return np.asarray(x)


def save_hf_checkpoint(model: CausalLM, hf_config: PreTrainedConfig, path: str | os.PathLike) -> Path:
    """Write ``model.safetensors`` (HF names and layouts, params' dtype) and ``config.json``
    to ``path``; ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads it.

    ``hf_config`` must describe ``model`` (checked through ``config_from_hf``; a padded
    vocabulary is cut back to ``hf_config.vocab_size``).  One file holds every tensor: fine
    up to a few GB; sharded writing is not implemented.
    """
    from safetensors.numpy import save_file

    if config_from_hf(hf_config) != model.cfg.unpadded():
        raise ValueError(f"hf_config describes {config_from_hf(hf_config)}, the model is {model.cfg}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = jax_to_hf_tensors(model, model.cfg)
    # transformers refuses safetensors files without format metadata.
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf_config.save_pretrained(path)
    return path


def from_pretrained(
    path: str | os.PathLike,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    *,
    tp: int = 1,
    make_vocab_size_divisible_by: int = 1,
    moe_dispatch: str = "auto",
    expert_parallel: int = 1,
) -> tuple[CausalLM, ModelConfig, PreTrainedConfig]:
    """Load an HF checkpoint directory: ``(CausalLM, ModelConfig, hf_config)``.

    The vocabulary is zero-padded to ``padded_vocab_size(vocab_size, tp,
    make_vocab_size_divisible_by)`` (unchanged with the defaults, or when ``tp`` divides it).
    A mixture of experts runs its experts the ``moe_dispatch`` way (``policy.jax_cfg.moe_dispatch``;
    ``auto`` resolved for the default JAX platform), expert-parallel over ``expert_parallel``
    ranks (``policy.parallel.expert_parallel_size``) when above 1.  ``expert_parallel`` above 1
    on a dense model raises ValueError.
    """
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    cfg = config_from_hf(hf_config).with_padded_vocab(tp, make_vocab_size_divisible_by)
    if isinstance(cfg, MoEConfig):
        dispatch = resolve_dispatch(moe_dispatch, jax.default_backend())
        cfg = dataclasses.replace(cfg, dispatch=dispatch, expert_parallel=expert_parallel)
    elif expert_parallel != 1:
        raise ValueError(
            f"policy.parallel.expert_parallel_size={expert_parallel}: model_type {hf_config.model_type!r} "
            "has no experts (a mixture of experts' option)"
        )
    model = abstract_model(cfg, dtype=dtype, param_dtype=param_dtype)
    load_hf_weights(model, path)
    return model, cfg, hf_config


__all__ = [
    "TRANSFORMS",
    "Entry",
    "entry_value",
    "table_for",
    "expected_entries",
    "check_hf_tensors",
    "hf_to_jax_state",
    "jax_to_hf_tensors",
    "iter_hf_tensors",
    "hf_layout",
    "flat_values",
    "read_hf_safetensors",
    "load_hf_weights",
    "save_hf_checkpoint",
    "from_pretrained",
]
