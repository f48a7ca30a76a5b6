"""SFT and DPO training throughput of dualrl's backends vs TRL's ``SFTTrainer`` / ``DPOTrainer``.

    python -m benchmarks.trl_compare [--algorithms sft dpo] [--layouts fsdp1-dp2 dtensor-dp2 jax-fsdp2 dtensor-dp1]
        [--batch 64] [--micro M] [--steps 8] [--warmup 2] [--threads 2] [--model PATH] [--json OUT]

One run, one machine, one model, one set of token ids.  Each row is reported as tokens/s
and as a ratio to TRL measured alongside it (×TRL):

* Model: by default the project's built-in tiny Llama (``arithmetic-llama`` of
  :mod:`core.models.builtin`, random init with seed 0, *no* warm start) saved once as a
  local HF checkpoint in a temporary directory, with the character tokenizer of
  :mod:`core.models.char_tokenizer` next to it.  ``--model PATH``: any local HF model
  directory (tokenizer in it or in ``PATH/tokenizer``).
* Data: problems ``0 .. n-1`` (seed 0) of the built-in sources "arithmetic" (SFT) and
  "arithmetic-preferences" (DPO: chosen = the right answer, rejected = a plausible slip),
  encoded by the project's own data path (``core.datasets.examples``, as ``dualrl sft`` /
  ``dualrl dpo`` do): prompt ids (``<s>`` + the problem) + answer ids + eos, loss on answer +
  eos only.  The ids are built once in this driver; the TRL process gets exactly these lists
  (a JSON file), the dualrl Policy the right-padded batch the loops build
  (``core.algorithms.sft.sequence_batch`` / ``core.algorithms.dpo.preference_batch``).  ``--batch`` counts
  *sequences* per optimizer step for both algorithms: SFT ``batch`` examples, DPO ``batch / 2`` pairs
  (= ``batch`` rows: dualrl lays them out chosen at even / rejected at odd rows, TRL's
  collator chosen half / rejected half).  Every step trains on the same batch.
* TRL (``trl``): ``SFTTrainer`` / ``DPOTrainer`` in a child process of its own, one per
  algorithm, alive through all layouts.  SFT gets a pre-tokenized dataset (``input_ids`` +
  ``completion_mask``, ``completion_only_loss=True``: TRL turns it into ``labels`` with -100
  on the prompt); DPO gets ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``.  Before the
  first step the child collates the whole batch with the trainer's own collator and checks
  that it holds exactly our rows and loss masks (reported as "same rows/masks").
  Settings: ``use_cpu``, fp32 (``bf16=False``), ``gradient_checkpointing=False`` (TRL
  defaults to ``True``), no packing, no padding-free, no eval / logging / saving / tqdm,
  ``max_length=None`` (no truncation), the optimizer passed in as ``torch.optim.AdamW(**the
  kwargs of core/configs/default.yaml)`` over all parameters, as dualrl's workers build it
  (TRL's own ``create_optimizer`` would exempt biases and norms from weight decay), with a
  constant LR (``LambdaLR(1.0)``), the same ``max_grad_norm``; DPO: sigmoid loss, ``beta`` = dualrl's
  ``reference_policy_kl_penalty``,
  ``precompute_ref_log_probs=False`` (TRL's default: a no-grad forward of a separate frozen
  reference model inside every step).
* dualrl (``fsdp1-*``, ``dtensor-*``, ``jax-*``): a :class:`core.policy.Policy` on a fresh
  :class:`RayVirtualCluster`, a new one for each (layout, algorithm), so that every
  algorithm starts from the same initial weights as TRL and ``max_total_sequence_length``
  is that algorithm's padded width (the JAX backend pads to its length bucket; the width
  itself is then the bucket).  The default policy section with ``scheduler: null``
  (constant LR, as TRL here), one optimizer step per call (``gbs = batch``).  SFT step =
  ``policy.train(batch, NLLLoss())``.  DPO step = ``policy.get_reference_policy_logprobs``
  + ``policy.train(batch + reference_policy_logprobs, DPOLossFn)`` (beta 0.1, no SFT term,
  summed log-probs = TRL's sigmoid DPO): the reference pass is timed as part of the step,
  as TRL's is.  Torch layouts: :data:`benchmarks.torch_backends.LAYOUTS`; JAX layouts
  ``jax-fsdp{F}[-tp{T}]`` as in :mod:`benchmarks.jax_backend` (one actor owning ``F x T``
  XLA host devices; Ray is started with ``XLA_FLAGS`` set, and restarted for another device
  count, by that module's ``RaySession``).
* Micro batch: ``--micro M`` = rows per forward/backward on one data-parallel rank (a
  torch worker, an XLA device, the TRL process).  Default: the whole local batch (TRL: all
  ``batch`` rows in one forward; dp2: ``batch / 2`` rows per rank; ``jax-fsdp2``: one
  ``batch``-row micro batch whose rows are split over the 2 devices).  TRL: ``M`` rows per
  micro batch, ``batch / M`` gradient-accumulation steps (DPO: ``M / 2`` pairs).

Methodology (as :mod:`benchmarks.torch_backends` / :mod:`benchmarks.jax_backend`):

* tokens/s = real (non-pad) tokens of one step's batch (identical for both frameworks) /
  median step seconds over ``--steps`` timed steps, after ``--warmup`` untimed ones (the
  first dualrl step of a JAX layout compiles; the first TRL step allocates AdamW state).
  TRL step = ``on_step_begin`` -> ``on_step_end`` of a ``TrainerCallback`` (after the
  batch was fetched and collated; forward, loss, backward, clip, AdamW, scheduler,
  ``zero_grad`` and TRL's per-step metrics inside).  The callback blocks the trainer in
  ``on_step_end`` until the driver asks for the next step, so trainer construction and
  the waits are excluded; "TRL loop s" (driver's go -> ``on_step_end``: also
  ``_maybe_log_save_evaluate``, the epoch bookkeeping and fetching + collating the next
  batch) is reported too.  dualrl step = wall time on the driver around the Policy calls
  (Ray dispatch, sharding, the driver-side input checks, result collection included: what
  a user sees); Policy start-up is excluded.
* Pairing: every dualrl step is immediately followed by one TRL step of the same
  algorithm, so both see the same background load; ×TRL of a layout = median of its
  paired TRL steps / its median step (the TRL row pools all its timed paired steps).  The
  ratio from the fastest steps (min) is printed too.  The load average is printed.
* Threads: ``--threads T`` (default 2 = this machine's cores) per case.  TRL:
  ``torch.set_num_threads(T)`` in its process; a 2-worker torch layout gets Ray bundles of
  ``T/2`` CPUs (Ray sets ``OMP_NUM_THREADS``, torch follows); a JAX layout one bundle of
  ``T`` CPUs whose XLA pool is pinned to ``T`` cores when the machine has more.  On a
  2-core machine dp2 is *not* extra hardware, only the same cores split into two processes
  plus gloo collectives; ``dtensor-dp1`` (one worker with all ``T`` threads, in the
  default set) does TRL's single-process computation, so its ratio is framework overhead.
* Step-1 check: the first step of every fresh dualrl Policy and of each TRL trainer runs
  on the same initial weights and batch, so their loss and pre-clip gradient norm must
  agree (to float32 reduction-order noise); both are printed.  For DPO the first loss is
  log 2 on both sides (policy = reference), the gradient norm is the informative number.

Caveats, plainly:

* Not bit-identical computations.  TRL patches a *fused LM head* onto the model
  (``trl.trainer.utils.add_fused_lm_head``): log-probs are computed in chunks from the
  last hidden states without materialising the ``[B, S, V]`` logits, and it computes
  entropy / top-1 / mean-logit metrics per token on the way (plus a handful of ``.item()``
  syncs per step); dualrl's workers build the full logits and take ``log_softmax``.  With
  vocab 32 this is noise; with a large vocab (``--model``) it favours TRL's memory and
  maybe its speed.  There is no TRL switch to turn it off.
* TRL's ``DPOTrainer`` (1.16) has no pre-tokenized input path: its ``_prepare_dataset``
  always extracts a prompt from text and tokenizes.  The TRL child therefore overrides
  that (private) method to return the pre-tokenized dataset unchanged; the collator,
  loss and training loop are TRL's own.  ``SFTTrainer`` takes pre-tokenized data natively.
* TRL's reference is a second full model in the same process, run inside the training
  step.  dualrl keeps the reference weights on the host and puts them in place of the
  policy's for a separate ``get_reference_policy_logprobs`` call (torch: copied into the
  local shards and back; JAX: ``device_put``), so its DPO step is two Ray round trips, and
  the reference log-probs travel to the driver and back.
* Padding: the whole batch is one TRL micro batch by default and is padded to its
  longest row, the same width as dualrl's batch.  With ``--micro`` TRL's random sampler
  draws different micro batches each step, each padded to its own longest row, while
  dualrl's micro batches are fixed slices of one padded batch.
* Tiny model, short sequences (~10 tokens): the default measures framework overhead per
  step (Python, Ray, collectives, TRL's trainer loop) far more than FLOPs.
* Only a quiet machine gives meaningful ratios.  Pairing evens out slow drifts, not
  oversubscription: when other processes take cores, a process running 2 OpenMP threads
  (TRL, ``dtensor-dp1``) loses far more than single-threaded workers (its threads wait on
  each other at every parallel region), and the ratios swing by several x.  Check the
  load average line; above the core count, rerun.
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
from benchmarks.layouts import Layout
from benchmarks.markdown import cell

ALGORITHMS = ("sft", "dpo")
DEFAULT_LAYOUTS = ["fsdp1-dp2", "dtensor-dp2", "jax-fsdp2", "dtensor-dp1"]
BUILTIN_MODEL = "arithmetic-llama"
#: Problem stream and model init seed.
SEED = 0
#: dualrl's DPO loss = TRL's ``loss_type=["sigmoid"]`` with ``beta = reference_policy_kl_penalty``.
DPO_LOSS_CFG = {
    "reference_policy_kl_penalty": 0.1,
    "preference_loss_weight": 1.0,
    "sft_loss_weight": 0.0,
    "preference_average_log_probs": False,
    "sft_average_log_probs": False,
}
#: Relative tolerance of the step-1 loss / gradient-norm check.
CHECK_RTOL = 1e-4


def trl_version() -> str | None:
    """The installed trl version, or ``None`` when trl is not importable."""
    try:
        import trl
    except Exception:  # noqa: BLE001 -- missing, or broken against this torch/transformers
        return None
    return trl.__version__


# ----------------------------------------------------------------------------- model


def build_builtin_model(path: Path) -> Path:
    """The built-in tiny Llama's shape, random init (seed 0), saved with its tokenizer in ``path``."""
    from core.models.builtin import BUILTIN_MODELS, write_random_init

    shape, _ = BUILTIN_MODELS[BUILTIN_MODEL]  # the shape only: random init, no warm start
    return write_random_init(shape, path, seed=SEED)


