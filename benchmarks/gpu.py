"""``dualrl bench --gpu``: every backend on one device next to plain HF eager, in one run.

    dualrl bench --gpu [--size 1b|tiny] [--backends B ...] [--mbs M ...] [--sections throughput refit loss]
        [--device auto|cuda|cpu] [--hf-compile] [--peak-tflops T] [--no-vllm] [--json PATH] [--model-dir DIR]
    python -m benchmarks.gpu [same]

The workload (GitHub issue 14): a Llama with random weights built locally from a config
(``--size 1b``, the default on a GPU: Llama-3.2-1B's shape, bf16 compute over fp32 master weights, 8 sequences x 2048
tokens; ``--size tiny``, the default on a CPU: a smoke, fp32, 4 x 64), every row full length (no padding), NLL loss,
the default AdamW of ``core/configs/policy.yaml``.  One :class:`core.policy.Policy` per backend
(``torch_fsdp``, ``torch_dtensor``, ``torch_dtensor-compiled`` -- ``policy.compile`` on, by
default only on a GPU --, ``jax_pjit``) on one bundle of one GPU (or of ``--threads`` CPUs)
through Ray, one backend alive at a time.  With the throughput or refit section the run first
measures its **roofline** (``benchmarks.lib.roofline``): every matmul engine present on the workload's
products at the largest micro batch, in the run's precision, and a device copy of the refit's bytes;
the throughput rows then show their share of the best engine ("% roof") and the refit rows theirs of
the copy.  Sections:

* **throughput**, per backend and micro batch size (``--mbs``): ``get_logprobs`` and ``train``
  (one optimizer step over the whole batch per call) tokens/s = ``batch x seq`` / the median
  wall seconds of ``--iters`` calls on the driver (Ray dispatch included; the results come back
  through Ray, so the device has finished when the clock is read), after ``--warmup`` untimed
  calls (JAX compiles in the first: its seconds are shown as "first s").  ×HF = tokens/s over
  HF eager's at the same micro batch.  MFU = tokens/s x model FLOPs per token / the peak:
  forward ``2 N + 4 L S d`` FLOPs per token (``N`` matmul weights incl. the LM head, ``L``
  layers, ``S`` sequence, ``d`` hidden: attention's two ``[S, S]`` products, not halved for the
  causal mask), train 3x that (``6 N + 12 L S d``) -- ``benchmarks.lib.machine.flops_per_token``.
  The peak is the datasheet's dense bf16 tensor-core figure of a known GPU (H100, H200, A100:
  ``benchmarks.lib.machine``), or ``--peak-tflops``; MFU is n/a on a CPU, an unknown GPU, or in fp32
  (whose matmuls run at ``highest`` precision, a peak no table here gives).  Peak memory per
  backend and micro batch: the workers' peak allocated bytes (torch: ``max_memory_allocated``
  after ``reset_peak_memory_stats``; JAX: ``memory_stats()['peak_bytes_in_use']``, which XLA
  cannot reset, so it is the process's peak so far); on a CPU the process's peak RSS.
* The yardstick (=1.00): plain ``AutoModelForCausalLM`` in a child process of its own (its
  device memory freed before any Policy starts), same model, batch and micro batches, bf16
  autocast when ``--precision bfloat16``, the same AdamW kwargs and grad-norm clip, timed in
  the child between device synchronisations.  ``--hf-compile`` adds a second yardstick row:
  every decoder block ``torch.compile``-d and ``AdamW(fused=True)``.
* **refit**: the source side of a refit without an engine: ``prepare_refit_info`` seconds, then
  the whole weight stream (``prepare_weights_for_ipc``, ``get_weights_ipc_handles`` per bucket,
  ``finish_refit_stream``: gathers, cast to the engine dtype, CUDA IPC handles on a GPU /
  shared-memory segments on a CPU), seconds and GB/s.  Refit *into* a vLLM engine and vLLM
  generation are printed as skipped with the reason: this mode holds one device for the
  policy, and without vLLM (or with ``--no-vllm``) there is no engine at all.
* **loss**: fp32 loss curves: ``--check-steps`` (5) ``train`` calls per backend on a fresh fp32
  Policy (constant lr ``--check-lr``, micro batch ``--check-mbs``) vs a plain-torch reference in a
  child process (HF model, fp32, ``highest`` matmul precision, the same loss normalisation,
  clip and AdamW); max over steps of ``|a - b| / max(1, |a|, |b|)``, pass if ``<= --loss-tol``
  (1e-5, the issue's bar).

Output: the machine line (``benchmarks.lib.machine``), one markdown table per section, skip notes,
and ``--json PATH``: one JSON object per line, appended as each row is measured (a run killed
by a time limit keeps what it measured).  Exit code 1 when a row failed or a loss check did not
pass.  Numbers for the README come from running this on a GPU machine, not from tests.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchmarks.lib.gpu.report import failed, report
from benchmarks.lib.gpu.sections import run_gpu_bench
from benchmarks.lib.gpu.workload import BACKENDS, SECTIONS, default_backends
from benchmarks.lib.sizes import GPU_SIZES


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog or "python -m benchmarks.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size", choices=list(GPU_SIZES), help="default: 1b on a GPU, tiny on a CPU")
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
    return p


def parse(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    parser = build_parser(prog)
    a = parser.parse_args(argv)
    a.device = resolve_device(a.device)
    if a.device is None:
        parser.error("--device cuda, but no CUDA GPU is visible")
    a.size = a.size or ("1b" if a.device == "cuda" else "tiny")
    a.backends = a.backends or default_backends(a.device)
    size = GPU_SIZES[a.size]
    a.batch, a.seq = a.batch or size.batch, a.seq or size.seq
    a.mbs, a.precision = a.mbs or list(size.mbs), a.precision or size.precision
    a.check_mbs = a.check_mbs or size.check_mbs
    a.warmup = a.warmup if a.warmup is not None else size.warmup
    a.iters = a.iters if a.iters is not None else size.iters
    bad = [m for m in [*a.mbs, a.check_mbs] if m < 1 or a.batch % m]
    if bad:
        parser.error(f"micro batch sizes {bad} do not divide --batch {a.batch}")
    if a.warmup < 1 or a.iters < 1 or a.refit_repeats < 1 or a.check_steps < 1:
        parser.error(
            "--warmup, --iters, --refit-repeats and --check-steps must be >= 1 (JAX compiles in the first call)"
        )
    a.ray_cpus = a.threads + 2  # one Policy bundle of --threads CPUs at a time
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
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text("")
    records = run_gpu_bench(args)
    print(report(records, args.loss_tol))
    return 1 if failed(records) else 0


if __name__ == "__main__":
    sys.exit(main())
