"""Refit (policy weights -> vLLM engine) time per training layout and transport, vs a plain memcpy.

    python -m benchmarks.refit [--model llama_bench] [--repeats 3] [--warmup 1] [--bucket-gb G]
        [--threads 2] [--cases fsdp1-dp2 dtensor-tp2 jax-fsdp2] [--transports ipc collective]

For every case (a training layout) one :class:`core.policy.Policy` is started, exactly as in
:mod:`benchmarks.torch_backends` / :mod:`benchmarks.jax_backend` (their runners and shared
start-up path ``PolicyRunner._start``, on a fresh :class:`RayVirtualCluster`; the JAX case
gets its XLA host devices the way ``benchmarks.jax_backend`` arranges them), and each
transport pushes its weights into one vLLM engine with
:func:`core.refit.refit_policy_generation`:

* cases: ``fsdp1-dp2`` (FSDP1, 2 workers), ``dtensor-tp2`` (DTensor, tensor parallel 2),
  ``jax-fsdp2`` (one JAX actor owning 2 XLA host devices, mesh ``(fsdp=2, tp=1)``); any
  case name of the two other benchmarks is accepted.
* transports: ``ipc`` (CPU: training rank 0 packs each bucket into a ``/dev/shm``
  segment the engine maps) and ``collective`` (training rank 0 broadcasts each bucket to
  the engine over a gloo group, formed by the first refit of each policy).
* the engine: one :class:`core.generation.VllmGeneration` (one engine, tensor parallel 1)
  on a cluster of its own (1 bundle of ``--threads`` CPUs), started once and reused by every
  case: it accepts any refit whose manifest matches its model, and all cases serve the same
  model in the same dtype.  It is restarted only if it died, or when Ray is restarted for
  another XLA device count.

Methodology:

* seconds = :class:`RefitStats` ``.seconds``: wall clock on the driver around the whole
  refit (manifest check, gathers, transport, engine load, end-of-stream check).  Per case,
  ``--warmup`` untimed refits per transport come first (the first ``collective`` one also
  forms the broadcast group; its seconds are shown as "first s"), then ``--repeats`` rounds
  of one refit per transport, alternating, so both transports see the same background
  load; the table gives the median.  After the timed refits the engine must report valid
  weights (``weights_valid()``), else the case is marked FAILED.
* GB = bytes of the refit stream (the manifest, in the engine's dtype) / 1e9; GB/s = GB /
  seconds.  ``--bucket-gb`` is ``refit_buffer_size_gb`` (GiB, like the config field;
  default: the config's value), buckets = transport calls of one refit.
* memcpy: ``dst.copy_(src)`` of two ``torch.uint8`` tensors of the same byte count, in the
  driver process on one thread (``torch.set_num_threads(1)``: a plain memcpy, and immune to
  the stalls a 2-thread copy suffers when another process holds one of the cores), ``dst``
  allocated and touched beforehand (so: memory bandwidth, no page faults); median of 7
  copies, measured right after each case's refits.  ×memcpy = refit seconds / memcpy
  seconds: what a refit costs over one copy of its bytes.  A "cold" copy (``dst`` freshly
  allocated each time, page faults included) is printed too, for reference.
* Start-up (policy, engine) is reported but is part of no timing.  On a 2-core machine the
  policy's workers and the engine share the same cores (Ray's logical CPUs are sized for
  a policy case plus the engine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks import jax_backend as jb
from benchmarks import torch_backends as tb

CASES = ["fsdp1-dp2", "dtensor-tp2", "jax-fsdp2"]
TRANSPORTS = ("ipc", "collective")
#: Copies the memcpy baseline takes the median of.
MEMCPY_COPIES = 7


def _case(name: str) -> str:
    if name in tb.LAYOUTS or jb.jax_layout(name) is not None:
        return name
    raise argparse.ArgumentTypeError(f"{name!r}: one of {list(tb.LAYOUTS)} or jax-fsdp<F>[-tp<T>] / jax-tp<T>")


# ----------------------------------------------------------------------------- policy and engine


class _RefitNames:
    """Prefixes the runners' Ray names (actors, placement groups) with ``refit-``, so that they
    never meet the names of the other benchmarks' policies in one Ray session."""

    def _start(self, name: str, *args, **kwargs) -> None:
        super()._start(f"refit-{name}", *args, **kwargs)


class TorchRunner(_RefitNames, tb.PolicyRunner):
    """A torch Policy case of ``benchmarks.torch_backends`` (``fsdp1-*``, ``dtensor-*``)."""


class JaxRunner(_RefitNames, jb.JaxPolicyRunner):
    """A ``jax_pjit`` Policy case of ``benchmarks.jax_backend`` (device count checked, pinned)."""


