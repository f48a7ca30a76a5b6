"""The models a benchmark runs, by name, path or shape; their tokenizer, vocabulary and size.

Every benchmark gets its model from :func:`prepare_model` (a name or a path) or
:func:`random_llama` (a shape: ``dualrl bench`` / ``--gpu`` sizes, ``benchmarks.packing``).
Nothing is downloaded for the names built here: the ``core.testing`` tiny models (``llama``,
``qwen2``, ``llama_gen``, ... also as ``tiny-qwen2``), :data:`LOCAL_MODELS` (``tiny-gpt2``,
``tiny-llama-hd32``) and the built-in ``arithmetic-llama`` shape with random weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The built-in model's name; built here with random weights (seed 0), never warm started.
BUILTIN_MODEL = "arithmetic-llama"
#: The seed of the built-in model's random weights (the TRL comparison's models start equal).
BUILTIN_SEED = 0


def random_llama(shape: dict[str, Any], path: Path, seed: int | None = None) -> str:
    """A Llama of ``shape`` (HF config fields) with seeded random weights and the character
    tokenizer in ``path``; reused when ``path`` already holds that shape (a 1b build takes a
    minute: ``dualrl bench --gpu --model-dir`` keeps it across runs)."""
    from transformers import AutoConfig

    from core.models.builtin import write_random_init

    if (path / "config.json").exists():
        have = AutoConfig.from_pretrained(path)
        wrong = {k: (getattr(have, k, None), v) for k, v in shape.items() if getattr(have, k, None) != v}
        if wrong:
            raise ValueError(f"{path} holds another shape (have, want): {wrong}")
        return str(path)
    path.mkdir(parents=True, exist_ok=True)
    write_random_init(shape, path, **({} if seed is None else {"seed": seed}))
    return str(path)


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
    not for the 16 of ``llama``, so this is the tiny llama the parity engine check can serve.
    (``llama_gen`` serves too, but its wide init makes logits large and fp32 rounding on the TP
    layouts exceed the parity tolerances.)"""
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


def save_builtin_random(path: Path) -> Path:
    """The built-in model's shape with random weights (seed :data:`BUILTIN_SEED`), tokenizer in ``path``."""
    from core.models.builtin import BUILTIN_MODELS

    shape, _ = BUILTIN_MODELS[BUILTIN_MODEL]  # the shape only: random init, no warm start
    random_llama(shape, path, seed=BUILTIN_SEED)
    return path


#: Models built here (no download): name -> builder of the model dir.
LOCAL_MODELS: dict[str, Callable[[Path], Path]] = {
    "tiny-gpt2": save_tiny_gpt2,
    "tiny-llama-hd32": save_tiny_llama_hd32,
    BUILTIN_MODEL: save_builtin_random,
}


def tiny_name(model: str) -> str | None:
    """The ``core.testing`` tiny model ``model`` names (``qwen2`` or ``tiny-qwen2``), else None."""
    from core.testing.tiny_models import TINY_MODELS

    for name in (model, model.removeprefix("tiny-")):
        if name in TINY_MODELS:
            return name
    return None


def builds_here(model: str) -> bool:
    """Whether :func:`prepare_model` builds ``model`` (a name, and no path of that name exists)."""
    return not Path(model).exists() and (model in LOCAL_MODELS or tiny_name(model) is not None)


def with_tokenizer_dir(path: Path) -> tuple[str, str]:
    """``(model, tokenizer)`` of a saved model: the tokenizer in ``path/tokenizer`` when there
    is one (the tiny models' layout: transformers 5 would pick a tokenizer class from a
    ``config.json`` next to it), else next to the model."""
    tok = path / "tokenizer"
    return str(path), str(tok if tok.is_dir() else path)


def prepare_model(model: str, root: Path) -> tuple[str, str]:
    """``(model path or hub id, tokenizer path or hub id)``: a model built here (see the module
    docstring) goes to ``root / model``; a local path or a hub id is used as it is."""
    if builds_here(model):
        if model in LOCAL_MODELS:
            return with_tokenizer_dir(LOCAL_MODELS[model](root / model))
        from core.testing.tiny_models import save_tiny_model

        name = tiny_name(model)
        return with_tokenizer_dir(save_tiny_model(name, root / name))
    path = Path(model)
    return with_tokenizer_dir(path) if path.is_dir() else (model, model)


def load_tokenizer(tokenizer_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path)


def hf_config(model_path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


def vocab_size(model_path: str) -> int:
    return hf_config(model_path).vocab_size


def param_count(config) -> int:
    """Parameters of the model (a tied embedding counted once), without allocating them."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def jax_model_problem(hf_config, model: str) -> str | None:
    """Why the JAX backend (jax_pjit) cannot run this model (the backend's own check of the HF
    config), or None -- asked on the driver, before any worker starts."""
    from backends.jax_pjit.models import config_from_hf

    try:
        config_from_hf(hf_config)
    except ValueError as err:
        return f"model {model!r} is not supported by the JAX backend (jax_pjit): {err}"
    return None


#: Backends whose model families the benchmarks check on the driver before starting a worker
#: (the check imports the backend's model code, which its spec may not).
MODEL_PROBLEMS = {"jax_pjit": jax_model_problem}


def backend_model_problem(backend: str, hf_config, model: str) -> str | None:
    """Why ``backend`` cannot run this model, where the benchmarks can tell on the driver."""
    check = MODEL_PROBLEMS.get(backend)
    return check(hf_config, model) if check else None
