"""``dualrl bench``: every backend layout on one workload, one table, measured in one run.

    dualrl bench [--size tiny|small|1b] [--layouts L ...] [--model NAME|PATH] [--device cpu|cuda]
        [--sections throughput refit generation grpo] [--out DIR] [--json FILE]
        [--batch B] [--seq S] [--micro M] [--iters N] [--warmup W] [--precision P] [--threads T]
        [--grpo-new-tokens N] [--grpo-prompts P] [--grpo-group G] [--grpo-micro-batch M] [--grpo-steps S]
        [--grpo-warmup W] [--grpo-packed-row-sequences K] [--[no-]grpo-full-length] [--grpo-async]
        [--grpo-multi-turn N] [--grpo-task arithmetic|reasoning_gym]
    python -m benchmarks.compare [same]

For each layout (``benchmarks.lib.layouts``: ``fsdp1-dp2``, ``dtensor-dp2``, ``dtensor-tp2``,
``dtensor-tp2-sp``, ``jax-fsdp2``, ``jax-tp2``, ...), on the same model, batch and thread / device
budget, one layout alive at a time:

* **throughput**: ``Policy.get_logprobs`` and ``Policy.train`` (NLL, one AdamW step per call) on a
  ragged random batch, tokens/s (real tokens / driver wall seconds), each as ×HF: plain HF eager
  (``AutoModelForCausalLM`` in a child process of its own, same threads, same micro batches) is
  called right after every Policy call, so both sides of a ratio see the same background load
  (``benchmarks.lib.hf``, ``benchmarks.lib.policy`` and ``benchmarks.lib.pairing`` describe the
  runners).  MFU of train and logprobs against the matmul peak measured on the same threads /
  GPU (``benchmarks.lib.machine``: model FLOPs, PaLM accounting), and the datasheet peak on a
  known GPU.  Start-up seconds (Policy construction) and first-call seconds (JAX: compile +
  run), peak memory (CPU: the processes' peak RSS; GPU: peak allocated bytes per worker).
* **refit**: seconds and GB/s of a refit into one vLLM engine over both transports (``ipc``,
  ``collective``), next to a memcpy of the same bytes (``benchmarks.lib.refit`` describes it).
* **generation**: vLLM tokens/s of the engine on the GRPO workload's prompts (one row: the
  engine does not depend on the training backend).
* **grpo**: the main job's full step (``benchmarks.lib.grpo_step``: ``core.algorithms.grpo.grpo_step``
  on the embedded arithmetic config with this model and layout) with its breakdown (generation /
  logprobs / reference / train / refit / reward), and as ×TRL: TRL's ``GRPOTrainer`` on the same
  model, prompt set, group size, completion length and optimizer (``benchmarks.lib.trl_grpo``; needs
  the optional ``bench`` extra, ``pip install -e .[bench]``, else skipped with a note), its steps
  interleaved with the layouts' steps like the HF calls.  ``--grpo-new-tokens`` / ``--grpo-prompts`` /
  ``--grpo-group`` / ``--grpo-micro-batch`` / ``--grpo-steps`` / ``--grpo-warmup`` override the size's
  GRPO workload (the generation row's too; more untimed steps first for layouts that compile a program
  per new shape, as packed JAX rows do: each step's bins set the packed width);
  ``--grpo-full-length`` makes every completion exactly N tokens on both sides;
  ``--grpo-async`` adds an async GRPO row next to every layout's sync one (the engine on a
  device / slot of its own, the policy on the layout's; ``benchmarks.lib.grpo_step``);
  ``--grpo-multi-turn N`` adds a multi-turn GRPO row next to every layout's sync one: the same
  prompts as N-turn episodes of a scripted environment (``benchmarks.lib.multi_turn_env``: a
  fixed observation between turns, so every episode plays N turns of exactly max_new_tokens each)
  in the EpisodePool's Ray actor, with generation per turn, environment step seconds, turns per
  episode and generated / observation tokens.  TRL has no multi-turn GRPO: the row has no ×TRL.
  ``--grpo-task reasoning_gym`` runs the GRPO (and generation) workload of
  ``core/configs/grpo_reasoning_gym.yaml`` instead of the arithmetic one: its reasoning-gym prompts
  (English, up to its ``data.max_input_seq_length`` tokens: the prompts' room) and reward on both
  sides, TRL's included; the size's random Llama reads bytes (the built-in byte tokenizer).
  Dynamic sampling is off on both sides (TRL has none: one generate call per step), and the
  layout name decides the micro batches: a ``-dynamic`` layout (``dtensor-dp2-dynamic``) plans
  token-budget ones, so ``--layouts dtensor-dp2 dtensor-dp2-dynamic`` measures dynamic batching.

Sizes: ``tiny`` (the built-in ~1M-parameter Llama's shape: a CI smoke, seconds per layout),
``small`` (a ~25M-parameter Llama: CPU minutes), ``1b`` (Llama-3.2-1B's shape, bf16: a GPU); all
random weights with the built-in character tokenizer, so the GRPO step runs the real arithmetic
task.  ``--model`` takes any HF model (path or hub id) instead.  ``--device cuda`` runs the
layouts on one GPU each with HF eager on the GPU; without vLLM the refit and generation rows are
skipped with the reason and the GRPO step uses the policy's own HF generation (as TRL does).

A layout that is unknown, does not fit the budget (``--max-devices``: the cores on CPU, the GPUs
on cuda) or fails is reported with its reason and the other layouts still run (exit code 1).
Output: markdown tables on stdout, ``--json``, and ``bench.png`` (bar charts) in ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from benchmarks.lib.compare.baselines import vllm_missing
from benchmarks.lib.compare.plot import plot
from benchmarks.lib.compare.report import report
from benchmarks.lib.compare.run import (
    DEFAULT_LAYOUTS,
    GPU_LAYOUTS,
    GRPO_ROW_KEYS,
    SECTIONS,
    resolve_layouts,
    run_bench,
)
from benchmarks.lib.grpo_step import GRPO_TASKS, task_prompt_room
from benchmarks.lib.refit import TRANSPORTS
from benchmarks.lib.sizes import SIZES, GRPOWorkload
from core.distributed.worker_output import WORKER_LOG_FILENAME


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or "python -m benchmarks.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size", default="small", choices=list(SIZES))
    parser.add_argument(
        "--layouts", nargs="+", help=f"default: {' '.join(DEFAULT_LAYOUTS)} (cuda: {' '.join(GPU_LAYOUTS)})"
    )
    parser.add_argument(
        "--model",
        help="any HF causal LM (path or hub id; a core.testing tiny model name) instead of the size's random Llama",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--out", default="runs/bench", help="directory of bench.png / bench.json")
    parser.add_argument("--json", help="also write the results here (default: OUT/bench.json)")
    for name, kind in (("batch", int), ("seq", int), ("micro", int), ("iters", int), ("warmup", int)):
        parser.add_argument(f"--{name}", type=kind, help="default: the size's")
    parser.add_argument("--precision", choices=["float32", "bfloat16"], help="default: the size's")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads per layout")
    parser.add_argument(
        "--max-devices", type=int, help="devices a layout may use (default: cores on CPU, GPUs on cuda)"
    )
    parser.add_argument("--no-progress", action="store_true")
    grpo = parser.add_argument_group("GRPO step (--sections grpo; the workload flags also set the generation row's)")
    for flag, metavar, field, what, after in (
        ("--grpo-new-tokens", "N", "new_tokens", "completion length, policy.generation.max_new_tokens",
         "; the sequence limit grows with it, the prompts keep their room"),
        ("--grpo-prompts", "P", "prompts", "prompts per step", ""),
        ("--grpo-micro-batch", "M", "micro_batch", "rows per train / logprob micro batch and rank, both sides",
         "; a -dynamic layout's token budget is M x the sequence limit"),
        ("--grpo-steps", "S", "steps", "timed GRPO steps per layout, each paired with a TRL step", ""),
        ("--grpo-warmup", "W", "warmup", "untimed GRPO steps per layout and for TRL before the timed ones",
         "; packed JAX rows compile a program per new packed shape"),
        ("--grpo-packed-row-sequences", "K", "packed_row_sequences",
         "full-length sequences per packed row of a -packed / -shared layout (its token budget)", ""),
    ):  # fmt: skip
        sizes = ", ".join(f"{k} {getattr(v.grpo, field)}" for k, v in SIZES.items() if v.grpo)
        grpo.add_argument(flag, type=int, metavar=metavar, help=f"{what} (default: the size's; {sizes}){after}")
    grpo.add_argument("--grpo-group", type=int, metavar="G", help="generations per prompt, >= 2 (default: the size's)")
    grpo.add_argument(
        "--grpo-full-length",
        action=argparse.BooleanOptionalAction,
        help="every completion exactly max_new_tokens long on both sides: policy.generation.min_new_tokens = "
        "max_new_tokens for dualrl, min_new_tokens in GRPOConfig.generation_kwargs for TRL (eos never sampled "
        "before); default: on when --grpo-new-tokens is given, else off",
    )
    grpo.add_argument(
        "--grpo-async",
        action="store_true",
        help="next to every layout's GRPO row, an async one: the same workload with grpo.async_grpo.enabled, "
        "max_trajectory_age_steps=1, the loss's importance correction, the vLLM engine on a slot / GPU of its "
        "own and the policy on the layout's devices; its step is the trainer's wall time (needs vLLM; on cuda "
        "one GPU more than each layout has)",
    )
    grpo.add_argument(
        "--grpo-task",
        choices=list(GRPO_TASKS),
        help="the prompts and reward of the workload: arithmetic (grpo_arithmetic.yaml, the default) or "
        "reasoning_gym (grpo_reasoning_gym.yaml: its task mix; needs reasoning-gym; the size's random Llama "
        "reads bytes); TRL's row runs the same",
    )
    grpo.add_argument(
        "--grpo-exact",
        action="store_true",
        help="next to every layout's GRPO row, two rows of the same workload generated by the policy's own "
        "sampler (policy.generation.backend hf): with default numerics, and in exact mode (policy.numerics "
        "exact: batch-invariant kernels, the sampler's logprobs bitwise the trainer's) -- exact mode's cost "
        "against the own-generate path and against vLLM, side by side in one run",
    )
    grpo.add_argument(
        "--grpo-multi-turn",
        type=int,
        metavar="N",
        help="next to every layout's GRPO row, a multi-turn one: the same prompts as N-turn episodes (N >= 2) of a "
        "scripted environment (a fixed 12-token observation between turns, every turn max_new_tokens long) stepped "
        "in the EpisodePool's Ray actor; no ×TRL (TRL has no multi-turn GRPO); built-in character tokenizer only",
    )
    return parser


GRPO_WORKLOAD_FLAGS = (
    "grpo_new_tokens",
    "grpo_prompts",
    "grpo_group",
    "grpo_full_length",
    "grpo_task",
    "grpo_micro_batch",
    "grpo_steps",
    "grpo_warmup",
    "grpo_packed_row_sequences",
)


def parse(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    for name in ("batch", "seq", "micro", "iters", "warmup", "precision"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(size, name))
    if args.iters < 1 or args.warmup < 1 or args.threads < 1:
        parser.error("--iters, --warmup and --threads must be >= 1 (the first call compiles on JAX)")
    if args.max_devices is None:
        args.max_devices = _gpu_count() if args.device == "cuda" else (os.cpu_count() or 1)
    args.layouts = args.layouts or (GPU_LAYOUTS if args.device == "cuda" else DEFAULT_LAYOUTS)
    args.layout_objs, args.rejected = resolve_layouts(args.layouts, args)
    args.grpo_work = grpo_workload(parser, args, size)
    args.grpo_task = args.grpo_task or "arithmetic"
    # logical CPUs: a layout, the refit engine's bundle, a GRPO run's colocated slots (CPU slots
    # are processes sharing the cores, not a reservation of them)
    args.ray_cpus = 4 * max(args.threads, args.max_devices) + 4
    args.grpo_generation = "hf" if vllm_missing() else "vllm"
    check_grpo_async(parser, args)
    args.transports, args.repeats, args.bucket_gb = TRANSPORTS, args.iters, None
    return args


def grpo_workload(parser: argparse.ArgumentParser, args: argparse.Namespace, size) -> GRPOWorkload | None:
    """The size's GRPO workload with the ``--grpo-*`` overrides, refused with a clear error
    (``parser.error``: exit 2, nothing started) when a value cannot run."""
    given = [f"--{f.replace('_', '-')}" for f in GRPO_WORKLOAD_FLAGS if getattr(args, f) is not None]
    if given and not {"grpo", "generation"} & set(args.sections):
        parser.error(f"{' '.join(given)}: only --sections grpo and generation use the GRPO workload")
    if args.grpo_async and "grpo" not in args.sections:
        parser.error("--grpo-async adds rows to --sections grpo, which this run does not measure")
    check_grpo_multi_turn(parser, args)
    for flag, value, low in (
        ("--grpo-new-tokens", args.grpo_new_tokens, 1),
        ("--grpo-prompts", args.grpo_prompts, 1),
        ("--grpo-group", args.grpo_group, 2),
        ("--grpo-micro-batch", args.grpo_micro_batch, 1),
        ("--grpo-steps", args.grpo_steps, 1),
        ("--grpo-warmup", args.grpo_warmup, 1),
        ("--grpo-packed-row-sequences", args.grpo_packed_row_sequences, 1),
    ):
        if value is not None and value < low:
            why = " (GRPO's advantage compares a prompt's samples; TRL's GRPOTrainer needs 2)" if low == 2 else ""
            parser.error(f"{flag} must be >= {low}{why}, got {value}")
    check_grpo_task(parser, args)
    if size.grpo is None:
        return None
    full = args.grpo_full_length if args.grpo_full_length is not None else args.grpo_new_tokens is not None
    work = size.grpo.with_overrides(args.grpo_new_tokens, args.grpo_prompts, args.grpo_group, full)
    given_fields = ("micro_batch", "steps", "warmup", "packed_row_sequences")
    work = dataclasses.replace(
        work, **{f: getattr(args, f"grpo_{f}") for f in given_fields if getattr(args, f"grpo_{f}") is not None}
    )
    if args.grpo_task not in (None, "arithmetic"):  # the task's prompts keep their own room
        work = dataclasses.replace(work, seq=task_prompt_room(args.grpo_task) + work.new_tokens)
    positions = size.shape.get("max_position_embeddings")
    if args.model is None and positions and work.seq > positions:
        parser.error(
            f"--grpo-new-tokens {work.new_tokens}: prompt room {work.prompt_room} + {work.new_tokens} new tokens = "
            f"{work.seq} > the {args.size} model's {positions} positions"
        )
    if "grpo" in args.sections:
        split = [lay.name for lay in args.layout_objs if work.samples % lay.dp]
        if split:
            parser.error(
                f"{work.prompts} prompts x {work.group} generations = {work.samples} samples per step do not split "
                f"over the data-parallel ranks of {', '.join(split)} (--grpo-prompts / --grpo-group)"
            )
    return work


def check_grpo_task(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--grpo-task reasoning_gym`` needs the package, and no multi-turn row (its scripted
    observation is sized in the character tokenizer's tokens)."""
    if args.grpo_task in (None, "arithmetic"):
        return
    from core.environments.reasoning_gym_checks import missing_package

    missing = missing_package()
    if missing:
        parser.error(f"--grpo-task {args.grpo_task}: {missing}")
    if args.grpo_multi_turn is not None:
        parser.error(f"--grpo-task {args.grpo_task} with --grpo-multi-turn: the multi-turn row is arithmetic only")


