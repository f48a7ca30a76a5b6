"""What one ``dualrl bench --gpu`` run shares (:class:`Bench`: arguments, device, model, rows so
far) and its setup: the random model, the machine facts row, and Ray."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import machine
from benchmarks import torch_backends as tb
from benchmarks.gpu.workload import SIZES, mfu_peak, param_count
from benchmarks.gpu.yardstick import run_child


@dataclass
class Bench:
    """What one run shares: arguments, the device, the model, and the rows measured so far."""

    args: argparse.Namespace
    device: str  # "cuda" | "cpu"
    tmp: Path
    model_path: str = ""
    config: Any = None  # the model's HF config
    tokenizer: Any = None
    records: list[dict] = field(default_factory=list)

    def record(self, row: dict) -> dict:
        """Keep a row, append it to ``--json`` at once (a killed run keeps it), say so on stderr."""
        self.records.append(row)
        if self.args.json:
            with open(self.args.json, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")
        what = " ".join(str(row[k]) for k in ("kind", "backend", "mbs") if k in row)
        print(
            f"[gpu bench] {what}" + (f": ERROR {row['error']}" if "error" in row else ""), file=sys.stderr, flush=True
        )
        return row

    @property
    def tokens(self) -> int:
        return self.args.batch * self.args.seq


def error_text(err: BaseException) -> str:
    """A row's ``error``: the exception's type and last line (its traceback goes to stderr)."""
    traceback.print_exc()
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"


def child_spec(bench: Bench, kind: str, **extra) -> dict:
    """What a :mod:`benchmarks.gpu.yardstick` child process is asked to do."""
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


def prepare_model(bench: Bench) -> None:
    """The size's random Llama with the character tokenizer, built in ``--model-dir`` unless
    that already holds one of the same shape (a 1b build takes a minute: reuse it across runs)."""
    from transformers import AutoConfig

    from core.models.builtin import write_random_init

    shape = SIZES[bench.args.size].shape
    path = Path(bench.args.model_dir) if bench.args.model_dir else bench.tmp / f"gpu-bench-{bench.args.size}"
    if (path / "config.json").exists():
        have = AutoConfig.from_pretrained(path)
        wrong = {k: (getattr(have, k, None), v) for k, v in shape.items() if getattr(have, k, None) != v}
        if wrong:
            raise ValueError(f"--model-dir {path} holds another shape (have, want): {wrong}")
    else:
        path.mkdir(parents=True, exist_ok=True)
        write_random_init(shape, path)
    bench.model_path = str(path)
    bench.config = AutoConfig.from_pretrained(path)
    bench.tokenizer = tb.load_tokenizer(str(path))


def machine_facts(bench: Bench) -> dict:
    """Device, its MFU peak, a measured matmul peak (a child process on a GPU, so this driver
    never holds GPU memory), software versions, the workload and its FLOPs per token."""
    a = bench.args
    if bench.device == "cuda":
        facts = run_child(child_spec(bench, "machine"), a.threads)[0]
    else:
        facts = {
            "device_name": machine.cpu_model(),
            "matmul_tflops": machine.measured_matmul_tflops("cpu", a.precision, a.threads),
        }
    peak, source = mfu_peak(bench.device, facts["device_name"], a.precision, a.peak_tflops)
    return {
        "kind": "machine",
        "device": bench.device,
        **facts,
        "cores": os.cpu_count(),
        "threads": a.threads,
        "precision": a.precision,
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


def start_ray(bench: Bench):
    """Ray for one Policy at a time; on a CPU its JAX actors get one XLA host device (as a
    one-GPU bundle gives one GPU).  A Ray the caller started is used as it is."""
    from benchmarks import jax_backend as jb

    if bench.device == "cuda":
        # JAX would take 75 % of the GPU at its first allocation (the measured GPU facts ran without that too)
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    session = jb.RaySession(bench.args)
    if session.owned:
        session.start(None if bench.device == "cuda" else 1)
    return session
