"""Built-in models: ``policy.model_name: builtin:<name>`` names a model the project makes itself.

The embedded defaults must run with no downloads, so their policies are a tiny Llama built
from a config here:

* ``builtin:arithmetic-llama-base``: random weights (seeded) -- what ``dualrl sft`` starts from;
* ``builtin:arithmetic-llama``: the base after a ``dualrl sft`` run on the run's own
  arithmetic task (``core/configs/sft_arithmetic.yaml`` with validation and checkpoints
  off, see ``WARM_START_OVERRIDES``) -- what the GRPO and DPO defaults start from.  Its
  training stream never shows the prompts the run holds out for validation.

A built model is saved as an ordinary local HF checkpoint under a cache directory: the
policy workers, vLLM and the JAX importer load it by path, exactly as they load a hub model.
The cache key covers everything that changes the weights (shape, init seed, the warm-start
SFT config, the task's knobs, the held-out prompts, a format version), so a changed task or
validation set builds a new model instead of reusing a stale one.  Builds are written to a
temporary sibling and renamed into place, under a file lock, so two runs starting together
build once and a killed build leaves nothing that looks finished.
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
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from core.models.char_tokenizer import char_tokenizer

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
INIT_SEED = 1234

#: name -> (shape, warm started by the SFT run?)
BUILTIN_MODELS: dict[str, tuple[dict[str, Any], bool]] = {
    "arithmetic-llama-base": (ARITHMETIC_LLAMA, False),
    "arithmetic-llama": (ARITHMETIC_LLAMA, True),
}

#: What the warm start changes in core/configs/sft_arithmetic.yaml: no validation (the GRPO /
#: DPO run validates on its own held-out prompts), no run checkpoints, and no progress bar
#: (the build logs a line before and after; its metrics and curves stay in the model's
#: directory, under warm_start/).
WARM_START_OVERRIDES = (
    "sft.val_batches=0",
    "sft.val_period=0",
    "sft.val_at_start=false",
    "sft.val_at_end=false",
    "checkpointing.enabled=false",
    "logger.tensorboard_enabled=false",
    "logger.progress_bar=false",
)


def is_builtin(name: Any) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def is_warm_started(name: Any) -> bool:
    """A built-in model trained on the arithmetic task (so the task's knobs shape its weights)."""
    return is_builtin(name) and BUILTIN_MODELS.get(name[len(PREFIX) :], (None, False))[1]


def _spec_name(name: str, key: str) -> str:
    short = name[len(PREFIX) :]
    if short not in BUILTIN_MODELS:
        raise ValueError(
            f"{key}: unknown built-in model {name!r}; built-in: " + ", ".join(PREFIX + n for n in BUILTIN_MODELS)
        )
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


def warm_start_config(task_cfg: Mapping[str, Any], out_dir: Path | None = None) -> dict[str, Any]:
    """The ``dualrl sft`` config that warm-starts ``builtin:arithmetic-llama`` for a task
    (``out_dir``: where its export and logs go; None gives the path-free form the cache key
    hashes)."""
    from core.config import EMBEDDED_CONFIGS, load_config

    out = Path(out_dir) if out_dir is not None else Path("<build>")
    cfg = load_config(
        EMBEDDED_CONFIGS["sft"],
        list(WARM_START_OVERRIDES)
        + [
            f"logger.log_dir={out / 'warm_start'}",
            f"checkpointing.checkpoint_dir={out / 'checkpoints'}",
            f"checkpointing.export_hf_dir={out}",
        ],
    )
    cfg["data"]["arithmetic"] = dict(task_cfg)
    return cfg


def cache_key(short: str, task_cfg: Mapping[str, Any], exclude: Iterable[str]) -> str:
    shape, warm = BUILTIN_MODELS[short]
    payload = {"version": FORMAT_VERSION, "model": shape, "init_seed": INIT_SEED}
    if warm:  # the SFT config without what cannot change the weights (where logs and files go)
        sft = {k: v for k, v in warm_start_config(task_cfg).items() if k not in ("logger", "checkpointing")}
        payload.update(warm_start=sft, exclude=sorted(exclude))
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def resolve_builtin_model(
    name: str,
    task_cfg: Mapping[str, Any] | None,
    exclude: Iterable[str],
    log: Callable[[str], None] = print,
    key: str = "policy.model_name",
    run_cfg: Mapping[str, Any] | None = None,
) -> Path:
    """The local directory of built-in model ``name`` for this task, building it on first use
    (``run_cfg``: the run that needs it, whose Ray set-up the warm start shares)."""
    from core.environments.arithmetic import ArithmeticTask

    short = _spec_name(name, key)
    task = ArithmeticTask(task_cfg, path="data.arithmetic")
    settings = {k: getattr(task, k) for k in ("min_value", "max_value", "num_operands", "operations", "allow_negative")}
    exclude = frozenset(exclude)
    target = cache_root() / "models" / f"{short}-{cache_key(short, settings, exclude)}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.with_suffix(".lock")):
        if not (target / "config.json").is_file():  # another run may have built it meanwhile
            tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
            try:
                _build(short, settings, exclude, tmp, log, run_cfg)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(
    short: str,
    settings: Mapping[str, Any],
    exclude: frozenset[str],
    out: Path,
    log: Callable[[str], None],
    run_cfg: Mapping[str, Any] | None,
) -> None:
    shape, warm = BUILTIN_MODELS[short]
    if not warm:
        write_random_init(shape, out)
        return
    from core.algorithms.placement import start_ray
    from core.algorithms.sft import run_sft

    cfg = warm_start_config(settings, out)
    cfg["policy"]["model_name"] = str(resolve_builtin_model(cfg["policy"]["model_name"], settings, (), log))
    log(
        f"building the built-in model {PREFIX}{short} (once; cached in {out.parent}): a `dualrl sft` run of "
        f"{cfg['sft']['max_num_steps']} steps on the arithmetic task"
    )
    start = time.perf_counter()
    start_ray(run_cfg or cfg)  # the run's Ray (with its JAX device flags), not one the SFT picks
    run = run_sft(cfg, log=lambda _line: None, exclude=exclude)
    rows = [r for r in run.logger.history if r["split"] == "train"]
    (out / "warm_start.json").write_text(
        json.dumps(
            {
                "steps": len(rows),
                "first_loss": rows[0]["loss"],
                "final_loss": rows[-1]["loss"],
                "seconds": time.perf_counter() - start,
                "backend": cfg["policy"]["backend"],
            }
        )
    )
    log(
        f"built {PREFIX}{short} in {time.perf_counter() - start:.0f} s "
        f"(SFT loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f})"
    )


def write_random_init(shape: Mapping[str, Any], out: Path, seed: int = INIT_SEED) -> Path:
    """A Llama of ``shape`` (HF config fields) with seeded random weights and the character
    tokenizer, saved as an HF checkpoint in ``out`` (benchmarks build their models with it too)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = char_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-6,
        **shape,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@contextlib.contextmanager
def _lock(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
