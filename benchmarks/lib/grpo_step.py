"""The full GRPO step of the main job, timed phase by phase on one layout (``dualrl bench``'s GRPO rows).

The step is :func:`core.algorithms.grpo.grpo_step` itself, on a run built by
:func:`core.algorithms.grpo_setup.setup_grpo` from the embedded ``grpo_arithmetic.yaml``
(built-in arithmetic prompts and exact-answer reward, vLLM generation colocated with the
policy: weights refit over ``ipc``) with the benchmark's model, layout and workload put in
by dotted overrides -- so the row times what ``dualrl grpo`` runs, nothing re-implemented.
Validation, checkpoints and every log sink are off.  Each step's ``timing/*`` metrics are
its breakdown: refit, generation, reward, logprobs (``prev_logprobs``), reference, train.

``async_grpo=True`` measures the same workload as async GRPO (:mod:`core.algorithms.async_grpo`,
the loop ``dualrl grpo`` runs with ``grpo.async_grpo.enabled``): ``max_trajectory_age_steps=1``,
the loss's importance correction on, the vLLM engine on a cluster of its own (one slot / GPU,
``collective`` refit) and the policy on the layout's devices.  Its step is the trainer's wall
time (``step_time_s``) and its ``timing/*`` phases are the trainer's -- ``wait_refit`` (waiting
until the rollouts meant for the old weights exist, then the refit), ``wait_rollouts``, logprobs,
reference, train -- while the producer thread's generation and reward seconds
(``async/generation_s``, ``async/reward_s``) overlap them and are reported apart, never added.

``task`` picks the embedded config whose prompts, reward and generation settings the step runs
(``dualrl bench --grpo-task``, :data:`GRPO_TASKS`): ``arithmetic`` (``grpo_arithmetic.yaml``, the
default) or ``reasoning_gym`` (``grpo_reasoning_gym.yaml``: its reasoning-gym task mix, English
prompts of up to its ``data.max_input_seq_length`` tokens, each task's own ``score_answer``); a
size's random Llama takes that task's built-in tokenizer (:func:`task_tokenizer`).  Dynamic
sampling is off on every task (one generate call per step, as TRL's step), and the layout name
decides the micro batches (``-dynamic``: token budgets, ``-packed`` / ``-shared``: packed rows;
:func:`token_batching_overrides`).

``multi_turn=N`` measures the same workload as multi-turn GRPO (``dualrl bench --grpo-multi-turn N``):
the scripted environment of :mod:`benchmarks.lib.multi_turn_env` (every episode exactly N turns,
a fixed 12-token observation between turns) stepped in the EpisodePool's Ray actor as a run
steps any multi-turn environment, ``grpo.max_rollout_turns=N``, every turn exactly
``new_tokens`` long (min_new_tokens) and the sequence limit grown to fit the whole
conversation.  Its ``generation`` phase is the N generate calls, ``reward`` the environment's
reset / step calls; the row adds turns per episode and generated / observation tokens.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.lib.layouts import Layout, LayoutError
from benchmarks.lib.multi_turn_env import ENV_NAME, OBSERVATION_TOKENS
from benchmarks.lib.sizes import GRPOWorkload

if TYPE_CHECKING:
    from core.algorithms.config import GRPORunConfig

PHASES = ("generation", "logprobs", "reference", "train", "refit", "reward")
#: The async step's phases (the trainer's ``timing/*``): they add up to its step.
ASYNC_PHASES = ("wait_refit", "wait_rollouts", "logprobs", "reference", "train")
#: The async producer's phases (``async/*_s``): they overlap the trainer's.
PRODUCER_PHASES = ("generation", "reward")
#: TRL GRPOTrainer's step, split (``benchmarks.lib.trl_grpo``'s step reply): HF generate, the
#: reference pass, the old-logprob pass (0 when off, as dualrl's fused step), the rest (train).
TRL_PHASES = ("generation_s", "reference_s", "old_logprobs_s", "train_s")
#: Where the train phase's seconds go (``train_call/*_s``, ``core.interfaces.CallTiming``).
TRAIN_CALL_PARTS = ("worker", "dispatch", "checks", "shard")
#: What makes a GRPO run async (besides the layout's own devices for the policy).
ASYNC_OVERRIDES = (
    "grpo.async_grpo.enabled=true",
    "grpo.async_grpo.max_trajectory_age_steps=1",
    "loss_fn.use_importance_sampling_correction=true",
    "policy.generation.colocated.enabled=false",
    "policy.generation.colocated.resources.gpus_per_node=1",
    "policy.generation.colocated.resources.num_nodes=1",
)


#: ``dualrl bench --grpo-task``: the embedded GRPO config of each task, and the built-in model
#: whose tokenizer (and vocabulary) a size's random Llama takes for it.
GRPO_TASKS: dict[str, tuple[str, str]] = {
    "arithmetic": ("grpo_arithmetic.yaml", "builtin:arithmetic-llama"),
    "reasoning_gym": ("grpo_reasoning_gym.yaml", "builtin:reasoning-gym-llama"),
}


def task_config_path(task: str) -> Path:
    from core.config import EMBEDDED_CONFIGS

    return EMBEDDED_CONFIGS["grpo"].with_name(GRPO_TASKS[task][0])


def task_prompt_room(task: str) -> int:
    """The task config's longest prompt in tokens (``data.max_input_seq_length``)."""
    from core.algorithms.config import GRPORunConfig
    from core.config import load_config

    room = load_config(task_config_path(task), schema=GRPORunConfig).data.max_input_seq_length
    assert room is not None  # GRPORunConfig requires it
    return room


