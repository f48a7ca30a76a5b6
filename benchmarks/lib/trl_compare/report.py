"""The TRL comparison's report: the header (machine, load, model, versions), the table of
tokens per second against TRL's paired steps, the batches both sides saw and the step-1 check."""

from __future__ import annotations

import json
import os
import statistics

from benchmarks.lib.layouts import parse_layout
from benchmarks.lib.markdown import cell, spread, threads_cell
from benchmarks.lib.pairing import median
from benchmarks.lib.trl_compare.data import CHECK_RTOL
from benchmarks.lib.workload import default_policy_section


def _ok(r: dict) -> bool:
    return "error" not in r and "skipped" not in r and bool(r.get("step_s"))


def ratio(r: dict, trl: dict | None, stat=statistics.median) -> float | None:
    """case tokens/s ÷ TRL tokens/s, against the case's own paired TRL steps (TRL row: itself)."""
    if not _ok(r):
        return None
    base = r.get("trl_step_s") if r["case"] != "trl" else r["step_s"]
    return stat(base) / stat(r["step_s"]) if base else None


def _procs(r: dict) -> str:
    threads = r.get("threads") or []
    t = threads_cell(r) if threads else "?"
    layout = parse_layout(r["case"]) if r["case"] != "trl" else None
    if layout is not None and layout.per_host:
        return f"1 ({layout.devices} dev) × {t} XLA"
    return f"{r['workers']} × {t}"


def _check(mine: dict | None, theirs: dict | None) -> str:
    if not mine or not theirs:
        return "-"
    parts = []
    for key in ("loss", "grad_norm"):
        a, b = mine.get(key), theirs.get(key)
        if a is None or b is None:
            parts.append(f"{key} ?")
            continue
        rel = abs(a - b) / max(abs(b), 1e-12)
        parts.append(f"{key} {a:.6g} vs {b:.6g} ({'ok' if rel <= CHECK_RTOL else f'DIFF {rel:.1e}'})")
    return "; ".join(parts)


def _header(args, facts: dict) -> list[str]:
    params, load, session, versions = facts["params"], facts["load"], facts["session"], facts["versions"]
    cores = os.cpu_count() or 1
    size = f"{params / 1e6:.2f}M params, " if params else ""
    micro = f"{args.micro} rows per rank" if args.micro else "whole local batch per rank"
    trl = (
        f"TRL {versions.get('trl')} (transformers {versions.get('transformers')}, torch {versions.get('torch')})"
        if args.trl
        else f"TRL: not run ({args.no_trl_reason})"
    )
    policy = default_policy_section()
    lines = [
        f"dualrl vs {trl}; model {args.model} ({size}vocab {args.vocab}), float32, attention "
        f"{versions.get('attn_implementation', 'sdpa')}; {args.batch} sequences per optimizer step (SFT: {args.batch} "
        f"examples, DPO: {args.batch // 2} pairs); micro batch: {micro}; {args.steps} timed steps after "
        f"{args.warmup} warm-up per (layout, algorithm); "
        f"AdamW {json.dumps(policy['optimizer']['kwargs'])}, "
        f"constant LR, max_grad_norm {policy['max_grad_norm']}",
        f"threads: {args.threads} per case on {cores} CPU cores (TRL: one process, torch.set_num_threads; torch "
        f"layouts: Ray bundles of threads/workers CPUs; JAX: one actor, XLA pool)",
        "tokens/s = real (non-pad) tokens of the step's batch / median step seconds. TRL step = on_step_begin -> "
        "on_step_end (callback); dualrl step = driver wall time of policy.train "
        "(DPO: + get_reference_policy_logprobs). "
        "Each dualrl step is followed by one TRL step; ×TRL = median paired TRL s / median dualrl s.",
        f"machine load average (1 min): {load[0]:.2f} at start, {load[1]:.2f} at end"
        + (f"  -- above {cores} cores: trust ×TRL (paired) more than absolute tokens/s" if max(load) > cores else ""),
        "",
    ]
    if session is not None and session.owned and session.restarts:
        lines.insert(
            4,
            "Ray restarts for another XLA device count: "
            + ", ".join(f"to {n} in {s:.1f} s" for n, s in session.restarts)
            + " (not timed)",
        )
    return lines


