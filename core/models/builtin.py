"""Built-in models: ``policy.model_name: builtin:<name>`` names a model the project makes itself.

The embedded defaults must run with no downloads, so their policies are a tiny Llama (or
Qwen3-MoE) built from a config here:

* ``builtin:arithmetic-llama-base``: random weights (seeded) -- what ``dualrl sft`` starts from;
* ``builtin:arithmetic-llama``: the base after a ``dualrl sft`` run on the run's own
  arithmetic task -- what the GRPO and DPO defaults start from;
* ``builtin:arithmetic-llama-small-base``: a smaller Llama with random weights (seeded) and
  the same tokenizer;
* ``builtin:arithmetic-llama-small``: that base after a shorter ``dualrl sft`` run (well below
  the teacher) -- the student of the on-policy distillation demo;
* ``builtin:arithmetic-qwen3-moe-base`` / ``builtin:arithmetic-qwen3-moe``: a Qwen3-MoE of the
  same width, random / after a ``dualrl sft`` run on the task (the mixture-of-experts demo,
  core/configs/grpo_arithmetic_moe.yaml);
* ``builtin:arithmetic-llama-tools-base`` / ``builtin:arithmetic-llama-tools``: the Llama of
  ``builtin:arithmetic-llama`` with the tool-use tokenizer (``tool_char_tokenizer``: it can write
  a calculator call), random / after a ``dualrl sft`` run on direct answers mixed with
  calculator-call demonstrations (the multi-turn default, core/configs/grpo_tool_arithmetic.yaml);
* ``builtin:reasoning-gym-llama-base`` / ``builtin:reasoning-gym-llama``: a tiny Llama that reads
  English through the byte tokenizer (``byte_tokenizer``), random / after a ``dualrl sft`` run on
  the run's own reasoning-gym tasks (``data.reasoning_gym``; core/configs/sft_reasoning_gym.yaml),
  what core/configs/grpo_reasoning_gym.yaml starts from.

The SFT runs (the warm starts) are :mod:`core.algorithms.warm_start`'s; this module only
describes the models (a leaf of the import graph: it imports nothing else of the project).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.models.byte_tokenizer import byte_tokenizer
from core.models.char_tokenizer import char_tokenizer, tool_char_tokenizer

PREFIX = "builtin:"
FORMAT_VERSION = 2

#: The tiny Llama (HF Llama config fields).  head_dim 32: vLLM's CPU attention has no kernel
#: for 16.  vocab 32 = the character tokenizer's 21 ids rounded up so tensor parallel sizes 2
#: and 4 divide it.
ARITHMETIC_LLAMA = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=32,
    tie_word_embeddings=True,
    max_position_embeddings=128,
)
#: A smaller student for the on-policy distillation demo (core/configs/distill_arithmetic.yaml):
#: two layers, hidden 128 (head_dim still 32), ~0.30 M parameters (the teacher: ~1.19 M); the same
#: vocabulary, so it shares the character tokenizer with the teacher.  Measured: one layer
#: (~0.15 M) learned from the teacher more slowly (docs/algorithms.md).
ARITHMETIC_LLAMA_SMALL = {**ARITHMETIC_LLAMA, "hidden_size": 128, "intermediate_size": 256,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
#: The tool-use model: the same Llama; vocab 48 = the tool tokenizer's 35 ids rounded up so
#: tensor parallel sizes 2, 4 and 8 divide it.
ARITHMETIC_LLAMA_TOOLS = {**ARITHMETIC_LLAMA, "vocab_size": 48}
#: A mixture of experts of the same width (Qwen3-MoE: q/k norms, head_dim 32; every layer
#: sparse, 8 experts of 128, 2 per token -- the active MLP width of the Llama's 512 / 2):
#: the MoE demo (core/configs/grpo_arithmetic_moe.yaml; docs/moe.md), ~2.2 M parameters.
ARITHMETIC_QWEN3_MOE = {**ARITHMETIC_LLAMA, "model_type": "qwen3_moe", "head_dim": 32, "num_experts": 8,
                        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "norm_topk_prob": True,
                        "tie_word_embeddings": False}  # fmt: skip
#: The English reader (builtin:reasoning-gym-llama): the byte tokenizer's 259 ids rounded up to
#: 264 (tensor parallel sizes 2, 4 and 8 divide it), and room for the longest reasoning-gym
#: prompts a recipe here uses.
REASONING_GYM_LLAMA = {**ARITHMETIC_LLAMA, "vocab_size": 264, "max_position_embeddings": 256}
INIT_SEED = 1234

#: name -> (shape, warm started by the SFT run?)
BUILTIN_MODELS: dict[str, tuple[dict[str, Any], bool]] = {
    "arithmetic-llama-base": (ARITHMETIC_LLAMA, False),
    "arithmetic-llama": (ARITHMETIC_LLAMA, True),
    "arithmetic-llama-small-base": (ARITHMETIC_LLAMA_SMALL, False),
    "arithmetic-llama-small": (ARITHMETIC_LLAMA_SMALL, True),
    "arithmetic-llama-tools-base": (ARITHMETIC_LLAMA_TOOLS, False),
    "arithmetic-llama-tools": (ARITHMETIC_LLAMA_TOOLS, True),
    "arithmetic-qwen3-moe-base": (ARITHMETIC_QWEN3_MOE, False),
    "arithmetic-qwen3-moe": (ARITHMETIC_QWEN3_MOE, True),
    "reasoning-gym-llama-base": (REASONING_GYM_LLAMA, False),
    "reasoning-gym-llama": (REASONING_GYM_LLAMA, True),
}

#: Built-in models with the tool-use tokenizer (the others have the character tokenizer).
TOOL_TOKENIZER_MODELS = frozenset({"arithmetic-llama-tools-base", "arithmetic-llama-tools"})
#: Built-in models with the byte tokenizer.
BYTE_TOKENIZER_MODELS = frozenset({"reasoning-gym-llama-base", "reasoning-gym-llama"})
#: The warm-started models that train on reasoning-gym tasks (``data.reasoning_gym`` of the run,
#: with the embedded SFT config ``REASONING_GYM_WARM_START_CONFIG``); the others train on the
#: arithmetic task (``env.arithmetic``, core/configs/sft_arithmetic.yaml).
REASONING_GYM_MODELS = frozenset({"reasoning-gym-llama"})
REASONING_GYM_WARM_START_CONFIG = "sft_reasoning_gym.yaml"

#: How a warm start differs from core/configs/sft_arithmetic.yaml (``dualrl sft`` overrides),
#: per warm-started model; absent: that file as it is.  The small student starts from its own
#: random-init base and trains for fewer steps, so that it stays well below its teacher.
WARM_START_SFT_OVERRIDES: dict[str, tuple[str, ...]] = {
    "arithmetic-llama-small": (
        "policy.model_name=builtin:arithmetic-llama-small-base",
        "policy.tokenizer.name=builtin:arithmetic-llama-small-base",
        "sft.max_num_steps=100",
    ),
    # Conversations of the built-in 'tool-arithmetic' source: a share (data.tool_demo_fraction)
    # are calculator-call demonstrations, the rest direct answers, so that the model calls the
    # tool sometimes at step 0 (measured: docs/multi-turn.md).
    "arithmetic-qwen3-moe": (
        "policy.model_name=builtin:arithmetic-qwen3-moe-base",
        "policy.tokenizer.name=builtin:arithmetic-qwen3-moe-base",
    ),
    "arithmetic-llama-tools": (
        "policy.model_name=builtin:arithmetic-llama-tools-base",
        "policy.tokenizer.name=builtin:arithmetic-llama-tools-base",
        "policy.max_total_sequence_length=96",
        "data.dataset_name=tool-arithmetic",
        "data.messages_key=messages",
        "data.response_key=null",
        "data.tool_demo_fraction=0.15",
    ),
}


def is_builtin(name: Any) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def is_warm_started(name: Any) -> bool:
    """A built-in model trained on the arithmetic task (so the task's knobs shape its weights)."""
    if not is_builtin(name):
        return False
    short = name[len(PREFIX) :]
    return BUILTIN_MODELS.get(short, (None, False))[1] and short not in REASONING_GYM_MODELS


def warm_started_on_reasoning_gym(name: Any) -> bool:
    """A built-in model whose warm start trains on the run's reasoning-gym tasks."""
    return is_builtin(name) and name[len(PREFIX) :] in REASONING_GYM_MODELS


def spec_name(name: str, key: str) -> str:
    short = name[len(PREFIX) :]
    if short not in BUILTIN_MODELS:
        raise ValueError(
            f"{key}: unknown built-in model {name!r}; built-in: " + ", ".join(PREFIX + n for n in BUILTIN_MODELS)
        )
    return short


def builtin_tokenizer(name: str, key: str = "policy.tokenizer.name"):
    """The tokenizer of a built-in model (the character tokenizer, its tool-use variant for the
    ``-tools`` models, the byte tokenizer for the reasoning-gym models; built, not loaded)."""
    short = spec_name(name, key)
    if short in BYTE_TOKENIZER_MODELS:
        return byte_tokenizer()
    return tool_char_tokenizer() if short in TOOL_TOKENIZER_MODELS else char_tokenizer()


def cache_root() -> Path:
    """``$DUALRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/dualrl``, else ``~/.cache/dualrl``."""
    if os.environ.get("DUALRL_CACHE_DIR"):
        return Path(os.environ["DUALRL_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dualrl"


def write_random_init(shape: Mapping[str, Any], out: Path, seed: int = INIT_SEED, tokenizer: Any = None) -> Path:
    """A model of ``shape`` (HF config fields; a Llama unless it names a ``model_type``) with
    seeded random weights and ``tokenizer`` (default: the character tokenizer), saved as an HF
    checkpoint in ``out`` (benchmarks build their models with it too)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = char_tokenizer() if tokenizer is None else tokenizer
    torch.manual_seed(seed)
    fields = dict(shape)
    config = AutoConfig.for_model(
        fields.pop("model_type", "llama"),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-6,
        **fields,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
