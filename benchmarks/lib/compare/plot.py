"""``bench.png`` of a ``dualrl bench`` run: one panel per section that measured something --
tokens/s ×HF per layout (logprobs, train), the roofline (every timed phase's GFLOP/s as a share of
the machine's best measured matmul peak), the GRPO step's breakdown (sync and async rows side by
side, TRL beside), refit GB/s.
Legends sit outside the axes, right of each panel, so no bar is hidden behind one."""

from __future__ import annotations

from pathlib import Path

from benchmarks.lib.compare.report import grpo_rows
from benchmarks.lib.grpo_step import PHASES
from benchmarks.lib.pairing import OPS, median, ratio
from benchmarks.lib.roofline import best_peak

LEGEND = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=7)


def throughput_panel(ax, results: dict) -> None:
    rows = [r for r in results["layouts"] if "logprobs_s" in r]
    for i, op in enumerate(OPS):
        vals = [ratio(r, results.get("hf"), op) or 0 for r in rows]
        ax.bar([x + 0.4 * i for x in range(len(rows))], vals, width=0.4, label=op)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(title="tokens/s ×HF eager", xticks=[x + 0.2 for x in range(len(rows))])
    ax.set_xticklabels([r["case"] for r in rows], rotation=30, ha="right")
    ax.legend(**LEGEND)


#: Stacked in the GRPO panel: the sync step's phases, then the async trainer's waits (each row
#: has the ones its step is made of; the async refit is inside wait_refit, so not stacked twice).
STACKED = (*PHASES, "wait_refit", "wait_rollouts")


def grpo_panel(ax, results: dict) -> None:
    """Sync and async rows of every layout side by side (stacked phases = the step), the async
    producer's overlapped generation + reward as a thin hatched bar beside its row, TRL last."""
    grpo = [(f"{name} {g.get('mode', 'sync')}", g) for name, g in grpo_rows(results) if "step_s" in g]
    trl_steps = [t for _, g in grpo for t in g.get("trl_step_s") or []]  # pooled over the layouts' pairs
    trl = [("TRL GRPOTrainer", {"phases_s": {"trl step": median(trl_steps)}})] if trl_steps else []
    bars = grpo + trl
    bottom = [0.0] * len(bars)
    for phase in [*STACKED, *(["trl step"] if trl else [])]:
        vals = [g["phases_s"].get(phase, 0.0) or 0.0 for _, g in bars]
        if any(vals):
            ax.bar(range(len(vals)), vals, width=0.6, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    overlapped = [(i, g["producer_s"]) for i, (_, g) in enumerate(grpo) if g.get("producer_s")]
    if overlapped:
        ax.bar(
            [i + 0.4 for i, _ in overlapped],
            [sum(v or 0.0 for v in p.values()) for _, p in overlapped],
            width=0.18,
            color="none",
            edgecolor="gray",
            hatch="///",
            label="async producer: generation + reward (overlaps the step)",
        )
    ax.set(title="GRPO step seconds (sync and async per layout)", xticks=range(len(bars)))
    ax.set_xticklabels([n for n, _ in bars], rotation=30, ha="right")
    ax.legend(**LEGEND)


def refit_transports(results: dict) -> list[tuple[str, str, dict]]:
    return [
        (r["case"], t, v)
        for r in results["layouts"]
        for t, v in ((r.get("refit") or {}).get("transports") or {}).items()
        if v.get("seconds")
    ]


def refit_panel(ax, results: dict) -> None:
    refit = refit_transports(results)
    ax.bar(range(len(refit)), [v["bytes"] / 1e9 / median(v["seconds"]) for _, _, v in refit])
    ax.set(title="refit GB/s", xticks=range(len(refit)))
    ax.set_xticklabels([f"{n} {t}" for n, t, _ in refit], rotation=30, ha="right")


def flop_phases(results: dict) -> list[dict]:
    """The roofline's phases measured in FLOPs (refit, in bytes, has its own panel)."""
    return [a for a in (results.get("roofline") or {}).get("achieved") or [] if a["unit"] == "GFLOP/s" and a["share"]]


def roofline_panel(ax, results: dict) -> None:
    """Each phase's share of the best peak; the other engines' peaks as lines at their share."""
    phases = flop_phases(results)
    ax.bar(range(len(phases)), [100 * a["share"] for a in phases], width=0.6)
    roof = results["roofline"]
    precision = results["machine"]["precision"]
    engine, best = best_peak(roof, precision) or ("", 0.0)
    for i, (name, rates) in enumerate(roof["peaks"].items()):
        if rates.get(precision):
            share = 100 * rates[precision] / best
            ax.axhline(share, color=f"C{i + 1}", lw=1, ls="--", label=f"{name} peak {rates[precision]:,.0f} GFLOP/s")
    ax.set(
        title=f"% of the best matmul peak ({engine}, {best:,.0f} GFLOP/s {precision})",
        xticks=range(len(phases)),
        ylim=(0, 110),
    )
    ax.set_xticklabels([f"{a['row']} {a['phase']}" for a in phases], rotation=30, ha="right", fontsize=7)
    ax.legend(**LEGEND)


def panels(results: dict) -> list:
    """The panels with something to show, in the report's order."""
    layouts = results["layouts"]
    out = []
    if any("logprobs_s" in r for r in layouts):
        out.append(throughput_panel)
    if flop_phases(results):
        out.append(roofline_panel)
    if refit_transports(results):
        out.append(refit_panel)
    if any("step_s" in g for _, g in grpo_rows(results)):
        out.append(grpo_panel)
    return out


def _panel_width(panel, results: dict) -> float:
    """Inches for one panel: the GRPO panel grows with its bars (sync + async per layout, TRL),
    so that its rotated labels do not overlap; the legend sits to its right."""
    if panel is grpo_panel:
        return max(6.2, 3.5 + 0.55 * (len(grpo_rows(results)) + 1))
    if panel is roofline_panel:
        return max(6.2, 3.5 + 0.35 * len(flop_phases(results)))
    return 6.2


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    draw = panels(results)
    widths = [_panel_width(panel, results) for panel in draw] or [6.2]
    fig, axes = plt.subplots(
        1, len(widths), figsize=(sum(widths), 4.5), squeeze=False, gridspec_kw={"width_ratios": widths}
    )
    for ax, panel in zip(axes[0], draw, strict=False):
        panel(ax, results)
    if not draw:
        axes[0][0].axis("off")
        axes[0][0].text(0.5, 0.5, "no section measured anything (see the report)", ha="center", va="center")
    fig.suptitle(f"dualrl bench --size {results['size']} ({results['machine']['device_name']})", fontsize=10)
    fig.tight_layout()
    # bbox_inches="tight": the figure grows to hold the legends right of the panels
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
