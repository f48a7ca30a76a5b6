"""Policy ``get_logprobs`` / ``train`` throughput on the torch layouts vs plain single-process HF.

    python -m benchmarks.torch_backends [--model llama_bench] [--batch 8] [--seq 256] [--iters 5]
        [--warmup 2] [--precision float32] [--threads 2] [--cases hf fsdp1-dp2 ...]

Every case runs the same model on the same batch (right-padded random ids with ragged
lengths, seed 0) in one invocation and is reported as tokens/s and as a ratio to the
``hf`` case of this same run:

* ``hf``: ``AutoModelForCausalLM`` in a child process of its own (its threads and memory are
  its alone; the driver sends it one line per call and it answers with the seconds the call
  took).  logprobs = one no-grad forward over the whole batch + ``log_softmax``/``gather``;
  train = forward + token-mean NLL + backward + grad-norm clip + AdamW step, with the
  optimizer kwargs and ``max_grad_norm`` of ``core/configs/default.yaml`` as the workers.
* ``fsdp1-*`` / ``dtensor-*``: a :class:`core.policy.Policy` on a fresh
  :class:`RayVirtualCluster` of 1 or 2 CPU workers (gloo).  One micro batch per rank
  (``train_micro_batch_size = logprob_batch_size = batch / dp``), one optimizer step per
  ``train`` call (``gbs = batch``), loss :class:`core.losses.NLLLoss`.

Methodology and caveats:

* tokens/s = real (unpadded) tokens of the batch / wall seconds of one call.  Policy calls
  are timed on the driver around ``policy.get_logprobs`` / ``policy.train``: Ray dispatch,
  sharding and result collection included (what a user sees).  ``--warmup`` calls per
  operation run first, untimed (the first AdamW step allocates its state there).  The
  table gives the median; min/max and ratios of the fastest calls follow.
* Threads: ``--threads T`` (default 2, this machine's core count) is each case's total.
  ``hf`` runs ``torch.set_num_threads(T)``; a 2-worker case gets Ray bundles of T/2 CPUs,
  a 1-worker case one bundle of T CPUs.  Ray sets ``OMP_NUM_THREADS`` to an actor's CPU
  count, which torch follows; the threads each worker really has
  (``policy.get_gpu_info()[i]["torch_num_threads"]``) are printed.  So every case uses the
  same T cores: on a 2-core CPU dp2/tp2 are *not* more hardware, only the same two cores
  split into two single-threaded processes plus gloo collectives.  The dp1 cases run the
  computation of ``hf`` on one process with the same threads, so their ratio isolates the
  framework's overhead (Ray, FSDP wrapping, the worker's logprob/loss path); the dp2/tp2
  ratios add the parallel split on top.
* Schedule: the ``hf`` child lives through the whole run; the Policy cases run one at a
  time (policy and cluster shut down before the next; Ray is started once, before anything
  is timed), and every Policy call is immediately followed by the same call on ``hf``.  The
  ×hf ratio of a case is taken against *its own* paired hf calls, so load from other
  processes on the machine (which drifts over minutes) hits both sides of a ratio alike;
  the hf row pools all its paired calls.  The report prints the load average.  Ratios
  from the fastest calls (min) are printed too: the least disturbed estimate.  Start-up
  (model load, Policy construction) is reported but is no part of any throughput.
* ``--precision bfloat16``: the workers compute in bf16 under FSDP mixed precision (fp32
  master weights); ``hf`` approximates that with CPU autocast.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

#: RNG seed of the batch: the driver and the hf subprocess build identical batches from it.
SEED = 0


@dataclass(frozen=True)
class Layout:
    """A Policy case: backend, workers, tensor parallel size, sequence parallelism."""

    backend: str
    workers: int
    tp: int = 1
    sp: bool = False

    @property
    def dp(self) -> int:
        return self.workers // self.tp


LAYOUTS: dict[str, Layout] = {
    "fsdp1-dp1": Layout("torch_fsdp", 1),
    "dtensor-dp1": Layout("torch_dtensor", 1),
    "fsdp1-dp2": Layout("torch_fsdp", 2),
    "dtensor-dp2": Layout("torch_dtensor", 2),
    "dtensor-tp2": Layout("torch_dtensor", 2, tp=2),
    "dtensor-tp2-sp": Layout("torch_dtensor", 2, tp=2, sp=True),
}
CASES = ["hf", *LAYOUTS]


# ----------------------------------------------------------------------------- inputs


def prepare_model(model: str, root: Path) -> tuple[str, str]:
    """``(model path or hub id, tokenizer path or hub id)``; a tiny model name is built in ``root``."""
    from core.testing.tiny_models import TINY_MODELS, save_tiny_model

    if model in TINY_MODELS:
        path = save_tiny_model(model, root / model)
        return str(path), str(path / "tokenizer")
    tok_dir = Path(model) / "tokenizer"  # the tiny-model layout, when given a saved one by path
    return model, str(tok_dir) if tok_dir.is_dir() else model


def load_tokenizer(tokenizer_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path)


def vocab_size(model_path: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path).vocab_size


def make_batch(batch: int, seq: int, vocab: int):
    """NLL training batch (also fine for logprobs): ragged right padding, loss on every real token."""
    import torch

    from core.data import BatchedDataDict
    from core.testing.tiny_models import random_batch

    ids, lengths = random_batch(batch, seq, vocab, seed=SEED)
    valid = (torch.arange(seq)[None, :] < lengths[:, None]).float()
    return BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=valid, sample_mask=torch.ones(batch))


def default_policy_section() -> dict:
    from core.config.loader import DEFAULT_CONFIG_PATH, load_config

    return copy.deepcopy(load_config(DEFAULT_CONFIG_PATH)["policy"])


def policy_config(model_path: str, tokenizer_path: str, layout: Layout, batch: int, seq: int,
                  precision: str) -> dict:
    """The default policy section on this model, one micro batch per rank, width ``seq``."""
    cfg = default_policy_section()
    local = batch // layout.dp
    cfg.update(
        backend=layout.backend,
        model_name=model_path,
        train_global_batch_size=batch,
        train_micro_batch_size=local,
        logprob_batch_size=local,
        max_total_sequence_length=seq,
        precision=precision,
    )
    cfg["tokenizer"]["name"] = tokenizer_path
    cfg["dtensor_cfg"].update(tensor_parallel_size=layout.tp, sequence_parallel=layout.sp)
    return cfg


# ----------------------------------------------------------------------------- hf case (child process)


def _hf_steps(model, data, precision: str):
    """(logprobs step, train step) closures: plain HF forward / forward+backward+AdamW."""
    import torch

    cfg = default_policy_section()
    ids = data["input_ids"]
    mask = (torch.arange(ids.shape[1])[None, :] < data["input_lengths"][:, None]).long()
    token_mask = data["token_mask"][:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), **cfg["optimizer"]["kwargs"])
    max_norm = cfg["max_grad_norm"]

    def next_token_logprobs():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]

    def logprobs():
        model.eval()
        with torch.no_grad():
            return next_token_logprobs() * token_mask

    def train():
        model.train()
        optimizer.zero_grad(set_to_none=True)
        loss = -(next_token_logprobs() * token_mask).sum() / token_mask.sum()
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        return float(loss)

    return {"logprobs": logprobs, "train": train}


def serve_hf(model_path: str, args) -> None:
    """Runs in the child process: load the model, then answer ``logprobs``/``train`` lines on
    stdin with the seconds each call took (``@@``-prefixed JSON on stdout) until ``quit``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    steps = _hf_steps(model, make_batch(args.batch, args.seq, model.config.vocab_size), args.precision)
    params = sum(p.numel() for p in model.parameters())
    print("@@" + json.dumps({"threads": torch.get_num_threads(), "params": params}), flush=True)
    for line in sys.stdin:
        op = line.strip()
        if op == "quit":
            break
        t0 = time.perf_counter()
        steps[op]()
        print("@@" + json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


class HFRunner:
    """The ``hf`` case: a child process running :func:`serve_hf`, timed by itself (pure compute)."""

    name, workers = "hf", 1

    def __init__(self, model_path: str, args) -> None:
        cmd = [sys.executable, "-m", "benchmarks.torch_backends", "--child-hf", model_path,
               "--batch", str(args.batch), "--seq", str(args.seq), "--precision", args.precision,
               "--threads", str(args.threads)]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
        self._stderr = tempfile.TemporaryFile(mode="w+")
        t0 = time.perf_counter()
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                      text=True, env=env)
        ready = self._reply()
        self.startup_s = time.perf_counter() - t0
        self.threads, self.params = [ready["threads"]], ready["params"]

    def _reply(self) -> dict:
        for line in self._proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        self._stderr.seek(0)
        raise RuntimeError(f"hf child exited (rc {self._proc.wait()}):\n{self._stderr.read()}")

    def _call(self, op: str) -> float:
        self._proc.stdin.write(op + "\n")
        self._proc.stdin.flush()
        return self._reply()["seconds"]

    def logprobs(self) -> float:
        return self._call("logprobs")

    def train(self) -> float:
        return self._call("train")

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.write("quit\n")
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
        self._stderr.close()


