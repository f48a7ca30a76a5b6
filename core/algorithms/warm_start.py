"""The warm start of ``builtin:arithmetic-llama``: a ``dualrl sft`` run, built once and cached.

``builtin:arithmetic-llama`` is the tiny built-in Llama after a ``dualrl sft`` run on the
run's own arithmetic task (``core/configs/sft_arithmetic.yaml`` with validation and
checkpoints off, see ``WARM_START_OVERRIDES``); its training stream never shows the prompts
the run holds out for validation.  ``builtin:arithmetic-llama-small``, the distillation demo's
student, is built the same way with its own base and fewer steps
(``core.models.builtin.WARM_START_SFT_OVERRIDES``).

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
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from core.algorithms.config import ClusterConfig, MasterConfig, SFTRunConfig
from core.algorithms.sft import setup_sft, sft_train
from core.algorithms.training_run import execute
from core.config import EMBEDDED_CONFIGS, ConfigError, load_config
from core.environments.config import ArithmeticTaskConfig, ReasoningGymConfig
from core.models.builtin import (
    BUILTIN_MODELS,
    FORMAT_VERSION,
    INIT_SEED,
    PREFIX,
    REASONING_GYM_MODELS,
    REASONING_GYM_WARM_START_CONFIG,
    WARM_START_SFT_OVERRIDES,
    builtin_tokenizer,
    cache_root,
    is_builtin,
    spec_name,
    write_random_init,
)
from core.reporting import get_logger

M = TypeVar("M", bound=MasterConfig)
#: What a warm start trains on: the arithmetic task's knobs, or a reasoning-gym task mix.
TaskSettings = ArithmeticTaskConfig | ReasoningGymConfig
logger = get_logger(__name__)


def resolve_model(cfg: M, exclude_prompts: Iterable[str]) -> M:
    """A copy of ``cfg`` whose ``policy.model_name`` (and enabled distillation teacher,
    ``grpo.distillation.teacher_model_name``) is loadable: a built-in model is built (or found
    in the cache) for the run's task without the held-out ``exclude_prompts``."""
    cfg = cfg.model_copy(deep=True)
    exclude_prompts = list(exclude_prompts)
    cfg.policy.model_name = _loadable(cfg, cfg.policy.model_name, "policy.model_name", exclude_prompts)
    distill = cfg.grpo.distillation if cfg.grpo is not None else None
    if distill is not None and distill.enabled and distill.teacher_model_name is not None:
        key = "grpo.distillation.teacher_model_name"
        distill.teacher_model_name = _loadable(cfg, distill.teacher_model_name, key, exclude_prompts)
    return cfg


def _loadable(cfg: MasterConfig, name: str, key: str, exclude: list[str]) -> str:
    if is_builtin(name):
        task_cfg: TaskSettings | None = cfg.env.arithmetic if cfg.env is not None else None
        template = None
        if spec_name(name, key) in REASONING_GYM_MODELS:
            if cfg.data is None or cfg.data.reasoning_gym is None:  # MasterConfig.check refuses it
                raise ConfigError(f"{key}: {name} is warm-started on the run's data.reasoning_gym tasks; set them")
            task_cfg, template = cfg.data.reasoning_gym, cfg.data.prompt_template
        return str(resolve_builtin_model(name, task_cfg, exclude, key=key, run_cfg=cfg, prompt_template=template))
    from core.policy.preflight import check_model_path

    check_model_path(name, key)
    return name


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


def warm_start_config(
    task_cfg: TaskSettings | Mapping[str, Any],
    out_dir: Path | None = None,
    short: str = "arithmetic-llama",
    prompt_template: str | None = None,
) -> SFTRunConfig:
    """The ``dualrl sft`` config that warm-starts built-in model ``short`` (default
    ``arithmetic-llama``) for a task (``out_dir``: where its export and logs go; None gives the
    path-free form the cache key hashes).  A reasoning-gym model trains on ``task_cfg`` (the
    run's ``data.reasoning_gym``) with the run's ``prompt_template`` (None: its config's), from
    core/configs/sft_reasoning_gym.yaml; the others on the arithmetic task's knobs ``task_cfg``."""
    out = Path(out_dir) if out_dir is not None else Path("<build>")
    reasoning_gym = short in REASONING_GYM_MODELS
    path = EMBEDDED_CONFIGS["sft"]
    cfg = load_config(
        path.with_name(REASONING_GYM_WARM_START_CONFIG) if reasoning_gym else path,
        list(WARM_START_OVERRIDES)
        + list(WARM_START_SFT_OVERRIDES.get(short, ()))
        + [
            f"logger.log_dir={out / 'warm_start'}",
            f"checkpointing.checkpoint_dir={out / 'checkpoints'}",
            f"checkpointing.export_hf_dir={out}",
        ],
        schema=SFTRunConfig,
    )
    if reasoning_gym:
        cfg.data.reasoning_gym = ReasoningGymConfig.coerce(task_cfg, "data.reasoning_gym")
        if prompt_template is not None:
            cfg.data.prompt_template = prompt_template
    else:
        cfg.data.arithmetic = ArithmeticTaskConfig.coerce(task_cfg, "data.arithmetic")
    return cfg