def prepare_model(model: str, root: Path) -> tuple[str, str]:
    """``(model dir, tokenizer dir)``: the built-in model is built under ``root``."""
    if model == BUILTIN_MODEL:
        path = build_builtin_model(root / BUILTIN_MODEL)
        return str(path), str(path)
    if not Path(model).is_dir():
        raise SystemExit(f"--model {model!r}: not {BUILTIN_MODEL!r} and not a local HF model directory")
    tok_dir = Path(model) / "tokenizer"
    return model, str(tok_dir) if tok_dir.is_dir() else model


def count_params(model_path: str) -> int:
    """Parameters of the model, counted on the meta device (nothing is allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- data (built once)


def build_examples(tokenizer, algorithm: str, batch: int) -> list:
    """One step's examples, encoded by the project's own data path (the built-in sources and
    :mod:`core.datasets.examples`, as ``dualrl sft`` / ``dualrl dpo`` encode them): SFT ``batch``
    ``SequenceDatum``s of "arithmetic", DPO ``batch // 2`` ``PreferenceDatum``s of
    "arithmetic-preferences" (rejected = a plausible slip), problems 0.. of seed ``SEED``."""
    from core.datasets.examples import PreferenceEncoder, SFTEncoder
    from core.datasets.sources import builtin_task, problem_row

    if algorithm == "sft":
        encoder, task, n = SFTEncoder({"response_key": "answer"}, tokenizer, 1 << 16), "arithmetic", batch
    else:
        encoder, task, n = PreferenceEncoder({}, tokenizer, 1 << 16), "arithmetic-preferences", batch // 2
    source = builtin_task(task, None)
    return [encoder.encode(problem_row(source.problem(SEED, i)), i, f"built-in {task}") for i in range(n)]


def rows(algorithm: str, examples: list) -> list[tuple[list[int], list[int]]]:
    """``(ids, loss mask)`` per sequence, in dualrl's row order (DPO: chosen, rejected, ...)."""
    sides = examples if algorithm == "sft" else [s for pair in examples for s in (pair.chosen, pair.rejected)]
    return [(list(s.input_ids), list(s.token_mask)) for s in sides]


