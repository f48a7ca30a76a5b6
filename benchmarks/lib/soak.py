"""Soak: many cycles of (one train step + one refit into vLLM); memory must stay flat, losses reproducible.

What runs (``python -m benchmarks.soak``): a tiny Llama (``core.testing.tiny_models``
``llama_gen``: the smallest shape vLLM's CPU attention takes, 0.36 M parameters = 1.44 MB in
fp32, saved to a temp dir) as a :class:`core.policy.Policy` (torch backends: 2 workers, data
parallel; JAX: one actor owning 2 XLA host devices) and one
:class:`core.generation.VllmGeneration` engine (dummy weights), each on a Ray cluster of its
own.  Every cycle trains one optimizer step with ``ClippedPGLossFn`` on a synthetic batch
seeded by the cycle number, then refits the engine with
:func:`core.refit.refit_policy_generation` in small buckets (``--bucket-kb``, default 48 KiB:
several shared-memory segments / broadcasts per refit, so the transport's per-bucket
resources churn as they would on a real model).

Memory: VmRSS and VmHWM (peak RSS) of the driver, every policy worker and every engine actor
(pids from ``Policy.get_gpu_info`` and from the engine actors themselves), read from
``/proc/<pid>/status`` every ``--sample-every`` cycles.  Growth = (value at the end - value
after ``--warmup`` cycles) / value after warm-up; the run passes when every process's peak
RSS grew by at most ``--max-growth-pct`` (5 %).  One-time costs (allocator pools, lazily
imported modules, the engine's first load) land inside the warm-up.

Determinism: after the soak, a fresh policy (same seed, same batches) trains
``--check-cycles`` cycles with the same refits; its losses must equal the soak's first
``--check-cycles`` losses bitwise (``torch.equal``), and so must the engine's greedy logprobs
on fixed prompts after cycle ``--check-cycles`` of each run (the refit weights, seen from
outside).  A refit must also leave no shared-memory segment behind.  Exit status 1 when any
check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.lib.policy import PolicyCase
from benchmarks.lib.proc import status_bytes
from benchmarks.lib.refit import Engine
from benchmarks.lib.workload import default_policy_section
from core.reporting import get_logger

logger = get_logger(__name__)

BACKENDS = ("torch_fsdp", "torch_dtensor", "jax_pjit")
MODEL = "llama_gen"
SEQ = 16
BATCH = 4
#: XLA host devices of the JAX actor (its mesh: fsdp=2), like the torch backends' 2 workers.
JAX_DEVICES = 2


# ----------------------------------------------------------------------------- memory


def read_memory(pid: int) -> dict[str, int] | None:
    """``{"rss": VmRSS, "hwm": VmHWM}`` in bytes of a live process, None if it is gone."""
    values = status_bytes(pid, "VmRSS", "VmHWM")
    return {"rss": values["VmRSS"], "hwm": values["VmHWM"]} if values else None


def engine_pids(generation) -> list[int]:
    """Pid of each engine actor, asked from inside the actor (``__ray_call__`` runs a function
    there), so the backend worker classes need no extra method."""
    import ray

    return ray.get([e.__ray_call__.remote(lambda self: os.getpid()) for e in generation.engines])


def shm_segments_of(pids) -> list[str]:
    """Refit shared-memory segments in the shm dir owned by one of ``pids``: a refit that
    finished leaves none, and a leaked one holds RAM that no process's RSS shows."""
    from core.refit.shm import _shm_dir

    owners = {f"dualrl-refit-{pid}-" for pid in pids}
    return sorted(n for n in os.listdir(_shm_dir()) if any(n.startswith(o) for o in owners))


def process_pids(policy, generation) -> dict[str, int]:
    """Name -> pid of every process a cycle runs in (all on this host)."""
    pids = {"driver": os.getpid()}
    for info in policy.get_gpu_info():
        pids[f"policy{info.get('rank', len(pids) - 1)}"] = int(info["pid"])
    for i, pid in enumerate(engine_pids(generation)):
        pids[f"engine{i}"] = pid
    return pids


