"""What every layout of a ``dualrl bench`` run is measured against or refit into, each started
once per run: plain HF eager (a child process, paired call by call), TRL's ``GRPOTrainer``
(a child process, paired step by step) and the vLLM engine (refit target and generation row)."""

from __future__ import annotations

import importlib.util
import statistics
import time
from typing import TYPE_CHECKING

from benchmarks.lib import trl_grpo
from benchmarks.lib.bench import Bench
from benchmarks.lib.errors import error_text
from benchmarks.lib.grpo_step import grpo_config, training_prompts
from benchmarks.lib.hf import HFRunner
from benchmarks.lib.layouts import parse_layout
from benchmarks.lib.pairing import Probe, new_result
from benchmarks.lib.refit import REFIT_LORA, Engine, engine_config

if TYPE_CHECKING:
    from core.algorithms.config import GRPORunConfig


def vllm_missing() -> str | None:
    return None if importlib.util.find_spec("vllm") else "vLLM is not installed on this machine"


def start_baselines(bench: Bench) -> None:
    if "throughput" in bench.args.sections:
        try:
            bench.hf = Probe(HFRunner(bench.model_path, bench.args))
            bench.hf_row = new_result(bench.hf)
        except Exception as err:  # noqa: BLE001 -- reported in its row; the layouts still run
            bench.hf_row = {"case": "hf", "workers": 1, "error": error_text(err)}
    if "grpo" in bench.args.sections:
        start_trl(bench)


def grpo_run_config(bench: Bench, log_dir: str, generation: str = "vllm") -> GRPORunConfig:
    """The GRPO step's config on one torch worker: the prompts a baseline gets come from it."""
    args = bench.args
    layout = parse_layout("fsdp1-dp1")
    return grpo_config(
        layout, bench.size.grpo, bench.model_path, bench.tokenizer_path, args.precision, log_dir, generation
    )


def start_trl(bench: Bench) -> None:
    if trl_grpo.trl_version() is None:
        bench.notes.append("TRL GRPOTrainer row skipped: trl is not installed (pip install -e .[bench])")
        return
    if bench.args.device == "cuda":  # its runner trains on the CPU (use_cpu): no fair GPU baseline yet
        bench.notes.append("TRL GRPOTrainer row skipped: benchmarks.lib.trl_grpo runs TRL on the CPU only")
        return
    work = bench.size.grpo
    cfg = grpo_run_config(bench, str(bench.tmp / "trl"), bench.args.grpo_generation)
    items = training_prompts(cfg, bench.tokenizer, 16 * work.prompts)
    spec = trl_grpo.spec_from_dualrl(
        cfg.to_dict(),
        [p.prompt for p in items],
        [str(p.metadata["ground_truth"]) for p in items],
        bench.model_path,
        bench.tokenizer_path,
    )
    try:
        (bench.tmp / "trl").mkdir(parents=True, exist_ok=True)
        bench.trl = trl_grpo.TRLGRPORunner(spec, bench.tmp / "trl", bench.args.threads)
        for _ in range(work.warmup):
            bench.trl.step()
        bench.notes.append(
            f"TRL {trl_grpo.trl_version()} GRPOTrainer: HF generate, {work.prompts} prompts x "
            f"{work.group}, {work.new_tokens} new tokens, one optimizer step per generation batch"
        )
    except Exception as err:  # noqa: BLE001
        bench.notes.append(f"TRL GRPOTrainer row failed: {error_text(err)}")
        bench.trl = None


def engine(bench: Bench) -> Engine:
    """The shared vLLM engine (started on first use, replaced if it died), with the model's own
    weights loaded at start (``load_format: auto``): the generation row can run on it without a
    refit (a run of ``--sections generation`` alone, or after Ray restarted for a JAX layout);
    the refit rows overwrite them."""
    if bench.engine is not None and not bench.engine.alive():
        bench.engine.close()
        bench.engine = None
    if bench.engine is None:
        cfg = engine_config(bench.model_path, bench.tokenizer_path, bench.args)
        cfg["generation"]["vllm_cfg"]["load_format"] = "auto"
        work = bench.size.grpo
        if work is not None:  # the generation row samples the GRPO workload's completions
            cfg["max_total_sequence_length"] = max(cfg["max_total_sequence_length"], work.seq)
            vllm = cfg["generation"]["vllm_cfg"]
            vllm["max_model_len"] = max(vllm["max_model_len"], cfg["max_total_sequence_length"])
            cfg["generation"]["max_new_tokens"] = work.new_tokens
            cfg["generation"]["min_new_tokens"] = work.new_tokens if work.full_length else 0
        bench.engine = Engine(bench.model_path, bench.tokenizer_path, bench.tokenizer, bench.args, cfg=cfg)
    return bench.engine


def lora_engine(bench: Bench) -> Engine:
    """The engine of ``-lora`` layouts' adapter rows: LoRA enabled (``policy.lora.refit:
    adapter`` at ``refit.REFIT_LORA``), started on first use, replaced if it died."""
    if bench.lora_engine is not None and not bench.lora_engine.alive():
        bench.lora_engine.close()
        bench.lora_engine = None
    if bench.lora_engine is None:
        cfg = engine_config(bench.model_path, bench.tokenizer_path, bench.args)
        cfg["lora"].update(enabled=True, refit="adapter", **REFIT_LORA)
        bench.lora_engine = Engine(
            bench.model_path, bench.tokenizer_path, bench.tokenizer, bench.args, cfg=cfg, name="bench-refit-vllm-lora"
        )
    return bench.lora_engine


def generation_row(bench: Bench) -> dict:
    """vLLM tokens/s on the GRPO workload's prompts x group and completion length (sampling, the
    engine's current weights)."""
    from core.algorithms.rollouts import prompt_batch

    work = bench.size.grpo
    cfg = grpo_run_config(bench, str(bench.tmp / "gen"))
    items = training_prompts(cfg, bench.tokenizer, work.prompts)
    batch = prompt_batch([p.input_ids for p in items], work.group, bench.tokenizer.pad_token_id)
    eng = engine(bench)
    times, tokens = [], 0
    for i in range(bench.args.warmup + bench.args.iters):
        t0 = time.perf_counter()
        out = eng.generation.generate(batch, greedy=False)
        if i >= bench.args.warmup:
            times.append(time.perf_counter() - t0)
            tokens = int(out["generation_lengths"].sum())
    seconds = statistics.median(times)
    return {
        "sequences": batch.size,
        "prompt_tokens": int(batch["input_lengths"].sum()),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "max_new_tokens": cfg.policy.generation.max_new_tokens,
    }


def close_baselines(bench: Bench) -> None:
    for part in (bench.hf, bench.trl, bench.engine, bench.lora_engine):
        if part is not None:
            part.close()