# ----------------------------------------------------------------------------- Policy cases


class PolicyRunner:
    """A Policy case on its own cluster; each call is timed on the driver (Ray dispatch included)."""

    def __init__(self, name: str, model_path: str, tokenizer_path: str, tokenizer, args) -> None:
        layout = LAYOUTS[name]
        self.name, self.workers = name, layout.workers
        cfg = policy_config(model_path, tokenizer_path, layout, args.batch, args.seq, args.precision)
        cpus = max(1, args.threads // layout.workers)
        self._start(name, cfg, tokenizer, args, layout.workers, cpus, args.batch // layout.dp)
        try:
            self.threads = [info.get("torch_num_threads") for info in self._policy.get_gpu_info()]
        except BaseException:
            self.close()
            raise

    def _start(self, name: str, cfg: dict, tokenizer, args, workers: int, cpus_per_worker: int, mbs: int) -> None:
        """Batch, loss and a Policy on a cluster of its own; start-up and Ray round trip timed."""
        from core.distributed import RayVirtualCluster
        from core.losses import NLLLoss
        from core.policy import Policy

        self._data = make_batch(args.batch, args.seq, vocab_size(cfg["model_name"]))
        self._loss, self._gbs, self._mbs = NLLLoss(), args.batch, mbs
        self._cluster = RayVirtualCluster([workers], use_gpus=False, num_cpus_per_bundle=cpus_per_worker,
                                          name=f"bench-{name}")
        self._policy = None
        try:
            t0 = time.perf_counter()
            self._policy = Policy(self._cluster, cfg, tokenizer, name_prefix=f"bench-{name}")
            self.startup_s = time.perf_counter() - t0
            self.noop_s = noop_round_trip(self._policy)
        except BaseException:
            self.close()
            raise

    def logprobs(self) -> float:
        t0 = time.perf_counter()
        self._policy.get_logprobs(self._data)
        return time.perf_counter() - t0

    def train(self) -> float:
        t0 = time.perf_counter()
        self._policy.train(self._data, self._loss, gbs=self._gbs, mbs=self._mbs)
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            if self._policy is not None:
                self._policy.shutdown()
        finally:
            self._cluster.shutdown()


def noop_round_trip(policy, calls: int = 5) -> float:
    """Median seconds of a call that does nothing on the workers: Ray dispatch + collection."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        policy.report_device_id()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------- scheduling


OPS = ("logprobs", "train")


def start_runner(name: str, model_path: str, tokenizer_path: str, tokenizer, args):
    print(f"[torch_backends] starting {name} ...", file=sys.stderr, flush=True)
    if name == "hf":
        return HFRunner(model_path, args)
    return PolicyRunner(name, model_path, tokenizer_path, tokenizer, args)


def _new_result(runner) -> dict:
    return {"case": runner.name, "workers": runner.workers, "threads": runner.threads,
            "startup_s": runner.startup_s, "noop_s": getattr(runner, "noop_s", None),
            "params": getattr(runner, "params", None),
            **{f"{op}_s": [] for op in OPS}, **{f"hf_{op}_s": [] for op in OPS}}


def _failed(name: str, err: BaseException) -> dict:
    traceback.print_exc()
    workers = LAYOUTS[name].workers if name in LAYOUTS else 1
    first = str(err).strip().splitlines()[-1] if str(err).strip() else ""
    return {"case": name, "workers": workers, "error": f"{type(err).__name__}: {first}"}


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


def _run_policy_case(name: str, start, hf, hf_result: dict | None, args) -> dict:
    try:
        runner = start(name)
    except Exception as err:  # noqa: BLE001 -- report it and go on with the other cases
        return _failed(name, err)
    try:
        result = _new_result(runner)
        measure(runner, hf, result, hf_result, args)
        return result
    except Exception as err:  # noqa: BLE001
        return _failed(name, err)
    finally:
        runner.close()


def run_cases(cases, start, args) -> list[dict]:
    """Policy cases one at a time (each shut down before the next), every call paired with an
    ``hf`` call; ``hf`` lives through the whole run and its row pools all its paired calls."""
    hf, hf_result = None, None
    if "hf" in cases:
        try:
            hf = start("hf")
            hf_result = _new_result(hf)
        except Exception as err:  # noqa: BLE001
            hf_result = _failed("hf", err)
    try:
        policy_cases = [c for c in cases if c != "hf"]
        results = {c: _run_policy_case(c, start, hf, hf_result, args) for c in policy_cases}
        if hf is not None and not policy_cases:
            measure(hf, None, hf_result, None, args)
    finally:
        if hf is not None:
            hf.close()
    if hf_result is not None:
        results["hf"] = hf_result
    return [results[c] for c in cases]


# ----------------------------------------------------------------------------- report


def median(times) -> float | None:
    return statistics.median(times) if times else None


def ratio(r: dict, hf: dict | None, op: str, stat=statistics.median) -> float | None:
    """case tokens/s ÷ hf tokens/s = hf seconds ÷ case seconds, against the case's own paired
    hf calls (the hf row: against itself)."""
    mine = r.get(f"{op}_s")
    base = r.get(f"hf_{op}_s") or (hf or {}).get(f"{op}_s")
    return stat(base) / stat(mine) if mine and base else None


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _threads(result: dict) -> str:
    threads = result.get("threads")
    if not threads:
        return "?"
    return str(threads[0]) if len(set(threads)) == 1 else "/".join(map(str, threads))


def hf_row(results: list[dict]) -> dict | None:
    return next((r for r in results if r["case"] == "hf" and "error" not in r), None)


def _throughput_table(results: list[dict], tokens: int) -> list[str]:
    hf = hf_row(results)
    lines = ["| case | workers | threads/worker | logprobs tok/s | ×hf | train tok/s | ×hf |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        cells = [r["case"], str(r["workers"]), _threads(r)]
        if "error" in r:
            cells += ["FAILED", "-", "FAILED", "-"]
        else:
            for op in OPS:
                med = median(r[f"{op}_s"])
                cells += [fmt(tokens / med, ".0f"), fmt(ratio(r, hf, op), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _spread(times: list[float] | None) -> str:
    if not times:
        return "-"
    return f"{statistics.median(times):.3f} [{min(times):.3f}, {max(times):.3f}]"


def timing_table(results: list[dict]) -> list[str]:
    hf = hf_row(results)
    lines = ["seconds per call: median [min, max]; paired hf = median of the hf calls made alongside "
             "this case; ×hf(min) = fastest hf call ÷ fastest call of the case; no-op ms = a Policy call "
             "that does nothing on the workers (report_device_id): Ray dispatch + collection",
             f"{'case':15} {'start s':>7} {'no-op ms':>8}  {'logprobs s':25} {'paired hf':>9}  {'train s':25} {'paired hf':>9}"
             f"  {'×hf(min) lp':>11} {'train':>6}"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['case']:15} FAILED: {r['error']}")
            continue
        noop_ms = r["noop_s"] * 1e3 if r.get("noop_s") is not None else None
        row = f"{r['case']:15} {fmt(r.get('startup_s'), '.1f'):>7} {fmt(noop_ms, '.1f'):>8}  "
        for op in OPS:
            row += f"{_spread(r[f'{op}_s']):25} {fmt(median(r.get(f'hf_{op}_s')), '.3f'):>9}  "
        row += f"{fmt(ratio(r, hf, 'logprobs', min), '.2f'):>11} {fmt(ratio(r, hf, 'train', min), '.2f'):>6}"
        lines.append(row)
    return lines


def report(results: list[dict], args, tokens: int, params: int | None, load: tuple[float, float]) -> str:
    size = f"{params / 1e6:.1f}M params, " if params else ""
    cores = os.cpu_count() or 1
    lines = [
        f"torch backends vs single-process HF: {args.model} ({size}vocab {args.vocab}), {args.precision}, "
        f"batch {args.batch} x seq {args.seq} = {tokens} real tokens ({args.batch * args.seq} padded), "
        f"{args.iters} timed calls after {args.warmup} warm-up per operation and case",
        f"threads: total budget {args.threads} on {cores} CPU cores; hf: torch.set_num_threads({args.threads}); "
        f"1-worker cases: one Ray bundle of {args.threads} CPU(s); 2-worker cases: bundles of "
        f"{max(1, args.threads // 2)} CPU(s). Ray sets OMP_NUM_THREADS to an actor's CPUs; threads/worker = "
        "torch.get_num_threads() reported by each worker (get_gpu_info).",
        "All cases share the same cores: dp2/tp2 = those cores split over two processes (+ gloo "
        "collectives), not extra hardware; dp1 vs hf = the same compute, so framework overhead only.",
        "tokens/s = real tokens / wall time of one call (median): Policy calls timed on the driver "
        "(Ray dispatch included), hf calls inside its process. Policy cases run one at a time, each "
        "call followed by an hf call; ×hf = case tokens/s ÷ tokens/s of those paired hf calls.",
        f"machine load average (1 min): {load[0]:.2f} at start, {load[1]:.2f} at end"
        + (f"  -- above {cores} cores: other processes competed for the CPU; trust ×hf (paired) "
           "more than absolute tokens/s" if max(load) > cores else ""),
        "",
        *_throughput_table(results, tokens),
        "",
        *timing_table(results),
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    parser.add_argument("--child-hf", metavar="MODEL_PATH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--iters must be >= 1, --warmup >= 0, --threads >= 1")
    if any(c in LAYOUTS and args.batch % LAYOUTS[c].dp for c in args.cases):
        parser.error(f"--batch {args.batch} must be divisible by the data-parallel size of every case (2)")
    return args


def add_workload_args(parser: argparse.ArgumentParser, warmup_help: str = "untimed calls per operation") -> None:
    """The arguments every backend benchmark shares: model, batch shape, repetitions, threads."""
    parser.add_argument("--model", default="llama_bench", help="a core.testing tiny model name, or an HF path / hub id")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help=warmup_help)
    parser.add_argument("--precision", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2, help="total threads per case (see the module docstring)")
    parser.add_argument("--json", help="also write the results to this file")


def ray_cpus(args) -> int:
    """Logical CPUs for Ray: room for the largest case (one case is alive at a time)."""
    need = [LAYOUTS[c].workers * max(1, args.threads // LAYOUTS[c].workers) for c in args.cases if c in LAYOUTS]
    return max([4, *need])


def start_ray(args) -> None:
    """Start Ray for this run unless the caller already did (then its settings stay)."""
    import ray

    from core.distributed import init_ray

    if ray.is_initialized():
        return
    # Ray sets an actor's OMP_NUM_THREADS to its CPU count only where the variable is unset;
    # an exported value would be inherited by every worker and oversubscribe the cores.
    os.environ.pop("OMP_NUM_THREADS", None)
    init_ray(num_cpus=ray_cpus(args))


def main(argv=None) -> int:
    args = _parse(argv)
    if args.child_hf:
        serve_hf(args.child_hf, args)
        return 0

    wall0 = time.perf_counter()
    if any(c in LAYOUTS for c in args.cases):
        start_ray(args)  # first: its start-up work is over before anything is timed
    with tempfile.TemporaryDirectory(prefix="dualrl-bench-") as tmp:
        model_path, tokenizer_path = prepare_model(args.model, Path(tmp))
        args.vocab = vocab_size(model_path)
        tokenizer = load_tokenizer(tokenizer_path)
        tokens = int(make_batch(args.batch, args.seq, args.vocab)["input_lengths"].sum())
        load0 = os.getloadavg()[0]
        start = lambda name: start_runner(name, model_path, tokenizer_path, tokenizer, args)  # noqa: E731
        results = run_cases(args.cases, start, args)
        load = (load0, os.getloadavg()[0])
    params = next((r["params"] for r in results if r.get("params")), None)
    print(report(results, args, tokens, params, load))
    print(f"\nbenchmark wall time {time.perf_counter() - wall0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": tokens, "args": {k: v for k, v in vars(args).items() if k != "child_hf"},
                       "results": results}, f, indent=2)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