def trl_examples(algorithm: str, examples: list) -> list[dict]:
    """The same token ids in TRL's pre-tokenized fields: SFT ``input_ids`` + ``completion_mask``;
    DPO ``prompt_ids`` (the tokens before the loss mask) + ``chosen_ids`` / ``rejected_ids``."""
    if algorithm == "sft":
        return [{"input_ids": list(e.input_ids), "completion_mask": list(e.token_mask)} for e in examples]
    out = []
    for pair in examples:
        start = pair.chosen.token_mask.index(1)
        assert pair.rejected.input_ids[:start] == pair.chosen.input_ids[:start], "sides must share the prompt"
        out.append(
            {
                "prompt_ids": list(pair.chosen.input_ids[:start]),
                "chosen_ids": list(pair.chosen.input_ids[start:]),
                "rejected_ids": list(pair.rejected.input_ids[start:]),
            }
        )
    return out


def to_batch(algorithm: str, examples: list, pad_id: int):
    """Right-padded ``BatchedDataDict`` as the loops build it (``core.algorithms.sft`` / ``dpo``)."""
    from core.algorithms.dpo import preference_batch
    from core.algorithms.sft import sequence_batch

    return (sequence_batch if algorithm == "sft" else preference_batch)(examples, pad_id)


def batch_facts(seqs) -> dict:
    return {
        "rows": len(seqs),
        "width": max(len(ids) for ids, _ in seqs),
        "real_tokens": sum(len(ids) for ids, _ in seqs),
        "loss_tokens": sum(sum(m) for _, m in seqs),
    }


# ----------------------------------------------------------------------------- TRL (child process)


