"""The report of ``dualrl bench --gpu`` from its recorded rows: the machine line, one markdown
table per section, the skip, attention and error notes; and whether the run failed."""

from __future__ import annotations

from benchmarks.lib.gpu.workload import BACKENDS, tokens_per_s
from benchmarks.lib.machine import mfu
from benchmarks.lib.markdown import cell, pct, table
from benchmarks.lib.roofline import ENGINE_NOTES, ENGINES, best_peak

ROW_ORDER = ("hf eager", "hf compile+fused", *BACKENDS)


def machine_line(m: dict) -> list[str]:
    v = m["versions"]
    peak = f"{m['peak_tflops']:g} TFLOP/s ({m['peak_source']})" if m["peak_tflops"] else m["peak_source"]
    return [
        f"## dualrl bench --gpu --size {m['size']}: random Llama, {m['params']:,} parameters, "
        f"batch {m['batch']} x {m['seq']} = {m['tokens']:,} tokens per call, {m['precision']}",
        "",
        f"machine: {m['device_name']} ({m['device']}), {m['cores']} cores, {m['threads']} threads per process; "
        + ", ".join(f"{k} {v[k]}" for k in v if v[k])
        + f"; matmul measured {m['matmul_tflops']:.3g} TFLOP/s; "
        f"MFU peak: {peak}",
        "",
    ]


def roofline_of(records: list[dict]) -> dict:
    return next((r for r in records if r["kind"] == "roofline" and "error" not in r), {})


def _tflops(gflops: float | None) -> float | None:
    return gflops / 1e3 if gflops else None


def roof_tflops(records: list[dict], precision: str) -> float | None:
    """The best measured engine's TFLOP/s in ``precision`` (None without a roofline)."""
    best = best_peak(roofline_of(records), precision)
    return _tflops(best[1]) if best else None


def roofline_lines(records: list[dict], m: dict) -> list[str]:
    roof = roofline_of(records)
    if not roof:
        return []
    peaks = roof.get("peaks", {})
    rows = [
        [engine, *[cell(_tflops(peaks[engine].get(d)), ",.3g") for d in ("float32", "bfloat16")]]
        + [ENGINE_NOTES.get(engine, "")]
        for engine in ENGINES
        if engine in peaks
    ]
    best = best_peak(roof, m["precision"])
    notes = [f"roof: {best[1] / 1e3:,.3g} TFLOP/s ({best[0]}, {m['precision']})" if best else "roof: not measured"]
    if roof.get("copy_gb_s"):
        size = roof["copy_bytes"] / 1e9
        notes.append(f"copy: {roof['copy_gb_s']:,.0f} GB/s (dst.copy_(src) of {size:.3g} GB, the refit's roof)")
    notes += [f"roofline engine {what} not measured: {why}" for what, why in (roof.get("errors") or {}).items()]
    return [
        f"### Roofline: matmul peaks on the workload's products ({roof['tokens']:,} tokens, the largest micro "
        "batch: each linear layer's forward, input- and weight-gradient product, weighted as a training step "
        "makes them; child processes set up as the workers)",
        "",
        *table(["engine", "fp32 TFLOP/s", "bf16 TFLOP/s", "what"], rows),
        "",
        *notes,
        "",
    ]


def throughput_rows(records: list[dict], m: dict) -> list[list[str]]:
    rows = sorted(
        (r for r in records if r["kind"] == "throughput"), key=lambda r: (r["mbs"], ROW_ORDER.index(r["backend"]))
    )
    base = {r["mbs"]: r for r in rows if r["backend"] == "hf eager" and "error" not in r}
    flops, peak, roof = m["flops_per_token"], m["peak_tflops"], roof_tflops(records, m["precision"])
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["backend"], str(r["mbs"]), "FAILED (below)"] + ["-"] * 10)
            continue
        lp, tr = tokens_per_s(m["tokens"], r["logprobs"]), tokens_per_s(m["tokens"], r["train"])
        hf = base.get(r["mbs"])
        hf_lp = tokens_per_s(m["tokens"], hf["logprobs"]) if hf else None
        hf_tr = tokens_per_s(m["tokens"], hf["train"]) if hf else None
        peak_mib = r["peak_bytes"] / 2**20 if r.get("peak_bytes") else None
        out.append(
            [
                r["backend"],
                str(r["mbs"]),
                cell(lp, ",.0f"),
                cell(lp / hf_lp if hf_lp else None, ".2f"),
                cell(tr, ",.0f"),
                cell(tr / hf_tr if hf_tr else None, ".2f"),
                cell(pct(mfu(lp, flops["forward"], peak)), ".1f"),
                cell(pct(mfu(tr, flops["train"], peak)), ".1f"),
                cell(pct(mfu(lp, flops["forward"], roof)), ".1f"),
                cell(pct(mfu(tr, flops["train"], roof)), ".1f"),
                cell(peak_mib, ",.0f") + (f" ({r['memory']})" if peak_mib else ""),
                f"{r['logprobs']['first_s']:.2f} / {r['train']['first_s']:.2f}",
                cell(r.get("startup_s"), ".1f"),
            ]
        )
    return out


