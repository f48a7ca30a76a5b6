"""The command line of ``dualrl bench --gpu`` (= ``python -m benchmarks.gpu``): the flags and their
size-dependent defaults, the device, and :func:`main` (a run, or a yardstick child process)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from benchmarks.gpu.bench import Bench, start_ray
from benchmarks.gpu.report import failed, report
from benchmarks.gpu.sections import run
from benchmarks.gpu.workload import BACKENDS, SECTIONS, SIZES, default_backends
from benchmarks.gpu.yardstick import child_main


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    from benchmarks import gpu  # its docstring is the help text

    p = argparse.ArgumentParser(
        prog=prog or "python -m benchmarks.gpu",
        description=gpu.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size", choices=list(SIZES), help="default: 1b on a GPU, tiny on a CPU")
    p.add_argument(
        "--backends", nargs="+", choices=BACKENDS, help="default: all on a GPU; on a CPU all but torch_dtensor-compiled"
    )
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="auto: cuda when a GPU is visible")
    p.add_argument("--mbs", nargs="+", type=int, help="micro batch sizes (default: the size's)")
    for name in ("batch", "seq", "warmup", "iters"):
        p.add_argument(f"--{name}", type=int, help="default: the size's" if name in ("batch", "seq") else None)
    p.add_argument("--precision", choices=["float32", "bfloat16"], help="throughput rows; default: the size's")
    p.add_argument("--hf-compile", action="store_true", help="add HF + per-block torch.compile + fused AdamW")
    p.add_argument("--peak-tflops", type=float, help="MFU against this peak instead of the datasheet table")
    p.add_argument("--no-vllm", action="store_true", help="treat vLLM as absent (its rows are skipped either way)")
    p.add_argument("--refit-repeats", type=int, default=2, help="whole weight streams per backend (first one apart)")
    p.add_argument("--check-steps", type=int, default=5)
    p.add_argument("--check-lr", type=float, default=1e-4)
    p.add_argument("--check-mbs", type=int, help="micro batch of the loss check (default: the size's)")
    p.add_argument("--loss-tol", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads per process")
    p.add_argument("--model-dir", help="build the random model here, or reuse the one there (default: a temp dir)")
    p.add_argument("--json", help="append one JSON object per row to this file (truncated first)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def parse(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    parser = build_parser(prog)
    a = parser.parse_args(argv)
    if a.child:
        return a
    a.device = resolve_device(a.device)
    if a.device is None:
        parser.error("--device cuda, but no CUDA GPU is visible")
    a.size = a.size or ("1b" if a.device == "cuda" else "tiny")
    a.backends = a.backends or default_backends(a.device)
    size = SIZES[a.size]
    a.batch, a.seq = a.batch or size.batch, a.seq or size.seq
    a.mbs, a.precision = a.mbs or list(size.mbs), a.precision or size.precision
    a.check_mbs = a.check_mbs or size.check_mbs
    big = a.size == "1b"
    a.warmup = a.warmup if a.warmup is not None else (2 if big else 1)
    a.iters = a.iters if a.iters is not None else 3
    bad = [m for m in [*a.mbs, a.check_mbs] if m < 1 or a.batch % m]
    if bad:
        parser.error(f"micro batch sizes {bad} do not divide --batch {a.batch}")
    if a.warmup < 1 or a.iters < 1 or a.refit_repeats < 1 or a.check_steps < 1:
        parser.error(
            "--warmup, --iters, --refit-repeats and --check-steps must be >= 1 (JAX compiles in the first call)"
        )
    a.ray_cpus = a.threads + 2  # one Policy bundle of --threads CPUs at a time (benchmarks.jax_backend.RaySession)
    return a


def resolve_device(requested: str) -> str | None:
    """cuda / cpu; None when cuda was asked for and no GPU is visible."""
    import torch

    has_gpu = torch.cuda.is_available()  # no CUDA context is created by this
    if requested == "auto":
        return "cuda" if has_gpu else "cpu"
    return None if requested == "cuda" and not has_gpu else requested


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse(argv, prog)
    if args.child:
        child_main(json.loads(args.child))
        return 0
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text("")
    import ray

    with tempfile.TemporaryDirectory(prefix="dualrl-gpu-bench-") as tmp:
        bench = Bench(args=args, device=args.device, tmp=Path(tmp))
        session = start_ray(bench)
        try:
            run(bench)
        finally:
            if session.owned and ray.is_initialized():
                ray.shutdown()
    print(report(bench.records, args.loss_tol))
    return 1 if failed(bench.records) else 0
