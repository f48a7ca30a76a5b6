"""The rows ``dualrl bench --gpu`` measures on one backend's :class:`core.policy.Policy`:
throughput at a micro batch, the refit source side, and an fp32 loss curve."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from benchmarks.lib.bench import Bench
from benchmarks.lib.errors import error_text
from benchmarks.lib.gpu.workload import engine_of, timing, worst_diff
from benchmarks.lib.layouts import Layout
from benchmarks.lib.policy import PolicyCase
from benchmarks.lib.proc import peak_rss_bytes
from benchmarks.lib.workload import full_batch, policy_config


def backend_config(bench: Bench, backend: str, precision: str, mbs: int) -> dict:
    """The default policy section on this model and batch, one device, micro batch ``mbs``
    (``backend``: a row of ``workload.BACKENDS``)."""
    a = bench.args
    engine, compiled = engine_of(backend)
    layout = Layout(backend, engine, compiled=compiled)
    cfg = policy_config(bench.model_path, bench.model_path, layout, a.batch, a.seq, precision, mbs)
    # the engine a refit would feed: rows of this length, in the training dtype (the stream is cast to it)
    cfg["generation"]["vllm_cfg"].update(max_model_len=a.seq, precision=precision)
    return cfg


def backend_case(bench: Bench, backend: str, cfg: dict) -> PolicyCase:
    """One backend's Policy on a one-bundle cluster of its own (one GPU, or ``--threads`` CPUs)."""
    name = f"gpu-bench-{backend}"
    return PolicyCase(cfg, bench.tokenizer, name, 1, bench.args.threads, use_gpus=bench.device == "cuda")


# ----------------------------------------------------------------------------- throughput


def timed_calls(fn: Callable[[], Any], warmup: int, iters: int) -> dict:
    """``warmup`` untimed + ``iters`` timed calls of ``fn`` (driver wall clock; a Policy call
    returns once its result is back through Ray, i.e. after the device finished)."""
    seconds = []
    for _ in range(warmup + iters):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return timing(seconds, warmup)


def logprobs_call(policy, data, mbs: int):
    # A per-call micro batch, so one Policy (one 1b start-up) serves every --mbs.
    return policy.get_logprobs(data, micro_batch_size=mbs)


def worker_peak(policy) -> tuple[int | None, str]:
    """Peak allocated device bytes of the (one) worker, or its process's peak RSS on a CPU."""
    info = policy.get_gpu_info()[0]
    if info.get("device_type") in ("cuda", "gpu"):
        return info.get("peak_memory_allocated_bytes", info.get("peak_memory_bytes")), "device"
    return info.get("peak_rss_bytes") or peak_rss_bytes(info["pid"]), "rss"


def throughput_row(bench: Bench, case: PolicyCase, backend: str, data, mbs: int) -> dict:
    from core.losses import NLLLoss

    a, policy, loss_fn, losses, logprobs = bench.args, case.policy, NLLLoss(), [], []
    row: dict[str, Any] = {"kind": "throughput", "backend": backend, "mbs": mbs, "startup_s": case.startup_s}
    try:
        policy.reset_peak_memory_stats()  # JAX: a no-op (XLA keeps one peak per process)
        row["logprobs"] = timed_calls(
            lambda: logprobs.append(logprobs_call(policy, data, mbs)["logprobs"]), a.warmup, a.iters
        )
        row["train"] = timed_calls(
            lambda: losses.append(policy.train(data, loss_fn, gbs=a.batch, mbs=mbs).loss[0]),
            a.warmup,
            a.iters,
        )
        row["losses"], row["mean_logprob"] = losses, float(logprobs[-1][:, 1:].mean())
        row["peak_bytes"], row["memory"] = worker_peak(policy)
        if not all(math.isfinite(x) for x in [*losses, row["mean_logprob"]]):
            row["error"] = f"non-finite numbers: losses {losses}, mean logprob {row['mean_logprob']}"
    except Exception as err:  # noqa: BLE001 -- e.g. out of memory at this micro batch: the next still runs
        row["error"] = error_text(err)
    return row


# ----------------------------------------------------------------------------- refit source side


def refit_row(bench: Bench, case: PolicyCase, backend: str) -> dict:
    """The source side of a refit without an engine: the manifest, then ``--refit-repeats``
    whole streams (gather, cast, export each bucket, release)."""
    from core.refit import RefitManifest

    policy, row = case.policy, {"kind": "refit", "backend": backend}
    try:
        t0 = time.perf_counter()
        manifest = RefitManifest.from_info(policy.prepare_refit_info())
        row.update(
            info_s=time.perf_counter() - t0,
            tensors=len(manifest),
            bytes=manifest.nbytes,
            dtype=manifest[manifest.names[0]].dtype,
        )
        seconds, transports = [], set()
        for _ in range(bench.args.refit_repeats):
            t0 = time.perf_counter()
            plan = policy.prepare_weights_for_ipc()
            try:
                for keys in plan:
                    transports.add(policy.get_weights_ipc_handles(keys).get("kind"))
            finally:
                policy.finish_refit_stream()
            seconds.append(time.perf_counter() - t0)
        row.update(timing(seconds, 1 if len(seconds) > 1 else 0), buckets=len(plan), transport=sorted(transports))
    except Exception as err:  # noqa: BLE001
        row["error"] = error_text(err)
    return row


# ----------------------------------------------------------------------------- fp32 loss curves


def check_config(bench: Bench, backend: str) -> dict:
    cfg = backend_config(bench, backend, "float32", bench.args.check_mbs)
    cfg["optimizer"]["kwargs"]["lr"] = bench.args.check_lr
    cfg["scheduler"] = None  # constant: large enough that 5 steps move the weights (5e-6 warm-up barely does)
    return cfg


def loss_row(bench: Bench, backend: str, ref: dict) -> dict:
    """``--check-steps`` train calls on a fresh fp32 Policy, compared step by step with ``ref``."""
    from core.losses import NLLLoss

    a, row = bench.args, {"kind": "loss", "backend": backend}
    data = full_batch(a.batch, a.seq, bench.config.vocab_size)
    try:
        case = backend_case(bench, backend, check_config(bench, backend))
        try:
            outs = [case.policy.train(data, NLLLoss(), gbs=a.batch, mbs=a.check_mbs) for _ in range(a.check_steps)]
        finally:
            case.close()
    except Exception as err:  # noqa: BLE001
        return {**row, "error": error_text(err)}
    row["losses"] = [o.loss[0] for o in outs]
    row["grad_norms"] = [o.grad_norm[0] for o in outs]
    row["max_loss_diff"] = worst_diff(row["losses"], ref["losses"])
    row["max_grad_norm_diff"] = worst_diff(row["grad_norms"], ref["grad_norms"])
    row["passed"] = row["max_loss_diff"] <= a.loss_tol  # NaN fails
    return row
