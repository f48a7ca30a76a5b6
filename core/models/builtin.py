"""Built-in models: ``policy.model_name: builtin:<name>`` names a model the project makes itself.

The embedded default must run with no downloads, so its policy is a tiny Llama built from a
config here and given a short supervised warm start on the run's own arithmetic task
(:mod:`core.models.warm_start`).  The result is saved with ``save_pretrained`` under a cache
directory and from then on is an ordinary local HF checkpoint: the policy workers, vLLM and
the JAX importer load it by path, exactly as they load a hub model.

The cache key covers everything that changes the weights (model shape, warm-start settings,
the task's knobs, the held-out prompts it must not see, a format version), so a changed
task or validation set builds a new model instead of reusing a stale one.  Builds are
written to a temporary sibling and renamed into place, under a file lock, so two runs
starting together build once and a killed build leaves nothing that looks finished.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from core.models.char_tokenizer import char_tokenizer
from core.models.warm_start import WarmStartConfig, warm_start

PREFIX = "builtin:"
FORMAT_VERSION = 1

#: Shapes of the built-in models (HF Llama config fields).  head_dim 32: vLLM's CPU
#: attention has no kernel for 16.  vocab 32 = the character tokenizer's 21 ids rounded up
#: so tensor parallel sizes 2 and 4 divide it.
BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "arithmetic-llama": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4, vocab_size=32,
                             tie_word_embeddings=True, max_position_embeddings=128),
}
WARM_STARTS: dict[str, WarmStartConfig] = {"arithmetic-llama": WarmStartConfig()}


def is_builtin(name: Any) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def _spec_name(name: str, key: str) -> str:
    short = name[len(PREFIX):]
    if short not in BUILTIN_MODELS:
        raise ValueError(f"{key}: unknown built-in model {name!r}; built-in: "
                         + ", ".join(PREFIX + n for n in BUILTIN_MODELS))
    return short


def builtin_tokenizer(name: str, key: str = "policy.tokenizer.name"):
    """The tokenizer of a built-in model (the character tokenizer; built, not loaded)."""
    _spec_name(name, key)
    return char_tokenizer()


def cache_root() -> Path:
    """``$DUALRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/dualrl``, else ``~/.cache/dualrl``."""
    if os.environ.get("DUALRL_CACHE_DIR"):
        return Path(os.environ["DUALRL_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dualrl"


def cache_key(short: str, task_cfg: Mapping[str, Any], exclude: Iterable[str]) -> str:
    payload = {"version": FORMAT_VERSION, "model": BUILTIN_MODELS[short], "warm_start": vars(WARM_STARTS[short]),
               "task": dict(task_cfg), "exclude": sorted(exclude)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def resolve_builtin_model(name: str, task_cfg: Mapping[str, Any] | None, exclude: Iterable[str],
                          log: Callable[[str], None] = print, key: str = "policy.model_name") -> Path:
    """The local directory of built-in model ``name`` for this task, building it on first use."""
    from core.environments.arithmetic import ArithmeticTask

    short = _spec_name(name, key)
    task = ArithmeticTask(task_cfg)
    settings = {k: getattr(task, k) for k in ("min_value", "max_value", "num_operands", "operations", "allow_negative")}
    exclude = frozenset(exclude)
    target = cache_root() / "models" / f"{short}-{cache_key(short, settings, exclude)}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.with_suffix(".lock")):
        if not (target / "config.json").is_file():  # another run may have built it meanwhile
            _build(short, task, exclude, target, log)
    return target


def _build(short: str, task: Any, exclude: frozenset[str], target: Path, log: Callable[[str], None]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = char_tokenizer()
    cfg = WARM_STARTS[short]
    log(f"building the built-in model {PREFIX}{short} (once; cached in {target}): "
        f"{cfg.steps} warm-start steps on the arithmetic task")
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    config = LlamaConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-6, **BUILTIN_MODELS[short])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with _torch_threads(os.cpu_count() or 1):
        losses = warm_start(model, tokenizer, task, exclude, cfg, log)
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp / "tokenizer")
        (tmp / "warm_start.json").write_text(json.dumps(
            {"steps": cfg.steps, "final_loss": losses[-1], "seconds": time.perf_counter() - start}))
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"built {PREFIX}{short} in {time.perf_counter() - start:.0f} s (final warm-start loss {losses[-1]:.3f})")


@contextlib.contextmanager
def _lock(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _torch_threads(n: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
