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
  as TRL's is.  Torch layouts: :data:`benchmarks.lib.parity.settings.TORCH_LAYOUTS`; JAX layouts
  ``jax-fsdp{F}[-tp{T}]`` as in :mod:`benchmarks.lib.policy` (one actor owning ``F x T``
  XLA host devices; Ray is started with ``XLA_FLAGS`` set, and restarted for another device
  count, by ``benchmarks.lib.ray_session.RaySession``).
* Micro batch: ``--micro M`` = rows per forward/backward on one data-parallel rank (a
  torch worker, an XLA device, the TRL process).  Default: the whole local batch (TRL: all
  ``batch`` rows in one forward; dp2: ``batch / 2`` rows per rank; ``jax-fsdp2``: one
  ``batch``-row micro batch whose rows are split over the 2 devices).  TRL: ``M`` rows per
  micro batch, ``batch / M`` gradient-accumulation steps (DPO: ``M / 2`` pairs).

Methodology (as :mod:`benchmarks.lib.pairing` / :mod:`benchmarks.lib.policy`):

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
import sys
import time
from pathlib import Path

from benchmarks.lib.layouts import host_layout, parse_layout
from benchmarks.lib.models import BUILTIN_MODEL, builds_here
from benchmarks.lib.parity.settings import TORCH_LAYOUTS
from benchmarks.lib.trl import trl_version
from benchmarks.lib.trl_compare import ALGORITHMS, DEFAULT_LAYOUTS, report, run_trl_compare


def _layout(name: str) -> str:
    if name in TORCH_LAYOUTS or host_layout(name) is not None:
        return name
    raise argparse.ArgumentTypeError(f"{name!r}: one of {list(TORCH_LAYOUTS)} or jax-fsdp<F>[-tp<T>] / jax-tp<T>")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument(
        "--layouts",
        nargs="*",
        default=DEFAULT_LAYOUTS,
        type=_layout,
        help=f"dualrl layouts (default {' '.join(DEFAULT_LAYOUTS)}); any of {list(TORCH_LAYOUTS)}, "
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
    return parser


def _parse(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.threads < 1 or args.batch < 2:
        parser.error("--steps >= 1, --warmup >= 1 (the first JAX step compiles), --threads >= 1, --batch >= 2")
    if args.batch % 2:
        parser.error("--batch must be even (DPO pairs)")
    for name in args.layouts:
        shards = parse_layout(name).dp
        micro = args.micro or args.batch // shards
        if args.batch % (shards * micro) or micro % 2:
            parser.error(
                f"{name}: --batch {args.batch} must split into {shards} rank(s) x micro batches of "
                f"{micro} rows, an even number (DPO pairs)"
            )
    if args.micro and (args.batch % args.micro or args.micro % 2):
        parser.error("--micro must be even and divide --batch")
    if not builds_here(args.model) and not Path(args.model).is_dir():
        parser.error(
            f"--model {args.model!r}: not a model built here ({BUILTIN_MODEL}, ...) and not a local HF model directory"
        )
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    args.trl = trl_version() is not None and not args.no_trl
    args.no_trl_reason = "--no-trl" if args.no_trl else "trl is not importable (pip install trl)"
    if not args.trl:
        print(f"[trl_compare] note: TRL rows skipped: {args.no_trl_reason}", flush=True)
    wall0 = time.perf_counter()
    results, facts = run_trl_compare(args)
    print(report(results, args, facts))
    print(f"\nbenchmark wall time {time.perf_counter() - wall0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "versions": facts["versions"], "results": results}, f, indent=2, default=str)
    failed = any("error" in r for res in results for r in res["cases"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
