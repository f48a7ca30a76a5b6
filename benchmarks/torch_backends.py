"""Policy ``get_logprobs`` / ``train`` throughput on the torch layouts vs plain single-process HF.

    python -m benchmarks.torch_backends [--model llama_bench] [--batch 8] [--seq 256]
        [--iters 5] [--warmup 2] [--precision float32] [--threads 2] [--cases hf fsdp1-dp2 ...]

Every case runs the same model on the same batch (right-padded random ids with ragged
lengths, seed 0) in one invocation, back to back, and is reported as tokens/s and as a
ratio to the ``hf`` case of this same run:

* ``hf``: ``AutoModelForCausalLM`` in a subprocess of its own (so its threads and memory are
  its alone).  logprobs = one no-grad forward over the whole batch + ``log_softmax`` /
  ``gather``; train = forward + token-mean NLL + backward + grad-norm clip + AdamW step
  (the optimizer kwargs and ``max_grad_norm`` of ``core/configs/default.yaml``, as the
  workers use).
* ``fsdp1-*`` / ``dtensor-*``: a :class:`core.policy.Policy` on a fresh
  :class:`RayVirtualCluster` of 1 or 2 CPU workers (gloo).  One micro batch per rank
  (``train_micro_batch_size = logprob_batch_size = batch / dp``), one optimizer step per
  ``train`` call (``gbs = batch``), loss :class:`core.losses.NLLLoss`.

Methodology and caveats:

* tokens/s = real (unpadded) tokens of the batch / wall seconds of one call, timed on the
  driver around ``policy.get_logprobs`` / ``policy.train``: Ray dispatch, sharding and
  result collection included (what a user sees).  ``--warmup`` calls per operation are
  run first and not timed (the first AdamW step allocates its state there).  The table
  gives the median; min/max follow.
* Threads: ``--threads T`` (default 2, this machine's core count) is the total budget.
  ``hf`` uses ``torch.set_num_threads(T)``; a 2-worker case gets Ray bundles of T/2 CPUs,
  a 1-worker case one bundle of T CPUs.  Ray sets ``OMP_NUM_THREADS`` to an actor's CPU
  count, which is what torch uses; the threads each worker really has
  (``policy.get_gpu_info()["torch_num_threads"]``) are printed.  So every case uses the
  same T cores: on a 2-core CPU the dp2/tp2 cases are *not* faster hardware, only the
  same two cores split into two single-threaded processes plus gloo collectives.
  The dp1 cases run the exact computation of ``hf`` on one process with the same threads,
  so their ratio isolates the framework's overhead (Ray, FSDP wrapping, the worker's
  logprob/loss path); the dp2/tp2 ratios add the parallel split on top.
* Policies and clusters are shut down between cases; Ray is started once.  Start-up
  (Policy construction) is reported but not part of any throughput.
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


# ----------------------------------------------------------------------------- timing


def time_calls(fn, warmup: int, iters: int) -> list[float]:
    """Wall seconds of ``iters`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


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
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16")

    def next_token_logprobs():
        with autocast:
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

    return logprobs, train


def run_hf(model_path: str, batch: int, seq: int, iters: int, warmup: int, precision: str, threads: int) -> dict:
    """Runs in the child process: the plain HF baseline."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    data = make_batch(batch, seq, model.config.vocab_size)
    logprobs, train = _hf_steps(model, data, precision)
    return {
        "case": "hf",
        "workers": 1,
        "threads": [torch.get_num_threads()],
        "params": sum(p.numel() for p in model.parameters()),
        "startup_s": None,
        "logprobs_s": time_calls(logprobs, warmup, iters),
        "train_s": time_calls(train, warmup, iters),
    }


def spawn_hf(model_path: str, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.torch_backends", "--child-hf", model_path,
           "--batch", str(args.batch), "--seq", str(args.seq), "--iters", str(args.iters),
           "--warmup", str(args.warmup), "--precision", args.precision, "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"hf child failed (rc {out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- Policy cases


def run_policy_case(name: str, model_path: str, tokenizer_path: str, tokenizer, args) -> dict:
    """Build the case's cluster and Policy, time both operations, tear everything down."""
    from core.distributed import RayVirtualCluster
    from core.losses import NLLLoss
    from core.policy import Policy

    layout = LAYOUTS[name]
    cfg = policy_config(model_path, tokenizer_path, layout, args.batch, args.seq, args.precision)
    data = make_batch(args.batch, args.seq, vocab_size(model_path))
    cpus = max(1, args.threads // layout.workers)
    cluster = RayVirtualCluster([layout.workers], use_gpus=False, num_cpus_per_bundle=cpus, name=f"bench-{name}")
    try:
        t0 = time.perf_counter()
        policy = Policy(cluster, cfg, tokenizer, name_prefix=f"bench-{name}")
        startup = time.perf_counter() - t0
        try:
            threads = [info.get("torch_num_threads") for info in policy.get_gpu_info()]
            loss_fn = NLLLoss()
            lp = time_calls(lambda: policy.get_logprobs(data), args.warmup, args.iters)
            tr = time_calls(lambda: policy.train(data, loss_fn, gbs=args.batch, mbs=args.batch // layout.dp),
                            args.warmup, args.iters)
        finally:
            policy.shutdown()
    finally:
        cluster.shutdown()
    return {"case": name, "workers": layout.workers, "threads": threads, "startup_s": startup,
            "logprobs_s": lp, "train_s": tr}


def run_case(name: str, model_path: str, tokenizer_path: str, tokenizer, args) -> dict:
    """One case; a failure is recorded (with its traceback on stderr) and the run goes on."""
    print(f"[torch_backends] running {name} ...", file=sys.stderr, flush=True)
    try:
        if name == "hf":
            return spawn_hf(model_path, args)
        return run_policy_case(name, model_path, tokenizer_path, tokenizer, args)
    except Exception as err:  # noqa: BLE001 -- report and continue with the other cases
        traceback.print_exc()
        return {"case": name, "workers": LAYOUTS[name].workers if name in LAYOUTS else 1,
                "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}


# ----------------------------------------------------------------------------- report


def _tok_s(result: dict, key: str, tokens: int) -> float | None:
    times = result.get(key)
    return tokens / statistics.median(times) if times else None


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _threads(result: dict) -> str:
    threads = result.get("threads")
    if not threads:
        return "?"
    return str(threads[0]) if len(set(threads)) == 1 else "/".join(map(str, threads))


def _throughput_table(results: list[dict], tokens: int) -> list[str]:
    hf = next((r for r in results if r["case"] == "hf" and "error" not in r), None)
    lines = ["| case | workers | threads/worker | logprobs tok/s | ×hf | train tok/s | ×hf |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        cells = [r["case"], str(r["workers"]), _threads(r)]
        for key in ("logprobs_s", "train_s"):
            mine = _tok_s(r, key, tokens)
            base = _tok_s(hf, key, tokens) if hf else None
            ratio = mine / base if mine is not None and base else None
            cells += [_fmt(mine, ".0f"), _fmt(ratio, ".2f")]
        if "error" in r:
            cells[-4:] = ["FAILED", "-", "FAILED", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _spread(times: list[float] | None) -> str:
    if not times:
        return "-"
    return f"{statistics.median(times):.3f} [{min(times):.3f}, {max(times):.3f}]"


def _timing_table(results: list[dict]) -> list[str]:
    lines = ["seconds per call: median [min, max]",
             f"{'case':15} {'startup s':>9}  {'logprobs':28} {'train':28}"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['case']:15} FAILED: {r['error']}")
            continue
        lines.append(f"{r['case']:15} {_fmt(r.get('startup_s'), '9.1f')}  "
                     f"{_spread(r.get('logprobs_s')):28} {_spread(r.get('train_s')):28}")
    return lines


def report(results: list[dict], args, tokens: int, params: int | None) -> str:
    size = f"{params / 1e6:.1f}M params, " if params else ""
    padded = args.batch * args.seq
    lines = [
        f"torch backends vs single-process HF: {args.model} ({size}vocab {args.vocab}), {args.precision}, "
        f"batch {args.batch} x seq {args.seq} = {tokens} real tokens ({padded} padded), "
        f"{args.iters} timed calls after {args.warmup} warm-up, {os.cpu_count()} CPU cores",
        f"threads: total budget {args.threads}; hf torch.set_num_threads({args.threads}); 1-worker cases one "
        f"Ray bundle of {args.threads} CPUs; 2-worker cases bundles of {max(1, args.threads // 2)} CPU(s) "
        "(Ray sets OMP_NUM_THREADS to the actor's CPUs). threads/worker below is torch.get_num_threads() "
        "measured inside each worker.",
        "Every case shares the same cores: on this machine dp2/tp2 = the same cores split over two "
        "processes (+ gloo collectives), not extra hardware; dp1 vs hf = framework overhead only.",
        "tokens/s = real tokens / driver wall time of one Policy call (Ray dispatch included); median of the "
        "timed calls; ×hf = case tokens/s ÷ hf tokens/s from this run.",
        "",
        *_throughput_table(results, tokens),
        "",
        *_timing_table(results),
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama_bench", help="a core.testing tiny model name, or an HF path / hub id")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precision", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2, help="total torch threads per case (see above)")
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child-hf", metavar="MODEL_PATH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--iters must be >= 1, --warmup >= 0, --threads >= 1")
    if any(c in LAYOUTS and args.batch % LAYOUTS[c].dp for c in args.cases):
        parser.error(f"--batch {args.batch} must be divisible by the data-parallel size of every case (2)")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    if args.child_hf:
        print(json.dumps(run_hf(args.child_hf, args.batch, args.seq, args.iters, args.warmup,
                                args.precision, args.threads)))
        return 0

    from core.distributed import init_ray

    wall0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dualrl-bench-") as tmp:
        model_path, tokenizer_path = prepare_model(args.model, Path(tmp))
        args.vocab = vocab_size(model_path)
        tokenizer = load_tokenizer(tokenizer_path)
        tokens = int(make_batch(args.batch, args.seq, args.vocab)["input_lengths"].sum())
        if any(c in LAYOUTS for c in args.cases):
            init_ray(num_cpus=max(4, args.threads))  # 4: room for any 2-bundle group
        results = [run_case(c, model_path, tokenizer_path, tokenizer, args) for c in args.cases]
    params = next((r.get("params") for r in results if r.get("params")), None)
    print(report(results, args, tokens, params))
    print(f"\nbenchmark wall time {time.perf_counter() - wall0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": tokens, "args": {k: v for k, v in vars(args).items() if k != "child_hf"},
                       "results": results}, f, indent=2)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
