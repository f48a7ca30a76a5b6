"""Chunked ``logprobs_from_logits`` vs naive ``log_softmax`` + gather, torch and jax.

    python -m benchmarks.kernels [--shape 8 1024 32000] [--repeats 3] [--engines torch jax]

Every (engine, implementation, pass) case runs in its own subprocess so that peak memory
is that case's alone: after the inputs exist and one warm-up call has run (jax compiles
there), the kernel's resident-set high-water mark is reset (``/proc/self/clear_refs``),
the timed calls run, and the peak is read back.  Reported: median seconds and peak extra
memory (above inputs) per case, and dualrl/naive ratios from the same run.
For jax the compiled program's own buffer plan (temp + output) is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MIB = 1 << 20


# ----------------------------------------------------------------------------- memory probe


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


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
    exact = _reset_peak_rss()
    base_kib = _status_kib("VmRSS")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak_kib = _status_kib("VmHWM")
    return {
        "engine": engine,
        "impl": impl,
        "pass": "fwd+bwd" if backward else "fwd",
        "seconds": statistics.median(times),
        "peak_extra_mib": max(0, peak_kib - base_kib) / 1024,
        "peak_exact": exact,
        "xla_temp_mib": getattr(step, "xla_temp_mib", None),
        "xla_output_mib": getattr(step, "xla_output_mib", None),
    }


# ----------------------------------------------------------------------------- driver


def _spawn(engine, impl, backward, shape, repeats) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.kernels",
        "--child",
        engine,
        impl,
        str(int(backward)),
        "--shape",
        *map(str, shape),
        "--repeats",
        str(repeats),
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _report(results: list[dict], shape) -> str:
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=3, default=[8, 1024, 32000], metavar=("B", "S", "V"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=["torch", "jax"], choices=["torch", "jax"])
    parser.add_argument("--no-backward", action="store_true", help="forward pass only")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        engine, impl, backward = args.child
        print(json.dumps(run_case(engine, impl, bool(int(backward)), args.shape, args.repeats)))
        return 0

    passes = [False] if args.no_backward else [False, True]
    results = [
        _spawn(engine, impl, backward, args.shape, args.repeats)
        for engine in args.engines
        for backward in passes
        for impl in ("naive", "dualrl")
    ]
    print(_report(results, args.shape))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
