"""Policy ``get_logprobs`` / ``train`` throughput of the JAX layouts vs the torch backends and plain HF.

    python -m benchmarks.jax_backend [--model llama_bench] [--batch 8] [--seq 256] [--iters 5]
        [--warmup 2] [--precision float32] [--threads 2] [--cases hf fsdp1-dp1 dtensor-dp2 jax-fsdp2 ...]

The methodology, the ``hf`` baseline, the batch, the policy config, the Ray set-up and the
pairing of every Policy call with an ``hf`` call are those of :mod:`benchmarks.torch_backends`
(imported, not repeated; its docstring has the details), so all ratios come from one run:

* ``hf``, ``fsdp1-*``, ``dtensor-*``: exactly the cases of ``benchmarks.torch_backends``.
* ``jax-fsdp{F}[-tp{T}]`` / ``jax-tp{T}``: a ``jax_pjit`` :class:`core.policy.Policy`: one Ray
  actor (one bundle of ``--threads`` CPUs) owning ``F x T`` XLA host devices, mesh
  ``(fsdp=F, tp=T)``.  One micro batch (``train_micro_batch_size = logprob_batch_size =
  batch``; its rows are split over ``fsdp`` inside the actor), one AdamW step per ``train``
  call, loss ``NLLLoss``.  Defaults: ``jax-fsdp2``, ``jax-tp2``, ``jax-fsdp1``.

JAX-specific points:

* First call = compile + run.  The first call of each operation is the first of the
  ``--warmup`` untimed calls (so ``--warmup >= 1``); its seconds are reported on their own
  ("first call s"), and "compile ~ s" = first call - median warm call.  For the torch cases
  and ``hf`` the same columns show their (compile-free) first call.  ``get_compile_counts()``
  of the worker is printed at the end of every JAX case.
* Host devices: ``make_mesh`` uses *all* devices the actor's jax sees, so ``F x T`` must equal
  that count, which XLA takes from ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` when
  the actor first initialises its backend.  ``Policy`` passes no env vars to its workers; Ray
  actors inherit the environment of the raylet, i.e. of the process that started Ray.  So
  this driver sets ``XLA_FLAGS`` (and ``JAX_PLATFORMS=cpu``) before it starts Ray, with N =
  the device count of the first JAX case, and restarts Ray (the ``hf`` child is not part of
  Ray and lives on) before a JAX case that needs another N.  The default order needs one
  restart (2 devices, then 1); its cost is reported and is no part of any timing.  When Ray
  was started by the caller (tests), it is not touched: the N its actors see is read once
  with a Ray task, and JAX cases needing another N are listed as skipped.
* Threads: XLA:CPU runs every device's program on one intra-op Eigen pool
  (``tf_XLAEigen`` threads) sized to the CPUs the process may run on (its affinity mask);
  it ignores ``OMP_NUM_THREADS`` (which Ray sets to the bundle's CPUs) and, in this jaxlib,
  ``--xla_cpu_multi_thread_eigen=false``.  With ``--threads`` equal to the cores of the
  machine (the default on the 2-core dev box) the pool is exactly the budget; with fewer,
  this driver pins every thread of the JAX actor to ``--threads`` CPUs
  (``sched_setaffinity``) after construction (the pool keeps its size, but the threads
  share that many cores).  What every case really used is measured, not assumed: the
  compute threads of each process (torch: ``torch.get_num_threads()``; JAX: the size of the
  XLA pool), its OS threads, and the cores it kept busy during the timed calls (CPU seconds
  of its processes from ``/proc`` / wall seconds of the calls).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import torch_backends as tb

OPS = tb.OPS
DEVICE_FLAG = "--xla_force_host_platform_device_count"
#: Name of the threads of XLA:CPU's intra-op pool (where the compiled programs run).
XLA_POOL_THREAD = "tf_XLAEigen"


@dataclass(frozen=True)
class JaxLayout:
    """A JAX case: one actor owning ``fsdp x tp`` XLA host devices, mesh ``(fsdp, tp)``."""

    fsdp: int
    tp: int = 1

    @property
    def devices(self) -> int:
        return self.fsdp * self.tp


JAX_LAYOUTS: dict[str, JaxLayout] = {
    "jax-fsdp2": JaxLayout(2),
    "jax-tp2": JaxLayout(1, tp=2),
    "jax-fsdp1": JaxLayout(1),
}
CASES = ["hf", "fsdp1-dp1", "dtensor-dp2", *JAX_LAYOUTS]
_JAX_NAME = re.compile(r"jax-(?:fsdp(\d+))?(?:-?tp(\d+))?")


def jax_layout(name: str) -> JaxLayout | None:
    """``jax-fsdp4-tp2`` -> ``JaxLayout(4, 2)``; ``None`` for a name that is no JAX case."""
    m = _JAX_NAME.fullmatch(name)
    if not m or not (m.group(1) or m.group(2)):
        return None
    layout = JaxLayout(int(m.group(1) or 1), int(m.group(2) or 1))
    return layout if layout.fsdp >= 1 and layout.tp >= 1 else None


def _case(name: str) -> str:
    if name in tb.CASES or jax_layout(name) is not None:
        return name
    raise argparse.ArgumentTypeError(f"{name!r}: one of {tb.CASES} or jax-fsdp<F>[-tp<T>] / jax-tp<T>")


def _workers(name: str) -> int:
    return tb.LAYOUTS[name].workers if name in tb.LAYOUTS else 1


def _devices(name: str) -> int:
    """Devices per worker (a torch worker or the hf process: one)."""
    layout = jax_layout(name)
    return layout.devices if layout else 1


# ----------------------------------------------------------------------------- XLA host devices / Ray


def with_device_count(flags: str | None, n: int) -> str:
    """``XLA_FLAGS`` with the host device count set to ``n`` (other flags kept)."""
    kept = [f for f in (flags or "").split() if not f.startswith(DEVICE_FLAG)]
    return " ".join([*kept, f"{DEVICE_FLAG}={n}"])


def device_count_of(flags: str | None, jax_num_cpu_devices: str | None = None) -> int:
    """XLA host devices a fresh jax process gets from these env values (jax's default: 1)."""
    if jax_num_cpu_devices not in (None, "", "-1"):
        return int(jax_num_cpu_devices)
    counts = re.findall(DEVICE_FLAG + r"=(\d+)", flags or "")
    return int(counts[-1]) if counts else 1


def actor_device_count() -> int:
    """Host devices a new Ray actor's jax would see, read from its environment by a task."""
    import ray

    @ray.remote(num_cpus=0)
    def env():
        return os.environ.get("XLA_FLAGS"), os.environ.get("JAX_NUM_CPU_DEVICES")

    return device_count_of(*ray.get(env.remote()))


class RaySession:
    """Ray with a given XLA host device count in its actors' environment.

    Started here (and restarted for another count) unless the caller already runs Ray:
    then its count is read once and cannot change (``fits`` says which cases can run).
    """

    def __init__(self, args) -> None:
        import ray

        self.args, self.owned = args, not ray.is_initialized()
        self.devices: int | None = None if self.owned else actor_device_count()
        self.restarts: list[tuple[int, float]] = []  # (new device count, seconds)

    def fits(self, devices: int) -> bool:
        return self.owned or self.devices == devices

    def start(self, devices: int | None) -> None:
        """Ray whose actors get ``devices`` host devices (``None``: any, for torch cases)."""
        import ray

        from core.distributed import init_ray

        if not self.owned:
            if devices is not None and devices != self.devices:
                raise RuntimeError(f"Ray was started by the caller with {self.devices} XLA host device(s) "
                                   f"per actor; this case needs {devices}")
            return
        if ray.is_initialized() and devices in (None, self.devices):
            return
        t0, restart = time.perf_counter(), ray.is_initialized()
        if restart:
            ray.shutdown()
        if devices is not None:
            os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS"), devices)
            os.environ.pop("JAX_NUM_CPU_DEVICES", None)  # it would override the flag
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
            self.devices = devices
        # As torch_backends.start_ray (an exported OMP_NUM_THREADS would reach every worker),
        # with room for a JAX case's one bundle of --threads CPUs too.
        os.environ.pop("OMP_NUM_THREADS", None)
        init_ray(num_cpus=max(tb.ray_cpus(self.args), self.args.threads))
        if restart:
            self.restarts.append((devices, time.perf_counter() - t0))


# ----------------------------------------------------------------------------- per-process facts (/proc)


def cpu_seconds(pids) -> float | None:
    """User + system CPU seconds of these processes (all their threads) so far."""
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    except (OSError, IndexError, ValueError):
        return None
    return total / os.sysconf("SC_CLK_TCK")


def thread_names(pid: int) -> collections.Counter:
    """``{thread name: how many}`` of a process (empty when it cannot be read)."""
    names: collections.Counter = collections.Counter()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    names[f.read().strip()] += 1
            except OSError:
                pass  # thread gone meanwhile
    except OSError:
        pass
    return names


def allowed_cpus(pid: int) -> int | None:
    try:
        return len(os.sched_getaffinity(pid))
    except OSError:
        return None


def pin_process(pid: int, cpus: set[int]) -> None:
    """Restrict every current thread of ``pid`` to ``cpus`` (new threads inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # thread gone meanwhile


# ----------------------------------------------------------------------------- JAX case


class JaxPolicyRunner(tb.PolicyRunner):
    """A ``jax_pjit`` Policy on its own one-bundle cluster; calls timed on the driver
    (``logprobs`` / ``train`` / ``close`` are ``torch_backends.PolicyRunner``'s)."""

    def __init__(self, name: str, model_path: str, tokenizer_path: str, tokenizer, args) -> None:
        layout = jax_layout(name)
        self.name, self.workers, self.layout = name, 1, layout
        # torch_backends' policy section for one data-parallel rank: one micro batch of `batch`.
        cfg = tb.policy_config(model_path, tokenizer_path, tb.Layout("jax_pjit", 1), args.batch, args.seq,
                               args.precision)
        cfg["jax_cfg"].update(fsdp_size=layout.fsdp, tensor_parallel_size=layout.tp)
        self._start(name, cfg, tokenizer, args, 1, args.threads, args.batch)
        try:
            info = self._policy.get_gpu_info()[0]
            if info["local_devices"] != layout.devices:
                raise RuntimeError(f"the actor sees {info['local_devices']} devices, {name} needs {layout.devices}")
            self.mesh, self.pids = info["mesh"], [info["pid"]]
            self.pinned = None
            cpus = sorted(os.sched_getaffinity(info["pid"]))
            if args.threads < len(cpus):  # XLA sized its pool to the affinity mask: shrink the mask
                self.pinned = set(cpus[:args.threads])
                pin_process(info["pid"], self.pinned)
            self.threads = [thread_names(info["pid"])[XLA_POOL_THREAD] or None]
        except BaseException:
            self.close()
            raise

    def compile_counts(self) -> dict[str, int]:
        group = self._policy.worker_group
        return group.get_all_worker_results(group.run_all_workers_single_data("get_compile_counts"))[0]


# ----------------------------------------------------------------------------- probe around any runner


class Probe:
    """Wraps an ``hf`` / Policy runner for ``torch_backends.run_cases``: the same calls, plus
    per call the driver-side wall seconds and the CPU seconds of the case's processes, the
    first call of each operation, and what the processes ran on (read before ``close``)."""

    def __init__(self, runner, pids) -> None:
        self._runner, self.pids = runner, list(pids)
        self.calls: dict[str, list[tuple[float, float, float | None]]] = {op: [] for op in OPS}
        self.facts: dict = {}

    def __getattr__(self, key):  # name, workers, threads, startup_s, noop_s, params
        return getattr(self._runner, key)

    def _call(self, op: str) -> float:
        c0, t0 = cpu_seconds(self.pids), time.perf_counter()
        seconds = getattr(self._runner, op)()
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
            self.facts = {"os_threads": [sum(n.values()) for n in names],
                          "xla_pool_threads": [n[XLA_POOL_THREAD] for n in names],
                          "allowed_cpus": [allowed_cpus(pid) for pid in self.pids]}
            if isinstance(self._runner, JaxPolicyRunner):
                self.facts.update(compile_counts=self._runner.compile_counts(), mesh=self._runner.mesh,
                                  pinned=sorted(self._runner.pinned) if self._runner.pinned else None)
        finally:
            self._runner.close()

    def summary(self, skip: int) -> dict:
        """First-call seconds and cores used per operation (calls after the first ``skip``)."""
        out = {"first_s": {op: calls[0][0] for op, calls in self.calls.items() if calls}, **self.facts}
        for op, calls in self.calls.items():
            timed = [c for c in calls[skip:] if c[2] is not None]
            wall = sum(c[1] for c in timed)
            out[f"{op}_cores"] = sum(c[2] for c in timed) / wall if timed and wall > 0 else None
        return out


# ----------------------------------------------------------------------------- run


def _start(name: str, session: RaySession, model_path: str, tokenizer_path: str, tokenizer, args,
           probes: dict) -> Probe:
    print(f"[jax_backend] starting {name} ...", file=sys.stderr, flush=True)
    if name == "hf":
        runner = tb.HFRunner(model_path, args)
        probes[name] = Probe(runner, [runner._proc.pid])
        return probes[name]
    session.start(_devices(name) if jax_layout(name) else None)
    if jax_layout(name):
        runner = JaxPolicyRunner(name, model_path, tokenizer_path, tokenizer, args)
        pids = runner.pids
    else:
        runner = tb.PolicyRunner(name, model_path, tokenizer_path, tokenizer, args)
        try:
            pids = [info["pid"] for info in runner._policy.get_gpu_info()]
        except BaseException:
            runner.close()
            raise
    probes[name] = Probe(runner, pids)
    return probes[name]


def run(cases: list[str], args, model_path: str, tokenizer_path: str,
        tokenizer) -> tuple[list[dict], RaySession | None]:
    """All cases through ``torch_backends.run_cases`` (hf alive throughout, Policy cases one at a
    time, every call paired with an hf call), plus the probes' facts; skipped cases listed."""
    session = None
    if any(c != "hf" for c in cases):
        session = RaySession(args)
        first_jax = next((_devices(c) for c in cases if jax_layout(c)), None)
        if session.owned:
            session.start(first_jax)  # before anything is timed
    skipped = [c for c in cases if jax_layout(c) and not session.fits(_devices(c))]
    runnable = [c for c in cases if c not in skipped]
    probes: dict[str, Probe] = {}
    start = lambda name: _start(name, session, model_path, tokenizer_path, tokenizer, args, probes)  # noqa: E731
    results = {r["case"]: r for r in tb.run_cases(runnable, start, args)}
    for name, probe in probes.items():
        if "error" not in results[name]:
            results[name].update(probe.summary(0 if name == "hf" else args.warmup))
    for name in cases:
        results.setdefault(name, {"case": name, "workers": _workers(name),
                                  "skipped": f"needs {_devices(name)} XLA host devices per actor; "
                                             f"the caller's Ray gives {session.devices}"})
        results[name]["devices"] = _devices(name)
    return [results[c] for c in cases], session


# ----------------------------------------------------------------------------- report


def _first(r: dict, op: str) -> float | None:
    return (r.get("first_s") or {}).get(op)


def _compile_estimate(r: dict, op: str) -> float | None:
    first, med = _first(r, op), tb.median(r.get(f"{op}_s"))
    return None if first is None or med is None else first - med


def _main_table(results: list[dict], tokens: int) -> list[str]:
    hf = tb.hf_row(results)
    lines = ["| case | workers×devices | first call s: logprobs / train | logprobs tok/s | ×hf "
             "| train tok/s | ×hf |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        cells = [r["case"], f"{r['workers']}×{r['devices']}"]
        if "skipped" in r or "error" in r:
            word = "skipped" if "skipped" in r else "FAILED"
            cells += ["-", word, "-", word, "-"]
        else:
            cells.append(" / ".join(tb.fmt(_first(r, op), ".2f") for op in OPS))
            for op in OPS:
                cells += [tb.fmt(tokens / tb.median(r[f"{op}_s"]), ".0f"), tb.fmt(tb.ratio(r, hf, op), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _list(values) -> str:
    values = [v for v in (values or []) if v is not None]
    if not values:
        return "?"
    return str(values[0]) if len(set(values)) == 1 else "/".join(map(str, values))


def _cpu_table(results: list[dict]) -> list[str]:
    lines = ["| case | processes | compute threads/process | OS threads/process | CPUs allowed | "
             "cores busy: logprobs | train |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "skipped" in r or "error" in r:
            continue
        compute = _list(r.get("threads"))
        if jax_layout(r["case"]):
            compute += " (XLA pool)"
        cpus = _list(r.get("allowed_cpus")) + (f" (pinned {r['pinned']})" if r.get("pinned") else "")
        lines.append("| " + " | ".join([
            r["case"], str(len(r.get("os_threads") or [])), compute, _list(r.get("os_threads")), cpus,
            tb.fmt(r.get("logprobs_cores"), ".2f"), tb.fmt(r.get("train_cores"), ".2f")]) + " |")
    return lines


def _compile_lines(results: list[dict]) -> list[str]:
    lines = []
    for r in results:
        if not jax_layout(r["case"]) or "skipped" in r or "error" in r:
            continue
        est = " / ".join(tb.fmt(_compile_estimate(r, op), ".2f") for op in OPS)
        lines.append(f"{r['case']:15} mesh {r.get('mesh')}  compile ~ (first - median) s, logprobs / train: {est}  "
                     f"get_compile_counts() at the end: {r.get('compile_counts')}")
    return lines


def report(results: list[dict], args, tokens: int, params: int | None, load: tuple[float, float],
           session: RaySession | None) -> str:
    size = f"{params / 1e6:.1f}M params, " if params else ""
    cores = os.cpu_count() or 1
    if session is None:
        ray_line = "Ray: not used"
    elif session.owned:
        restarts = ", ".join(f"to {n} device(s) in {s:.1f} s" for n, s in session.restarts) or "none"
        ray_line = ("Ray: started here with XLA_FLAGS in its environment (actors inherit it); "
                    f"restarts for another device count: {restarts} (not part of any timing)")
    else:
        ray_line = f"Ray: started by the caller; its actors see {session.devices} XLA host device(s)"
    lines = [
        f"JAX layouts vs torch backends vs single-process HF: {args.model} ({size}vocab {args.vocab}), "
        f"{args.precision}, batch {args.batch} x seq {args.seq} = {tokens} real tokens "
        f"({args.batch * args.seq} padded), {args.iters} timed calls after {args.warmup} warm-up per operation "
        "and case (the first warm-up call = compile + run, reported on its own)",
        f"threads: total budget {args.threads} per case on {cores} CPU cores; hf: torch.set_num_threads; torch "
        f"cases: Ray bundles of {args.threads} CPU(s) per case, OMP_NUM_THREADS = the bundle; JAX: one actor "
        f"(bundle of {args.threads} CPU(s)) whose XLA pool is sized by its CPU affinity (see the CPU table)",
        "first call s = seconds of the first call of each operation (the first warm-up call; excluded from "
        "tok/s like every warm-up call): for JAX compile + run, for torch/hf a compile-free first call.",
        "tokens/s = real tokens / wall time of one call (median): Policy calls timed on the driver "
        "(Ray dispatch included), hf calls inside its process. Each Policy call is followed by the same "
        "hf call; ×hf = case tokens/s ÷ tokens/s of those paired hf calls.",
        ray_line,
        f"machine load average (1 min): {load[0]:.2f} at start, {load[1]:.2f} at end"
        + (f"  -- above {cores} cores: other processes competed for the CPU; trust ×hf (paired) "
           "more than absolute tokens/s" if max(load) > cores else ""),
        "",
        *_main_table(results, tokens),
        "",
        "CPU use: compute threads = torch.get_num_threads() (hf, torch workers) or the XLA intra-op pool "
        f"({XLA_POOL_THREAD} threads) of the JAX actor; cores busy = CPU seconds of the case's processes "
        "(/proc, all threads) ÷ wall seconds, over its timed calls (hf: over all its calls)",
        *_cpu_table(results),
        "",
        *tb.timing_table([r for r in results if "skipped" not in r]),
        "",
        "JAX compilation (first call - median warm call; the counts are jax.jit cache sizes of the worker's "
        "logprob / grad steps)",
        *_compile_lines(results),
    ]
    lines += [f"{r['case']:15} skipped: {r['skipped']}" for r in results if "skipped" in r]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tb.add_workload_args(parser, warmup_help="untimed calls per operation, the first one compiles")
    parser.add_argument("--cases", nargs="+", default=CASES, type=_case,
                        help=f"{' '.join(CASES)}, or any of {tb.CASES}, jax-fsdp<F>[-tp<T>], jax-tp<T>")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 1 or args.threads < 1:
        parser.error("--iters must be >= 1, --warmup >= 1 (the first call compiles), --threads >= 1")
    if any(c in tb.LAYOUTS and args.batch % tb.LAYOUTS[c].dp for c in args.cases):
        parser.error(f"--batch {args.batch} must be divisible by the data-parallel size of every torch case")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    wall0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dualrl-bench-") as tmp:
        model_path, tokenizer_path = tb.prepare_model(args.model, Path(tmp))
        args.vocab = tb.vocab_size(model_path)
        tokenizer = tb.load_tokenizer(tokenizer_path)
        tokens = int(tb.make_batch(args.batch, args.seq, args.vocab)["input_lengths"].sum())
        load0 = os.getloadavg()[0]
        results, session = run(args.cases, args, model_path, tokenizer_path, tokenizer)
        load = (load0, os.getloadavg()[0])
    params = next((r["params"] for r in results if r.get("params")), None)
    print(report(results, args, tokens, params, load, session))
    print(f"\nbenchmark wall time {time.perf_counter() - wall0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": tokens, "args": vars(args), "results": results}, f, indent=2, default=str)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
