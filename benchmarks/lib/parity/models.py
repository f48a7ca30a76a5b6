"""Checking layout names against the machine, and the models a parity run can use (tiny ones built here)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import jax_backend as jb
from benchmarks import layouts
from benchmarks import torch_backends as tb
from benchmarks.layouts import GRAMMAR, torch_layout
from benchmarks.parity.checks import crossload_pairs


def jax_devices(name: str) -> int | None:
    """XLA host devices the layout's actor needs (``None``: a torch layout)."""
    layout = jb.jax_layout(name)
    return layout.devices if layout else None


def check_arguments(layouts: list[str], engine: Any, crossload: str, seq: int, steps: int) -> None:
    """``ValueError`` for what makes the whole run meaningless (before anything starts); a bad
    *layout* is not one of them (:func:`layout_problem`: that layout gets an error line)."""
    if not layouts:
        raise ValueError("no layouts given")
    if len(set(layouts)) != len(layouts):
        raise ValueError(f"a layout is given twice: {layouts}")
    if isinstance(engine, (list, tuple)) and (unknown := [n for n in engine if n not in layouts]):
        raise ValueError(f"--engine {' '.join(unknown)}: not among the layouts {layouts}")
    crossload_pairs(layouts, crossload)
    if seq < 2 or steps < 1:
        raise ValueError(f"seq must be >= 2 and steps >= 1, got seq={seq}, steps={steps}")


def layout_problem(name: str, batch: int, threads: int, ray_cpus: float | None) -> str | None:
    """Why ``name`` cannot run here (unknown, does not fit, batch), or ``None``.  See "Bad
    input" in the package docstring (``benchmarks/parity/__init__.py``) for what *fits* means."""
    jax = jb.jax_layout(name)
    layout = torch_layout(name)
    if jax is None and layout is None:
        return f"unknown layout {name!r}: one of {', '.join(tb.LAYOUTS)}, or by the grammar {GRAMMAR}"
    cpus = "" if ray_cpus is None else f" (the Ray cluster has {ray_cpus:g} CPUs)"
    if layout is not None:
        if layout.workers > threads:
            return (
                f"does not fit: {name} needs {layout.workers} workers, each with a CPU thread of its own; "
                f"the thread budget --threads {threads} gives at most {threads}{cpus}"
            )
        need = layout.workers * (threads // layout.workers)
        if ray_cpus is not None and need > ray_cpus:
            return f"does not fit: {name} needs {layout.workers} x {threads // layout.workers} CPUs{cpus}"
        if batch % layout.dp:
            return f"batch {batch} is not divisible by its data-parallel size {layout.dp}"
    elif ray_cpus is not None and threads > ray_cpus:
        return f"does not fit: {name} is one actor of --threads {threads} CPUs{cpus}"
    return None


def jax_model_problem(model: str, model_path: str) -> str | None:
    """Why the JAX backend cannot load this model (its own check on the HF config), or ``None``."""
    from transformers import AutoConfig

    return layouts.jax_model_problem(AutoConfig.from_pretrained(model_path), model)


def resolve_model(model: str) -> str:
    """``tiny-qwen2`` -> ``qwen2`` (a ``core.testing`` tiny model) unless a path of that name exists;
    anything else (tiny name, local path, hub id) goes to ``torch_backends.prepare_model`` as is."""
    from core.testing.tiny_models import TINY_MODELS

    if model.startswith("tiny-") and model[len("tiny-") :] in TINY_MODELS and not Path(model).exists():
        return model[len("tiny-") :]
    return model


def save_tiny_gpt2(path: Path) -> Path:
    """A random tiny GPT-2 (a family the JAX backend does not support), saved like the
    ``core.testing`` tiny models: the model in ``path``, the word-level tokenizer in ``path/tokenizer``."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    from core.testing.tiny_models import BOS_ID, EOS_ID, MAX_POSITIONS, PAD_ID, TINY_VOCAB_SIZE, tiny_tokenizer

    torch.manual_seed(0)
    # No dropout (GPT-2's default is 0.1): a training step must be a function of the weights.
    config = GPT2Config(
        vocab_size=TINY_VOCAB_SIZE,
        n_positions=MAX_POSITIONS,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path / "tokenizer")
    return path


def save_tiny_llama_hd32(path: Path) -> Path:
    """Tiny llama with head_dim 32 (``core.testing``'s ``llama`` at hidden 128 / intermediate 256,
    same 4 heads, 2 kv heads, init and seed): vLLM's CPU attention has kernels for head_dim 32,
    not for the 16 of ``llama``, so this is the tiny llama the engine check can serve.  (``llama_gen``
    serves too, but its wide init makes logits large and fp32 rounding on the TP layouts exceed
    the tolerances above.)"""
    import torch
    from transformers import AutoModelForCausalLM

    from core.testing.tiny_models import tiny_config, tiny_tokenizer

    config = tiny_config("llama")
    config.hidden_size, config.intermediate_size = 128, 256
    config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path / "tokenizer")
    return path


#: Tiny models built here (no download): name -> builder of the model dir (tokenizer in ``tokenizer/``).
LOCAL_MODELS: dict[str, Callable[[Path], Path]] = {"tiny-gpt2": save_tiny_gpt2, "tiny-llama-hd32": save_tiny_llama_hd32}


def prepare_model(model: str, root: Path) -> tuple[str, str]:
    """``(model path, tokenizer path)``: :data:`LOCAL_MODELS` built here, the rest by ``torch_backends``."""
    if model in LOCAL_MODELS and not Path(model).exists():
        path = LOCAL_MODELS[model](root / model)
        return str(path), str(path / "tokenizer")
    return tb.prepare_model(resolve_model(model), root)


def parity_settings(cfg: dict, lr: float) -> dict:
    """The policy section of a parity run: a constant learning rate large enough that 3 steps
    move the weights visibly (the default 5e-6 with a 10-step warm-up barely does), so that the
    loss curve and the cross-loaded export test trained weights, not the initial ones."""
    cfg["optimizer"]["kwargs"]["lr"] = lr
    cfg["scheduler"] = None
    return cfg
