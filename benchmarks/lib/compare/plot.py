"""``bench.png`` of a ``dualrl bench`` run: tokens/s ×HF per layout (logprobs, train), the GRPO
step's breakdown (TRL beside), refit GB/s."""

from __future__ import annotations

from pathlib import Path

from benchmarks.lib.grpo_step import PHASES
from benchmarks.lib.pairing import OPS, median, ratio


def plot(results: dict, path: Path) -> Path | None:
    """Bars: tokens/s ×HF per layout (logprobs, train), GRPO step breakdown (TRL beside), refit GB/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    rows = [r for r in results["layouts"] if "logprobs_s" in r]
    names = [r["case"] for r in rows]
    for i, op in enumerate(OPS):
        vals = [ratio(r, results.get("hf"), op) or 0 for r in rows]
        axes[0].bar([x + 0.4 * i for x in range(len(rows))], vals, width=0.4, label=op)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set(title="tokens/s ×HF eager", xticks=[x + 0.2 for x in range(len(rows))])
    axes[0].set_xticklabels(names, rotation=30, ha="right")
    axes[0].legend()
    grpo = [(r["case"], r["grpo"]) for r in results["layouts"] if "step_s" in (r.get("grpo") or {})]
    trl_steps = [t for _, g in grpo for t in g.get("trl_step_s") or []]  # pooled over the layouts' pairs
    trl = [("TRL GRPOTrainer", {"phases_s": {"trl step": median(trl_steps)}})] if trl_steps else []
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
    axes[2].bar(range(len(refit)), [v["bytes"] / 1e9 / median(v["seconds"]) for _, _, v in refit])
    axes[2].set(title="refit GB/s", xticks=range(len(refit)))
    axes[2].set_xticklabels([f"{n} {t}" for n, t, _ in refit], rotation=30, ha="right")
    fig.suptitle(f"dualrl bench --size {results['size']} ({results['machine']['device_name']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