def _trainer_classes():
    """``SFTTrainer`` / ``DPOTrainer`` subclasses that record each step's loss and pre-clip
    gradient norm (for the step-1 check); the DPO one takes pre-tokenized pairs as is."""
    from trl import DPOTrainer, SFTTrainer

    class Recording:
        _bench_loss, _bench_grad_norm = 0.0, None

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self._bench_loss += float(loss)  # summed over the micro batches of a step
            return loss

        def _clip_grad_norm(self, model):
            norm = super()._clip_grad_norm(model)
            self._bench_grad_norm = float(norm)
            return norm

    class SFT(Recording, SFTTrainer):
        pass

    class DPO(Recording, DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            # trl 1.16's DPOTrainer always tokenizes text; our dataset is already
            # prompt_ids / chosen_ids / rejected_ids, which its collator takes as is.
            return dataset

    return SFT, DPO


def _check_collated(trainer, algorithm: str, spec: dict) -> dict:
    """Collate the whole prepared dataset with the trainer's own collator and compare its
    rows and loss masks with ours (order-free: TRL's sampler shuffles)."""
    import torch

    dataset = trainer.train_dataset
    features = [dataset[i] for i in range(len(dataset))]
    if algorithm == "sft":
        features = [{k: f[k] for k in ("input_ids", "labels")} for f in features]
    out = trainer.data_collator(features)
    ids, attention = out["input_ids"], out["attention_mask"]
    if algorithm == "sft":
        # labels[t] != -100 <=> token t is a target (the shift happens in the model)
        loss_mask = (out["labels"] != -100).long()
    else:
        loss_mask = out["completion_mask"]
    theirs = []
    for i in range(ids.shape[0]):
        n = int(attention[i].sum())
        if not bool((attention[i, :n] == 1).all()):
            raise RuntimeError("TRL's collator produced a non right-padded row")
        theirs.append((ids[i, :n].tolist(), loss_mask[i, :n].tolist()))
    ours = [(list(a), list(b)) for a, b in spec["rows"]]
    return {
        "same_rows_and_masks": sorted(theirs) == sorted(ours),
        "width": int(ids.shape[1]),
        "real_tokens": int(attention.sum()),
        "loss_tokens": int(loss_mask.sum()),
        "padded_tokens": int(torch.numel(ids)),
    }


class _Stop(Exception):
    """The driver said quit (or went away): leave ``trainer.train()``."""


def _emit(payload: dict) -> None:
    print("@@" + json.dumps(payload), flush=True)


def serve_trl(spec_path: str) -> None:
    """Runs in the TRL child: build the trainer from the spec, then run one training step per
    ``step`` line on stdin (answering with its timings) until ``quit``."""
    t0 = time.perf_counter()
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    algorithm, batch, micro = spec["algorithm"], spec["batch"], spec["micro"]
    transformers.logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_path"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    opt_kwargs = dict(spec["optimizer_kwargs"])
    opt_kwargs["betas"] = tuple(opt_kwargs["betas"])
    optimizer = torch.optim.AdamW(model.parameters(), **opt_kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: 1.0)
    common = dict(
        output_dir=spec["output_dir"],
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        max_steps=10**6,
        gradient_accumulation_steps=batch // micro,
        max_grad_norm=spec["max_grad_norm"],
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        seed=SEED,
        max_length=None,
        learning_rate=opt_kwargs["lr"],
        weight_decay=opt_kwargs["weight_decay"],
        adam_beta1=opt_kwargs["betas"][0],
        adam_beta2=opt_kwargs["betas"][1],
        adam_epsilon=opt_kwargs["eps"],
    )
    sft_cls, dpo_cls = _trainer_classes()
    state: dict = {}

    class Gate(TrainerCallback):
        """Holds the trainer between steps until the driver says ``step``; times each step."""

        def _wait(self) -> None:
            line = sys.stdin.readline().strip()
            if line != "step":
                raise _Stop
            state["go"] = time.perf_counter()
            state["trainer"]._bench_loss = 0.0

        def on_train_begin(self, args, st, control, **kwargs):
            _emit({**state["ready"], "startup_s": time.perf_counter() - t0})
            self._wait()

        def on_step_begin(self, args, st, control, **kwargs):
            state["begin"] = time.perf_counter()

        def on_step_end(self, args, st, control, **kwargs):
            end, trainer = time.perf_counter(), state["trainer"]
            _emit(
                {
                    "step_s": end - state["begin"],
                    "loop_s": end - state["go"],
                    "loss": trainer._bench_loss,
                    "grad_norm": trainer._bench_grad_norm,
                }
            )
            self._wait()

    if algorithm == "sft":
        config = trl.SFTConfig(
            **common, per_device_train_batch_size=micro, completion_only_loss=True, packing=False, padding_free=False
        )
        trainer = sft_cls(
            model=model,
            args=config,
            train_dataset=Dataset.from_list(spec["examples"]),
            processing_class=tokenizer,
            optimizers=(optimizer, scheduler),
            callbacks=[Gate()],
        )
    else:
        ref_model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
        config = trl.DPOConfig(
            **common,
            per_device_train_batch_size=micro // 2,
            beta=spec["beta"],
            loss_type=["sigmoid"],
            precompute_ref_log_probs=False,
            padding_free=False,
        )
        trainer = dpo_cls(
            model=model,
            ref_model=ref_model,
            args=config,
            train_dataset=Dataset.from_list(spec["examples"]),
            processing_class=tokenizer,
            optimizers=(optimizer, scheduler),
            callbacks=[Gate()],
        )
    state["trainer"] = trainer
    state["ready"] = {
        "threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "attn_implementation": model.config._attn_implementation,
        "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
        "check": _check_collated(trainer, algorithm, spec),
    }
    try:
        trainer.train()
    except _Stop:
        pass


class TRLRunner(tb.HFRunner):
    """A TRL trainer in a child process (``serve_trl``); ``step()`` returns its timings.
    ``_reply`` / ``close`` are ``torch_backends.HFRunner``'s."""

    def __init__(self, algorithm: str, spec: dict, root: Path, threads: int) -> None:
        self.name, self.algorithm, self.workers = "trl", algorithm, 1
        spec_path = root / f"trl-{algorithm}.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "benchmarks.trl_compare", "--child-trl", str(spec_path)]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false",
            "TRANSFORMERS_VERBOSITY": "error",
            "ACCELERATE_DISABLE_RICH": "1",
        }
        import subprocess

        self._stderr = tempfile.TemporaryFile(mode="w+")
        t0 = time.perf_counter()
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
            cwd=str(Path(__file__).resolve().parent.parent),
        )
        self.ready = self._reply()
        self.startup_s = time.perf_counter() - t0
        self.threads = [self.ready["threads"]]

    def step(self) -> dict:
        self._proc.stdin.write("step\n")
        self._proc.stdin.flush()
        return self._reply()


