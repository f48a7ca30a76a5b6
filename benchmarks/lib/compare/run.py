"""``dualrl bench``: every backend layout on one workload, one table, measured in one run.

    dualrl bench [--size tiny|small|1b] [--layouts L ...] [--model NAME|PATH] [--device cpu|cuda]
        [--sections throughput refit generation grpo] [--out DIR] [--json FILE]
        [--batch B] [--seq S] [--micro M] [--iters N] [--warmup W] [--precision P] [--threads T]
    python -m benchmarks.compare [same]

For each layout (``benchmarks.layouts``: ``fsdp1-dp2``, ``dtensor-dp2``, ``dtensor-tp2``,
``dtensor-tp2-sp``, ``jax-fsdp2``, ``jax-tp2``, ...), on the same model, batch and thread / device
budget, one layout alive at a time:

* **throughput**: ``Policy.get_logprobs`` and ``Policy.train`` (NLL, one AdamW step per call) on a
  ragged random batch, tokens/s (real tokens / driver wall seconds), each as ×HF: plain HF eager
  (``AutoModelForCausalLM`` in a child process of its own, same threads, same micro batches) is
  called right after every Policy call, so both sides of a ratio see the same background load
  (``benchmarks.torch_backends`` describes the runners).  MFU of train and logprobs against the
  matmul peak measured on the same threads / GPU (``benchmarks.machine``: model FLOPs, PaLM
  accounting), and the datasheet peak on a known GPU.  Start-up seconds (Policy construction)
  and first-call seconds (JAX: compile + run), peak memory (CPU: the processes' peak RSS; GPU:
  peak allocated bytes per worker).
* **refit**: seconds and GB/s of a refit into one vLLM engine over both transports (``ipc``,
  ``collective``), next to a memcpy of the same bytes (``benchmarks.refit`` describes it).
* **generation**: vLLM tokens/s of the engine on the GRPO workload's prompts (one row: the
  engine does not depend on the training backend).
* **grpo**: the main job's full step (``benchmarks.grpo_step``: ``core.algorithms.grpo.grpo_step``
  on the embedded arithmetic config with this model and layout) with its breakdown (generation /
  logprobs / reference / train / refit / reward), and as ×TRL: TRL's ``GRPOTrainer`` on the same
  model, prompt set, group size, completion length and optimizer (``benchmarks.trl_grpo``; needs
  the optional ``bench`` extra, ``pip install -e .[bench]``, else skipped with a note), its steps
  interleaved with the layouts' steps like the HF calls.

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
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import jax_backend as jb
from benchmarks import machine
from benchmarks import refit as rf
from benchmarks import torch_backends as tb
from benchmarks.grpo_step import GRPOWorkload
from benchmarks.layouts import Layout, LayoutError, check_batch, check_fits, jax_model_problem, parse_layout
from benchmarks.machine import mfu
from benchmarks.markdown import cell, pct, table

SECTIONS = ("throughput", "refit", "generation", "grpo")
DEFAULT_LAYOUTS = ["fsdp1-dp2", "dtensor-dp2", "dtensor-tp2", "dtensor-tp2-sp", "jax-fsdp2", "jax-tp2"]
GPU_LAYOUTS = ["fsdp1-dp1", "dtensor-dp1", "jax-fsdp1"]


@dataclass(frozen=True)
class Size:
    shape: dict[str, Any]  # HF Llama config fields
    batch: int
    seq: int
    grpo: GRPOWorkload
    precision: str = "float32"
    micro: int | None = None
    iters: int = 3
    warmup: int = 1


def _llama(
    hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, positions: int, tied: bool
) -> dict[str, Any]:
    return dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=positions,
        tie_word_embeddings=tied,
    )


SIZES: dict[str, Size] = {
    # the built-in model's shape (vocab 32 = the character tokenizer rounded up for tp 2 / 4)
    "tiny": Size(
        _llama(256, 512, 2, 8, 4, 32, 128, True),
        batch=8,
        seq=32,
        iters=2,
        grpo=GRPOWorkload(prompts=4, group=4, new_tokens=6, seq=32, micro_batch=8, steps=1),
    ),
    "small": Size(
        _llama(512, 1536, 8, 8, 4, 32, 512, True),
        batch=8,
        seq=256,
        iters=3,
        grpo=GRPOWorkload(prompts=16, group=8, new_tokens=16, seq=32, micro_batch=32, steps=2),
    ),
    "1b": Size(
        _llama(2048, 8192, 16, 32, 8, 128256, 4096, True),
        batch=8,
        seq=2048,
        precision="bfloat16",
        micro=4,
        iters=5,
        warmup=2,
        grpo=GRPOWorkload(prompts=32, group=8, new_tokens=256, seq=512, micro_batch=16, steps=3),
    ),
}


@dataclass
class Bench:
    """What one run shares: arguments, model, Ray session, the HF / TRL baselines, the engine."""

    args: argparse.Namespace
    size: Size
    model_path: str = ""
    tokenizer_path: str = ""
    tokenizer: Any = None
    config: Any = None  # the model's HF config
    session: Any = None
    hf: Any = None
    hf_row: dict | None = None
    trl: Any = None
    engine: Any = None
    notes: list[str] = field(default_factory=list)
    tmp: Path = Path(".")
    refit_skipped: str | None = None


def _error(err: BaseException) -> str:
    traceback.print_exc()
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first}"


# ----------------------------------------------------------------------------- set-up


def prepare_model(bench: Bench) -> None:
    """The size's random model (character tokenizer) or ``--model``; its config and tokenizer."""
    from transformers import AutoConfig

    from core.models.builtin import write_random_init

    if bench.args.model:
        bench.model_path, bench.tokenizer_path = tb.prepare_model(bench.args.model, bench.tmp)
    else:
        path = bench.tmp / f"bench-{bench.args.size}"
        write_random_init(bench.size.shape, path)
        bench.model_path = bench.tokenizer_path = str(path)
    bench.config = AutoConfig.from_pretrained(bench.model_path)
    bench.tokenizer = tb.load_tokenizer(bench.tokenizer_path)


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


