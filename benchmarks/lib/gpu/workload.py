"""What ``dualrl bench --gpu`` measures and how it is counted: its rows (backends, sections), and the
arithmetic of timings, tokens/s, MFU and loss differences (no processes, no Ray).  Its sizes are
``benchmarks.lib.sizes.GPU_SIZES``; its batch and AdamW ``benchmarks.lib.workload``'s."""

from __future__ import annotations

import math
import statistics

from benchmarks.lib import machine

#: Rows of Policies; ``torch_dtensor-compiled`` is torch_dtensor with ``policy.compile`` on.
COMPILED = "torch_dtensor-compiled"
BACKENDS = ("torch_fsdp", "torch_dtensor", COMPILED, "jax_pjit")


def engine_of(backend: str) -> tuple[str, bool]:
    """A row's ``policy.backend`` and whether its blocks are compiled."""
    return ("torch_dtensor", True) if backend == COMPILED else (backend, False)


def default_backends(device: str) -> list[str]:
    """Every row on a GPU; on a CPU not the compiled one (inductor's CPU build of the blocks
    takes longer than the rest of a tiny run, and says nothing about a GPU)."""
    return [b for b in BACKENDS if device == "cuda" or b != COMPILED]


SECTIONS = ("throughput", "refit", "loss")


# ----------------------------------------------------------------------------- timings, tokens/s, MFU


def timing(seconds: list[float], warmup: int) -> dict:
    """First call, the timed calls after ``warmup`` and their median."""
    timed = seconds[warmup:]
    return {"first_s": seconds[0], "times_s": timed, "median_s": statistics.median(timed)}


def tokens_per_s(tokens: int, t: dict | None) -> float | None:
    return tokens / t["median_s"] if t and t.get("median_s") else None


def mfu_peak(device: str, device_name: str, precision: str, override: float | None) -> tuple[float | None, str]:
    """``(peak TFLOP/s, where it comes from)`` for MFU; ``(None, why not)`` when there is none."""
    if override:
        return override, "--peak-tflops"
    if device != "cuda":
        return None, "MFU n/a on a CPU (no datasheet peak; pass --peak-tflops)"
    if precision != "bfloat16":
        # fp32 matmuls run at matmul_precision "highest" (no TF32): the table's fp32 row is TF32's
        return None, f"MFU n/a in {precision} (the datasheet peaks are bf16 / TF32 tensor-core ones)"
    peak = machine.datasheet_tflops(device_name, "bfloat16")
    if peak is None:
        return None, f"MFU n/a: {device_name!r} is not in benchmarks.lib.machine.DATASHEET_TFLOPS (pass --peak-tflops)"
    return peak, f"datasheet dense bf16 peak of {device_name}"


# ----------------------------------------------------------------------------- loss differences


def loss_measure(a: float, b: float) -> float:
    """Absolute below 1, relative above (as ``dualrl parity``): losses are ~ln(vocab)."""
    return abs(a - b) / max(1.0, abs(a), abs(b))


def worst_diff(xs: list[float], ys: list[float]) -> float:
    """The largest :func:`loss_measure` over paired steps; NaN when any step is NaN."""
    diffs = [loss_measure(x, y) for x, y in zip(xs, ys, strict=True)]
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs)