@dataclass
class MemoryLog:
    """Memory samples per process, keyed by the cycle after which they were taken."""

    pids: dict[str, int]
    samples: dict[int, dict[str, dict[str, int]]] = field(default_factory=dict)

    shm_left: dict[int, list[str]] = field(default_factory=dict)

    def sample(self, cycle: int) -> None:
        self.samples[cycle] = {name: m for name, pid in self.pids.items() if (m := read_memory(pid)) is not None}
        self.shm_left[cycle] = shm_segments_of(self.pids.values())

    def growth(self, warm_cycle: int, end_cycle: int) -> dict[str, dict[str, float]]:
        """Per process: the values at both cycles (MiB) and their growth (%)."""
        warm, end = self.samples[warm_cycle], self.samples[end_cycle]
        out = {}
        for name in self.pids:
            if name not in warm or name not in end:
                out[name] = {"error": "process gone"}
                continue
            row = {}
            for key in ("rss", "hwm"):
                row[f"{key}_warm_mib"] = warm[name][key] / 2**20
                row[f"{key}_end_mib"] = end[name][key] / 2**20
                row[f"{key}_growth_pct"] = 100.0 * (end[name][key] - warm[name][key]) / warm[name][key]
            out[name] = row
        return out


# ----------------------------------------------------------------------------- set-up


def policy_config(model_dir: Path, backend: str, bucket_bytes: int) -> dict:
    """The default policy section on the tiny model: 2-way data parallel, small batches,
    a learning rate that moves the weights every step, an engine long enough for ``SEQ``."""
    cfg = default_policy_section()
    cfg.update(
        backend=backend,
        model_name=str(model_dir),
        train_global_batch_size=BATCH,
        train_micro_batch_size=BATCH // 2,
        logprob_batch_size=BATCH // 2,
        max_total_sequence_length=32,
        refit_buffer_size_gb=bucket_bytes / 2**30,
    )
    cfg["tokenizer"]["name"] = str(model_dir / "tokenizer")
    cfg["optimizer"]["kwargs"].update(lr=1e-3)
    cfg["generation"]["vllm_cfg"].update(max_model_len=64, precision="float32")
    cfg["generation"].update(max_new_tokens=4)
    if backend == "jax_pjit":
        cfg["parallel"].update(fsdp_size=JAX_DEVICES, tensor_parallel_size=1)
    return cfg


def train_batch(seed: int):
    """A ClippedPG batch (ragged right padding, a masked 2-token prompt), a pure function of ``seed``."""
    import torch

    from core.data import BatchedDataDict
    from core.testing.tiny_models import TINY_VOCAB_SIZE, random_batch

    ids, lens = random_batch(BATCH, SEQ, TINY_VOCAB_SIZE, seed=seed, min_len=4)
    g = torch.Generator().manual_seed(seed + 1)
    valid = (torch.arange(SEQ)[None] < lens[:, None]).float()
    token_mask = valid.clone()
    token_mask[:, :2] = 0
    old = -torch.rand(BATCH, SEQ, generator=g) * 3 * valid
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lens,
        token_mask=token_mask,
        sample_mask=torch.ones(BATCH),
        advantages=torch.randn(BATCH, SEQ, generator=g) * valid,
        prev_logprobs=old,
        generation_logprobs=old,
        reference_policy_logprobs=old,
    )


def probe_prompts():
    """Fixed prompts the engine answers greedily after a run (its weights, seen from outside)."""
    from core.data import BatchedDataDict
    from core.testing.tiny_models import BOS_ID, TINY_VOCAB_SIZE, random_batch

    ids, lens = random_batch(BATCH, 8, TINY_VOCAB_SIZE, seed=7, min_len=3)
    ids[:, 0] = BOS_ID
    return BatchedDataDict(input_ids=ids, input_lengths=lens)


@contextlib.contextmanager
def policy_on_own_cluster(cfg: dict, tokenizer, name: str) -> Iterator[Any]:
    """The torch backends on 2 workers of 1 CPU each; JAX as one actor of ``JAX_DEVICES`` CPUs."""
    jax = cfg["backend"] == "jax_pjit"
    with PolicyCase(cfg, tokenizer, name, 1 if jax else 2, JAX_DEVICES if jax else 1) as case:
        yield case.policy