def start_ray(bench: Bench) -> None:
    if bench.args.device == "cuda":
        from core.distributed import init_ray

        init_ray()
        return
    bench.session = jb.RaySession(bench.args)
    first_jax = next((lay.devices for lay in bench.args.layout_objs if lay.is_jax), None)
    if bench.session.owned:
        bench.session.start(first_jax)


def ray_for(bench: Bench, layout: Layout) -> str | None:
    """Ray with the layout's XLA host devices (CPU JAX); why not, when the caller's Ray cannot."""
    if bench.session is None:
        return None
    devices = layout.devices if layout.is_jax else None
    if devices is not None and not bench.session.fits(devices):
        return f"needs {devices} XLA host devices per actor; the caller's Ray gives {bench.session.devices}"
    if devices not in (None, bench.session.devices) and bench.engine is not None:
        bench.engine.close()  # Ray restarts for another device count: the engine goes with it
        bench.engine = None
    bench.session.start(devices)
    return None


def jax_unsupported(bench: Bench, layout: Layout) -> str | None:
    """Why the JAX backend cannot run this model (its own config check, on the driver), or None."""
    return jax_model_problem(bench.config, bench.args.model or "this model") if layout.is_jax else None


def vllm_missing() -> str | None:
    return None if importlib.util.find_spec("vllm") else "vLLM is not installed on this machine"


# ----------------------------------------------------------------------------- per layout


