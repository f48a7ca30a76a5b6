"""The yardstick of ``dualrl bench --gpu``: plain HF ``AutoModelForCausalLM`` steps
(``benchmarks.lib.hf.hf_steps``), run in a child process of their own (``benchmarks.lib.child``)
so that its device memory is gone before any Policy starts.  The child answers the device's
facts, the HF eager rows, or the plain-torch fp32 loss curve the backends are held to."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

from benchmarks.lib import machine
from benchmarks.lib.bench import Bench
from benchmarks.lib.child import reply, run_child
from benchmarks.lib.gpu.workload import timing
from benchmarks.lib.hf import hf_steps
from benchmarks.lib.proc import peak_rss_bytes, reset_peak_rss
from benchmarks.lib.workload import default_policy_section, full_batch, optimizer_kwargs


def child_spec(bench: Bench, kind: str, **extra) -> dict:
    """What a yardstick child is asked to do: ``machine``, ``hf`` or ``reference``."""
    a = bench.args
    return {
        "kind": kind,
        "model": bench.model_path,
        "batch": a.batch,
        "seq": a.seq,
        "precision": a.precision,
        "device": bench.device,
        "threads": a.threads,
        "warmup": a.warmup,
        "iters": a.iters,
        **extra,
    }


def run_yardstick(spec: dict, threads: int, on_reply: Callable[[dict], None] = lambda r: None) -> list[dict]:
    """:func:`yardstick` in a fresh process (its device memory is gone when it exits)."""
    return run_child("benchmarks.lib.gpu.yardstick:yardstick", spec, threads, on_reply)


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()  # as the torch workers do on a CPU


def _peak(device) -> tuple[int | None, str]:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "device"
    return peak_rss_bytes("self"), "rss"


def measure_hf(model, data, mbs: int, spec: dict, device) -> dict:
    """One yardstick row: ``warmup`` + ``iters`` calls per operation, each between syncs."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    max_norm = default_policy_section()["max_grad_norm"]
    bf16 = spec["precision"] == "bfloat16"
    steps = hf_steps(model, data, mbs, bf16, optimizer_kwargs(fused=spec["fused"]), max_norm)
    _reset_peak(device)
    row: dict[str, Any] = {"mbs": mbs, "losses": []}
    for op in ("logprobs", "train"):
        seconds = []
        for _ in range(spec["warmup"] + spec["iters"]):
            sync()
            t0 = time.perf_counter()
            out = steps[op]()
            sync()
            seconds.append(time.perf_counter() - t0)
            if op == "train":
                row["losses"].append(float(out[0]))
        row[op] = timing(seconds, spec["warmup"])
    row["peak_bytes"], row["memory"] = _peak(device)
    return row


def reference_curve(model, data, spec: dict) -> dict:
    """The plain-torch fp32 loss curve the backends are held to."""
    max_norm = default_policy_section()["max_grad_norm"]
    steps = hf_steps(model, data, spec["mbs"][0], False, optimizer_kwargs(lr=spec["lr"]), max_norm)
    out = [steps["train"]() for _ in range(spec["steps"])]
    return {"losses": [float(loss) for loss, _ in out], "grad_norms": [float(norm) for _, norm in out]}


def hf_rows(model, data, spec: dict, device) -> None:
    """One row per micro batch; one that fails (e.g. out of memory) is reported and the next still runs."""
    import torch

    reply({"attn_implementation": model.config._attn_implementation, "threads": torch.get_num_threads()})
    for mbs in spec["mbs"]:
        try:
            row = measure_hf(model, data, mbs, spec, device)
        except Exception as err:  # noqa: BLE001 -- e.g. out of memory at this micro batch: the next still runs
            traceback.print_exc()
            row = {"mbs": mbs, "error": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"}
        reply(row)


def yardstick(spec: dict) -> None:
    """The child: the device's facts ("machine"), the HF yardstick ("hf") or the fp32 reference
    ("reference"), each result one reply."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    if spec["kind"] == "machine":  # the matmul peak in the benchmark's dtype: context for MFU
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else machine.cpu_model()
        tflops = machine.measured_matmul_tflops(device.type, spec["precision"], spec["threads"])
        reply({"device_name": name, "matmul_tflops": tflops})
        return
    if spec["kind"] == "reference":  # fp32 means fp32: no TF32 (as policy.matmul_precision "highest")
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).to(device)
    if spec.get("compile"):
        for block in model.model.layers:
            block.compile()
    data = full_batch(spec["batch"], spec["seq"], model.config.vocab_size)
    if spec["kind"] == "reference":
        reply(reference_curve(model, data, spec))
        return
    hf_rows(model, data, spec, device)