def task_tokenizer(task: str) -> tuple[Any, int]:
    """(the task's built-in tokenizer, its model's vocabulary size): what a random Llama needs
    to read the task's prompts."""
    from core.models.builtin import BUILTIN_MODELS, PREFIX, builtin_tokenizer

    name = GRPO_TASKS[task][1]
    return builtin_tokenizer(name), BUILTIN_MODELS[name.removeprefix(PREFIX)][0]["vocab_size"]


def multi_turn_sequence(work: GRPOWorkload, turns: int) -> int:
    """The sequence limit of an N-turn conversation: the prompt's room, N turns of
    ``new_tokens``, N - 1 observations."""
    return work.prompt_room + turns * work.new_tokens + (turns - 1) * OBSERVATION_TOKENS


def multi_turn_overrides(work: GRPOWorkload, turns: int) -> list[str]:
    """What makes the workload an N-turn one (the module docstring); after the others (last wins)."""
    seq = multi_turn_sequence(work, turns)
    return [
        f"env.name={ENV_NAME}",
        f"env.kwargs.turns={turns}",
        "env.num_workers=1",
        f"grpo.max_rollout_turns={turns}",
        f"policy.generation.min_new_tokens={work.new_tokens}",
        f"policy.max_total_sequence_length={seq}",
        f"policy.generation.vllm_cfg.max_model_len={seq}",
    ]