def start_policy(bench: Bench, layout: Layout):
    if layout.is_jax:
        runner = jb.JaxPolicyRunner(layout.name, bench.model_path, bench.tokenizer_path, bench.tokenizer, bench.args)
        return jb.Probe(runner, runner.pids)
    runner = tb.PolicyRunner(layout.name, bench.model_path, bench.tokenizer_path, bench.tokenizer, bench.args)
    try:
        return jb.Probe(runner, [info["pid"] for info in runner._policy.get_gpu_info()])
    except BaseException:
        runner.close()
        raise


def peak_memory(probe) -> list[int | None]:
    """Per worker: peak allocated bytes on a GPU, peak resident bytes of the process on a CPU."""
    infos = probe._runner._policy.get_gpu_info()
    out = []
    for info in infos:
        gpu = info.get("peak_memory_allocated_bytes", info.get("peak_memory_bytes"))
        out.append(gpu if info.get("device_type") in ("cuda", "gpu") else machine.peak_rss_bytes(info["pid"]))
    return out


def throughput(bench: Bench, probe) -> dict:
    row = tb._new_result(probe)
    tb.measure(probe, bench.hf, row, bench.hf_row, bench.args)
    row.update(probe.summary(bench.args.warmup))
    row["peak_memory_bytes"] = peak_memory(probe)
    return row


def engine(bench: Bench):
    """The shared vLLM engine (started on first use, replaced if it died)."""
    if bench.engine is not None and not bench.engine.alive():
        bench.engine.close()
        bench.engine = None
    if bench.engine is None:
        bench.engine = rf.Engine(bench.model_path, bench.tokenizer_path, bench.tokenizer, bench.args)
    return bench.engine


def refit_rows(bench: Bench, probe) -> dict:
    eng = engine(bench)
    per_transport = rf.measure(probe._runner, eng, rf.TRANSPORTS, bench.args)
    nbytes = next((r["bytes"] for r in per_transport.values() if r.get("bytes")), None)
    return {
        "transports": per_transport,
        "memcpy": rf.memcpy_seconds(nbytes) if nbytes else {},
        "engine_startup_s": eng.startup_s,
    }


def bench_layout(bench: Bench, layout: Layout, progress) -> dict:
    """Throughput and refit on one Policy (closed afterwards), then the GRPO step on a run of its own."""
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
    sections = bench.args.sections
    if "throughput" in sections or "refit" in sections:
        progress.set_description(f"{layout.name}: start")
        try:
            probe = start_policy(bench, layout)
        except Exception as err:  # noqa: BLE001 -- reported in its row; the other layouts go on
            return {**row, "error": _error(err)}
        try:
            if "throughput" in sections:
                progress.set_description(f"{layout.name}: throughput")
                row.update(throughput(bench, probe))
            if "refit" in sections and not bench.refit_skipped:
                progress.set_description(f"{layout.name}: refit")
                try:
                    row["refit"] = refit_rows(bench, probe)
                except Exception as err:  # noqa: BLE001
                    row["refit"] = {"error": _error(err)}
        except Exception as err:  # noqa: BLE001
            row["error"] = _error(err)
        finally:
            probe.close()
        progress.update(1)
    if "grpo" in sections and "error" not in row:
        progress.set_description(f"{layout.name}: GRPO step")
        row["grpo"] = grpo_row(bench, layout)
        progress.update(1)
    return row


def grpo_row(bench: Bench, layout: Layout) -> dict:
    from benchmarks.grpo_step import measure_grpo

    work = bench.size.grpo
    try:
        out = measure_grpo(
            layout,
            work,
            bench.model_path,
            bench.tokenizer_path,
            bench.args.precision,
            str(bench.tmp / f"grpo-{layout.name}"),
            generation=bench.args.grpo_generation,
            jax_cpu_slots=None if bench.args.device == "cuda" else bench.args.threads,
        )
    except Exception as err:  # noqa: BLE001
        return {"error": _error(err)}
    if bench.trl is not None:
        try:
            out["trl_step_s"] = [bench.trl.step()["seconds"] for _ in range(work.steps)]
        except Exception as err:  # noqa: BLE001
            out["trl_error"] = _error(err)
    return out


