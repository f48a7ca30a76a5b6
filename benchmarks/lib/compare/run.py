"""A ``dualrl bench`` run: Ray, the model, the baselines, then every layout in turn, one alive at a time.

Per layout: throughput (paired with HF eager) and refit (into the shared vLLM engine) on one
Policy, closed afterwards; then the GRPO step on a run of its own (paired with TRL's
``GRPOTrainer``), and with ``--grpo-async`` the async GRPO step on another (paired too).  A
layout that fails is reported in its row and the others still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.lib import refit
from benchmarks.lib.bench import Bench
from benchmarks.lib.compare.baselines import (
    close_baselines,
    engine,
    generation_row,
    grpo_run_config,
    lora_engine,
    start_baselines,
    vllm_missing,
)
from benchmarks.lib.errors import error_text
from benchmarks.lib.grpo_step import TRL_PHASES, measure_grpo, training_prompts
from benchmarks.lib.layouts import Layout, LayoutError, check_batch, check_fits, parse_layout
from benchmarks.lib.machine import machine_facts
from benchmarks.lib.models import backend_model_problem, param_count
from benchmarks.lib.pairing import Probe, measure, new_result
from benchmarks.lib.policy import PolicyRunner
from benchmarks.lib.proc import peak_rss_bytes
from benchmarks.lib.ray_session import RaySession
from benchmarks.lib.roofline import achieved, measure_peaks
from benchmarks.lib.sizes import SIZES
from benchmarks.lib.workload import make_batch
from core.distributed.worker_output import WORKER_LOG_FILENAME

SECTIONS = ("throughput", "refit", "generation", "grpo")
#: A layout's GRPO rows: sync, async (--grpo-async), multi-turn (--grpo-multi-turn), the policy's own
#: sampler with default numerics and in exact mode (--grpo-exact).
GRPO_ROW_KEYS = ("grpo", "grpo_async", "grpo_multi_turn", "grpo_hf", "grpo_exact")
DEFAULT_LAYOUTS = ["fsdp1-dp2", "dtensor-dp2", "dtensor-tp2", "dtensor-tp2-sp", "jax-fsdp2", "jax-tp2"]
GPU_LAYOUTS = ["fsdp1-dp1", "dtensor-dp1", "jax-fsdp1"]


def resolve_layouts(names: list[str], args) -> tuple[list[Layout], dict[str, str]]:
    """The layouts that can run, and ``{name: why not}`` for the others."""
    ok, bad = [], {}
    for name in names:
        try:
            layout = parse_layout(name)
        except LayoutError as err:
            bad[name] = str(err)
            continue
        why = check_fits(
            layout, args.max_devices, "--max-devices " + ("(GPUs)" if args.device == "cuda" else "(cores)")
        ) or check_batch(layout, args.batch)
        if why:
            bad[name] = why
        else:
            ok.append(layout)
    return ok, bad


def start_session(bench: Bench) -> None:
    """Ray once, before anything is timed, with the first JAX layout's host devices (CPU); the
    workers' own output (vLLM's Triton / NUMA lines, the libraries' FutureWarnings) goes to
    ``--out``'s ``workers.log``, not between the bench's lines."""
    cpu = bench.args.device != "cuda"
    worker_log = Path(bench.args.out) / WORKER_LOG_FILENAME
    bench.session = RaySession(bench.args.ray_cpus if cpu else None, host_devices=cpu, worker_log=worker_log)
    first_jax = next((lay.devices for lay in bench.args.layout_objs if lay.per_host), None)
    if bench.session.owned:
        bench.session.start(first_jax)


def ray_for(bench: Bench, layout: Layout) -> str | None:
    """Ray with the layout's XLA host devices (CPU JAX); why not, when the caller's Ray cannot."""
    devices = bench.session.devices_for(layout)
    if not bench.session.fits(devices):
        return f"needs {devices} XLA host devices per actor; the caller's Ray gives {bench.session.devices}"
    if bench.session.restarts_for(devices):  # Ray restarts for another device count: the engines go with it
        for key in ("engine", "lora_engine"):
            if getattr(bench, key) is not None:
                getattr(bench, key).close()
                setattr(bench, key, None)
    bench.session.start(devices)
    return None


def jax_unsupported(bench: Bench, layout: Layout) -> str | None:
    """Why the JAX backend cannot run this model (its own config check, on the driver), or None."""
    return backend_model_problem(layout.backend, bench.config, bench.args.model or "this model")


# ----------------------------------------------------------------------------- per layout


def peak_memory(policy) -> list[int | None]:
    """Per worker: peak allocated bytes on a GPU, peak resident bytes of the process on a CPU."""
    out = []
    for info in policy.get_gpu_info():
        gpu = info.get("peak_memory_allocated_bytes", info.get("peak_memory_bytes"))
        out.append(gpu if info.get("device_type") in ("cuda", "gpu") else peak_rss_bytes(info["pid"]))
    return out


def throughput(bench: Bench, probe: Probe) -> dict:
    row = new_result(probe)
    measure(probe, bench.hf, row, bench.hf_row, bench.args)
    row.update(probe.summary(bench.args.warmup))
    row["peak_memory_bytes"] = peak_memory(probe.policy)
    return row


def refit_rows(bench: Bench, probe: Probe) -> dict:
    eng = engine(bench)
    per_transport = refit.measure(probe.policy, eng, refit.TRANSPORTS, bench.args)
    nbytes = next((r["bytes"] for r in per_transport.values() if r.get("bytes")), None)
    rows = {
        "transports": per_transport,
        "memcpy": refit.memcpy_seconds(nbytes) if nbytes else {},
        "engine_startup_s": eng.startup_s,
    }
    if probe.runner.layout.lora:  # merged rows above; adapter-only rows beside them
        rows["transports"] = {f"{t} merged": v for t, v in per_transport.items()}
        lora = lora_engine(bench)
        for t, v in refit.measure(probe.policy, lora, refit.TRANSPORTS, bench.args).items():
            if v.get("bytes"):
                v["memcpy_s"] = refit.memcpy_seconds(v["bytes"])["warm_s"]
            rows["transports"][f"{t} adapter"] = v
        rows["lora_engine_startup_s"] = lora.startup_s
    return rows


def policy_sections(bench: Bench, layout: Layout, row: dict, progress) -> None:
    """Throughput and refit on one Policy, closed afterwards."""
    sections = bench.args.sections
    args = bench.args
    if layout.lora:  # only the refit section has LoRA settings (and merged-vs-adapter rows)
        if "throughput" in sections:
            row["error"] = f"layout {layout.name!r}: -lora is measured by --sections refit (and dualrl parity) only"
            return
        args = argparse.Namespace(**{**vars(bench.args), "lora": refit.REFIT_LORA})
    progress.set_description(f"{layout.name}: start")
    try:
        probe = Probe(PolicyRunner(layout, bench.model_path, bench.tokenizer_path, bench.tokenizer, args))
    except Exception as err:  # noqa: BLE001 -- reported in its row; the other layouts go on
        row["error"] = error_text(err)
        return
    try:
        if "throughput" in sections:
            progress.set_description(f"{layout.name}: throughput")
            row.update(throughput(bench, probe))
        if "refit" in sections and not bench.refit_skipped:
            progress.set_description(f"{layout.name}: refit")
            try:
                row["refit"] = refit_rows(bench, probe)
            except Exception as err:  # noqa: BLE001
                row["refit"] = {"error": error_text(err)}
    except Exception as err:  # noqa: BLE001
        row["error"] = error_text(err)
    finally:
        probe.close()
    progress.update(1)


def bench_layout(bench: Bench, layout: Layout, progress) -> dict:
    """Throughput and refit on one Policy, then the GRPO step on a run of its own."""
    row: dict[str, Any] = {
        "case": layout.name,
        "backend": layout.backend,
        "devices": layout.devices,
        "workers": layout.workers,
    }
    unsupported = jax_unsupported(bench, layout)
    if unsupported:
        return {**row, "error": unsupported}
    why = ray_for(bench, layout)
    if why:
        return {**row, "skipped": why}
    if "throughput" in bench.args.sections or "refit" in bench.args.sections:
        policy_sections(bench, layout, row, progress)
    if "grpo" in bench.args.sections and "error" not in row:
        turns = getattr(bench.args, "grpo_multi_turn", None)
        rows: list[tuple[str, dict[str, Any]]] = [("grpo", {})]
        rows += [("grpo_async", {"async_grpo": True})] if bench.args.grpo_async else []
        rows += [("grpo_multi_turn", {"multi_turn": turns})] if turns else []
        if getattr(bench.args, "grpo_exact", False):
            rows += [("grpo_hf", {"own_sampler": "default"}), ("grpo_exact", {"own_sampler": "exact"})]
        for key, kwargs in rows:
            progress.set_description(f"{layout.name}: GRPO step ({key})")
            row[key] = grpo_row(bench, layout, **kwargs)
            progress.update(1)
    return row


def grpo_row(
    bench: Bench,
    layout: Layout,
    async_grpo: bool = False,
    multi_turn: int | None = None,
    own_sampler: str | None = None,
) -> dict:
    """One layout's GRPO step (sync, async or multi-turn; ``own_sampler``: generated by the
    policy's own sampler with these ``policy.numerics``) on a run of its own, then as many TRL
    steps (not beside a multi-turn or own-sampler row: TRL has no multi-turn GRPO, and the
    own-sampler rows compare with the layout's sync row)."""
    work = bench.size.grpo
    mode = "async" if async_grpo else f"multi-turn {multi_turn}" if multi_turn else "sync"
    if own_sampler is not None:
        mode = "exact (hf)" if own_sampler == "exact" else "hf"
    try:
        out = measure_grpo(
            layout,
            work,
            bench.model_path,
            bench.tokenizer_path,
            bench.args.precision,
            str(bench.tmp / f"grpo-{layout.name}-{mode.replace(' ', '')}"),
            generation="hf" if own_sampler else bench.args.grpo_generation,
            cpu_threads=None if bench.args.device == "cuda" else bench.args.threads,
            async_grpo=async_grpo,
            multi_turn=multi_turn,
            task=getattr(bench.args, "grpo_task", "arithmetic"),
            numerics=own_sampler or "default",
        )
    except Exception as err:  # noqa: BLE001
        return {"mode": mode, "error": error_text(err)}
    if own_sampler is not None:
        out["mode"] = mode
    if bench.trl is not None and not multi_turn and own_sampler is None:
        try:
            trl = [bench.trl.step() for _ in range(work.steps)]
            out["trl_step_s"] = [t["seconds"] for t in trl]
            out["trl_completion_length"] = [t.get("completion_length_mean") for t in trl]
            # where TRL's step goes, next to dualrl's phases (TRL_PHASES)
            out["trl_phases_s"] = {k: [t.get(k) for t in trl] for k in TRL_PHASES}
        except Exception as err:  # noqa: BLE001
            out["trl_error"] = error_text(err)
    return out


# ----------------------------------------------------------------------------- once per run


def generation_section(bench: Bench, progress) -> dict:
    missing = vllm_missing()
    if missing:
        return {"skipped": missing}
    progress.set_description("vLLM generation")
    try:
        return generation_row(bench)
    except Exception as err:  # noqa: BLE001
        return {"error": error_text(err)}
    finally:
        progress.update(1)


def grpo_prompt_tokens_mean(bench: Bench) -> float:
    """Mean prompt tokens of the prompts the GRPO rows' steps draw (warm-up and timed): what the
    roofline counts per sample besides each side's completions."""
    work = bench.size.grpo
    cfg = grpo_run_config(bench, str(bench.tmp / "prompts"))
    items = training_prompts(cfg, bench.tokenizer, work.prompts * (work.warmup + work.steps))
    return statistics.fmean(len(p.input_ids) for p in items)


def skip_notes(bench: Bench) -> None:
    """Without vLLM: no refit rows, and the GRPO step generates with the policy's own HF generate."""
    bench.refit_skipped = vllm_missing()
    if bench.refit_skipped and "refit" in bench.args.sections:
        bench.notes.append(f"refit rows skipped: {bench.refit_skipped}")
    if bench.refit_skipped and "grpo" in bench.args.sections:
        bench.notes.append(f"GRPO rows generate with the policy's own HF generate: {bench.refit_skipped}")


def run(bench: Bench, progress) -> dict:
    args = bench.args
    results: dict[str, Any] = {
        "size": args.size,
        "model": args.model or f"random {args.size} Llama",
        "batch": args.batch,
        "seq": args.seq,
        "micro": args.micro,
        "layouts": [],
    }
    skip_notes(bench)
    start_session(bench)
    bench.load_model(args.model, task=getattr(args, "grpo_task", "arithmetic"))
    results["machine"] = machine_facts(args.device, args.precision, args.threads)
    results["roofline"] = measure_peaks(bench.config, args.batch * args.seq, args.device, args.threads)
    results["tokens"] = int(make_batch(args.batch, args.seq, bench.config.vocab_size)["input_lengths"].sum())
    if "grpo" in args.sections:
        results["grpo_prompt_tokens_mean"] = grpo_prompt_tokens_mean(bench)
    start_baselines(bench)
    try:
        for layout in args.layout_objs:
            results["layouts"].append(bench_layout(bench, layout, progress))
        if "generation" in args.sections:
            results["generation"] = generation_section(bench, progress)
        if bench.hf is not None and "error" not in bench.hf_row:
            gpu_peak = bench.hf.last_reply.get("peak_bytes")
            bench.hf_row.update(bench.hf.summary(0), peak_memory_bytes=[gpu_peak or peak_rss_bytes(bench.hf.pids[0])])
    finally:
        close_baselines(bench)
    results["hf"] = bench.hf_row
    results["params"] = param_count(bench.config)
    results["notes"] = bench.notes
    return results


def run_bench(args, progress) -> tuple[dict, Bench]:
    """The whole run in a temp dir, Ray shut down afterwards if this run started it; the results
    (and the run's :class:`Bench`: its model's config is what the report's FLOPs need)."""
    import ray

    wall = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dualrl-bench-") as tmp:
        size = SIZES[args.size]
        if getattr(args, "grpo_work", None) is not None:  # the --grpo-* overrides
            size = dataclasses.replace(size, grpo=args.grpo_work)
        bench = Bench(args=args, size=size, tmp=Path(tmp), device=args.device)
        try:
            results = run(bench, progress)
        finally:
            if bench.session is not None and bench.session.owned and ray.is_initialized():
                ray.shutdown()
    results.update(
        rejected=args.rejected,
        seconds=time.perf_counter() - wall,
        grpo_workload=dataclasses.asdict(bench.size.grpo),
        grpo_generation=args.grpo_generation,
        grpo_exact=getattr(args, "grpo_exact", False),
        grpo_multi_turn=getattr(args, "grpo_multi_turn", None),
        grpo_task=getattr(args, "grpo_task", "arithmetic"),
        load=os.getloadavg(),
    )
    results["roofline"]["achieved"] = [dataclasses.asdict(a) for a in achieved(results, bench.config)]
    return results, bench