def start_policy(name: str, model_path: str, tokenizer_path: str, tokenizer, args):
    print(f"[refit] starting {name} ...", file=sys.stderr, flush=True)
    cls = JaxRunner if jb.jax_layout(name) else TorchRunner
    return cls(name, model_path, tokenizer_path, tokenizer, args)


def engine_config(model_path: str, tokenizer_path: str, args) -> dict:
    """The benchmarks' policy section with a vLLM engine long enough for ``--seq``."""
    cfg = tb.policy_config(model_path, tokenizer_path, tb.Layout("torch_fsdp", 1), args.batch, args.seq,
                           args.precision)
    cfg["generation"]["backend"] = "vllm"
    cfg["generation"]["vllm_cfg"]["max_model_len"] = max(args.seq, cfg["generation"]["vllm_cfg"]["max_model_len"])
    return cfg


class Engine:
    """One vLLM engine (``VllmGeneration``) on a one-bundle cluster of its own."""

    def __init__(self, model_path: str, tokenizer_path: str, tokenizer, args) -> None:
        from core.distributed import RayVirtualCluster
        from core.generation.vllm_generation import VllmGeneration

        print("[refit] starting the vLLM engine ...", file=sys.stderr, flush=True)
        self._cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=args.threads,
                                          name="bench-refit-vllm")
        self.generation = None
        try:
            t0 = time.perf_counter()
            self.generation = VllmGeneration(self._cluster, engine_config(model_path, tokenizer_path, args),
                                             tokenizer, name_prefix="bench-refit-vllm")
            self.startup_s = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise

    def alive(self) -> bool:
        try:
            self.generation.check_alive()
            return True
        except Exception:  # noqa: BLE001 -- a dead engine is replaced, not reported here
            return False

    def close(self) -> None:
        try:
            if self.generation is not None:
                self.generation.shutdown()
        finally:
            self._cluster.shutdown()


# ----------------------------------------------------------------------------- memcpy baseline


def memcpy_seconds(nbytes: int, threads: int = 1, copies: int = MEMCPY_COPIES) -> dict:
    """Median seconds of ``dst.copy_(src)`` over ``nbytes`` uint8: warm (``dst`` allocated and
    touched once) and cold (a fresh ``torch.empty`` per copy: page faults included)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)  # touch every page once
        warm, cold = [], []
        for _ in range(copies):
            t0 = time.perf_counter()
            dst.copy_(src)
            warm.append(time.perf_counter() - t0)
        for _ in range(copies):
            t0 = time.perf_counter()
            fresh = torch.empty(nbytes, dtype=torch.uint8)
            fresh.copy_(src)
            cold.append(time.perf_counter() - t0)
            del fresh
        return {"warm_s": statistics.median(warm), "cold_s": statistics.median(cold), "threads": threads}
    finally:
        torch.set_num_threads(previous)


# ----------------------------------------------------------------------------- one case


def _error(err: BaseException) -> str:
    traceback.print_exc()
    first = str(err).strip().splitlines()[-1] if str(err).strip() else ""
    return f"{type(err).__name__}: {first}"


def _refit(policy, engine: Engine, transport: str, args):
    from core.refit import refit_policy_generation

    return refit_policy_generation(policy, engine.generation, transport, refit_buffer_size_gb=args.bucket_gb)


def measure(runner, engine: Engine, transports, args) -> dict[str, dict]:
    """Warm-up refits per transport, then ``--repeats`` alternating rounds; one result per
    transport (a transport that fails is dropped from the later rounds)."""
    policy = runner._policy
    out = {t: {"seconds": [], "first_s": None} for t in transports}
    live = list(transports)
    for t in transports:
        try:
            for i in range(args.warmup):
                stats = _refit(policy, engine, t, args)
                if i == 0:
                    out[t].update(first_s=stats.seconds, bytes=stats.bytes, tensors=stats.tensors,
                                  buckets=stats.buckets)
        except Exception as err:  # noqa: BLE001 -- report it, go on with the other transport
            out[t]["error"] = _error(err)
            live.remove(t)
    for _ in range(args.repeats):
        for t in list(live):
            try:
                stats = _refit(policy, engine, t, args)
            except Exception as err:  # noqa: BLE001
                out[t]["error"] = _error(err)
                live.remove(t)
                continue
            out[t]["seconds"].append(stats.seconds)
            out[t].update(bytes=stats.bytes, tensors=stats.tensors, buckets=stats.buckets)
    if live and not engine.generation.weights_valid():
        for t in live:
            out[t]["error"] = "the engine does not report valid weights after the timed refits"
    return out


def run_case(name: str, engine: Engine, transports, args, model_path, tokenizer_path, tokenizer) -> list[dict]:
    """One Policy case: its refits per transport, and the memcpy baseline of its byte count."""
    base = {"case": name, "workers": jb._workers(name), "devices": jb._devices(name)}
    try:
        runner = start_policy(name, model_path, tokenizer_path, tokenizer, args)
    except Exception as err:  # noqa: BLE001
        return [{**base, "transport": t, "error": _error(err)} for t in transports]
    try:
        base["policy_startup_s"] = runner.startup_s
        per_transport = measure(runner, engine, transports, args)
    except Exception as err:  # noqa: BLE001
        return [{**base, "transport": t, "error": _error(err)} for t in transports]
    finally:
        runner.close()
    nbytes = next((r["bytes"] for r in per_transport.values() if r.get("bytes")), None)
    copy = memcpy_seconds(nbytes) if nbytes else {}
    return [{**base, "transport": t, **r, "memcpy": copy} for t, r in per_transport.items()]


# ----------------------------------------------------------------------------- run


def ray_session(args) -> jb.RaySession:
    """``benchmarks.jax_backend``'s Ray session (XLA host devices in the actors' environment),
    with logical CPUs for a policy case plus the engine's bundle."""
    sized = argparse.Namespace(**{**vars(args), "threads": 2 * args.threads})
    return jb.RaySession(sized)


