"""Chunked ``logprobs_from_logits`` vs naive ``log_softmax`` + gather, torch and jax
(``python -m benchmarks.kernels``).

Every (engine, implementation, pass) case runs in its own subprocess so that peak memory
is that case's alone: after the inputs exist and one warm-up call has run (jax compiles
there), the kernel's resident-set high-water mark is reset (``/proc/self/clear_refs``),
the timed calls run, and the peak is read back.  Reported: median seconds and peak extra
memory (above inputs) per case, and dualrl/naive ratios from the same run.
For jax the compiled program's own buffer plan (temp + output) is printed too.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.lib.child import reply, run_child
from benchmarks.lib.proc import reset_peak_rss, status_bytes

MIB = 1 << 20


# ----------------------------------------------------------------------------- cases


def _torch_case(impl: str, backward: bool, shape):
    import torch

    from core.kernels import logprobs_from_logits

    torch.manual_seed(0)
    b, s, v = shape
    logits = torch.randn(b, s, v, dtype=torch.float32, requires_grad=backward)
    ids = torch.randint(0, v, (b, s))

    def naive(x):
        return torch.log_softmax(x, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)

    fn = naive if impl == "naive" else (lambda x: logprobs_from_logits(x, ids))

    def step():
        out = fn(logits)
        if backward:
            out.sum().backward()
            logits.grad = None
        return float(out[0, 0])

    return step


def _jax_case(impl: str, backward: bool, shape):
    import jax
    import jax.numpy as jnp

    from core.kernels import logprobs_from_logits

    b, s, v = shape
    key = jax.random.PRNGKey(0)
    logits = jax.random.normal(key, (b, s, v), dtype=jnp.float32)
    ids = jax.random.randint(key, (b, s), 0, v)

    def naive(x):
        return jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), ids[..., None], axis=-1)[..., 0]

    fn = naive if impl == "naive" else (lambda x: logprobs_from_logits(x, ids))
    compiled = jax.jit(jax.grad(lambda x: fn(x).sum()) if backward else fn).lower(logits).compile()
    plan = compiled.memory_analysis()

    def step():
        out = compiled(logits)
        out.block_until_ready()
        return float(out.ravel()[0])

    # XLA's own buffer plan is exact where RSS is not (the runtime frees buffers lazily).
    step.xla_temp_mib = plan.temp_size_in_bytes / MIB
    step.xla_output_mib = plan.output_size_in_bytes / MIB
    return step


def run_case(engine: str, impl: str, backward: bool, shape, repeats: int) -> dict:
    """Runs in the child process: time and peak extra RSS of one case."""
    step = (_torch_case if engine == "torch" else _jax_case)(impl, backward, shape)
    step()  # warm-up (jax compiles here); its memory is not counted
    exact = reset_peak_rss()
    base = status_bytes("self", "VmRSS")["VmRSS"]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = status_bytes("self", "VmHWM")["VmHWM"]
    return {
        "engine": engine,
        "impl": impl,
        "pass": "fwd+bwd" if backward else "fwd",
        "seconds": statistics.median(times),
        "peak_extra_mib": max(0, peak - base) / MIB,
        "peak_exact": exact,
        "xla_temp_mib": getattr(step, "xla_temp_mib", None),
        "xla_output_mib": getattr(step, "xla_output_mib", None),
    }


# ----------------------------------------------------------------------------- driver side


def case_child(spec: dict) -> None:
    """The child process of one case."""
    reply(run_case(spec["engine"], spec["impl"], spec["backward"], spec["shape"], spec["repeats"]))


def spawn(engine: str, impl: str, backward: bool, shape, repeats: int) -> dict:
    """One case in a child process of its own (its peak memory is that case's alone)."""
    spec = {"engine": engine, "impl": impl, "backward": backward, "shape": list(shape), "repeats": repeats}
    return run_child("benchmarks.lib.kernels:case_child", spec, None, env={"JAX_PLATFORMS": "cpu"})[-1]


def report(results: list[dict], shape) -> str:
    b, s, v = shape
    naive_mib = b * s * v * 4 / MIB
    lines = [
        f"logprobs_from_logits on [{b}, {s}, {v}] float32 (one fp32 [B,S,V] = {naive_mib:.0f} MiB)",
        f"{'engine':6} {'pass':8} {'impl':8} {'seconds':>9} {'peak MiB':>9}   (XLA plan: temp + output MiB)",
    ]
    for r in results:
        xla = "" if r["xla_temp_mib"] is None else f"   ({r['xla_temp_mib']:.0f} + {r['xla_output_mib']:.0f})"
        lines.append(f"{r['engine']:6} {r['pass']:8} {r['impl']:8} {r['seconds']:9.3f} {r['peak_extra_mib']:9.0f}{xla}")
    lines.append("ratios dualrl kernel / naive (time: <1 is faster; memory: <1 is smaller)")
    by_key = {(r["engine"], r["pass"], r["impl"]): r for r in results}
    for engine, pas in sorted({(r["engine"], r["pass"]) for r in results}):
        n, c = by_key.get((engine, pas, "naive")), by_key.get((engine, pas, "dualrl"))
        if n and c:
            mem = c["peak_extra_mib"] / max(n["peak_extra_mib"], 1e-9)
            line = f"  {engine:6} {pas:8} time x{c['seconds'] / n['seconds']:.2f}   peak memory x{mem:.3f}"
            if c["xla_temp_mib"] is not None:
                line += f"   XLA temp buffers {c['xla_temp_mib']:.0f} vs {n['xla_temp_mib']:.0f} MiB"
            lines.append(line)
    if not all(r["peak_exact"] for r in results):
        lines.append("  (peak RSS could not be reset here: memory numbers include the warm-up)")
    return "\n".join(lines)