# ----------------------------------------------------------------------------- once per run


def start_baselines(bench: Bench) -> None:
    if "throughput" in bench.args.sections:
        try:
            bench.hf = jb.Probe(tb.HFRunner(bench.model_path, bench.args), [])
            bench.hf.pids = [bench.hf._runner._proc.pid]
            bench.hf_row = tb._new_result(bench.hf)
        except Exception as err:  # noqa: BLE001
            bench.hf_row = {"case": "hf", "workers": 1, "error": _error(err)}
    if "grpo" in bench.args.sections:
        start_trl(bench)


def start_trl(bench: Bench) -> None:
    from benchmarks import trl_grpo
    from benchmarks.grpo_step import grpo_config, training_prompts

    if trl_grpo.trl_version() is None:
        bench.notes.append("TRL GRPOTrainer row skipped: trl is not installed (pip install -e .[bench])")
        return
    if bench.args.device == "cuda":  # its runner trains on the CPU (use_cpu): no fair GPU baseline yet
        bench.notes.append("TRL GRPOTrainer row skipped: benchmarks.trl_grpo runs TRL on the CPU only")
        return
    work = bench.size.grpo
    cfg = grpo_config(
        parse_layout("fsdp1-dp1"),
        work,
        bench.model_path,
        bench.tokenizer_path,
        bench.args.precision,
        str(bench.tmp / "trl"),
        generation=bench.args.grpo_generation,
    )
    items = training_prompts(cfg, bench.tokenizer, 16 * work.prompts)
    spec = trl_grpo.spec_from_dualrl(
        cfg,
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
        bench.notes.append(f"TRL GRPOTrainer row failed: {_error(err)}")
        bench.trl = None


def generation_row(bench: Bench) -> dict:
    """vLLM tokens/s on the GRPO workload's prompts x group (sampling, the engine's current weights)."""
    from benchmarks.grpo_step import grpo_config, training_prompts
    from core.algorithms.rollouts import prompt_batch

    work = bench.size.grpo
    cfg = grpo_config(
        parse_layout("fsdp1-dp1"),
        work,
        bench.model_path,
        bench.tokenizer_path,
        bench.args.precision,
        str(bench.tmp / "gen"),
    )
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
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "max_new_tokens": cfg["policy"]["generation"]["max_new_tokens"],
    }


def machine_facts(bench: Bench) -> dict:
    import torch

    args = bench.args
    device = "cuda" if args.device == "cuda" else "cpu"
    facts = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else machine.cpu_model(),
        "cores": os.cpu_count(),
        "threads": args.threads,
        "precision": args.precision,
        "matmul_tflops": machine.measured_matmul_tflops(device, args.precision, args.threads),
    }
    if device == "cuda":
        facts["datasheet_tflops"] = machine.datasheet_tflops(facts["device"], args.precision)
    return facts


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
    bench.refit_skipped = vllm_missing()
    if bench.refit_skipped and "refit" in args.sections:
        bench.notes.append(f"refit rows skipped: {bench.refit_skipped}")
    if bench.refit_skipped and "grpo" in args.sections:
        bench.notes.append(f"GRPO rows generate with the policy's own HF generate: {bench.refit_skipped}")
    start_ray(bench)
    prepare_model(bench)
    results["machine"] = machine_facts(bench)
    results["tokens"] = int(tb.make_batch(args.batch, args.seq, bench.config.vocab_size)["input_lengths"].sum())
    start_baselines(bench)
    try:
        for layout in args.layout_objs:
            results["layouts"].append(bench_layout(bench, layout, progress))
        if "generation" in args.sections:
            missing = vllm_missing()
            if missing:
                results["generation"] = {"skipped": missing}
            else:
                progress.set_description("vLLM generation")
                try:
                    results["generation"] = generation_row(bench)
                except Exception as err:  # noqa: BLE001
                    results["generation"] = {"error": _error(err)}
            progress.update(1)
        if bench.hf is not None and "error" not in bench.hf_row:
            gpu_peak = getattr(bench.hf._runner, "last_reply", {}).get("peak_bytes")
            bench.hf_row.update(
                bench.hf.summary(0), peak_memory_bytes=[gpu_peak or machine.peak_rss_bytes(bench.hf.pids[0])]
            )
    finally:
        for part in (bench.hf, bench.trl, bench.engine):
            if part is not None:
                part.close()
    results["hf"] = bench.hf_row
    results["params"] = machine_params(bench.config)
    results["notes"] = bench.notes
    return results


