"""The workload of ``dualrl bench --gpu`` and how it is counted: the model sizes, the batch, the
AdamW, and the arithmetic of timings, tokens/s, MFU and loss differences (no processes, no Ray)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from benchmarks import machine
from benchmarks import torch_backends as tb

#: Rows of Policies; ``torch_dtensor-compiled`` is torch_dtensor with ``dtensor_cfg.compile`` on.
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
SEED = 0


@dataclass(frozen=True)
class Size:
    shape: dict[str, Any]  # HF Llama config fields
    batch: int
    seq: int
    mbs: tuple[int, ...]
    precision: str
    check_mbs: int


SIZES: dict[str, Size] = {
    # Llama-3.2-1B's shape (random init, default RoPE): 1.24 B parameters, tied embeddings
    "1b": Size(
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        ),
        batch=8,
        seq=2048,
        mbs=(1, 2, 4),
        precision="bfloat16",
        check_mbs=1,
    ),
    # the CPU smoke: seconds per backend
    "tiny": Size(
        dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
            max_position_embeddings=128,
            tie_word_embeddings=True,
        ),
        batch=4,
        seq=64,
        mbs=(2,),
        precision="float32",
        check_mbs=2,
    ),
}


# ----------------------------------------------------------------------------- the model, the batch, the AdamW


def full_batch(batch: int, seq: int, vocab: int):
    """Full-length rows of seeded random ids (specials excluded), NLL on every token."""
    import torch

    from core.data import BatchedDataDict

    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(4, vocab, (batch, seq), generator=g)
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.full((batch,), seq),
        token_mask=torch.ones(batch, seq),
        sample_mask=torch.ones(batch),
    )


def param_count(config) -> int:
    """Parameters of the model (a tied embedding counted once), without allocating them."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def optimizer_kwargs(lr: float | None = None, fused: bool = False) -> dict:
    """The default policy section's AdamW kwargs (what the workers build), optionally changed."""
    kwargs = dict(tb.default_policy_section()["optimizer"]["kwargs"])
    kwargs["betas"] = tuple(kwargs["betas"])  # YAML gives a list
    if lr is not None:
        kwargs["lr"] = lr
    if fused:
        kwargs["fused"] = True
    return kwargs


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
        return None, f"MFU n/a: {device_name!r} is not in benchmarks.machine.DATASHEET_TFLOPS (pass --peak-tflops)"
    return peak, f"datasheet dense bf16 peak of {device_name}"


# ----------------------------------------------------------------------------- loss differences


def loss_measure(a: float, b: float) -> float:
    """Absolute below 1, relative above (as ``dualrl parity``): losses are ~ln(vocab)."""
    return abs(a - b) / max(1.0, abs(a), abs(b))


def worst_diff(xs: list[float], ys: list[float]) -> float:
    """The largest :func:`loss_measure` over paired steps; NaN when any step is NaN."""
    diffs = [loss_measure(x, y) for x, y in zip(xs, ys, strict=True)]
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs)