@contextlib.contextmanager
def engine_on_own_cluster(cfg: dict, tokenizer, name: str) -> Iterator[Any]:
    """One vLLM engine on a bundle of one CPU."""
    engine = Engine(
        cfg["model_name"], cfg["tokenizer"]["name"], tokenizer, argparse.Namespace(threads=1), cfg=cfg, name=name
    )
    try:
        yield engine.generation
    finally:
        engine.close()


# ----------------------------------------------------------------------------- cycles


def run_cycles(policy, generation, cycles: int, transport: str, seed: int, on_cycle=None):
    """``cycles`` x (train one step on ``train_batch(seed + cycle)``, refit); the losses as one
    ``[cycles]`` tensor.  ``on_cycle(cycle)`` runs after each (1-based) cycle, e.g. to sample memory."""
    import torch

    from core.config.loader import DEFAULT_CONFIG_PATH, load_raw_config
    from core.losses import ClippedPGLossFn
    from core.refit import refit_policy_generation

    loss_fn = ClippedPGLossFn(load_raw_config(DEFAULT_CONFIG_PATH)["loss_fn"])
    losses = None  # preallocated at the first step: the harness must not grow the driver's memory
    for cycle in range(1, cycles + 1):
        result = policy.train(train_batch(seed + cycle), loss_fn)
        if result.skipped_steps or len(result.loss) != 1:
            raise RuntimeError(
                f"cycle {cycle}: expected one optimizer step, got {len(result.loss)} (skipped: {result.skip_reasons})"
            )
        if losses is None:
            losses = torch.empty(cycles, dtype=torch.float64)
        losses[cycle - 1] = result.loss[0]
        refit_policy_generation(policy, generation, transport)
        if on_cycle is not None:
            on_cycle(cycle)
    return losses


def sample_cycles(cycles: int, warmup: int, every: int) -> set[int]:
    """Cycles after which memory is read: every ``every``, plus warm-up and end."""
    return {c for c in range(every, cycles + 1, every)} | {warmup, cycles}


def bitwise_equal(a, b) -> bool:
    """Same shape and dtype, and the same bits: ``torch.equal`` (NaN != NaN would make a
    NaN loss fail, which is right: a soak step must not produce one)."""
    import torch

    return a.dtype == b.dtype and torch.equal(a, b)


# ----------------------------------------------------------------------------- the run


