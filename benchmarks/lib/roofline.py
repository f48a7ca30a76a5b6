"""The roofline of a ``dualrl bench`` run: the rate each matmul engine reaches on this machine with
the workload's own matrices, and the share of the best one that every timed phase achieves.

**Peaks.**  Every engine present multiplies the workload's matrices: each linear layer's forward
(``[T, in] @ [in, out]``), input-gradient (``[T, out] @ [out, in]``) and weight-gradient
(``[in, T] @ [T, out]``) product at ``T`` = the throughput batch's padded tokens, each shape
weighted by how often a training step makes it (:func:`workload_products`).  An engine's rate is
the FLOPs of that set over its best seconds (each product best of ``repeats`` after a warm-up).
Engines: ``xla`` (``jax.jit`` of the products at the matmul precision the JAX backend takes for
that dtype by default), ``torch`` (``torch.matmul``: torch's default
path, MKL's sgemm on a CPU) and, where torch has oneDNN, ``torch-onednn`` (the product the torch
backends' fp32 CPU linears run: ``backends.torch_common.cpu_linear``); fp32 and bf16 each.  They
run in child processes set up as the workers are (:func:`measure_peaks`): ``--threads``
OpenMP / torch threads for torch; for XLA the JAX actor's ``XLA_FLAGS`` (one host device, Eigen's
pool off: ``core.distributed.ray_init.jax_cpu_flags``) and, with fewer threads than cores, its
pinning to that many CPUs (``benchmarks.lib.policy.JaxActor``).

**Achieved.**  FLOPs per phase come from the bench's accounting (``benchmarks.lib.machine.
flops_per_token``: ``2 N`` per token forward plus attention, times 3 for training): logprobs and
train per real token of the throughput batch; vLLM generation per prompt and generated token at
the mean sequence length; the GRPO step's generation and train phases (dualrl's and TRL's) per
sample at its mean prompt + completion length.  The share is against the machine's best
measured peak in the run's precision.  Refit moves bytes, not FLOPs: its roof is the memcpy
bandwidth the refit section times beside it (``benchmarks.lib.refit``): its share is refit GB/s over memcpy GB/s.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.lib.child import reply, run_child

#: The engines, in report order; ``torch-onednn`` only where torch has oneDNN (CPU).
ENGINES = ("xla", "torch", "torch-onednn")
#: What each engine is, for the reports' peaks tables.
ENGINE_NOTES = {
    "xla": "jax.jit matmul at the JAX backend's precision (highest in fp32, default in bf16)",
    "torch": "torch.matmul, torch's default path (cuBLAS on a GPU, MKL on a CPU; HF eager and TRL)",
    "torch-onednn": "oneDNN matmul (the torch backends' fp32 CPU linears)",
}
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Product:
    """``[m, k] @ [k, n]``, made ``count`` times per training step."""

    m: int
    k: int
    n: int
    count: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n


def linear_shapes(config: Any) -> dict[tuple[int, int], int]:
    """``{(in, out): layers}`` of the model's linear layers (attention and MLP projections of every
    layer, the LM head), from an HF config as ``benchmarks.lib.machine.matmul_params`` reads it."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    shapes: dict[tuple[int, int], int] = {}
    for shape, n in (
        ((hidden, heads * head_dim), 1),  # q
        ((hidden, kv * head_dim), 2),  # k, v
        ((heads * head_dim, hidden), 1),  # o
        ((hidden, config.intermediate_size), 2),  # gate, up
        ((config.intermediate_size, hidden), 1),  # down
    ):
        shapes[shape] = shapes.get(shape, 0) + n * layers
    head = (hidden, config.vocab_size)
    shapes[head] = shapes.get(head, 0) + 1
    return shapes


def workload_products(config: Any, tokens: int) -> list[Product]:
    """The forward, input-gradient and weight-gradient product of every linear layer at ``tokens``
    rows (shapes of equal dims merged, counts added)."""
    out: dict[tuple[int, int, int], int] = {}
    for (d_in, d_out), layers in linear_shapes(config).items():
        for mkn in ((tokens, d_in, d_out), (tokens, d_out, d_in), (d_in, tokens, d_out)):
            out[mkn] = out.get(mkn, 0) + layers
    return [Product(m, k, n, c) for (m, k, n), c in out.items()]