def check_grpo_multi_turn(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--grpo-multi-turn N``: N >= 2 turns, the grpo section, the built-in tokenizer (the
    scripted observation's length, which the sequence limit counts on, is in its tokens)."""
    turns = args.grpo_multi_turn
    if turns is None:
        return
    if turns < 2:
        parser.error(f"--grpo-multi-turn must be >= 2 (turns per episode; 1 is the sync row), got {turns}")
    if "grpo" not in args.sections:
        parser.error("--grpo-multi-turn adds rows to --sections grpo, which this run does not measure")
    if args.model is not None:
        parser.error(
            "--grpo-multi-turn with --model: the scripted observation is sized in the built-in character "
            "tokenizer's tokens (benchmarks.lib.multi_turn_env); run it on the size's random Llama"
        )


def check_grpo_async(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--grpo-async`` needs vLLM (async GRPO generates with engines of their own while the
    policy trains; the policy's own HF generate cannot) and, on cuda, a GPU for the engine
    beside every layout's."""
    if not args.grpo_async:
        return
    missing = vllm_missing()
    if missing:
        parser.error(
            f"--grpo-async needs vLLM: async GRPO generates with vLLM engines on devices of their own while the "
            f"policy trains (the policy's own HF generate cannot run beside its training); {missing}"
        )
    if args.device == "cuda":
        short = [lay.name for lay in args.layout_objs if lay.devices + 1 > args.max_devices]
        if short:
            parser.error(
                f"--grpo-async --device cuda: the engine needs a GPU of its own beside the policy's; "
                f"{', '.join(short)} leave none of the {args.max_devices} GPU(s) (--max-devices)"
            )


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse(argv, prog)
    if args.device == "cuda" and not args.max_devices:
        print("bench: --device cuda: no CUDA GPU is visible", file=sys.stderr)
        return 2
    from tqdm import tqdm

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    grpo_rows = ("grpo" in args.sections) * (1 + args.grpo_async + bool(args.grpo_multi_turn) + 2 * args.grpo_exact)
    per_layout = ("throughput" in args.sections or "refit" in args.sections) + grpo_rows
    phases = len(args.layout_objs) * per_layout + ("generation" in args.sections)
    with tqdm(total=phases, disable=args.no_progress, file=sys.stderr, dynamic_ncols=True) as progress:
        results, bench = run_bench(args, progress)
    text = report(results, bench.config)
    json_path = Path(args.json) if args.json else out_dir / "bench.json"
    json_path.write_text(json.dumps(results, indent=2, default=str))
    png = plot(results, out_dir / "bench.png")
    print(text)
    print(f"\n{results['seconds']:.0f} s; JSON {json_path}; chart {png}; worker output {out_dir / WORKER_LOG_FILENAME}")
    failed = args.rejected or any(
        "error" in r or "skipped" in r or any("error" in (r.get(k) or {}) for k in GRPO_ROW_KEYS)
        for r in results["layouts"]
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
