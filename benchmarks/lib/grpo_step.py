"""The full GRPO step of the main job, timed phase by phase on one layout (``dualrl bench``'s GRPO rows).

The step is :func:`core.algorithms.grpo.grpo_step` itself, on a run built by
:func:`core.algorithms.grpo_setup.setup_grpo` from the embedded ``grpo_arithmetic.yaml``
(built-in arithmetic prompts and exact-answer reward, vLLM generation colocated with the
policy: weights refit over ``ipc``) with the benchmark's model, layout and workload put in
by dotted overrides -- so the row times what ``dualrl grpo`` runs, nothing re-implemented.
Validation, checkpoints and every log sink are off.  Each step's ``timing/*`` metrics are
its breakdown: refit, generation, reward, logprobs (``prev_logprobs``), reference, train.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from benchmarks.lib.layouts import Layout
from benchmarks.lib.sizes import GRPOWorkload

if TYPE_CHECKING:
    from core.algorithms.config import GRPORunConfig

PHASES = ("generation", "logprobs", "reference", "train", "refit", "reward")


def layout_overrides(layout: Layout, jax_cpu_slots: int | None = None) -> list[str]:
    """What puts a run on ``layout``: backend, slots, parallel sizes.  A JAX worker on a CPU
    machine gets ``jax_cpu_slots`` CPUs (its XLA host devices come from ``XLA_FLAGS``, which the
    benchmark's Ray session sets), elsewhere one slot per device."""
    if layout.is_jax and jax_cpu_slots:
        # the mesh's fsdp axis fills the actor's devices (checked after start-up: mesh_mismatch)
        slots = max(layout.tp * layout.cp, jax_cpu_slots - jax_cpu_slots % (layout.tp * layout.cp))
        return [
            f"policy.backend={layout.backend}",
            f"cluster.gpus_per_node={slots}",
            "cluster.num_nodes=1",
            "policy.jax_cfg.fsdp_size=-1",
            f"policy.jax_cfg.tensor_parallel_size={layout.tp}",
            *_sequence_overrides(layout),
        ]
    out = [f"policy.backend={layout.backend}", f"cluster.gpus_per_node={layout.devices}", "cluster.num_nodes=1"]
    if layout.is_jax:
        out += [f"policy.jax_cfg.fsdp_size={layout.dp}", f"policy.jax_cfg.tensor_parallel_size={layout.tp}"]
    elif layout.backend == "torch_dtensor":
        out += [
            f"policy.dtensor_cfg.tensor_parallel_size={layout.tp}",
            f"policy.dtensor_cfg.sequence_parallel={str(layout.sp).lower()}",
            f"policy.dtensor_cfg.compile={str(layout.compiled).lower()}",
        ]
    return out + _sequence_overrides(layout)


def _sequence_overrides(layout: Layout) -> list[str]:
    """Context parallel size, the sequence multiple it needs, and sequence packing."""
    out = []
    if layout.cp > 1:
        section = "jax_cfg" if layout.is_jax else "dtensor_cfg"
        out += [
            f"policy.{section}.context_parallel_size={layout.cp}",
            f"policy.make_sequence_length_divisible_by={layout.sequence_multiple}",
        ]
    if layout.packed:
        out += ["policy.sequence_packing.enabled=true"]  # the config's own budgets
    return out


def grpo_overrides(
    layout: Layout,
    work: GRPOWorkload,
    model_path: str,
    tokenizer_path: str,
    precision: str,
    log_dir: str,
    generation: str = "vllm",
    jax_cpu_slots: int | None = None,
) -> list[str]:
    gbs = work.samples
    mbs = min(work.micro_batch, gbs // layout.dp)
    return [
        *layout_overrides(layout, jax_cpu_slots),
        f"policy.model_name={model_path}",
        f"policy.tokenizer.name={tokenizer_path}",
        f"policy.precision={precision}",
        f"policy.generation.vllm_cfg.precision={precision}",
        f"policy.train_global_batch_size={gbs}",
        f"policy.train_micro_batch_size={mbs}",
        f"policy.logprob_batch_size={mbs}",
        f"policy.generation_batch_size={gbs}",
        f"policy.max_total_sequence_length={work.seq}",
        f"policy.generation.vllm_cfg.max_model_len={work.seq}",
        f"policy.generation.max_new_tokens={work.new_tokens}",
        f"policy.generation.backend={generation}",
        # a constant lr: the default's 400-step decay schedule is no part of a step's cost
        "policy.scheduler=null",
        f"grpo.num_prompts_per_step={work.prompts}",
        f"grpo.num_generations_per_prompt={work.group}",
        f"grpo.max_num_steps={work.warmup + work.steps}",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "grpo.max_val_samples=8",
        "grpo.val_batch_size=8",
        f"logger.log_dir={log_dir}",
        "logger.jsonl_enabled=false",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
        "logger.plot_enabled=false",
        "logger.num_val_samples_to_print=0",
        f"checkpointing.checkpoint_dir={log_dir}/checkpoints",
        "checkpointing.enabled=false",
    ]


def grpo_config(
    layout: Layout,
    work: GRPOWorkload,
    model_path: str,
    tokenizer_path: str,
    precision: str,
    log_dir: str,
    generation: str = "vllm",
    jax_cpu_slots: int | None = None,
) -> GRPORunConfig:
    """The embedded GRPO config on this layout, model and workload (``generation``: vllm | hf)."""
    from core.algorithms.config import GRPORunConfig
    from core.config import EMBEDDED_CONFIGS, load_config

    return load_config(
        EMBEDDED_CONFIGS["grpo"],
        grpo_overrides(layout, work, model_path, tokenizer_path, precision, log_dir, generation, jax_cpu_slots),
        schema=GRPORunConfig,
    )


def measure_grpo(
    layout: Layout,
    work: GRPOWorkload,
    model_path: str,
    tokenizer_path: str,
    precision: str,
    log_dir: str,
    generation: str = "vllm",
    jax_cpu_slots: int | None = None,
) -> dict[str, Any]:
    """Set up the run (timed as ``startup_s``), ``warmup`` untimed steps, ``steps`` timed ones;
    the median of each phase and of the whole step, and the last step's rollout facts."""
    from core.algorithms.grpo import grpo_step
    from core.algorithms.grpo_setup import setup_grpo
    from core.algorithms.warm_start import resolve_model

    cfg = grpo_config(layout, work, model_path, tokenizer_path, precision, log_dir, generation, jax_cpu_slots)
    t0 = time.perf_counter()
    run = setup_grpo(cfg, log=lambda _msg: None, resolve=resolve_model)
    try:
        startup = time.perf_counter() - t0
        mismatch = mesh_mismatch(run.policy, layout)
        if mismatch:
            raise RuntimeError(mismatch)
        steps = [grpo_step(run, step) for step in range(1, work.warmup + work.steps + 1)]
    finally:
        run.close()
    timed = steps[work.warmup :]
    out = {
        "startup_s": startup,
        "step_s": statistics.median(m["step_time_s"] for m in timed),
        "steps": len(timed),
        "samples": work.samples,
        "phases_s": {p: statistics.median(m.get(f"timing/{p}_s", 0.0) for m in timed) for p in PHASES},
        "first_step_s": steps[0]["step_time_s"],
    }
    last = timed[-1]
    for key in ("reward_mean", "response_length_mean", "token_mult_prob_error", "refit_gb_per_s"):
        if key in last:
            out[key] = last[key]
    return out


def mesh_mismatch(policy, layout: Layout) -> str | None:
    """Why the run's JAX mesh is not the layout's (a CPU actor's devices come from XLA_FLAGS), or None."""
    if not layout.is_jax:
        return None
    mesh = policy.get_gpu_info()[0].get("mesh") or {}
    if (mesh.get("fsdp"), mesh.get("cp", 1), mesh.get("tp")) != (layout.dp, layout.cp, layout.tp):
        return (
            f"layout {layout.name!r}: the GRPO run's JAX mesh is {mesh}, not fsdp={layout.dp} x cp={layout.cp} "
            f"x tp={layout.tp}"
        )
    return None


def training_prompts(cfg: GRPORunConfig, tokenizer, count: int) -> list:
    """The first ``count`` training prompts of the run's data (``PromptDatum``: formatted text,
    ids, ground truth): what a baseline trainer (TRL) and the generation row get, so every side
    sees the same prompt set."""
    from core.datasets import build_prompt_datasets

    train_set, _ = build_prompt_datasets(
        cfg.data, cfg.env.arithmetic, tokenizer, num_val=cfg.grpo.max_val_samples, seed=cfg.grpo.seed
    )
    available = count if train_set.size is None else min(count, train_set.size)
    return [train_set[i] for i in range(available)]