def run(args, model_path: str, tokenizer_path: str, tokenizer) -> tuple[list[dict], dict]:
    """Every case in turn against one engine; returns the rows and facts about the run."""
    import ray

    session = ray_session(args)
    first_jax = next((jb._devices(c) for c in args.cases if jb.jax_layout(c)), None)
    if session.owned:
        session.start(first_jax)  # before anything is timed
    facts: dict = {"engine_startup_s": [], "ray_owned": session.owned}
    rows: list[dict] = []
    engine = None
    try:
        for name in args.cases:
            devices = jb._devices(name) if jb.jax_layout(name) else None
            if devices is not None and not session.fits(devices):
                rows += [{"case": name, "workers": 1, "devices": devices, "transport": t,
                          "skipped": f"needs {devices} XLA host devices per actor; the caller's Ray gives "
                                     f"{session.devices}"} for t in args.transports]
                continue
            if engine is not None and session.owned and devices not in (None, session.devices):
                engine.close()  # Ray restarts for another device count: the engine goes with it
                engine = None
            session.start(devices)
            if engine is not None and not engine.alive():
                engine.close()
                engine = None
            if engine is None:
                try:
                    engine = Engine(model_path, tokenizer_path, tokenizer, args)
                    facts["engine_startup_s"].append(engine.startup_s)
                except Exception as err:  # noqa: BLE001
                    message = _error(err)
                    rows += [{"case": name, "workers": jb._workers(name), "devices": jb._devices(name),
                              "transport": t, "error": f"engine: {message}"} for t in args.transports]
                    continue
            rows += run_case(name, engine, args.transports, args, model_path, tokenizer_path, tokenizer)
    finally:
        if engine is not None:
            engine.close()
        facts["ray_restarts"] = session.restarts
        if session.owned and ray.is_initialized():
            ray.shutdown()
    return rows, facts


# ----------------------------------------------------------------------------- report