def cache_key(
    short: str,
    task_cfg: TaskSettings | Mapping[str, Any] | None,
    exclude: Iterable[str],
    prompt_template: str | None = None,
) -> str:
    shape, warm = BUILTIN_MODELS[short]
    payload = {"version": FORMAT_VERSION, "model": shape, "init_seed": INIT_SEED}
    if warm:  # the SFT config without what cannot change the weights (where logs and files go)
        # Left out: where logs and files go, the mixture-of-experts options (policy.moe, the
        # expert parallelism and a backend's own blocks: exact either way, and the warm starts
        # run torch) and policy.numerics (a warm start always runs the default numerics), which
        # came after the first keys were published.
        left_out: dict[str, Any] = {"logger": True, "checkpointing": True, "policy": {"moe": True, "numerics": True}}
        sft = warm_start_config(task_cfg or {}, short=short, prompt_template=prompt_template).model_dump(
            exclude=left_out, exclude_none=True
        )
        sft["policy"] = _published_spelling(sft["policy"])
        # cluster.cpus_per_slot came after the first keys too; at its default (the published
        # builds' one CPU per slot) it is left out, other values key their own build (a torch
        # worker's thread count can change its reductions' bits).
        if sft["cluster"].get("cpus_per_slot") == ClusterConfig.model_fields["cpus_per_slot"].default:
            del sft["cluster"]["cpus_per_slot"]
        payload.update(warm_start=sft, exclude=sorted(exclude))
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


#: Keys of the policy section added after the first cache keys were published (left out of them).
_ADDED_SINCE_PUBLISHED = frozenset({"parallel.expert_parallel_size"})
#: Policy keys added since, with the value that leaves the weights as they were: left out of the
#: key at that value (a model built before keeps its key), hashed at any other.
_ADDED_AT_DEFAULT = {"sequence_packing.shared_prompts": False}


def _published_spelling(policy: dict[str, Any]) -> dict[str, Any]:
    """The dumped policy section as the published cache keys spelled it: every option one key
    now had a spelling per backend then (each spec's ``renamed`` maps it back), so a model
    built before keeps its key; the backends' own blocks are left out (null in a warm start,
    or added since)."""
    from core.policy.backend_blocks import block_models, renamed_keys

    renamed = renamed_keys()
    shared = {new.split(".")[0] for new in renamed.values()}
    out = {k: v for k, v in policy.items() if k not in shared and k not in block_models()}
    for key, default in _ADDED_AT_DEFAULT.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.get(part) or {}
        if node.get(leaf, default) == default:
            node.pop(leaf, None)
    for old, new in renamed.items():
        if new not in _ADDED_SINCE_PUBLISHED:
            *parents, leaf = old.split(".")
            node = out
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = _dotted(policy, new)
    return out


def _dotted(data: Mapping[str, Any], key: str) -> Any:
    for part in key.split("."):
        data = data[part]
    return data


def resolve_builtin_model(
    name: str,
    task_cfg: TaskSettings | Mapping[str, Any] | None,
    exclude: Iterable[str],
    key: str = "policy.model_name",
    run_cfg: MasterConfig | None = None,
    prompt_template: str | None = None,
) -> Path:
    """The local directory of built-in model ``name`` for this task, building it on first use
    (``run_cfg``: the run that needs it, whose Ray set-up the warm start shares; a reasoning-gym
    model: ``task_cfg`` is the run's ``data.reasoning_gym``, ``prompt_template`` its template)."""
    short = spec_name(name, key)
    settings = _settings(short, task_cfg)
    exclude = frozenset(exclude)
    target = cache_root() / "models" / f"{short}-{cache_key(short, settings, exclude, prompt_template)}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.with_suffix(".lock")):
        if not (target / "config.json").is_file():  # another run may have built it meanwhile
            tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
            try:
                _build(short, settings, exclude, tmp, run_cfg, prompt_template)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _settings(short: str, task_cfg: TaskSettings | Mapping[str, Any] | None) -> TaskSettings | None:
    """The validated task of ``short``'s warm start (None: a random-init model, task-free)."""
    if not BUILTIN_MODELS[short][1]:
        return None
    if short in REASONING_GYM_MODELS:
        return ReasoningGymConfig.coerce(task_cfg, "data.reasoning_gym")
    return ArithmeticTaskConfig.coerce({} if task_cfg is None else task_cfg, "data.arithmetic")


def _build(
    short: str,
    settings: TaskSettings | None,
    exclude: frozenset[str],
    out: Path,
    run_cfg: MasterConfig | None,
    prompt_template: str | None,
) -> None:
    shape, warm = BUILTIN_MODELS[short]
    if not warm or settings is None:
        write_random_init(shape, out, tokenizer=builtin_tokenizer(PREFIX + short))
        return
    from core.algorithms.placement import start_ray

    cfg = warm_start_config(settings, out, short, prompt_template)
    cfg.policy.model_name = str(resolve_builtin_model(cfg.policy.model_name, None, ()))
    task = "the arithmetic task"
    if isinstance(settings, ReasoningGymConfig):
        task = "reasoning-gym tasks " + ", ".join(t.name for t in settings.tasks)
    logger.info(
        "building the built-in model %s%s (once; cached in %s): a `dualrl sft` run of %d steps on %s",
        PREFIX,
        short,
        out.parent,
        cfg.sft.max_num_steps,
        task,
    )
    start = time.perf_counter()
    start_ray(run_cfg or cfg)  # the run's Ray (with its JAX device flags), not one the SFT picks
    run, _summary = execute(lambda: setup_sft(cfg, resolve=resolve_model, exclude=exclude), sft_train, lambda _: {})
    rows = [r for r in run.logger.history if r["split"] == "train"]
    (out / "warm_start.json").write_text(
        json.dumps(
            {
                "steps": len(rows),
                "first_loss": rows[0]["loss"],
                "final_loss": rows[-1]["loss"],
                "seconds": time.perf_counter() - start,
                "backend": cfg.policy.backend,
            }
        )
    )
    logger.info(
        "built %s%s in %.0f s (SFT loss %.3f -> %.3f)",
        PREFIX,
        short,
        time.perf_counter() - start,
        rows[0]["loss"],
        rows[-1]["loss"],
    )


@contextlib.contextmanager
def _lock(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
