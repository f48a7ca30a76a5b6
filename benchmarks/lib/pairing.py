"""Paired timing: every Policy call is followed at once by the same call on the HF baseline, so
both sides of a ratio see the same background load (which drifts over minutes on a shared
machine).  A case's ×HF is taken against *its own* paired HF calls; the HF row pools all of
them.  ``--warmup`` calls per operation run first, untimed (the first AdamW step allocates its
state there; JAX compiles), and their first call is reported on its own.

:class:`Probe` wraps any runner (``benchmarks.lib.hf.HFRunner``, ``benchmarks.lib.policy.PolicyRunner``)
and records per call the driver-side wall seconds and the CPU seconds of the case's processes,
so the cores a case really kept busy are measured (CPU seconds / wall seconds of the timed calls).
"""

from __future__ import annotations

import statistics
import time

from benchmarks.lib.proc import XLA_POOL_THREAD, allowed_cpus, cpu_seconds, thread_names

OPS = ("logprobs", "train")


def new_result(runner) -> dict:
    return {
        "case": runner.name,
        "workers": runner.workers,
        "threads": runner.threads,
        "startup_s": runner.startup_s,
        "noop_s": getattr(runner, "noop_s", None),
        "params": getattr(runner, "params", None),
        **{f"{op}_s": [] for op in OPS},
        **{f"hf_{op}_s": [] for op in OPS},
    }


def measure(runner, hf, result: dict, hf_result: dict | None, args) -> None:
    """Warm-up + timed calls of each operation, each call of ``runner`` paired with one of
    ``hf`` (when there is one) so both see the same background load."""
    for op in OPS:
        for i in range(args.warmup + args.iters):
            seconds = getattr(runner, op)()
            hf_seconds = getattr(hf, op)() if hf is not None else None
            if i < args.warmup:
                continue
            result[f"{op}_s"].append(seconds)
            if hf is not None:
                result[f"hf_{op}_s"].append(hf_seconds)
                hf_result[f"{op}_s"].append(hf_seconds)


def median(times) -> float | None:
    return statistics.median(times) if times else None


def ratio(r: dict, hf: dict | None, op: str, stat=statistics.median) -> float | None:
    """case tokens/s ÷ hf tokens/s = hf seconds ÷ case seconds, against the case's own paired
    hf calls (the hf row: against itself)."""
    mine = r.get(f"{op}_s")
    base = r.get(f"hf_{op}_s") or (hf or {}).get(f"{op}_s")
    return stat(base) / stat(mine) if mine and base else None


class Probe:
    """A runner's calls, plus per call the wall and CPU seconds of its processes, the first call of
    each operation, and (read before ``close``) what the processes ran on."""

    def __init__(self, runner) -> None:
        self.runner, self.pids = runner, list(runner.pids)
        self.calls: dict[str, list[tuple[float, float, float | None]]] = {op: [] for op in OPS}
        self.facts: dict = {}

    def __getattr__(self, key):  # name, workers, threads, startup_s, noop_s, params, policy
        return getattr(self.runner, key)

    def _call(self, op: str) -> float:
        c0, t0 = cpu_seconds(self.pids), time.perf_counter()
        seconds = getattr(self.runner, op)()
        wall, c1 = time.perf_counter() - t0, cpu_seconds(self.pids)
        self.calls[op].append((seconds, wall, None if c0 is None or c1 is None else c1 - c0))
        return seconds

    def logprobs(self) -> float:
        return self._call("logprobs")

    def train(self) -> float:
        return self._call("train")

    def close(self) -> None:
        try:
            names = [thread_names(pid) for pid in self.pids]
            self.facts = {
                "os_threads": [sum(n.values()) for n in names],
                "xla_pool_threads": [n[XLA_POOL_THREAD] for n in names],
                "allowed_cpus": [allowed_cpus(pid) for pid in self.pids],
            }
            jax_facts = getattr(self.runner, "jax_facts", None)
            self.facts.update(jax_facts() if jax_facts else {})
        finally:
            self.runner.close()

    def summary(self, skip: int) -> dict:
        """First-call seconds and cores used per operation (calls after the first ``skip``)."""
        out = {"first_s": {op: calls[0][0] for op, calls in self.calls.items() if calls}, **self.facts}
        for op, calls in self.calls.items():
            timed = [c for c in calls[skip:] if c[2] is not None]
            wall = sum(c[1] for c in timed)
            out[f"{op}_cores"] = sum(c[2] for c in timed) / wall if timed and wall > 0 else None
        return out
