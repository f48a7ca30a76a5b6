"""The HF eager baseline and the torch Policy runner of ``dualrl bench`` (``benchmarks.compare``).

    python -m benchmarks.torch_backends [dualrl bench options]
        = dualrl bench --sections throughput --layouts <the torch layouts below> --model llama_bench --seq 256

Every case runs the same model on the same batch (right-padded random ids with ragged
lengths, seed 0) in one invocation and is reported as tokens/s and as a ratio to the
``hf`` case of this same run:

* ``hf``: ``AutoModelForCausalLM`` in a child process of its own (its threads and memory are
  its alone; the driver sends it one line per call and it answers with the seconds the call
  took).  logprobs = one no-grad forward over the whole batch + ``log_softmax``/``gather``;
  train = forward + token-mean NLL + backward + grad-norm clip + AdamW step, with the
  optimizer kwargs and ``max_grad_norm`` of ``core/configs/default.yaml`` as the workers
  (and their defaults: fused AdamW on CUDA, the float32 matmul precision of
  ``policy.matmul_precision``).
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
from pathlib import Path

from benchmarks.layouts import Layout, parse_layout

#: RNG seed of the batch: the driver and the hf subprocess build identical batches from it.
SEED = 0


LAYOUTS: dict[str, Layout] = {
    name: parse_layout(name)
    for name in ("fsdp1-dp1", "dtensor-dp1", "fsdp1-dp2", "dtensor-dp2", "dtensor-tp2", "dtensor-tp2-sp")
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


def policy_config(
    model_path: str,
    tokenizer_path: str,
    layout: Layout,
    batch: int,
    seq: int,
    precision: str,
    micro: int | None = None,
    packing: dict | None = None,
) -> dict:
    """The default policy section on this model, width ``seq``; micro batches of ``micro`` rows
    per rank (default: one micro batch of all the rank's rows); ``packing`` updates
    ``sequence_packing`` (``benchmarks.packing``)."""
    cfg = default_policy_section()
    local = min(micro or batch, batch // layout.dp)
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
    cfg["dtensor_cfg"].update(tensor_parallel_size=layout.tp, sequence_parallel=layout.sp, compile=layout.compiled)
    if layout.backend == "torch_dtensor":
        cfg["dtensor_cfg"]["context_parallel_size"] = layout.cp
    if layout.cp > 1:
        cfg["make_sequence_length_divisible_by"] = layout.sequence_multiple
    if layout.packed:  # packed rows of at most one padded micro batch's tokens
        cfg["sequence_packing"].update(enabled=True, train_mb_tokens=local * seq, logprob_mb_tokens=local * seq)
    if packing:
        cfg["sequence_packing"].update(packing)
    return cfg


# ----------------------------------------------------------------------------- hf case (child process)


def on_cuda(args) -> bool:
    """Whether this run measures on a CUDA GPU (``--device cuda``) rather than the CPU."""
    return getattr(args, "device", "cpu") == "cuda"


def _hf_steps(model, data, precision: str, micro: int | None = None):
    """(logprobs step, train step) closures: plain HF forward / forward+backward+AdamW, over
    micro batches of ``micro`` rows (gradients accumulated; default: the whole batch at once)."""
    import torch

    cfg = default_policy_section()
    device = next(model.parameters()).device
    data = data.to(device)
    ids = data["input_ids"]
    mask = (torch.arange(ids.shape[1])[None, :] < data["input_lengths"][:, None]).long()
    token_mask = data["token_mask"][:, 1:]
    from backends.torch_common.optim import with_default_kernel

    # The workers' kernel choice (fused AdamW on CUDA unless the config says otherwise).
    optimizer = torch.optim.AdamW(
        model.parameters(), **with_default_kernel(torch.optim.AdamW, cfg["optimizer"]["kwargs"], device.type)
    )
    max_norm = cfg["max_grad_norm"]

    rows = ids.shape[0]
    chunks = [slice(i, i + (micro or rows)) for i in range(0, rows, micro or rows)]

    def next_token_logprobs(part: slice):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            logits = model(input_ids=ids[part], attention_mask=mask[part], use_cache=False).logits
        return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[part, 1:, None])[..., 0]

    def logprobs():
        model.eval()
        with torch.no_grad():
            return torch.cat([next_token_logprobs(part) * token_mask[part] for part in chunks])

    def train():
        model.train()
        optimizer.zero_grad(set_to_none=True)
        total = token_mask.sum()
        for part in chunks:  # token-mean over the whole batch, as the workers' global normaliser
            loss = -(next_token_logprobs(part) * token_mask[part]).sum() / total
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

    from backends.torch_common.precision import apply_matmul_precision

    torch.set_num_threads(args.threads)
    # The float32 matmul / TF32 settings the workers apply for this precision (no TF32 in fp32).
    apply_matmul_precision({**default_policy_section(), "precision": args.precision})
    device = torch.device("cuda" if on_cuda(args) else "cpu")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    steps = _hf_steps(
        model, make_batch(args.batch, args.seq, model.config.vocab_size), args.precision, getattr(args, "micro", None)
    )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    params = sum(p.numel() for p in model.parameters())
    print("@@" + json.dumps({"threads": torch.get_num_threads(), "params": params}), flush=True)
    for line in sys.stdin:
        op = line.strip()
        if op == "quit":
            break
        sync()
        t0 = time.perf_counter()
        steps[op]()
        sync()
        reply = {"seconds": time.perf_counter() - t0}
        if device.type == "cuda":
            reply["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        print("@@" + json.dumps(reply), flush=True)


class HFRunner:
    """The ``hf`` case: a child process running :func:`serve_hf`, timed by itself (pure compute)."""

    name, workers = "hf", 1

    def __init__(self, model_path: str, args) -> None:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.torch_backends",
            "--child-hf",
            model_path,
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
            "--precision",
            args.precision,
            "--threads",
            str(args.threads),
            "--device",
            getattr(args, "device", "cpu"),
            *(["--micro", str(args.micro)] if getattr(args, "micro", None) else []),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
        self._stderr = tempfile.TemporaryFile(mode="w+")
        t0 = time.perf_counter()
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env
        )
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
        self.last_reply = self._reply()  # on a GPU also its peak allocated bytes
        return self.last_reply["seconds"]

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
        layout = LAYOUTS.get(name) or parse_layout(name)
        self.name, self.workers = name, layout.workers
        micro = getattr(args, "micro", None)
        cfg = policy_config(
            model_path,
            tokenizer_path,
            layout,
            args.batch,
            args.seq,
            args.precision,
            micro,
            getattr(args, "packing", None),
        )
        cpus = max(1, args.threads // layout.workers)
        self._start(name, cfg, tokenizer, args, layout.workers, cpus, cfg["train_micro_batch_size"])
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
        name = f"{name}{getattr(args, 'tag', '')}"  # a tag tells apart two Policies of one layout
        self._cluster = RayVirtualCluster(
            [workers], use_gpus=on_cuda(args), num_cpus_per_bundle=cpus_per_worker, name=f"bench-{name}"
        )
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


def _new_result(runner) -> dict:
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


# ----------------------------------------------------------------------------- report


def median(times) -> float | None:
    return statistics.median(times) if times else None


def ratio(r: dict, hf: dict | None, op: str, stat=statistics.median) -> float | None:
    """case tokens/s ÷ hf tokens/s = hf seconds ÷ case seconds, against the case's own paired
    hf calls (the hf row: against itself)."""
    mine = r.get(f"{op}_s")
    base = r.get(f"hf_{op}_s") or (hf or {}).get(f"{op}_s")
    return stat(base) / stat(mine) if mine and base else None


def _threads(result: dict) -> str:
    threads = result.get("threads")
    if not threads:
        return "?"
    return str(threads[0]) if len(set(threads)) == 1 else "/".join(map(str, threads))


def _spread(times: list[float] | None) -> str:
    if not times:
        return "-"
    return f"{statistics.median(times):.3f} [{min(times):.3f}, {max(times):.3f}]"


# ----------------------------------------------------------------------------- driver


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
    """``dualrl bench`` on the torch layouts, throughput only (``--child-hf``: the HF child)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--child-hf", metavar="MODEL_PATH")
    known, rest = parser.parse_known_args(argv)
    if known.child_hf:
        child = argparse.ArgumentParser()
        for name, kind in (("batch", int), ("seq", int), ("threads", int), ("micro", int)):
            child.add_argument(f"--{name}", type=kind)
        child.add_argument("--precision")
        child.add_argument("--device", default="cpu")
        serve_hf(known.child_hf, child.parse_args(rest))
        return 0
    from benchmarks import compare

    return compare.main(
        ["--sections", "throughput", "--layouts", *LAYOUTS, "--model", "llama_bench", "--seq", "256", *rest],
        prog="python -m benchmarks.torch_backends",
    )


if __name__ == "__main__":
    sys.exit(main())