# ----------------------------------------------------------------------------- dualrl


def is_jax(name: str) -> bool:
    return jb.jax_layout(name) is not None


def layout_workers(name: str) -> int:
    return 1 if is_jax(name) else tb.LAYOUTS[name].workers


class DualRLRunner(tb.PolicyRunner):
    """One algorithm on one layout: a Policy on a cluster of its own; steps timed on the driver.
    Its own start-up (per-algorithm loss and reference model); ``close`` is the torch runner's."""

    def __init__(
        self, name: str, algorithm: str, data, width: int, model_path: str, tokenizer_path: str, tokenizer, args
    ) -> None:
        from core.distributed import RayVirtualCluster
        from core.losses import DPOLossFn, NLLLoss
        from core.policy import Policy

        self.name, self.algorithm, self._data = name, algorithm, data
        jax = jb.jax_layout(name)
        if jax:
            layout, workers, cpus = Layout(name, "jax_pjit"), 1, args.threads
            self.mbs = args.micro * jax.dp if args.micro else args.batch  # rows split over fsdp
        else:
            layout = tb.LAYOUTS[name]
            workers, cpus = layout.workers, max(1, args.threads // layout.workers)
            self.mbs = args.micro or args.batch // layout.dp
        cfg = tb.policy_config(model_path, tokenizer_path, layout, args.batch, width, "float32")
        cfg.update(train_micro_batch_size=self.mbs, logprob_batch_size=self.mbs, scheduler=None)
        if jax:
            cfg["jax_cfg"].update(fsdp_size=jax.dp, tensor_parallel_size=jax.tp)
        self.optimizer_kwargs, self.max_grad_norm = cfg["optimizer"]["kwargs"], cfg["max_grad_norm"]
        self.workers = workers
        self._loss = NLLLoss() if algorithm == "sft" else DPOLossFn(DPO_LOSS_CFG)
        self._cluster = RayVirtualCluster(
            [workers], use_gpus=False, num_cpus_per_bundle=cpus, name=f"trlcmp-{name}-{algorithm}"
        )
        self._policy, self.pinned = None, None
        try:
            t0 = time.perf_counter()
            self._policy = Policy(
                self._cluster,
                cfg,
                tokenizer,
                name_prefix=f"trlcmp-{name}-{algorithm}",
                init_reference_model=algorithm == "dpo",
            )
            self.startup_s = time.perf_counter() - t0
            self.noop_s = tb.noop_round_trip(self._policy)
            infos = self._policy.get_gpu_info()
            if jax:
                info = infos[0]
                if info["local_devices"] != jax.devices:
                    raise RuntimeError(f"the actor sees {info['local_devices']} devices, {name} needs {jax.devices}")
                allowed = sorted(os.sched_getaffinity(info["pid"]))
                if args.threads < len(allowed):  # XLA sizes its pool to the affinity mask (see jax_backend)
                    self.pinned = set(allowed[: args.threads])
                    jb.pin_process(info["pid"], self.pinned)
                self.threads = [jb.thread_names(info["pid"])[jb.XLA_POOL_THREAD] or None]
            else:
                self.threads = [info.get("torch_num_threads") for info in infos]
        except BaseException:
            self.close()
            raise

    def step(self) -> dict:
        """One optimizer step (DPO: reference pass + step); seconds, loss and grad norm."""
        from core.data import BatchedDataDict

        t0 = time.perf_counter()
        ref_s = None
        data = self._data
        if self.algorithm == "dpo":
            ref = self._policy.get_reference_policy_logprobs(data)["reference_logprobs"]
            ref_s = time.perf_counter() - t0
            data = BatchedDataDict({**data, "reference_policy_logprobs": ref})
        out = self._policy.train(data, self._loss, gbs=data.size, mbs=self.mbs)
        seconds = time.perf_counter() - t0
        return {
            "step_s": seconds,
            "ref_s": ref_s,
            "loss": float(out["loss"][0]),
            "grad_norm": float(out["grad_norm"][0]),
        }

    def compile_counts(self) -> dict | None:
        if not is_jax(self.name):
            return None
        group = self._policy.worker_group
        return group.get_all_worker_results(group.run_all_workers_single_data("get_compile_counts"))[0]


# ----------------------------------------------------------------------------- schedule


def _error(err: BaseException) -> str:
    traceback.print_exc()
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[-1] if text else ''}"


def _trl_spec(algorithm: str, examples, seqs, model_path, tokenizer_path, root: Path, args, dual_cfg: dict) -> dict:
    return {
        "algorithm": algorithm,
        "examples": examples,
        "rows": seqs,
        "model_path": model_path,
        "tokenizer_path": tokenizer_path,
        "threads": args.threads,
        "batch": args.batch,
        "micro": args.micro or args.batch,
        "optimizer_kwargs": dual_cfg["optimizer"]["kwargs"],
        "max_grad_norm": dual_cfg["max_grad_norm"],
        "beta": DPO_LOSS_CFG["reference_policy_kl_penalty"],
        "output_dir": str(root / f"trl-{algorithm}-out"),
    }