def combined_rate(products: list[Product], seconds: list[float]) -> float:
    """GFLOP/s of the whole weighted set: its FLOPs over the seconds its products take."""
    flops = sum(p.flops * p.count for p in products)
    return flops / sum(s * p.count for p, s in zip(products, seconds, strict=True)) / 1e9


# ----------------------------------------------------------------------------- measuring (children)


def _best_seconds(run, repeats: int) -> float:
    run()  # warm-up: kernel choice, packing, compilation, first-touch pages
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def _torch_runs(engine: str, dtype: str, device: str, products: list[Product]) -> list:
    import torch

    from backends.torch_common.cpu_linear import onednn_product

    dt = getattr(torch, dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    runs = []
    for p in products:
        a = torch.randn(p.m, p.k, device=device).to(dt)
        b = torch.randn(p.k, p.n, device=device).to(dt)
        if engine == "torch-onednn":  # linear(a, w) with w [n, k]: b's transpose, as the backends' weights
            w = b.t().contiguous()
            runs.append(lambda a=a, w=w: onednn_product(a, w, None))
        else:
            runs.append(lambda a=a, b=b: (torch.matmul(a, b), sync()))
    return runs


def _xla_runs(dtype: str, products: list[Product]) -> list:
    import jax
    import jax.numpy as jnp

    from core.policy.matmul_precision import default_matmul_precision

    # The JAX backend's own precision for this dtype: on a GPU, "highest" on bf16 inputs can
    # take another (slower) kernel than the backend's "default" does.
    precision = default_matmul_precision(dtype)
    matmul = jax.jit(lambda a, b: jnp.dot(a, b, precision=precision))
    # Drawn on the device: a 1b model's LM-head products hold GB of inputs, far too many to draw
    # in float64 on the host and convert.
    key, dt = jax.random.key(0), getattr(jnp, dtype)
    runs = []
    for i, p in enumerate(products):
        ka, kb = jax.random.split(jax.random.fold_in(key, i))
        a, b = jax.random.normal(ka, (p.m, p.k), dt), jax.random.normal(kb, (p.k, p.n), dt)
        runs.append(lambda a=a, b=b: matmul(a, b).block_until_ready())
    return runs


def serve_peaks(spec: dict) -> None:
    """Child side of :func:`measure_peaks`: one reply ``{"peaks": {engine: {dtype: GFLOP/s}},
    "errors": {"engine dtype": why}}`` for the spec's engines (its ``pin``: CPUs to restrict every
    thread of this process to, before any pool starts).  A product one engine cannot run in one
    dtype (oneDNN has no bf16 inner product on a CPU without AVX-512) is that pair's error; the
    engine's other dtype still counts."""
    if spec.get("pin"):
        os.sched_setaffinity(0, spec["pin"])
    products = [Product(**p) for p in spec["products"]]
    if spec["family"] == "torch":
        import torch

        if spec["device"] != "cuda":
            torch.set_num_threads(spec["threads"])
    peaks: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    extra = {}
    if spec["family"] == "torch" and spec.get("copy_bytes"):
        extra["copy_gb_s"] = _copy_gb_s(spec["device"], spec["copy_bytes"], spec["repeats"])
    for engine in spec["engines"]:
        peaks[engine] = {}
        for dtype in spec["dtypes"]:
            try:
                if engine == "xla":
                    runs = _xla_runs(dtype, products)
                else:
                    runs = _torch_runs(engine, dtype, spec["device"], products)
                peaks[engine][dtype] = combined_rate(products, [_best_seconds(r, spec["repeats"]) for r in runs])
            except RuntimeError as err:  # the engine's own refusal of this dtype; anything else fails the child
                errors[f"{engine} {dtype}"] = _last_line(err)
    reply({"peaks": peaks, "errors": errors, **extra})


def _copy_gb_s(device: str, nbytes: int, repeats: int) -> float:
    """GB/s of ``dst.copy_(src)`` of ``nbytes`` on ``device`` (bytes copied per second): the roof of
    a refit's source side where :mod:`benchmarks.lib.refit`'s host memcpy is not measured beside it
    (``dualrl bench --gpu``), since its gathers and casts to the engine dtype are copies."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return nbytes / _best_seconds(lambda: (dst.copy_(src), sync()), repeats) / 1e9


def _last_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[-1][:300]


def present_engines(device: str) -> dict[str, list[str]]:
    """``{child family: engines}`` that this machine has (oneDNN: a CPU and a torch built with it)."""
    engines = {"torch": ["torch"]}
    if device != "cuda":
        from backends.torch_common.cpu_linear import onednn_linear_available

        if onednn_linear_available():
            engines["torch"].append("torch-onednn")
    try:
        import jax  # noqa: F401
    except ImportError:
        return engines
    engines["xla"] = ["xla"]
    return engines


def worker_env(family: str, device: str, threads: int) -> tuple[dict[str, str | None], list[int] | None]:
    """The environment and CPU pinning a layout's worker of this engine family runs with."""
    if family == "torch" or device == "cuda":
        return {"JAX_PLATFORMS": "cuda" if device == "cuda" else "cpu"}, None
    from core.distributed.ray_init import jax_cpu_flags

    cpus = sorted(os.sched_getaffinity(0))
    env = {"XLA_FLAGS": jax_cpu_flags("", 1), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": None}
    return env, cpus[:threads] if threads < len(cpus) else None


def measure_peaks(
    config: Any,
    tokens: int,
    device: str,
    threads: int,
    repeats: int = 3,
    dtypes: tuple[str, ...] = DTYPES,
    copy_bytes: int | None = None,
) -> dict[str, Any]:
    """Every present engine's rate on the workload's products (the module docstring), each engine
    family in a child process of its own; a family whose child fails, or an engine that refuses
    one dtype, is reported with its error (``errors``: by family, or by ``"engine dtype"``).
    ``copy_bytes``: also the copy bandwidth of that many bytes on the device (``copy_gb_s``)."""
    products = workload_products(config, tokens)
    peaks: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    copy: dict[str, float] = {}
    for family, engines in present_engines(device).items():
        env, pin = worker_env(family, device, threads)
        spec = {
            "family": family,
            "engines": engines,
            "dtypes": list(dtypes),
            "device": device,
            "threads": threads,
            "repeats": repeats,
            "pin": pin,
            "products": [vars(p) for p in products],
            "copy_bytes": copy_bytes,
        }
        try:
            (got,) = run_child("benchmarks.lib.roofline:serve_peaks", spec, threads, env=env)
            peaks.update(got["peaks"])
            errors.update(got["errors"])
            copy.update({"copy_gb_s": got["copy_gb_s"]} if "copy_gb_s" in got else {})
        except Exception as err:  # noqa: BLE001 -- reported; the other engines still count
            errors[family] = _last_line(err)
    return {"tokens": tokens, "products": [vars(p) for p in products], "peaks": peaks, "errors": errors, **copy}


# ----------------------------------------------------------------------------- achieved shares


def best_peak(roofline: dict, dtype: str) -> tuple[str, float] | None:
    """(engine, GFLOP/s) of the fastest engine in ``dtype``, or None when nothing was measured."""
    rates = [(e, r[dtype]) for e, r in roofline.get("peaks", {}).items() if r.get(dtype)]
    return max(rates, key=lambda er: er[1]) if rates else None


@dataclass(frozen=True)
class Achieved:
    """One phase's achieved rate: GFLOP/s (or GB/s for a refit) and its share of the roof."""

    row: str
    phase: str
    rate: float
    unit: str  # "GFLOP/s" | "GB/s"
    share: float | None  # of the machine's best peak (memcpy for a refit)


def flop_phase(row: str, phase: str, flops: float, seconds: float | None, peak: float | None) -> Achieved | None:
    """A phase that did ``flops`` in ``seconds`` (None when it was not timed)."""
    if not seconds:
        return None
    rate = flops / seconds / 1e9
    return Achieved(row, phase, rate, "GFLOP/s", rate / peak if peak else None)


def refit_phase(
    row: str, transport: str, nbytes: float, seconds: float | None, memcpy_s: float | None
) -> Achieved | None:
    if not seconds:
        return None
    return Achieved(row, f"refit {transport}", nbytes / seconds / 1e9, "GB/s", memcpy_s / seconds if memcpy_s else None)


def _median(values) -> float | None:
    vals = [v for v in values or [] if v is not None]
    return statistics.median(vals) if vals else None


def throughput_phases(results: dict, config: Any, peak: float | None) -> list[Achieved]:
    """logprobs and train of the HF row and every layout (real tokens of the throughput batch)."""
    from benchmarks.lib.machine import flops_per_token

    out = []
    tokens, seq = results["tokens"], results["seq"]
    for r in [results.get("hf") or {}] + results["layouts"]:
        for op, train in (("logprobs", False), ("train", True)):
            got = flop_phase(
                r.get("case", "hf"), op, tokens * flops_per_token(config, seq, train), _median(r.get(f"{op}_s")), peak
            )
            out += [got] if got else []
    return out


def generation_phase(results: dict, config: Any, peak: float | None) -> list[Achieved]:
    """vLLM's generation row: every prompt and generated token's forward at the mean length."""
    from benchmarks.lib.machine import flops_per_token

    gen = results.get("generation") or {}
    if not gen.get("seconds") or not gen.get("prompt_tokens"):
        return []
    tokens = gen["prompt_tokens"] + gen["tokens"]
    seq = round(tokens / gen["sequences"])
    got = flop_phase("vLLM engine", "generation", tokens * flops_per_token(config, seq, False), gen["seconds"], peak)
    return [got] if got else []


#: The GRPO step's phases with FLOPs: (phase, TRL's key for it, forward passes per token).
GRPO_FLOP_PHASES = (("generation", "generation_s", 1), ("train", "train_s", 3))


def _grpo_sides(row: dict) -> list[tuple[str, float | None, dict[str, float | None]]]:
    """(name, mean completion tokens, {phase: seconds}) of a layout's GRPO row and of TRL beside it."""
    g = row.get("grpo") or {}
    if "step_s" not in g:
        return []
    sides = [(row["case"], g.get("response_length_mean"), {p: g["phases_s"].get(p) for p, _, _ in GRPO_FLOP_PHASES})]
    trl = g.get("trl_phases_s") or {}
    if trl:
        seconds = {p: _median(trl.get(key)) for p, key, _ in GRPO_FLOP_PHASES}
        sides.append((f"TRL beside {row['case']}", _median(g.get("trl_completion_length")), seconds))
    return sides


def grpo_phases(results: dict, config: Any, peak: float | None) -> list[Achieved]:
    """The GRPO rows' generation and train phases, dualrl's and TRL's beside (FLOPs per sample at
    the run's mean prompt length + each side's mean completion length)."""
    from benchmarks.lib.machine import flops_per_token

    work = results.get("grpo_workload") or {}
    prompt, samples = results.get("grpo_prompt_tokens_mean"), work.get("prompts", 0) * work.get("group", 0)
    if not prompt or not samples:
        return []
    out = []
    for r in results["layouts"]:
        for name, completion, seconds in _grpo_sides(r):
            if not completion:
                continue
            length = prompt + completion
            for phase, _, passes in GRPO_FLOP_PHASES:
                flops = samples * length * flops_per_token(config, round(length), False) * passes
                got = flop_phase(name, f"GRPO {phase}", flops, seconds[phase], peak)
                out += [got] if got else []
    return out


def refit_phases(results: dict) -> list[Achieved]:
    out = []
    for r in results["layouts"]:
        refit = r.get("refit") or {}
        copy = (refit.get("memcpy") or {}).get("warm_s")
        for transport, t in (refit.get("transports") or {}).items():
            got = refit_phase(
                r["case"], transport, t.get("bytes", 0), _median(t.get("seconds")), t.get("memcpy_s", copy)
            )
            out += [got] if got else []
    return out


def achieved(results: dict, config: Any) -> list[Achieved]:
    """Every timed phase's rate and share of the roof (the module docstring), report order."""
    best = best_peak(results.get("roofline") or {}, results["machine"]["precision"])
    peak = best[1] if best else None
    return (
        throughput_phases(results, config, peak)
        + generation_phase(results, config, peak)
        + grpo_phases(results, config, peak)
        + refit_phases(results)
    )
