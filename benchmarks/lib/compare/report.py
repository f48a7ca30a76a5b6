"""The markdown report of a ``dualrl bench`` run: the machine line, one table per section, and the
error, skip and note lines."""

from __future__ import annotations

from benchmarks.lib.grpo_step import PRODUCER_PHASES, TRL_PHASES
from benchmarks.lib.machine import flops_per_token, mfu
from benchmarks.lib.markdown import cell, pct, table
from benchmarks.lib.pairing import OPS, median, ratio
from benchmarks.lib.roofline import ENGINE_NOTES, ENGINES, best_peak


def _mib(values) -> str:
    vals = [v for v in (values or []) if v]
    return "/".join(f"{v / 2**20:.0f}" for v in vals) if vals else "-"


def throughput_summary(r: dict, hf: dict | None, tokens: int) -> dict:
    """tokens/s, ×HF and the first call per operation (``None`` where not measured)."""
    out = {}
    for op in OPS:
        med = median(r.get(f"{op}_s"))
        out[f"{op}_tok_s"] = tokens / med if med else None
        out[f"{op}_x_hf"] = ratio(r, hf, op)
        out[f"{op}_first_s"] = (r.get("first_s") or {}).get(op)
    return out


def throughput_lines(results: dict, cfg) -> list[str]:
    hf, tokens, seq = results.get("hf"), results["tokens"], results["seq"]
    peak, sheet = results["machine"]["matmul_tflops"], results["machine"].get("datasheet_tflops")
    train_flops = flops_per_token(cfg, seq, True)
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
                cell(pct(mfu(s["logprobs_tok_s"], flops_per_token(cfg, seq, False), peak)), ".1f"),
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
            med = median(t.get("seconds"))
            gb = t.get("bytes", 0) / 1e9
            rows.append(
                [
                    r["case"],
                    transport,
                    cell(gb, ".3f"),
                    cell(med, ".3f"),
                    cell(gb / med if med else None, ".2f"),
                    cell(gb / t.get("memcpy_s", copy) if t.get("memcpy_s", copy) else None, ".2f"),
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


#: The GRPO table's phase columns: the sync step's, then the async trainer's waits.
GRPO_COLUMNS = ("refit", "generation", "reward", "logprobs", "reference", "train", "wait_refit", "wait_rollouts")


def grpo_rows(results: dict) -> list[tuple[str, dict]]:
    """(layout, row) of every GRPO row: each layout's sync row, then its async one (``--grpo-async``),
    then its own-sampler rows with default numerics and in exact mode (``--grpo-exact``)."""
    keys = ("grpo", "grpo_async", "grpo_hf", "grpo_exact")
    return [(r["case"], r[key]) for r in results["layouts"] for key in keys if r.get(key)]


def _grpo_cells(g: dict) -> list[str]:
    """The phase columns of one row: a sync row's own phases; an async row's trainer phases,
    its refit seconds (inside wait_refit) and its producer's overlapped seconds."""
    phases = dict(g["phases_s"])
    if g.get("mode") == "async":
        phases["refit"] = g.get("refit_s")
        producer = g.get("producer_s") or {}
        overlapped = " / ".join(cell(producer.get(p), ".2f") for p in PRODUCER_PHASES)
    else:
        overlapped = "-"
    call = g.get("train_call_s")
    split = "-"
    if call:
        driver = call["checks"] + call["shard"]
        split = " / ".join([cell(call["worker"], ".2f"), cell(call["dispatch"], ".2f"), cell(driver, ".2f")])
    return [cell(phases.get(p), ".2f") for p in GRPO_COLUMNS] + [split, overlapped]


def per_token_ratio(g: dict, trl_step_s: float | None, trl_tokens: float | None) -> float | None:
    """×TRL per generated token: TRL's seconds per completion token over dualrl's (the two sides
    sample their own completions, whose lengths differ unless the run is full length)."""
    mine = g.get("response_length_mean")
    if not (trl_step_s and trl_tokens and mine):
        return None
    return (trl_step_s / trl_tokens) / (g["step_s"] / mine)


def threads_cell(threads: dict | None) -> str:
    """``1+1 / 1+1``: each policy worker's torch threads (``xla``: a JAX worker, whose pool spans
    its CPUs), then each engine's; ``-`` for a row measured without the count."""
    if not threads:
        return "-"
    policy = "+".join("xla" if t is None else str(t) for t in threads["policy"])
    return f"{policy} / {'+'.join(str(t) for t in threads['engines']) or '-'}"


def grpo_lines(results: dict) -> list[str]:
    rows = []
    for name, g in grpo_rows(results):
        mode = g.get("mode", "sync")
        if "error" in g:
            rows.append([name, mode, g["error"]] + [""] * (len(GRPO_COLUMNS) + 9))
            continue
        trl = median(g.get("trl_step_s"))
        trl_len = median([x for x in g.get("trl_completion_length") or [] if x is not None])
        trl_phases = g.get("trl_phases_s") or {}
        trl_split = " / ".join(
            cell(median([x for x in trl_phases.get(k) or [] if x is not None]), ".2f") for k in TRL_PHASES
        )
        rows.append(
            [
                name,
                mode,
                cell(g["step_s"], ".2f"),
                cell(trl / g["step_s"] if trl else None, ".2f"),
                cell(per_token_ratio(g, trl, trl_len), ".2f"),
                cell(trl, ".2f"),
                trl_split if trl_phases else "-",
                *_grpo_cells(g),
                cell(g.get("response_length_mean"), ".1f") + " / " + cell(trl_len, ".1f"),
                cell(g.get("token_mult_prob_error"), ".7f"),
                threads_cell(g.get("threads")),
            ]
        )
    if not rows:
        return []
    work = results["grpo_workload"]
    full = ", full length: min_new_tokens = max_new_tokens on both sides" if work.get("full_length") else ""
    header = [
        "layout",
        "mode",
        "step s",
        "×TRL",
        "×TRL per token",
        "TRL step s",
        "TRL " + " / ".join(k.removesuffix("_s") for k in TRL_PHASES) + " s",
        *[f"{p} s" for p in GRPO_COLUMNS],
        "train: workers / dispatch / driver checks s",
        "async producer generation / reward s",
        "tokens / sample (dualrl / TRL)",
        "token_mult_prob_error",
        "threads: policy workers / engines",
    ]
    lines = [
        f"### GRPO step ({work['prompts']} prompts x {work['group']}, {work['new_tokens']} new tokens{full}, "
        f"{results['grpo_generation']} generation, {results.get('grpo_task', 'arithmetic')} task; ×TRL = TRL step s / "
        "dualrl step s, paired steps; per token: seconds per sampled completion token)",
        "",
        *table(header, rows),
        "",
    ]
    if any(g.get("mode") in ("hf", "exact (hf)") for _, g in grpo_rows(results)):
        lines += [
            "hf: the same workload generated by the policy's own sampler (policy.generation.backend hf, no refit); "
            "exact (hf): the same in exact mode (policy.numerics exact: batch-invariant kernels in the sampler and "
            "the trainer, token_mult_prob_error exactly 1).  Their step s against the sync (vLLM) row and each "
            "other is the cost of exact mode.",
            "",
        ]
    if any(g.get("mode") == "async" for _, g in grpo_rows(results)):
        lines += [
            "sync: step = refit + generation + reward + logprobs + reference + train (+ the driver's own work).  "
            "async (grpo.async_grpo, max_trajectory_age_steps 1, the engine on a slot / GPU of its own): step = "
            "the trainer's wall time = wait_refit (until the rollouts due from the old weights exist, then the "
            "refit, whose seconds are in the refit column) + wait_rollouts + logprobs + reference + train; the "
            "producer's generation and reward run beside it and are not part of the step.",
            "",
        ]
    return lines


#: The multi-turn table's phase columns (generation: every turn's generate call; reward: the
#: environment's reset / step calls through the EpisodePool's actor).
MULTI_TURN_COLUMNS = ("refit", "generation", "reward", "logprobs", "reference", "train")


def multi_turn_lines(results: dict) -> list[str]:
    """The ``--grpo-multi-turn`` rows, each beside its layout's sync single-turn step (the same
    prompts, one turn of the same length): no ×TRL, TRL has no multi-turn GRPO."""
    rows = []
    for r in results["layouts"]:
        g = r.get("grpo_multi_turn")
        if not g:
            continue
        if "error" in g:
            rows.append([r["case"], g.get("mode", ""), g["error"]] + [""] * (len(MULTI_TURN_COLUMNS) + 6))
            continue
        single = (r.get("grpo") or {}).get("step_s")
        tokens = cell(g.get("generated_tokens_mean"), ".1f") + " / " + cell(g.get("observation_tokens_mean"), ".1f")
        rows.append(
            [
                r["case"],
                g["mode"],
                cell(g["step_s"], ".2f"),
                cell(single, ".2f"),
                *[cell(g["phases_s"].get(p), ".2f") for p in MULTI_TURN_COLUMNS],
                cell(g.get("generation_per_turn_s"), ".2f"),
                cell(g.get("turns_mean"), ".2f"),
                tokens,
                cell(g.get("short_episodes"), ".0f"),
            ]
        )
    if not rows:
        return []
    work = results["grpo_workload"]
    header = [
        "layout",
        "mode",
        "step s",
        "single-turn step s",
        *[f"{p} s" for p in MULTI_TURN_COLUMNS],
        "generation / turn s",
        "turns / episode",
        "tokens / episode (generated / observation)",
        "short episodes",
    ]
    return [
        f"### Multi-turn GRPO step ({work['prompts']} prompts x {work['group']}, scripted episodes of "
        f"{results.get('grpo_multi_turn')} turns x {work['new_tokens']} new tokens, a fixed observation between turns; "
        f"{results['grpo_generation']} generation; no ×TRL: TRL has no multi-turn GRPO)",
        "",
        *table(header, rows),
        "",
        "generation: the generate calls of every turn (one per turn, all live episodes); reward: the environment's "
        "reset / step calls in the EpisodePool's Ray actor (one call per actor and turn); single-turn step: the "
        "layout's sync row (the same prompts, one turn); short episodes: truncated or failed (0: every episode "
        "played every turn).",
        "",
    ]


def roofline_lines(results: dict) -> list[str]:
    """The engines' peaks on the workload's products, then every timed phase's rate and share
    (``benchmarks.lib.roofline.achieved``, kept in the results by the run)."""
    roof = results.get("roofline")
    if not roof:
        return []
    dtypes = ("float32", "bfloat16")
    peaks = roof.get("peaks", {})
    engine_rows = [
        [engine, *[cell(peaks[engine].get(d), ",.0f") for d in dtypes], ENGINE_NOTES.get(engine, "")]
        for engine in ENGINES
        if engine in peaks
    ]
    precision = results["machine"]["precision"]
    best = best_peak(roof, precision)
    phase_rows = [
        [a["row"], a["phase"], cell(a["rate"], ",.1f" if a["unit"] == "GB/s" else ",.0f") + " " + a["unit"]]
        + [cell(pct(a["share"]), ".1f")]
        for a in roof.get("achieved") or []
    ]
    best_text = f"{best[1]:,.0f} GFLOP/s ({best[0]}, {precision})" if best else "not measured"
    lines = [
        f"### Roofline: matmul peaks on the workload's products ({roof['tokens']} tokens: each linear layer's "
        "forward, input- and weight-gradient product, weighted as a training step makes them; worker set-up)",
        "",
        *table(["engine", "fp32 GFLOP/s", "bf16 GFLOP/s", "what"], engine_rows),
        "",
        *[f"roofline engine {what} not measured: {why}" for what, why in (roof.get("errors") or {}).items()],
    ]
    if phase_rows:
        lines += [
            f"Every timed phase against the machine's best measured peak, {best_text}; refit against the "
            "memcpy bandwidth (GB/s over memcpy GB/s):",
            "",
            *table(["row", "phase", "achieved", "% of roof"], phase_rows),
            "",
        ]
    return lines


def report(results: dict, config) -> str:
    """The markdown report; ``config``: the model's HF config (its FLOPs per token for MFU)."""
    m = results["machine"]
    lines = [
        f"## dualrl bench --size {results['size']}: {results['model']}, {results['params'] or 0:,} parameters",
        "",
        f"machine: {m['device_name']}, {m['cores']} cores; {m['threads']} threads per layout; {m['precision']}; "
        f"matmul peak measured {m['matmul_tflops']:.3g} TFLOP/s"
        + (f", datasheet {m['datasheet_tflops']:g}" if m.get("datasheet_tflops") else "")
        + f"; batch {results['batch']} x {results['seq']}"
        + (f", micro {results['micro']}" if results["micro"] else ""),
        "",
    ]
    lines += roofline_lines(results) + throughput_lines(results, config) + refit_lines(results)
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
    lines += multi_turn_lines(results)
    for r in [results.get("hf") or {}] + results["layouts"]:
        for key in ("error", "skipped"):
            if key in r:
                lines.append(f"{key.upper()} {r['case']}: {r[key]}")
    for name, why in results["rejected"].items():
        lines.append(f"ERROR {name}: {why}")
    lines += [f"note: {n}" for n in results["notes"]]
    return "\n".join(lines)