class _TRLSide:
    """The TRL row of one algorithm and its child; a failing child is reported once and then left out."""

    def __init__(self, algorithm: str, spec: dict | None, root: Path, threads: int) -> None:
        self.row: dict = {"case": "trl", "workers": 1, "step_s": [], "loop_s": [], "first": None}
        self.runner = None
        if spec is None:
            return
        print(f"[trl_compare] starting TRL {algorithm} ...", file=sys.stderr, flush=True)
        try:
            self.runner = TRLRunner(algorithm, spec, root, threads)
            self.row.update(threads=self.runner.threads, startup_s=self.runner.startup_s, ready=self.runner.ready)
        except Exception as err:  # noqa: BLE001 -- report it; the dualrl rows can still run
            self.row["error"] = _error(err)

    def step(self, timed: bool) -> dict | None:
        if self.runner is None or "error" in self.row:
            return None
        try:
            out = self.runner.step()
        except Exception as err:  # noqa: BLE001
            self.row["error"] = _error(err)
            return None
        self.row["first"] = self.row["first"] or out
        if timed:
            self.row["step_s"].append(out["step_s"])
            self.row["loop_s"].append(out["loop_s"])
        return out

    def close(self) -> None:
        if self.runner is not None:
            try:
                self.runner.close()
            except Exception as err:  # noqa: BLE001
                self.row.setdefault("error", _error(err))


def _run_layout(
    name: str,
    algorithm: str,
    session,
    data,
    facts: dict,
    trl: _TRLSide,
    model_path: str,
    tokenizer_path: str,
    tokenizer,
    args,
) -> dict:
    """One Policy for one algorithm: warm-up + timed steps, each followed by one TRL step."""
    row = {"case": name, "workers": layout_workers(name), "step_s": [], "ref_s": [], "trl_step_s": [], "trl_loop_s": []}
    if is_jax(name) and not session.fits(jb.jax_layout(name).devices):
        row["skipped"] = (
            f"needs {jb.jax_layout(name).devices} XLA host devices per actor; the caller's Ray gives {session.devices}"
        )
        return row
    print(f"[trl_compare] starting {name} {algorithm} ...", file=sys.stderr, flush=True)
    try:
        session.start(jb.jax_layout(name).devices if is_jax(name) else None)
        runner = DualRLRunner(name, algorithm, data, facts["width"], model_path, tokenizer_path, tokenizer, args)
    except Exception as err:  # noqa: BLE001 -- report it and go on with the other layouts
        row["error"] = _error(err)
        return row
    try:
        row.update(
            threads=runner.threads,
            startup_s=runner.startup_s,
            noop_s=runner.noop_s,
            pinned=sorted(runner.pinned) if runner.pinned else None,
        )
        for i in range(args.warmup + args.steps):
            timed = i >= args.warmup
            mine = runner.step()
            theirs = trl.step(timed)
            row["first"] = row.get("first") or mine
            if not timed:
                continue
            row["step_s"].append(mine["step_s"])
            if mine["ref_s"] is not None:
                row["ref_s"].append(mine["ref_s"])
            if theirs is not None:
                row["trl_step_s"].append(theirs["step_s"])
                row["trl_loop_s"].append(theirs["loop_s"])
        row["compile_counts"] = runner.compile_counts()
    except Exception as err:  # noqa: BLE001
        row["error"] = _error(err)
    finally:
        runner.close()
    return row


def run_algorithm(
    algorithm: str, layouts: list[str], session, model_path: str, tokenizer_path: str, tokenizer, root: Path, args
) -> dict:
    """The TRL child of this algorithm lives throughout; the layouts' Policies one at a time."""
    examples = build_examples(tokenizer, algorithm, args.batch)
    seqs = rows(algorithm, examples)
    facts = batch_facts(seqs)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    data = to_batch(algorithm, examples, pad_id)
    spec = (
        _trl_spec(
            algorithm,
            trl_examples(algorithm, examples),
            seqs,
            model_path,
            tokenizer_path,
            root,
            args,
            tb.default_policy_section(),
        )
        if args.trl
        else None
    )
    trl = _TRLSide(algorithm, spec, root, args.threads)
    try:
        cases = [
            _run_layout(name, algorithm, session, data, facts, trl, model_path, tokenizer_path, tokenizer, args)
            for name in layouts
        ]
        if not any(c.get("trl_step_s") for c in cases):  # no layout ran: time TRL on its own
            for i in range(args.warmup + args.steps):
                trl.step(i >= args.warmup)
    finally:
        trl.close()
    return {"algorithm": algorithm, "batch": facts, "cases": ([trl.row] if args.trl else []) + cases}


# ----------------------------------------------------------------------------- report


def _ok(r: dict) -> bool:
    return "error" not in r and "skipped" not in r and bool(r.get("step_s"))


def ratio(r: dict, trl: dict | None, stat=statistics.median) -> float | None:
    """case tokens/s ÷ TRL tokens/s, against the case's own paired TRL steps (TRL row: itself)."""
    if not _ok(r):
        return None
    base = r.get("trl_step_s") if r["case"] != "trl" else r["step_s"]
    return stat(base) / stat(r["step_s"]) if base else None


def _procs(r: dict) -> str:
    threads = r.get("threads") or []
    t = tb._threads(r) if threads else "?"
    if is_jax(r["case"]):
        return f"1 ({jb.jax_layout(r['case']).devices} dev) × {t} XLA"
    return f"{r['workers']} × {t}"