def machine_params(config) -> int:
    """Parameters of the model (embedding counted once when tied)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- report


def _mib(values) -> str:
    vals = [v for v in (values or []) if v]
    return "/".join(f"{v / 2**20:.0f}" for v in vals) if vals else "-"


def throughput_summary(r: dict, hf: dict | None, tokens: int) -> dict:
    """tokens/s, ×HF and the first call per operation (``None`` where not measured)."""
    out = {}
    for op in tb.OPS:
        med = tb.median(r.get(f"{op}_s"))
        out[f"{op}_tok_s"] = tokens / med if med else None
        out[f"{op}_x_hf"] = tb.ratio(r, hf, op)
        out[f"{op}_first_s"] = (r.get("first_s") or {}).get(op)
    return out


def throughput_lines(results: dict) -> list[str]:
    hf, tokens, seq = results.get("hf"), results["tokens"], results["seq"]
    peak, sheet = results["machine"]["matmul_tflops"], results["machine"].get("datasheet_tflops")
    cfg = results["_config"]
    train_flops = machine.flops_per_token(cfg, seq, True)
    rows = []
    for r in ([hf] if hf else []) + results["layouts"]:
        if r is None or "logprobs_s" not in r:
            continue
        s = throughput_summary(r, hf, tokens)
        rows.append(
            [
                r["case"],
                str(r.get("workers", 1)),
                cell(r.get("startup_s"), ".1f"),
                cell(s["logprobs_first_s"], ".2f") + " / " + cell(s["train_first_s"], ".2f"),
                cell(s["logprobs_tok_s"], ",.0f"),
                cell(s["logprobs_x_hf"], ".2f"),
                cell(s["train_tok_s"], ",.0f"),
                cell(s["train_x_hf"], ".2f"),
                cell(pct(mfu(s["logprobs_tok_s"], machine.flops_per_token(cfg, seq, False), peak)), ".1f"),
                cell(pct(mfu(s["train_tok_s"], train_flops, peak)), ".1f"),
                *([cell(pct(mfu(s["train_tok_s"], train_flops, sheet)), ".1f")] if sheet else []),
                _mib(r.get("peak_memory_bytes")),
            ]
        )
    if not rows:
        return []
    return [
        f"### Throughput ({tokens} real tokens per call; ×HF against each layout's own paired HF calls; "
        f"MFU vs the measured {peak:.3g} TFLOP/s matmul peak)",
        "",
        *table(
            [
                "layout",
                "workers",
                "start s",
                "first call s (lp / train)",
                "logprobs tok/s",
                "×HF",
                "train tok/s",
                "×HF",
                "lp MFU %",
                "train MFU %",
                *([f"train MFU % ({sheet:g} datasheet)"] if sheet else []),
                "peak MiB / worker",
            ],
            rows,
        ),
        "",
    ]


def refit_lines(results: dict) -> list[str]:
    rows = []
    for r in results["layouts"]:
        refit = r.get("refit")
        if not refit:
            continue
        if "error" in refit:
            rows.append([r["case"], "-", "-", "-", "-", "-", refit["error"]])
            continue
        copy = refit["memcpy"].get("warm_s")
        for transport, t in refit["transports"].items():
            med = tb.median(t.get("seconds"))
            gb = t.get("bytes", 0) / 1e9
            rows.append(
                [
                    r["case"],
                    transport,
                    cell(gb, ".3f"),
                    cell(med, ".3f"),
                    cell(gb / med if med else None, ".2f"),
                    cell(gb / copy if copy else None, ".2f"),
                    t.get("error", ""),
                ]
            )
    if not rows:
        return []
    return [
        "### Refit into the vLLM engine (memcpy: one warm copy of the same bytes, one thread)",
        "",
        *table(["layout", "transport", "GB", "seconds", "GB/s", "memcpy GB/s", "error"], rows),
        "",
    ]


def grpo_lines(results: dict) -> list[str]:
    from benchmarks.grpo_step import PHASES

    rows = []
    for r in results["layouts"]:
        g = r.get("grpo")
        if not g:
            continue
        if "error" in g:
            rows.append([r["case"], g["error"]] + [""] * (len(PHASES) + 3))
            continue
        trl = tb.median(g.get("trl_step_s"))
        rows.append(
            [
                r["case"],
                cell(g["step_s"], ".2f"),
                cell(trl / g["step_s"] if trl else None, ".2f"),
                cell(trl, ".2f"),
                *[cell(g["phases_s"][p], ".2f") for p in PHASES],
                cell(g.get("token_mult_prob_error"), ".4f"),
            ]
        )
    if not rows:
        return []
    work = results["grpo_workload"]
    return [
        f"### GRPO step ({work['prompts']} prompts x {work['group']}, {work['new_tokens']} new tokens, "
        f"{results['grpo_generation']} generation; ×TRL = TRL step s / dualrl step s, paired steps)",
        "",
        *table(["layout", "step s", "×TRL", "TRL step s", *[f"{p} s" for p in PHASES], "token_mult_prob_error"], rows),
        "",
    ]


def report(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"## dualrl bench --size {results['size']}: {results['model']}, {results['params'] or 0:,} parameters",
        "",
        f"machine: {m['device']}, {m['cores']} cores; {m['threads']} threads per layout; {m['precision']}; "
        f"matmul peak measured {m['matmul_tflops']:.3g} TFLOP/s"
        + (f", datasheet {m['datasheet_tflops']:g}" if m.get("datasheet_tflops") else "")
        + f"; batch {results['batch']} x {results['seq']}"
        + (f", micro {results['micro']}" if results["micro"] else ""),
        "",
    ]
    lines += throughput_lines(results) + refit_lines(results)
    gen = results.get("generation")
    if gen and "tokens_per_s" in gen:
        lines += [
            f"### vLLM generation: {gen['tokens_per_s']:,.0f} tokens/s ({gen['sequences']} sequences, "
            f"{gen['tokens']} tokens in {gen['seconds']:.2f} s, up to {gen['max_new_tokens']} new tokens each)",
            "",
        ]
    elif gen:
        lines += [f"vLLM generation: {gen.get('skipped') or gen.get('error')}", ""]
    lines += grpo_lines(results)
    for r in [results.get("hf") or {}] + results["layouts"]:
        for key in ("error", "skipped"):
            if key in r:
                lines.append(f"{key.upper()} {r['case']}: {r[key]}")
    for name, why in results["rejected"].items():
        lines.append(f"ERROR {name}: {why}")
    lines += [f"note: {n}" for n in results["notes"]]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path | None:
    """Bars: tokens/s ×HF per layout (logprobs, train), GRPO step breakdown (TRL beside), refit GB/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.grpo_step import PHASES

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    rows = [r for r in results["layouts"] if "logprobs_s" in r]
    names = [r["case"] for r in rows]
    for i, op in enumerate(tb.OPS):
        vals = [tb.ratio(r, results.get("hf"), op) or 0 for r in rows]
        axes[0].bar([x + 0.4 * i for x in range(len(rows))], vals, width=0.4, label=op)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set(title="tokens/s ×HF eager", xticks=[x + 0.2 for x in range(len(rows))])
    axes[0].set_xticklabels(names, rotation=30, ha="right")
    axes[0].legend()
    grpo = [(r["case"], r["grpo"]) for r in results["layouts"] if "step_s" in (r.get("grpo") or {})]
    trl_steps = [t for _, g in grpo for t in g.get("trl_step_s") or []]  # pooled over the layouts' pairs
    trl = [("TRL GRPOTrainer", {"phases_s": {"trl step": tb.median(trl_steps)}})] if trl_steps else []
    bottom = [0.0] * (len(grpo) + len(trl))
    for phase in [*PHASES, "trl step"]:
        vals = [g["phases_s"].get(phase, 0.0) for _, g in grpo + trl]
        axes[1].bar(range(len(vals)), vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    axes[1].set(title="GRPO step seconds", xticks=range(len(bottom)))
    axes[1].set_xticklabels([n for n, _ in grpo + trl], rotation=30, ha="right")
    axes[1].legend(fontsize=7)
    refit = [
        (r["case"], t, v)
        for r in results["layouts"]
        for t, v in ((r.get("refit") or {}).get("transports") or {}).items()
        if v.get("seconds")
    ]
    axes[2].bar(range(len(refit)), [v["bytes"] / 1e9 / tb.median(v["seconds"]) for _, _, v in refit])
    axes[2].set(title="refit GB/s", xticks=range(len(refit)))
    axes[2].set_xticklabels([f"{n} {t}" for n, t, _ in refit], rotation=30, ha="right")
    fig.suptitle(f"dualrl bench --size {results['size']} ({results['machine']['device']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- driver


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
    return parser


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
    args.cases = [lay.name for lay in args.layout_objs]  # what torch_backends.ray_cpus sizes Ray for
    # logical CPUs: a layout, the refit engine's bundle, a GRPO run's colocated slots (CPU slots
    # are processes sharing the cores, not a reservation of them)
    args.ray_cpus = 4 * max(args.threads, args.max_devices) + 4
    args.grpo_generation = "hf" if vllm_missing() else "vllm"
    args.transports, args.repeats, args.bucket_gb = rf.TRANSPORTS, args.iters, None
    return args


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse(argv, prog)
    if args.device == "cuda" and not args.max_devices:
        print("bench: --device cuda: no CUDA GPU is visible", file=sys.stderr)
        return 2
    import ray
    from tqdm import tqdm

    wall = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    phases = len(args.layout_objs) * (
        ("throughput" in args.sections or "refit" in args.sections) + ("grpo" in args.sections)
    ) + ("generation" in args.sections)
    with (
        tempfile.TemporaryDirectory(prefix="dualrl-bench-") as tmp,
        tqdm(total=phases, disable=args.no_progress, file=sys.stderr, dynamic_ncols=True) as progress,
    ):
        bench = Bench(args=args, size=SIZES[args.size], tmp=Path(tmp))
        try:
            results = run(bench, progress)
        finally:
            if bench.session is not None and bench.session.owned and ray.is_initialized():
                ray.shutdown()
    results.update(
        rejected=args.rejected,
        seconds=time.perf_counter() - wall,
        grpo_workload=vars(bench.size.grpo),
        grpo_generation=args.grpo_generation,
        load=os.getloadavg(),
    )
    results["_config"] = bench.config
    text = report(results)
    del results["_config"]
    json_path = Path(args.json) if args.json else out_dir / "bench.json"
    json_path.write_text(json.dumps(results, indent=2, default=str))
    png = plot(results, out_dir / "bench.png")
    print(text)
    print(f"\n{results['seconds']:.0f} s; JSON {json_path}; chart {png}")
    failed = args.rejected or any(
        "error" in r or "skipped" in r or "error" in (r.get("grpo") or {}) for r in results["layouts"]
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
