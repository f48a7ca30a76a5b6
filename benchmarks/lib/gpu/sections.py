"""The run of ``dualrl bench --gpu``: which rows are recorded, in what order -- the machine facts,
the vLLM rows it skips, the HF yardstick, each backend's Policy, the fp32 loss curves."""

from __future__ import annotations

import importlib.util

from benchmarks.gpu.bench import Bench, child_spec, error_text, machine_facts, prepare_model
from benchmarks.gpu.policy_rows import PolicyCase, loss_row, policy_config, refit_row, throughput_row
from benchmarks.gpu.workload import full_batch
from benchmarks.gpu.yardstick import run_child


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
            run_child(spec, bench.args.threads, on_reply)
        except Exception as err:  # noqa: BLE001 -- reported in its row; the backends still run
            bench.record({"kind": "error", "backend": name, "error": error_text(err)})


def backend_section(bench: Bench, backend: str) -> None:
    """Throughput at every ``--mbs`` and the refit source on one Policy, closed afterwards."""
    sections, data = bench.args.sections, full_batch(bench.args.batch, bench.args.seq, bench.config.vocab_size)
    try:
        case = PolicyCase(bench, backend, policy_config(bench, backend, bench.args.precision, bench.args.mbs[0]))
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
        ref = run_child(spec, a.threads)[-1]
    except Exception as err:  # noqa: BLE001
        bench.record({"kind": "error", "backend": "torch reference", "error": error_text(err)})
        return
    bench.record({"kind": "loss", "backend": "torch reference", **ref})
    for backend in a.backends:
        bench.record(loss_row(bench, backend, ref))


def run(bench: Bench) -> None:
    a = bench.args
    prepare_model(bench)
    bench.record(machine_facts(bench))
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