def soak(
    cycles: int = 1000,
    backend: str = "torch_fsdp",
    transport: str = "ipc",
    warmup: int = 50,
    sample_every: int = 50,
    check_cycles: int = 30,
    seed: int = 0,
    bucket_bytes: int = 48 * 1024,
    max_growth_pct: float = 5.0,
) -> dict[str, Any]:
    """The whole benchmark (Ray must be up: ``benchmarks.soak`` starts it); returns the report.
    Progress goes to the ``dualrl`` loggers (shown by ``python -m benchmarks.soak``)."""
    import torch

    from core.testing.tiny_models import save_tiny_model, tiny_tokenizer

    if not 0 < warmup < cycles or not 0 < check_cycles <= cycles:
        raise ValueError(f"need 0 < warmup ({warmup}) < cycles ({cycles}) and 0 < check_cycles <= cycles")
    tokenizer = tiny_tokenizer()
    with tempfile.TemporaryDirectory(prefix="dualrl-soak-") as tmp:
        model_dir = save_tiny_model(MODEL, Path(tmp) / MODEL)
        cfg = policy_config(model_dir, backend, bucket_bytes)
        with engine_on_own_cluster(cfg, tokenizer, "soak_engine") as generation:
            with policy_on_own_cluster(cfg, tokenizer, "soak_policy_a") as policy:
                memory = MemoryLog(process_pids(policy, generation))
                marks = sample_cycles(cycles, warmup, sample_every)
                times: list[float] = [time.perf_counter()]
                probe: dict[str, Any] = {}

                def on_cycle(cycle: int) -> None:
                    if cycle == check_cycles:  # what the replay below must reproduce
                        probe["a"] = generation.generate(probe_prompts(), greedy=True)["logprobs"]
                    times.append(time.perf_counter())
                    if cycle in marks:
                        memory.sample(cycle)
                        logger.info("%s", _progress(cycle, cycles, memory.samples[cycle], times))

                losses = run_cycles(policy, generation, cycles, transport, seed, on_cycle)
            # A fresh policy with the same seed replays the first check_cycles cycles.
            with policy_on_own_cluster(cfg, tokenizer, "soak_policy_b") as policy:
                replay = run_cycles(policy, generation, check_cycles, transport, seed)
                probe_b = generation.generate(probe_prompts(), greedy=True)["logprobs"]
    growth = memory.growth(warmup, cycles)
    worst = max((row.get("hwm_growth_pct", float("inf")) for row in growth.values()), default=0.0)
    post = times[warmup:]
    report = {
        "backend": backend,
        "transport": transport,
        "cycles": cycles,
        "warmup": warmup,
        "seed": seed,
        "bucket_bytes": bucket_bytes,
        "pids": memory.pids,
        "memory": growth,
        "samples": {c: memory.samples[c] for c in sorted(memory.samples)},
        "seconds_per_cycle": (post[-1] - post[0]) / (len(post) - 1),
        "seconds_per_cycle_warmup": (times[warmup] - times[0]) / warmup,
        "shm_segments_left": memory.shm_left[cycles],
        "max_hwm_growth_pct": worst,
        "max_growth_pct": max_growth_pct,
        "memory_ok": worst <= max_growth_pct and not memory.shm_left[cycles],
        "check_cycles": check_cycles,
        "losses": losses.tolist(),
        "losses_bitwise_equal": bitwise_equal(losses[:check_cycles], replay),
        "engine_probe_bitwise_equal": bool(torch.equal(probe["a"], probe_b)),
    }
    return report


def _progress(cycle: int, cycles: int, sample: dict, times: list[float]) -> str:
    recent = times[-min(len(times), 51) :]
    per = (recent[-1] - recent[0]) / max(1, len(recent) - 1)
    mem = "  ".join(f"{n} {m['rss'] / 2**20:.0f}/{m['hwm'] / 2**20:.0f}" for n, m in sample.items())
    return f"[soak] cycle {cycle}/{cycles}  {per:.3f} s/cycle  RSS/peak MiB: {mem}"


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"soak: {report['backend']} / {report['transport']}, {report['cycles']} cycles "
        f"(warm-up {report['warmup']}), {report['seconds_per_cycle']:.3f} s/cycle after warm-up "
        f"({report['seconds_per_cycle_warmup']:.3f} during it)",
        f"{'process':<10} {'pid':>8} {'RSS warm':>10} {'RSS end':>10} {'growth':>8} "
        f"{'peak warm':>10} {'peak end':>10} {'growth':>8}",
    ]
    for name, row in report["memory"].items():
        pid = report["pids"][name]
        if "error" in row:
            lines.append(f"{name:<10} {pid:>8} {row['error']}")
            continue
        lines.append(
            f"{name:<10} {pid:>8} {row['rss_warm_mib']:>8.1f}Mi {row['rss_end_mib']:>8.1f}Mi "
            f"{row['rss_growth_pct']:>+7.2f}% {row['hwm_warm_mib']:>8.1f}Mi {row['hwm_end_mib']:>8.1f}Mi "
            f"{row['hwm_growth_pct']:>+7.2f}%"
        )
    lines.append(f"refit shared-memory segments left after the last refit: {len(report['shm_segments_left'])}")
    verdict = "PASS" if report["memory_ok"] else "FAIL"
    lines.append(
        f"peak RSS growth after warm-up: max {report['max_hwm_growth_pct']:+.2f}% "
        f"(limit {report['max_growth_pct']:.0f}%, no segment left): {verdict}"
    )
    lines.append(
        f"same seed, fresh policy, {report['check_cycles']} cycles: losses bitwise equal: "
        f"{report['losses_bitwise_equal']}; engine greedy logprobs bitwise equal: "
        f"{report['engine_probe_bitwise_equal']}"
    )
    return "\n".join(lines)