def _check(mine: dict | None, theirs: dict | None) -> str:
    if not mine or not theirs:
        return "-"
    parts = []
    for key in ("loss", "grad_norm"):
        a, b = mine.get(key), theirs.get(key)
        if a is None or b is None:
            parts.append(f"{key} ?")
            continue
        rel = abs(a - b) / max(abs(b), 1e-12)
        parts.append(f"{key} {a:.6g} vs {b:.6g} ({'ok' if rel <= CHECK_RTOL else f'DIFF {rel:.1e}'})")
    return "; ".join(parts)


def report(results: list[dict], args, params: int | None, load: tuple[float, float], session, versions: dict) -> str:
    cores = os.cpu_count() or 1
    size = f"{params / 1e6:.2f}M params, " if params else ""
    micro = f"{args.micro} rows per rank" if args.micro else "whole local batch per rank"
    trl = (
        f"TRL {versions.get('trl')} (transformers {versions.get('transformers')}, torch {versions.get('torch')})"
        if args.trl
        else f"TRL: not run ({args.no_trl_reason})"
    )
    lines = [
        f"dualrl vs {trl}; model {args.model} ({size}vocab {args.vocab}), float32, attention "
        f"{versions.get('attn_implementation', 'sdpa')}; {args.batch} sequences per optimizer step (SFT: {args.batch} "
        f"examples, DPO: {args.batch // 2} pairs); micro batch: {micro}; {args.steps} timed steps after "
        f"{args.warmup} warm-up per (layout, algorithm); "
        f"AdamW {json.dumps(tb.default_policy_section()['optimizer']['kwargs'])}, "
        f"constant LR, max_grad_norm {tb.default_policy_section()['max_grad_norm']}",
        f"threads: {args.threads} per case on {cores} CPU cores (TRL: one process, torch.set_num_threads; torch "
        f"layouts: Ray bundles of threads/workers CPUs; JAX: one actor, XLA pool)",
        "tokens/s = real (non-pad) tokens of the step's batch / median step seconds. TRL step = on_step_begin -> "
        "on_step_end (callback); dualrl step = driver wall time of policy.train "
        "(DPO: + get_reference_policy_logprobs). "
        "Each dualrl step is followed by one TRL step; ×TRL = median paired TRL s / median dualrl s.",
        f"machine load average (1 min): {load[0]:.2f} at start, {load[1]:.2f} at end"
        + (f"  -- above {cores} cores: trust ×TRL (paired) more than absolute tokens/s" if max(load) > cores else ""),
        "",
    ]
    if session is not None and session.owned and session.restarts:
        lines.insert(
            4,
            "Ray restarts for another XLA device count: "
            + ", ".join(f"to {n} in {s:.1f} s" for n, s in session.restarts)
            + " (not timed)",
        )
    lines += [
        "| algorithm | case | processes × threads | tokens/s | ×TRL | step s: median [min, max] |",
        "|---|---|---|---:|---:|---|",
    ]
    for res in results:
        tokens = res["batch"]["real_tokens"]
        trl_row = next((r for r in res["cases"] if r["case"] == "trl"), None)
        for r in res["cases"]:
            cells = [res["algorithm"], r["case"], _procs(r)]
            if not _ok(r):
                word = "skipped" if "skipped" in r else "FAILED"
                cells += [word, "-", r.get("skipped") or r.get("error") or "no steps"]
            else:
                cells += [
                    f"{tokens / statistics.median(r['step_s']):.0f}",
                    cell(ratio(r, trl_row), ".2f"),
                    tb._spread(r["step_s"]),
                ]
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Batches (identical ids for both frameworks; TRL's check = its collator's output of the whole "
        "batch holds exactly these rows and loss masks):",
    ]
    for res in results:
        b = res["batch"]
        trl_row = next((r for r in res["cases"] if r["case"] == "trl"), None)
        check = (trl_row or {}).get("ready", {}).get("check")
        same = (
            "-"
            if not check
            else (
                "yes"
                if check["same_rows_and_masks"]
                and check["real_tokens"] == b["real_tokens"]
                and check["loss_tokens"] == b["loss_tokens"]
                and check["width"] == b["width"]
                else f"NO: {check}"
            )
        )
        lines.append(
            f"  {res['algorithm']}: {b['rows']} rows x width {b['width']} = {b['rows'] * b['width']} padded, "
            f"{b['real_tokens']} real tokens, {b['loss_tokens']} loss tokens; TRL same rows/masks: {same}"
        )
    lines += [
        "",
        "Details: start s = Policy construction / TRL child start-up (not timed); no-op ms = a Policy call "
        "that does nothing on the workers; paired TRL = median of the TRL steps run alongside; ×TRL(min) = "
        "fastest paired TRL step / fastest step; ref s = the DPO reference pass inside the dualrl step; TRL "
        "loop s = driver's go -> on_step_end (adds the trainer loop's between-step work and the next batch's "
        "collation)",
        f"{'algorithm':9} {'case':12} {'start s':>7} {'no-op ms':>8} {'paired TRL s':>12} {'×TRL(min)':>9} "
        f"{'ref s':>6} {'TRL loop s':>10}  step-1 check vs TRL's first step (loss; pre-clip grad norm)",
    ]
    for res in results:
        trl_row = next((r for r in res["cases"] if r["case"] == "trl"), None)
        for r in res["cases"]:
            if not _ok(r):
                continue
            noop = r["noop_s"] * 1e3 if r.get("noop_s") is not None else None
            paired = r["step_s"] if r["case"] == "trl" else r.get("trl_step_s")
            loop = r.get("loop_s") if r["case"] == "trl" else r.get("trl_loop_s")
            check = (
                f"TRL first step: loss {r['first']['loss']:.6g}, grad norm {r['first']['grad_norm']:.6g}"
                if r["case"] == "trl" and r.get("first")
                else _check(r.get("first"), (trl_row or {}).get("first"))
            )
            lines.append(
                f"{res['algorithm']:9} {r['case']:12} {cell(r.get('startup_s'), '.1f'):>7} "
                f"{cell(noop, '.1f'):>8} {cell(tb.median(paired), '.4f'):>12} "
                f"{cell(ratio(r, trl_row, min), '.2f'):>9} {cell(tb.median(r.get('ref_s')), '.4f'):>6} "
                f"{cell(tb.median(loop), '.4f'):>10}  {check}"
            )
            if r.get("compile_counts"):
                lines.append(
                    f"{'':22} JAX get_compile_counts() at the end: {r['compile_counts']}"
                    + (f"; pinned to CPUs {r['pinned']}" if r.get("pinned") else "")
                )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver


def _layout(name: str) -> str:
    if name in tb.LAYOUTS or is_jax(name):
        return name
    raise argparse.ArgumentTypeError(f"{name!r}: one of {list(tb.LAYOUTS)} or jax-fsdp<F>[-tp<T>] / jax-tp<T>")


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument(
        "--layouts",
        nargs="*",
        default=DEFAULT_LAYOUTS,
        type=_layout,
        help=f"dualrl layouts (default {' '.join(DEFAULT_LAYOUTS)}); any of {list(tb.LAYOUTS)}, "
        "jax-fsdp<F>[-tp<T>], jax-tp<T>; none = TRL only",
    )
    parser.add_argument("--batch", type=int, default=64, help="sequences per optimizer step (DPO: batch/2 pairs)")
    parser.add_argument(
        "--micro",
        type=int,
        default=None,
        help="rows per forward/backward per data-parallel rank (default: the whole local batch)",
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per (layout, algorithm)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (JAX compiles in the first)")
    parser.add_argument("--threads", type=int, default=2, help="total threads per case (see the module docstring)")
    parser.add_argument("--model", default=BUILTIN_MODEL, help=f"{BUILTIN_MODEL} (built here) or a local HF model dir")
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL rows even if trl is installed")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child-trl", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_trl:
        return args
    if args.steps < 1 or args.warmup < 1 or args.threads < 1 or args.batch < 2:
        parser.error("--steps >= 1, --warmup >= 1 (the first JAX step compiles), --threads >= 1, --batch >= 2")
    if args.batch % 2:
        parser.error("--batch must be even (DPO pairs)")
    for name in args.layouts:
        shards = jb.jax_layout(name).dp if is_jax(name) else tb.LAYOUTS[name].dp
        micro = args.micro or args.batch // shards
        if args.batch % (shards * micro) or micro % 2:
            parser.error(
                f"{name}: --batch {args.batch} must split into {shards} rank(s) x micro batches of "
                f"{micro} rows, an even number (DPO pairs)"
            )
    if args.micro and (args.batch % args.micro or args.micro % 2):
        parser.error("--micro must be even and divide --batch")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    if args.child_trl:
        serve_trl(args.child_trl)
        return 0
    version = trl_version()
    args.trl = version is not None and not args.no_trl
    args.no_trl_reason = "--no-trl" if args.no_trl else "trl is not importable (pip install trl)"
    if not args.trl:
        print(f"[trl_compare] note: TRL rows skipped: {args.no_trl_reason}", flush=True)
    wall0 = time.perf_counter()
    session = None
    if args.layouts:
        args.cases = list(args.layouts)  # what torch_backends.ray_cpus sizes Ray for
        session = jb.RaySession(args)
        first_jax = next((jb.jax_layout(c).devices for c in args.layouts if is_jax(c)), None)
        if session.owned:
            session.start(first_jax)  # before anything is timed
    results = []
    with tempfile.TemporaryDirectory(prefix="dualrl-trl-") as tmp:
        root = Path(tmp)
        model_path, tokenizer_path = prepare_model(args.model, root)
        args.vocab, args.params = tb.vocab_size(model_path), count_params(model_path)
        tokenizer = tb.load_tokenizer(tokenizer_path)
        load0 = os.getloadavg()[0]
        for algorithm in args.algorithms:
            results.append(
                run_algorithm(algorithm, args.layouts, session, model_path, tokenizer_path, tokenizer, root, args)
            )
        load = (load0, os.getloadavg()[0])
    ready = next((r["ready"] for res in results for r in res["cases"] if r["case"] == "trl" and r.get("ready")), {})
    print(report(results, args, args.params, load, session, ready))
    print(f"\nbenchmark wall time {time.perf_counter() - wall0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": {k: v for k, v in vars(args).items() if k != "child_trl"},
                    "versions": ready,
                    "results": results,
                },
                f,
                indent=2,
                default=str,
            )
    failed = any("error" in r for res in results for r in res["cases"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