def _gb(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / 1e9


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _ratio(r: dict) -> float | None:
    med, copy = tb.median(r.get("seconds")), (r.get("memcpy") or {}).get("warm_s")
    return med / copy if med and copy else None


def _table(rows: list[dict]) -> list[str]:
    lines = ["| case | transport | workers×devices | GB | buckets | first s | refit s | GB/s | memcpy ms | ×memcpy |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [r["case"], r["transport"], f"{r['workers']}×{r['devices']}"]
        if "skipped" in r or "error" in r:
            word = "skipped" if "skipped" in r else "FAILED"
            cells += ["-", "-", "-", word, "-", "-", "-"]
        else:
            med = tb.median(r["seconds"])
            cells += [tb.fmt(_gb(r["bytes"]), ".4f"), str(r["buckets"]), tb.fmt(r["first_s"], ".3f"),
                      tb.fmt(med, ".3f"), tb.fmt(_gb(r["bytes"]) / med if med else None, ".2f"),
                      tb.fmt(_ms(r["memcpy"].get("warm_s")), ".3f"), tb.fmt(_ratio(r), ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _details(rows: list[dict]) -> list[str]:
    lines = ["refit seconds per call: median [min, max]; policy start s; memcpy warm / cold ms (median of "
             f"{MEMCPY_COPIES}, driver, threads)"]
    for r in rows:
        label = f"{r['case']:12} {r['transport']:10}"
        if "skipped" in r:
            lines.append(f"{label} skipped: {r['skipped']}")
        elif "error" in r:
            lines.append(f"{label} FAILED: {r['error']}")
        else:
            copy = r["memcpy"]
            start = tb.fmt(r.get("policy_startup_s"), ".1f")
            lines.append(f"{label} {tb._spread(r['seconds']):25} start {start:>5} s  {r['tensors']} tensors"
                         f"  memcpy {tb.fmt(_ms(copy.get('warm_s')), '.3f')} / "
                         f"{tb.fmt(_ms(copy.get('cold_s')), '.3f')} ms ({copy.get('threads')} thread(s))")
    return lines


def report(rows: list[dict], facts: dict, args, load: tuple[float, float]) -> str:
    from core.refit import buffer_bytes, refit_dtype
    from core.refit.manifest import DTYPE_BYTES

    cores = os.cpu_count() or 1
    dtype = refit_dtype(tb.default_policy_section())  # the stream's and the engine's (engine_config)
    nbytes = next((r["bytes"] for r in rows if r.get("bytes")), None)
    size = f"{nbytes / DTYPE_BYTES[dtype] / 1e6:.1f}M params, " if nbytes else ""
    if args.bucket_gb is not None:
        bucket = f"{args.bucket_gb:g} GiB"
    else:
        configured = buffer_bytes(tb.default_policy_section().get("refit_buffer_size_gb")) / 1024 ** 3
        bucket = f"the config's refit_buffer_size_gb ({configured:g} GiB)"
    starts = ", ".join(f"{s:.1f} s" for s in facts["engine_startup_s"]) or "-"
    restarts = ", ".join(f"to {n} device(s) in {s:.1f} s" for n, s in facts["ray_restarts"]) or "none"
    lines = [
        f"refit policy -> vLLM engine (CPU): {args.model} ({size}stream in {dtype}, the engine's dtype), bucket size "
        f"{bucket}, {args.warmup} warm-up refit(s) per transport then {args.repeats} timed round(s) of one "
        "refit per transport, alternating",
        f"threads: {args.threads} per policy case (torch: split over its workers; JAX: one actor), engine: one "
        f"vLLM engine on its own bundle of {args.threads} CPU(s), reused by every case (start-up {starts}); "
        f"{cores} CPU cores on this machine",
        "refit s = RefitStats.seconds (driver wall clock of refit_policy_generation, median); first s = the "
        "first warm-up refit (collective: includes forming the broadcast group); GB = stream bytes / 1e9; "
        "memcpy ms = one dst.copy_(src) of the same bytes in the driver (1 thread, dst pre-touched, "
        "median); ×memcpy = refit s / memcpy s",
        f"Ray: {'started here' if facts['ray_owned'] else 'started by the caller'}; restarts for another "
        f"XLA device count: {restarts}",
        f"machine load average (1 min): {load[0]:.2f} at start, {load[1]:.2f} at end"
        + (f"  -- above {cores} cores: other processes competed for the CPU" if max(load) > cores else ""),
        "",
        *_table(rows),
        "",
        *_details(rows),
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     conflict_handler="resolve")
    # --batch / --seq shape the policy's config (max_total_sequence_length, the engine's
    # max_model_len) and the batch its runner prepares; no forward pass runs here.
    tb.add_workload_args(parser)
    parser.add_argument("--repeats", "--iters", dest="repeats", type=int, default=3,
                        help="timed refits per case and transport (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed refits per case and transport first")
    parser.add_argument("--bucket-gb", type=float, default=None,
                        help="refit_buffer_size_gb in GiB (default: the config's value)")
    parser.add_argument("--cases", nargs="+", default=CASES, type=_case,
                        help=f"{' '.join(CASES)}, or any of {list(tb.LAYOUTS)}, jax-fsdp<F>[-tp<T>], jax-tp<T>")
    parser.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 1 or args.threads < 1:
        parser.error("--repeats must be >= 1, --warmup >= 1, --threads >= 1")
    if args.bucket_gb is not None and args.bucket_gb <= 0:
        parser.error("--bucket-gb must be positive")
    if any(c in tb.LAYOUTS and args.batch % tb.LAYOUTS[c].dp for c in args.cases):
        parser.error(f"--batch {args.batch} must be divisible by the data-parallel size of every torch case")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    wall0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dualrl-bench-") as tmp:
        model_path, tokenizer_path = tb.prepare_model(args.model, Path(tmp))
        tokenizer = tb.load_tokenizer(tokenizer_path)
        load0 = os.getloadavg()[0]
        rows, facts = run(args, model_path, tokenizer_path, tokenizer)
        load = (load0, os.getloadavg()[0])
    print(report(rows, facts, args, load))
    print(f"\nbenchmark wall time {time.perf_counter() - wall0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "facts": facts, "results": rows}, f, indent=2, default=str)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
