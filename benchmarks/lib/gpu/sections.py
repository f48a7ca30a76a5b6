"""The run of ``dualrl bench --gpu``: which rows are recorded, in what order -- the machine facts,
the roofline, the vLLM rows it skips, the HF yardstick, each backend's Policy, the fp32 loss curves."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

from benchmarks.lib import machine
from benchmarks.lib.bench import Bench
from benchmarks.lib.errors import error_text
from benchmarks.lib.gpu.policy_rows import backend_case, backend_config, loss_row, refit_row, throughput_row
from benchmarks.lib.gpu.workload import mfu_peak
from benchmarks.lib.gpu.yardstick import child_spec, run_yardstick
from benchmarks.lib.models import param_count
from benchmarks.lib.ray_session import RaySession
from benchmarks.lib.roofline import measure_peaks
from benchmarks.lib.sizes import GPU_SIZES
from benchmarks.lib.workload import full_batch


def vllm_skip_reason(no_vllm: bool) -> str:
    """Why the rows that need a vLLM engine are not measured in this mode."""
    if no_vllm:
        return "vLLM treated as absent (--no-vllm)"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed on this machine"
    return (
        "vLLM is installed, but this mode holds its one device for the policy and the engine needs "
        "one of its own: `dualrl bench --device cuda --sections refit generation` on two GPUs"
    )


def hf_section(bench: Bench) -> None:
    """HF eager (and with ``--hf-compile`` HF + compiled blocks + fused AdamW), every ``--mbs``."""
    for compiled in (False, True) if bench.args.hf_compile else (False,):
        name = "hf compile+fused" if compiled else "hf eager"
        spec = child_spec(bench, "hf", mbs=list(bench.args.mbs), compile=compiled, fused=compiled)

        def on_reply(reply: dict, name=name) -> None:
            kind = "throughput" if "mbs" in reply else "yardstick"
            bench.record({"kind": kind, "backend": name, **reply})

        try:
            run_yardstick(spec, bench.args.threads, on_reply)
        except Exception as err:  # noqa: BLE001 -- reported in its row; the backends still run
            bench.record({"kind": "error", "backend": name, "error": error_text(err)})


def backend_section(bench: Bench, backend: str) -> None:
    """Throughput at every ``--mbs`` and the refit source on one Policy, closed afterwards."""
    sections, data = bench.args.sections, full_batch(bench.args.batch, bench.args.seq, bench.config.vocab_size)
    try:
        cfg = backend_config(bench, backend, bench.args.precision, bench.args.mbs[0])
        case = backend_case(bench, backend, cfg)
    except Exception as err:  # noqa: BLE001 -- reported; the other backends still run
        bench.record({"kind": "error", "backend": backend, "error": error_text(err)})
        return
    try:
        if "throughput" in sections:
            for mbs in bench.args.mbs:
                bench.record(throughput_row(bench, case, backend, data, mbs))
        if "refit" in sections:
            bench.record(refit_row(bench, case, backend))
    finally:
        case.close()


def loss_section(bench: Bench) -> None:
    """The plain-torch fp32 reference curve (a child process), then each backend's against it."""
    a = bench.args
    spec = child_spec(bench, "reference", mbs=[a.check_mbs], steps=a.check_steps, lr=a.check_lr)
    try:
        ref = run_yardstick(spec, a.threads)[-1]
    except Exception as err:  # noqa: BLE001
        bench.record({"kind": "error", "backend": "torch reference", "error": error_text(err)})
        return
    bench.record({"kind": "loss", "backend": "torch reference", **ref})
    for backend in a.backends:
        bench.record(loss_row(bench, backend, ref))


def machine_row(bench: Bench) -> dict:
    """Device, its MFU peak, a measured matmul peak (a child process on a GPU, so this driver
    never holds GPU memory), software versions, the workload and its FLOPs per token."""
    a = bench.args
    measured = run_yardstick(child_spec(bench, "machine"), a.threads)[0] if bench.device == "cuda" else None
    facts = machine.machine_facts(bench.device, a.precision, a.threads, measured)
    peak, source = mfu_peak(bench.device, facts["device_name"], a.precision, a.peak_tflops)
    return {
        "kind": "machine",
        **facts,
        "peak_tflops": peak,
        "peak_source": source,
        "versions": machine.software_versions(),
        "size": a.size,
        "params": param_count(bench.config),
        "batch": a.batch,
        "seq": a.seq,
        "tokens": bench.tokens,
        "flops_per_token": {
            "forward": machine.flops_per_token(bench.config, a.seq, False),
            "train": machine.flops_per_token(bench.config, a.seq, True),
        },
    }


def roofline_row(bench: Bench) -> dict:
    """Every engine's matmul rate on the workload's products at the largest micro batch (the
    tokens one forward multiplies at once) in the run's precision, and the device's copy
    bandwidth on the bytes a refit streams (the refit's roof), in child processes set up as the
    workers are.  One precision only: the rows compute in one, and a second would double the
    roofline's time, which at the 1b shape on a GPU is long (docs/results.md)."""
    a = bench.args
    copy_bytes = param_count(bench.config) * (2 if a.precision == "bfloat16" else 4)
    try:
        roof = measure_peaks(
            bench.config, max(a.mbs) * a.seq, bench.device, a.threads, dtypes=(a.precision,), copy_bytes=copy_bytes
        )
    except Exception as err:  # noqa: BLE001 -- reported in its row; the rows still run without a roof
        return {"kind": "roofline", "error": error_text(err)}
    return {"kind": "roofline", "copy_bytes": copy_bytes, **roof}


def run(bench: Bench) -> None:
    a = bench.args
    bench.load_model(model_dir=a.model_dir)
    bench.record(machine_row(bench))
    if "throughput" in a.sections or "refit" in a.sections:
        bench.record(roofline_row(bench))
    reason = vllm_skip_reason(a.no_vllm)
    for what in ("refit into the vLLM engine", "vLLM generation"):
        bench.record({"kind": "skipped", "row": what, "reason": reason})
    if "throughput" in a.sections:
        hf_section(bench)
    if "throughput" in a.sections or "refit" in a.sections:
        for backend in a.backends:
            backend_section(bench, backend)
    if "loss" in a.sections:
        loss_section(bench)


def run_gpu_bench(args) -> list[dict]:
    """A whole run; its rows.  Ray for one Policy at a time; on a CPU its JAX actors get one XLA
    host device (as a one-GPU bundle gives one GPU).  A Ray the caller started is used as it is."""
    import ray

    with tempfile.TemporaryDirectory(prefix="dualrl-gpu-bench-") as tmp:
        bench = Bench(args=args, size=GPU_SIZES[args.size], tmp=Path(tmp), device=args.device)
        bench.session = RaySession(args.ray_cpus, host_devices=args.device != "cuda")
        if bench.session.owned:
            bench.session.start(1)
        try:
            run(bench)
        finally:
            if bench.session.owned and ray.is_initialized():
                ray.shutdown()
    return bench.records