def throughput_lines(records: list[dict], m: dict) -> list[str]:
    rows = throughput_rows(records, m)
    if not rows:
        return []
    return [
        "### Throughput (tokens/s = tokens per call / median seconds; ×HF = / hf eager at the same micro "
        "batch; MFU: forward 2N + 4LSd, train 6N + 12LSd FLOPs per token over the peak above; % roof: the "
        "same FLOP/s over the roofline's best measured peak)",
        "",
        *table(
            [
                "row",
                "mbs",
                "logprobs tok/s",
                "×HF",
                "train tok/s",
                "×HF",
                "lp MFU %",
                "train MFU %",
                "lp % roof",
                "train % roof",
                "peak MiB",
                "first call s (lp / train)",
                "start s",
            ],
            rows,
        ),
        "",
        "peak MiB: (device) = peak allocated on the GPU (JAX: process peak so far, XLA has no reset); "
        "(rss) = the process's peak resident memory. Policy rows are timed on the driver (Ray dispatch "
        "included), hf rows inside their process.",
        "",
    ]


def refit_lines(records: list[dict]) -> list[str]:
    rows, copy = [], roofline_of(records).get("copy_gb_s")
    for r in (r for r in records if r["kind"] == "refit"):
        if "error" in r:
            rows.append([r["backend"], "FAILED (below)"] + ["-"] * 7)
            continue
        gb = r["bytes"] / 1e9
        gb_s = gb / r["median_s"] if r["median_s"] else None
        rows.append(
            [
                r["backend"],
                str(r["tensors"]),
                f"{gb:.3f} {r['dtype']}",
                f"{r['info_s']:.2f}",
                f"{r['first_s']:.2f}",
                f"{r['median_s']:.2f}",
                cell(gb_s, ".2f"),
                cell(pct(gb_s / copy if gb_s and copy else None), ".1f"),
                f"{r['buckets']} x {'/'.join(map(str, r['transport']))}",
            ]
        )
    if not rows:
        return []
    return [
        "### Refit source side (no engine: prepare_refit_info, then the whole stream of gathered, cast, "
        "exported buckets)",
        "",
        *table(
            [
                "backend",
                "tensors",
                "GB",
                "prepare_refit_info s",
                "first stream s",
                "stream s",
                "GB/s",
                "% of copy",
                "buckets",
            ],
            rows,
        ),
        "",
    ]


def loss_lines(records: list[dict], tol: float | None) -> list[str]:
    rows = [r for r in records if r["kind"] == "loss"]
    if not rows:
        return []
    steps = len(rows[0].get("losses") or [])
    loss_rows = []
    for r in rows:
        if "error" in r:
            loss_rows.append([r["backend"], "FAILED (below)"] + ["-"] * (steps + 2))
            continue
        ref = "passed" not in r
        loss_rows.append(
            [
                r["backend"],
                *(f"{x:.7f}" for x in r["losses"]),
                "-" if ref else f"{r['max_loss_diff']:.2e}",
                "-" if ref else f"{r['max_grad_norm_diff']:.2e}",
                "reference" if ref else ("PASS" if r["passed"] else "FAIL"),
            ]
        )
    return [
        f"### fp32 loss curves vs a plain-torch reference (measure |a - b| / max(1, |a|, |b|), max over "
        f"steps; pass if loss <= {tol:g})",
        "",
        *table(
            ["backend", *(f"loss {i + 1}" for i in range(steps)), "max Δloss", "max Δgrad norm", "result"], loss_rows
        ),
        "",
    ]


def report(records: list[dict], loss_tol: float | None = None) -> str:
    m = next(r for r in records if r["kind"] == "machine")
    lines = machine_line(m) + roofline_lines(records, m) + throughput_lines(records, m) + refit_lines(records)
    lines += loss_lines(records, loss_tol)
    lines += [f"SKIPPED {r['row']}: {r['reason']}" for r in records if r["kind"] == "skipped"]
    lines += [
        f"note: {r['backend']} attention: {r['attn_implementation']}" for r in records if r["kind"] == "yardstick"
    ]
    lines += [
        f"ERROR {r.get('backend', 'roofline')}"
        + (f" mbs {r['mbs']}" if "mbs" in r else "")
        + f" ({r['kind']}): {r['error']}"
        for r in records
        if "error" in r
    ]
    return "\n".join(lines)


def failed(records: list[dict]) -> bool:
    return any("error" in r or r.get("passed") is False for r in records)