def _trl_row(res: dict) -> dict | None:
    return next((r for r in res["cases"] if r["case"] == "trl"), None)


def _table(results: list[dict]) -> list[str]:
    lines = [
        "| algorithm | case | processes × threads | tokens/s | ×TRL | step s: median [min, max] |",
        "|---|---|---|---:|---:|---|",
    ]
    for res in results:
        tokens = res["batch"]["real_tokens"]
        for r in res["cases"]:
            cells = [res["algorithm"], r["case"], _procs(r)]
            if not _ok(r):
                word = "skipped" if "skipped" in r else "FAILED"
                cells += [word, "-", r.get("skipped") or r.get("error") or "no steps"]
            else:
                cells += [
                    f"{tokens / statistics.median(r['step_s']):.0f}",
                    cell(ratio(r, _trl_row(res)), ".2f"),
                    spread(r["step_s"]),
                ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _same_batch(check: dict | None, b: dict) -> str:
    """Whether TRL's collator held exactly our rows and loss masks."""
    if not check:
        return "-"
    same = check["same_rows_and_masks"] and all(check[k] == b[k] for k in ("real_tokens", "loss_tokens", "width"))
    return "yes" if same else f"NO: {check}"


def _batches(results: list[dict]) -> list[str]:
    lines = [
        "",
        "Batches (identical ids for both frameworks; TRL's check = its collator's output of the whole "
        "batch holds exactly these rows and loss masks):",
    ]
    for res in results:
        b = res["batch"]
        same = _same_batch((_trl_row(res) or {}).get("ready", {}).get("check"), b)
        lines.append(
            f"  {res['algorithm']}: {b['rows']} rows x width {b['width']} = {b['rows'] * b['width']} padded, "
            f"{b['real_tokens']} real tokens, {b['loss_tokens']} loss tokens; TRL same rows/masks: {same}"
        )
    return lines


def _detail(algorithm: str, r: dict, trl_row: dict | None) -> list[str]:
    noop = r["noop_s"] * 1e3 if r.get("noop_s") is not None else None
    paired = r["step_s"] if r["case"] == "trl" else r.get("trl_step_s")
    loop = r.get("loop_s") if r["case"] == "trl" else r.get("trl_loop_s")
    check = (
        f"TRL first step: loss {r['first']['loss']:.6g}, grad norm {r['first']['grad_norm']:.6g}"
        if r["case"] == "trl" and r.get("first")
        else _check(r.get("first"), (trl_row or {}).get("first"))
    )
    lines = [
        f"{algorithm:9} {r['case']:12} {cell(r.get('startup_s'), '.1f'):>7} "
        f"{cell(noop, '.1f'):>8} {cell(median(paired), '.4f'):>12} "
        f"{cell(ratio(r, trl_row, min), '.2f'):>9} {cell(median(r.get('ref_s')), '.4f'):>6} "
        f"{cell(median(loop), '.4f'):>10}  {check}"
    ]
    if r.get("compile_counts"):
        lines.append(
            f"{'':22} JAX get_compile_counts() at the end: {r['compile_counts']}"
            + (f"; pinned to CPUs {r['pinned']}" if r.get("pinned") else "")
        )
    return lines


def _details(results: list[dict]) -> list[str]:
    lines = [
        "",
        "Details: start s = Policy construction / TRL child start-up (not timed); no-op ms = a Policy call "
        "that does nothing on the workers; paired TRL = median of the TRL steps run alongside; ×TRL(min) = "
        "fastest paired TRL step / fastest step; ref s = the DPO reference pass inside the dualrl step; TRL "
        "loop s = driver's go -> on_step_end (adds the trainer loop's between-step work and the next batch's "
        "collation)",
        f"{'algorithm':9} {'case':12} {'start s':>7} {'no-op ms':>8} {'paired TRL s':>12} {'×TRL(min)':>9} "
        f"{'ref s':>6} {'TRL loop s':>10}  step-1 check vs TRL's first step (loss; pre-clip grad norm)",
    ]
    for res in results:
        for r in res["cases"]:
            if _ok(r):
                lines += _detail(res["algorithm"], r, _trl_row(res))
    return lines


def report(results: list[dict], args, facts: dict) -> str:
    """The text report; ``facts``: :func:`run_trl_compare`'s."""
    return "\n".join(_header(args, facts) + _table(results) + _batches(results) + _details(results))