def layout_overrides(layout: Layout, cpu_threads: int | None = None) -> list[str]:
    """What puts a run on ``layout``: backend, slots, parallel sizes.  On a CPU machine every
    layout gets ``cpu_threads`` CPUs in all (``dualrl bench --threads``, as every other section):
    a JAX worker one XLA host device per CPU (from ``XLA_FLAGS``, which the benchmark's Ray
    session sets), a torch layout's workers ``cpu_threads / workers`` each
    (``cluster.cpus_per_slot``: their threads, and the engines colocated on each slot).  On a
    GPU (``cpu_threads`` None) one slot per device."""
    if layout.lora:  # no LoRA settings here: the layout would run the base model
        raise LayoutError(f"layout {layout.name!r}: -lora (policy.lora) is measured by dualrl parity only")
    settings = layout.policy_settings()  # packing, if on, with the config's own budgets
    devices, cpus_per_slot = layout.devices, 1
    if layout.per_host and cpu_threads:
        # the mesh's fsdp axis fills the actor's devices (checked after start-up: mesh_mismatch)
        devices = max(layout.tp * layout.cp, cpu_threads - cpu_threads % (layout.tp * layout.cp))
        settings["parallel.fsdp_size"] = -1
    elif cpu_threads:
        cpus_per_slot = max(1, cpu_threads // devices)
    out = [f"policy.{key}={_yaml(value)}" for key, value in settings.items()]
    return out + [f"cluster.gpus_per_node={devices}", "cluster.num_nodes=1", f"cluster.cpus_per_slot={cpus_per_slot}"]


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def grpo_overrides(
    layout: Layout,
    work: GRPOWorkload,
    model_path: str,
    tokenizer_path: str,
    precision: str,
    log_dir: str,
    generation: str = "vllm",
    cpu_threads: int | None = None,
    async_grpo: bool = False,
    multi_turn: int | None = None,
    numerics: str = "default",
) -> list[str]:
    """The dotted overrides of the embedded GRPO config for this layout and workload;
    ``work.full_length``: ``min_new_tokens = max_new_tokens``; ``async_grpo``:
    :data:`ASYNC_OVERRIDES`; ``multi_turn``: :func:`multi_turn_overrides` (the module docstring);
    ``numerics``: ``policy.numerics`` (exact mode samples with ``generation`` hf)."""
    gbs = work.samples
    mbs = micro_batch(work, layout.dp)
    return [
        *layout_overrides(layout, cpu_threads),
        *token_batching_overrides(layout, mbs * work.seq, work.packed_row_sequences * work.seq),
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
        f"policy.generation.min_new_tokens={work.new_tokens if work.full_length else 0}",
        f"policy.generation.backend={generation}",
        f"policy.numerics={numerics}",
        # a constant lr: the default's 400-step decay schedule is no part of a step's cost
        "policy.scheduler=null",
        f"grpo.num_prompts_per_step={work.prompts}",
        # one generate call per step, as TRL's GRPOTrainer (it has no DAPO dynamic sampling,
        # which the reasoning-gym recipe turns on and which would triple the generation)
        "grpo.use_dynamic_sampling=false",
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
        *(ASYNC_OVERRIDES if async_grpo else ()),
        *(multi_turn_overrides(work, multi_turn) if multi_turn else ()),
    ]


def token_batching_overrides(layout: Layout, budget: int, packed_budget: int) -> list[str]:
    """The layout name decides the micro batches, whatever the task config says: a ``-dynamic``
    layout plans token-budget micro batches of ``budget`` tokens (a fixed micro batch's padded
    tokens: as many rows where they are short), a ``-packed`` / ``-shared`` one packed rows of
    ``packed_budget`` tokens, any other one fixed rows."""
    out = [f"policy.sequence_packing.enabled={_yaml(layout.packed)}"]
    out.append(f"policy.sequence_packing.shared_prompts={_yaml(layout.shared)}")
    if layout.packed:
        out += [f"policy.sequence_packing.{key}={packed_budget}" for key in ("train_mb_tokens", "logprob_mb_tokens")]
    if not layout.dynamic:
        return [*out, "policy.dynamic_batching.enabled=false"]
    return out + [
        f"policy.dynamic_batching.{key}={_yaml(value)}" for key, value in layout.dynamic_batching(budget).items()
    ]


def micro_batch(work: GRPOWorkload, dp: int) -> int:
    """Rows per train / logprob micro batch and rank: the largest divisor of the rank's share
    of the samples that is at most ``work.micro_batch``."""
    local = work.samples // dp
    return max(d for d in range(1, min(work.micro_batch, local) + 1) if local % d == 0)


def grpo_config(
    layout: Layout,
    work: GRPOWorkload,
    model_path: str,
    tokenizer_path: str,
    precision: str,
    log_dir: str,
    generation: str = "vllm",
    cpu_threads: int | None = None,
    async_grpo: bool = False,
    multi_turn: int | None = None,
    task: str = "arithmetic",
    numerics: str = "default",
) -> GRPORunConfig:
    """The embedded GRPO config of ``task`` on this layout, model and workload (``generation``:
    vllm | hf)."""
    from core.algorithms.config import GRPORunConfig
    from core.config import load_config

    overrides = grpo_overrides(
        layout,
        work,
        model_path,
        tokenizer_path,
        precision,
        log_dir,
        generation,
        cpu_threads,
        async_grpo,
        multi_turn,
        numerics,
    )
    return load_config(task_config_path(task), overrides, schema=GRPORunConfig)


def measure_grpo(
    layout: Layout,
    work: GRPOWorkload,
    model_path: str,
    tokenizer_path: str,
    precision: str,
    log_dir: str,
    generation: str = "vllm",
    cpu_threads: int | None = None,
    async_grpo: bool = False,
    multi_turn: int | None = None,
    task: str = "arithmetic",
    numerics: str = "default",
) -> dict[str, Any]:
    """Set up the run (timed as ``startup_s``), ``warmup`` untimed steps, ``steps`` timed ones;
    the median of each phase and of the whole step, and the last step's rollout facts.  Async:
    the steps of :func:`core.algorithms.async_grpo.async_grpo_loop`; multi-turn: N-turn
    episodes (the module docstring)."""
    from core.algorithms.grpo import grpo_step
    from core.algorithms.grpo_setup import setup_grpo
    from core.algorithms.warm_start import resolve_model

    cfg = grpo_config(
        layout,
        work,
        model_path,
        tokenizer_path,
        precision,
        log_dir,
        generation,
        cpu_threads,
        async_grpo,
        multi_turn,
        task,
        numerics,
    )
    total = work.warmup + work.steps
    t0 = time.perf_counter()
    run = setup_grpo(cfg, resolve=resolve_model)
    try:
        startup = time.perf_counter() - t0
        mismatch = mesh_mismatch(run.policy, layout)
        if mismatch:
            raise RuntimeError(mismatch)
        threads = compute_threads(run)
        if async_grpo:
            from core.algorithms.async_grpo import async_grpo_loop

            step_fn = async_grpo_loop(run, 1, total).step  # its producer stops with run.close()
        else:
            step_fn = lambda step: grpo_step(run, step)  # noqa: E731
        steps = [step_fn(step) for step in range(1, total + 1)]
    finally:
        run.close()
    out = {**summarize(steps, work, startup, async_grpo), "threads": threads}
    return {**out, **multi_turn_facts(steps[work.warmup :], multi_turn)} if multi_turn else out


def compute_threads(run) -> dict[str, list[int | None]]:
    """The compute threads each policy worker and each engine has: torch's own count (None for a
    JAX worker: XLA's pool spans the CPUs the process may run on) and the engines' (empty when the
    policy generates itself)."""
    policy = [info.get("torch_num_threads") for info in run.policy.get_gpu_info()]
    generation = run.engine.generation
    return {"policy": policy, "engines": list(generation.engine_threads) if generation is not None else []}


def summarize(steps: list[dict[str, float]], work: GRPOWorkload, startup: float, async_grpo: bool) -> dict[str, Any]:
    """A GRPO row from its steps' metrics: medians over the timed steps (after ``work.warmup``)."""

    def med(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in timed)

    timed = steps[work.warmup :]
    phases = ASYNC_PHASES if async_grpo else PHASES
    out: dict[str, Any] = {
        "mode": "async" if async_grpo else "sync",
        "startup_s": startup,
        "step_s": med("step_time_s"),
        "steps": len(timed),
        "samples": work.samples,
        "phases_s": {p: med(f"timing/{p}_s") for p in phases},
        "first_step_s": steps[0]["step_time_s"],
        "response_length_mean": med("response_length_mean"),
    }
    if all("train_call/worker_s" in m for m in timed):
        out["train_call_s"] = {p: med(f"train_call/{p}_s") for p in TRAIN_CALL_PARTS}
    if async_grpo:
        out["producer_s"] = {p: med(f"async/{p}_s") for p in PRODUCER_PHASES}
        out["refit_s"] = med("refit/seconds")  # inside wait_refit
        for key in ("trajectory_age_mean", "trainer_idle_s", "engine_idle_s"):
            out[key] = med(f"async/{key}")
    last = timed[-1]
    for key in ("reward_mean", "token_mult_prob_error"):
        if key in last:
            out[key] = last[key]
    return out


def multi_turn_facts(timed: list[dict[str, float]], turns: int) -> dict[str, Any]:
    """What a multi-turn row adds (medians over the timed steps): turns per episode, generate
    calls, seconds per generate call, generated and observation tokens per episode, and the
    episodes that did not play every turn (truncated or failed: 0 when the workload is fair)."""

    def med(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in timed)

    calls = med("multi_turn/turns_max")
    return {
        "mode": f"multi-turn {turns}",
        "turns": turns,
        "turns_mean": med("multi_turn/turns_mean"),
        "generate_calls": calls,
        "generation_per_turn_s": med("timing/generation_s") / calls if calls else None,
        "generated_tokens_mean": med("response_length_mean"),
        "observation_tokens_mean": med("multi_turn/observation_tokens_mean"),
        "short_episodes": med("multi_turn/truncated") + med("multi_turn/episode_errors"),
    }


def mesh_mismatch(policy, layout: Layout) -> str | None:
    """Why the run's JAX mesh is not the layout's (a CPU actor's devices come from XLA_FLAGS), or None."""
    if not layout.per_host:
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
