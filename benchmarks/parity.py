"""Numerical parity of the backend layouts: a pass/fail matrix against stated tolerances.

    python -m benchmarks.parity [--layouts fsdp1-dp2 dtensor-dp2 dtensor-tp2 jax-fsdp2 jax-tp2]
        [--model llama | tiny-llama-hd32 | tiny-qwen2 | qwen3 | tiny-gpt2 | PATH | HUB_ID] [--json OUT]
        [--crossload ring|full] [--engine [LAYOUT ...]] [--batch 8] [--seq 24] [--lr 1e-3] [--threads 2]
    dualrl parity [--layouts ...] [--model ...] [--json OUT] [--crossload ...]

Every layout (``benchmarks.lib.parity.settings.TORCH_LAYOUTS``, or any name of the ``benchmarks.lib.layouts``
grammar: ``fsdp1-dp<D>``, ``dtensor-[dp<D>][-cp<C>][-tp<T>][-sp]``, ``jax-[fsdp<F>][-cp<C>][-tp<T>]``,
each optionally ``-packed``, ``-shared`` (packing with shared prompts) or ``-dynamic`` and then
``-lora`` (item 9) -- so context parallelism, sequence packing (with shared prompts: the GRPO
batch of item 7 holds each prompt's two samples) and dynamic batching are checked against the
plain layouts like any other layout; a ``-dynamic`` layout's token budget is half a rank's padded
micro batch, so that its rows split into micro batches of different widths) runs
one :class:`core.policy.Policy`, started by the benchmarks' runner (``benchmarks.lib.policy``: same
cluster shapes, thread budget, Ray/XLA set-up), on one fixed ragged batch (``benchmarks.lib.workload.make_batch``:
right-padded random ids of different lengths, seed 0, loss on every real token).  ``hf`` is a
reference computed in this process: plain ``AutoModelForCausalLM`` in fp32, ``log_softmax``
(float64) + gather in the ``get_logprobs`` layout ``[0, logp(x_1), ..., 0 padding]`` -- what
tests/torch_backends compares against.

What is compared (every layout against ``hf`` and against every other layout):

1. ``logprobs``: ``Policy.get_logprobs`` on the batch at the initial weights.
2. ``loss_step0`` / ``grad_norm_step0``: the NLL loss and the (pre-clipping) global gradient
   norm of the first NLL ``policy.train`` call (``NLLLoss``, one AdamW step per call); ``hf``: the
   same loss code on full-batch HF logits, ``clip_grad_norm_`` and ``torch.optim.AdamW``.
   ``loss_curve``: the loss of 3 such steps on the same batch (each loss is taken before its
   step's update).  ``trained_logprobs``: ``get_logprobs`` after the 3 steps.  These steps
   follow the GRPO steps of items 7, 8, 10 and 11 in the same start (no extra Policy start for
   them): they continue from the weights and the AdamW state their 9 updates left -- in ``hf``
   too, which keeps one AdamW for all --, so "step 0" is the first NLL step, the run's tenth update.
3. ``batch_invariance`` (per layout, ``hf`` included): a row's logprobs must not depend on the
   other rows of its batch / micro batch.  Variants, each against the row in the full batch:
   ``alone`` (the longest and the last row, each as a batch of one, same width),
   ``alone_trimmed`` (the shortest row alone at its own width: a batch of only it is that wide),
   ``reversed`` (the whole batch in reverse order: rows change rank and micro batch),
   ``mixed`` (the first half interleaved with rows of another random batch).
   The value is the largest deviation of all variants; which variants are *bitwise* equal is
   reported per layout.
4. ``crossload``: after the 3 steps the source layout writes ``save_hf_checkpoint``; a Policy
   of another layout is started with ``model_name`` = that export and its ``get_logprobs`` is
   compared with the source's own (``hf`` = the export loaded in this process).
   ``--crossload ring`` (default) loads layout i's export into layout i+1 (the last into the
   first), so every layout is exported and imported once, torch -> JAX and JAX -> torch in the
   default order; ``full``: every ordered pair (n x (n-1) extra Policy starts).
   ``weights_moved`` checks that the 3 steps moved the logprobs by at least 1e-3, so the
   export carries trained weights: a target that loaded the initial ones instead would be off
   by at least that much.
5. ``dcp_crossload`` / ``dcp_resume`` (torch layouts only): after the 3 steps (and the HF
   export) each torch layout writes ``save_checkpoint(weights_path, optimizer_path)`` -- torch
   DCP shards of the weights, of the AdamW state, and the scheduler/step -- and then takes one
   more NLL step (its "resumed" logprobs).  In a ring over the torch layouts (i -> i+1, the
   last into the first; none with fewer than two), the target layout is started on the
   *initial* model with ``Policy(..., weights_path=, optimizer_path=)``: ``dcp_crossload``
   compares its ``get_logprobs`` with the source's trained ones (a target that ignored the
   checkpoint would hold the initial weights: off by ``weights_moved``), ``dcp_resume`` its
   logprobs after the same one more step with the source's (that step uses the loaded Adam
   moments and step count; a target loading the weights only was measured 0.15 off on tiny
   llama).  DCP reshards by HF
   parameter name, so FSDP1 <-> DTensor and any dp/tp change load directly.  torch DCP <-> JAX
   has no direct path (the JAX backend writes and reads orbax checkpoints of its own param
   tree): those pairs are covered by ``crossload`` through the HF export, and the report says
   so.  (JAX <-> JAX orbax reloads are not compared here.)
6. ``token_mult_prob_error`` (per layout, with ``--engine``): one vLLM engine
   (``core.generation.VllmGeneration``, CPU, fp32, tensor parallel 1, on a bundle of its own)
   for the whole run.  After the layout's training steps the engine is refit from the layout's
   policy with ``core.refit.refit_policy_generation``, once per transport (``ipc``: shared
   memory, as colocated; ``collective``: a gloo broadcast, as a separate engine), and samples
   8 tokens (temperature 1, seeded per row) for 4 prompts; ``get_logprobs`` of the policy on the
   generated sequences against the engine's sampling logprobs gives NeMo RL's
   ``token_mult_prob_error`` (``core.kernels.token_mult_prob_error``: mean over generated
   tokens of exp|lp_policy - lp_engine|, 1.0 = exact), the larger of the two transports.
   Opt-in: the engine's start and warm-up (first generate), then its checks per layout, cost
   about as much as the rest of a layout on a CPU (docs/results.md#other-costs-the-comments-gave), and vLLM's
   CPU attention has no kernel for head_dim 16, so the default tiny ``llama`` cannot be served:
   use ``--model tiny-llama-hd32`` (the same tiny llama at hidden 128, head_dim 32, built here)
   with ``--engine``.  ``--engine`` alone checks every layout, ``--engine L1 L2`` only those.  If
   the engine does not start, one ERROR line says why and every other check still runs; a
   head_dim it cannot serve is reported once, with that hint.
7. ``grpo_step0`` (every layout and ``hf``, pairwise): the training part of a GRPO step
   (``core.algorithms.grpo.grpo_step``) at the initial weights with a fresh optimizer -- in the
   layout's start, after the batch-invariance variants and before the NLL steps of item 2: one
   fixed train batch built in the driver the way ``core.algorithms.rollouts.training_batch``
   builds it (keys ``input_ids``, ``input_lengths``, ``token_mask`` = 1 on the "response"
   tokens only -- here the last two thirds of each ragged row, the first third being the
   "prompt" --, ``sample_mask``, ``advantages`` = a seeded normal draw per row x the mask,
   ``generation_logprobs`` = the ``hf`` logprobs of the batch x the mask, standing in for an
   engine's), then, as the real step does, ``prev_logprobs`` = the layout's own
   ``get_logprobs``, ``reference_policy_logprobs`` = its ``get_reference_policy_logprobs``
   (equal at step 0), and ``policy.train`` with ``ClippedPGLossFn(core/configs/default.yaml
   loss_fn)``.  The batch is two global batches (``gbs`` = batch / 2; one for an odd batch), i.e.
   two optimizer steps, as a GRPO step with more rollouts than ``train_global_batch_size`` takes: at the
   first one the ratio is 1 and the KL 0 by construction, the second sees the weights the
   first moved, so ``probs_ratio`` and ``kl_penalty`` are not trivially 1 and 0.  Compared:
   ``loss``, ``actor_loss``, ``kl_penalty``, ``clip_fraction``, ``probs_ratio`` (and, on a
   mixture-of-experts model, the router's load-balancing loss ``moe_aux_loss``; ``hf``: HF's
   ``load_balancing_loss_func`` per sequence) of both steps and both gradient norms; the value
   is the largest scalar measure of them.  (At lr 1e-3 no ratio
   leaves the trust region: ``clip_fraction`` is 0 everywhere, compared anyway.)  The full GRPO
   step with generation, rewards and refit is proven equal across backends by
   tests/algorithms/test_grpo_runs.py (step 1 on the three backends within 1e-5).
8. ``grpo_fused`` (pairwise) and ``grpo_fused_vs_separate`` (per layout): right after step 0,
   one more GRPO ``train`` call on the same batch as ONE global batch -- the case where a GRPO
   run fuses the old-policy log-probs into the training forward (``grpo.fuse_old_logprobs``:
   ``ClippedPGLossFn(old_logprobs="forward")``, no ``prev_logprobs`` in the batch, no
   ``get_logprobs`` pass); the reference log-probs come from the policy (the initial weights,
   so the KL term is not 0).  ``hf`` computes that step twice from the same weights and AdamW
   state: with a separate old-log-prob pass (today's path, then rolled back) and fused (kept).
   ``grpo_fused_vs_separate`` holds each layout's fused step (``hf``'s own included) to ``hf``'s
   separate-pass step: same loss, metrics and gradient norm within 1e-5, i.e. the fused path
   computes what the separate pass did, on every backend.  The NLL steps of item 2 follow,
   so the updated weights of the fused step are compared too (``loss_curve``,
   ``trained_logprobs``).

9. ``-lora`` layouts (``fsdp1-dp2-lora``, ``dtensor-tp2-lora``, ``jax-fsdp2-lora``, ...): the
   layout's policy trains LoRA adapters, ``policy.lora`` at ``settings.LORA`` (rank 4, alpha 8,
   all-linear, init_seed 0; one place).  Their reference is ``hf-lora``: the same HF model in
   this process with the torch backends' ``LoRALinear`` on every target and the seeded initial
   adapters of ``core.models.lora`` (B = 0), every other weight frozen and the AdamW over the
   adapters only -- so ``hf-lora`` and every ``-lora`` layout compute the same thing, and every
   check above holds them to it at the same tolerances.  ``lora_b0_is_base`` (per LoRA layout,
   ``hf-lora`` included): the initial logprobs against the *plain* HF model's (B = 0 must give
   the base model; <= 1e-5).  The HF export of a LoRA policy is the merged model, so ``src ->
   hf`` (a plain model loading it) and the ring into the next layout (a LoRA target re-adds
   B = 0 adapters on the merged weights) must both give the source's trained logprobs.
   *Mixing* ``-lora`` and plain layouts in one run: two references (``hf`` only when a plain
   layout runs, ``hf-lora`` only when a LoRA one does) and the pairwise checks only within a
   kind -- after step 0 the two train different parameters, so their losses and trained
   logprobs differ by design, while the cross-load ring may cross kinds (both directions must
   reproduce the source's logprobs: the export is merged).  Two references rather than a refusal:
   the comparison rule is one predicate (``checks.same_kind``) and one run can still prove that
   plain and LoRA layouts load each other's exports.  The DCP ring runs per kind (a LoRA
   checkpoint holds adapters and their AdamW state a full fine-tuning target has no place for).
   Measured: see "LoRA, measured" below.
10. ``grpo_multi_turn_step0`` / ``grpo_multi_turn_logprobs`` / ``multi_turn_episodes`` (pairwise,
   ``hf`` included): right after the fused step, one multi-turn GRPO step
   (``benchmarks.lib.parity.multi_turn``).  8 scripted tool-use episodes (4 problems x 2, 1-3
   assistant turns: calculator calls, an unknown tool, right and wrong final answers) are played
   by the code path training uses -- ``EpisodeRunner`` against the built-in ``tool_arithmetic``
   ``ToolEnvironment``, ``ObservationTokens``, ``episodes_to_rows``, then
   ``core.algorithms.grpo.training_data`` with ``core/configs/grpo_tool_arithmetic.yaml``'s
   ``grpo`` section -- driven by a scripted engine: each turn's ids are a fixed text's ids plus
   the stop token, their logprobs the layout's own ``get_logprobs`` (``hf``: its own), so the
   episodes depend on no sampling.  Then, as item 7: old log-probs from the policy, reference
   log-probs from its reference model (``hf``: a copy of its initial weights), one ``train``
   call of 2 optimizer steps; then ``get_logprobs`` of the episodes.  ``multi_turn_episodes``:
   ids, lengths, ``token_mask``, ``sample_mask``, advantages, rewards and turns must be bitwise
   equal; ``grpo_multi_turn_step0``: item 7's quantities and the episodes' generation logprobs;
   ``grpo_multi_turn_logprobs``: the logprobs after the step.  The parity tiny tokenizer has no
   word for a tool call: the episodes use a word-level tokenizer of their own words (ids < 64)
   on the run's model; a model with a smaller vocabulary, or a ``--seq`` the conversations do
   not fit (19 tokens), is refused naming the row (exit 2, before any layout starts).

11. ``grpo_dr_grpo_step`` / ``grpo_rloo_step`` (pairwise, ``hf`` included; the estimator rows,
   ``benchmarks.lib.parity.estimators``): right after the multi-turn step, one GRPO ``train``
   call of 2 optimizer steps per row on item 7's batch with the advantages of a registered
   estimator (``core.algorithms.advantages``: ``dr_grpo``, group mean subtracted, no std;
   ``rloo``, leave-one-out baseline) of seeded rewards in groups of 4 rows, and the last row's
   ``sample_mask`` at 0 (a sample ``grpo.overlong_filtering`` dropped).  ``grpo_dr_grpo_step``
   trains with ``loss_fn.token_normalizer: constant`` (Dr. GRPO: the token sum divided by the
   global batch's valid sequences x ``constant_token_budget``, here the batch width), so every
   backend's count of valid sequences over ranks and micro batches enters the loss;
   ``grpo_rloo_step`` with the default per-token normaliser.  Old and reference log-probs as in
   item 7; compared: item 7's quantities.  A ``--batch`` below 2 is refused (RLOO needs two
   samples per group).

Bad input.  Each layout is checked before it starts, and a layout that cannot run gets an
``ERROR <layout>: ...`` line naming it and why while every other layout still runs and is
checked (the exit code is then 1): an unknown name; a layout that does not fit; a batch its
data-parallel size does not divide; a model the JAX backend does not support (for a JAX layout:
``backends.jax_pjit.models.ModelConfig.from_hf`` on the model's config, which names the
``model_type`` and the supported ones -- llama, qwen2, qwen3, qwen3_moe, mistral without a
binding window, gemma3_text --;
``--model tiny-gpt2`` builds a tiny GPT-2 locally to try it).  *Fits*: a torch layout of W
workers gets ``--threads // W`` CPUs per worker (``benchmarks.lib.policy.PolicyRunner``), so it fits
when W <= ``--threads`` (every worker a thread of its own) and W x (``--threads`` // W) <= the
CPUs of the Ray cluster; a JAX layout is one actor of ``--threads`` CPUs (its devices are XLA
host devices), so it fits when the Ray cluster has ``--threads`` CPUs.  With ``--engine`` the
engine's bundle of ``--threads`` CPUs lives next to one policy: Ray needs twice ``--threads``.

Tolerances (fp32 on CPU; ``--lr`` default 1e-3, constant, ``max_grad_norm`` 1.0 as
``core/configs/default.yaml``):

=======================  ===========================================  =========
check                    value                                         pass if
=======================  ===========================================  =========
logprobs                 max |a - b| over all positions                <= 1e-5
loss_step0               |a - b| / max(1, |a|, |b|)                    <= 1e-5
grad_norm_step0          |a - b| / max(1, |a|, |b|)                    <= 1e-5
loss_curve               max over 3 steps of the loss measure          <= 1e-4
trained_logprobs         max |a - b| after 3 steps                     <= 1e-4
batch_invariance         max |row in variant - row in full batch|      <= 1e-5
crossload                max |target - source| logprobs                <= 1e-5
weights_moved            max |after 3 steps - initial| logprobs        >= 1e-3
dcp_crossload            max |target - source| logprobs                <= 1e-5
dcp_resume               max |target - source| after one more step     <= 1e-4
grpo_step0               max over metrics and steps of the measure     <= 1e-5
grpo_fused               max over metrics of the measure               <= 1e-5
grpo_fused_vs_separate   same, layout's fused vs hf's separate pass    <= 1e-5
token_mult_prob_error    mean exp|lp_policy - lp_engine|               <= 1.0001
lora_b0_is_base          max |LoRA at init - plain hf| logprobs         <= 1e-5
grpo_multi_turn_step0    as grpo_step0, + the generation logprobs       <= 1e-5
grpo_multi_turn_logprobs max |a - b| after the multi-turn step          <= 1e-4
multi_turn_episodes      max |a - b| of ids, masks, rewards, advantages <= 0
grpo_dr_grpo_step        as grpo_step0 (Dr. GRPO advantages + loss)     <= 1e-5
grpo_rloo_step           as grpo_step0 (RLOO advantages)                <= 1e-5
exact_batch_invariance   --exact: batch_invariance's variants           <= 0
exact_sampler            --exact: max |lp_sampler - lp_policy|, alone   <= 0
=======================  ===========================================  =========

``--exact`` runs every layout in exact mode (``policy.numerics: exact``, the policy's own
sampler) and adds the two bitwise rows (``benchmarks.lib.parity.exact``): a layout whose sampler
and trainer differ by one bit in one token fails; the other checks keep their tolerances
(exact mode computes the same model as ``hf`` to rounding).

``--precision bfloat16`` runs every layout in bf16 compute over fp32 master weights (HF under
CPU autocast) and judges it by ``BF16_TOLERANCES`` (their comment gives the measured maxima
and why the bands are ~3-4x them: logprobs 1e-2, loss 2e-4, grad norm 5e-3, GRPO 1e-2, ...).

The scalar measure is absolute below 1 and relative above (losses of a 256-token vocabulary
are ~5.5, gradient norms of a real model can be hundreds).  AdamW normalises each update by
the gradient's running RMS, so an fp32 rounding difference in a near-zero gradient entry
becomes a full-size difference in that weight's step: hence 1e-4 for logprobs after training
(``dcp_resume`` included).  Losses, gradient norms and the GRPO metrics are sums / means over the
whole batch and all weights, in which those per-weight differences average out: measured on tiny
llama they stay below 4e-7 although ``grpo_step0``'s second step comes after one update and
``loss_step0`` after two, so 1e-5 holds for them (``loss_curve`` keeps its 1e-4).
``token_mult_prob_error``: vLLM computes in its own CPU kernels (attention, sampler), so the
engine's logprobs are not bitwise the policy's.  Measured (fp32, every default layout, both
transports): on ``tiny-llama-hd32`` the per-token difference stays below 1e-6 and the metric
below 1 + 2e-7; on ``llama_gen`` (``core.testing``'s head_dim-32 llama with a 10x wider init: large
logits) below 1.1e-5 and 1 + 2.5e-6.  1 + 1e-4 leaves 40x headroom over the worse of the two and
still fails a refit that missed or mangled a tensor (the engine would serve other weights: one
step moves this batch's logprobs by ~0.25, the metric by far more than 1e-4) -- NeMo RL flags
runs above ~1.05, tests/generation hold it to 1.001.  (``llama_gen`` itself is no parity model:
its large logits push the TP layouts' fp32 logprob differences past the 1e-5 / 1e-4 above.)

LoRA rows: measured largest differences in docs/results.md (parity).

Batch invariance, measured (2-core CPU, fp32, torch 2.13 / jax 0.10; tiny llama on every default
layout plus jax-fsdp8, tiny qwen2 on fsdp1-dp2 / dtensor-tp2-sp / jax-tp2; batch 8 x 24):

* At a fixed padded width (``alone``, ``reversed``, ``mixed``) every layout, ``hf`` included, was
  bitwise invariant in every run, consistent with CPU kernels that reduce each row in the
  same order whatever its companions, rank or micro batch.  This is an observation on CPU,
  not a promise (on GPUs, GEMM kernels are picked by shape, batch size included).
* When the companions change the padded *width* (``alone_trimmed``: 24 -> 4 columns), the torch
  side is not bitwise: ``hf`` and ``dtensor-tp2`` (llama) and ``fsdp1-dp2`` (qwen2) moved a
  logprob by one fp32 ulp (4.8e-7 at |logp| ~ 5.5), while other torch layouts happened to stay
  bitwise on the same batch; which one is hit depends on model and data, so no torch layout
  can promise bitwise invariance across widths -- only the 1e-5 tolerance.
* The JAX layouts were bitwise in every variant, including the width change (which crosses
  from the 24-column to the 16-column length bucket, i.e. another compiled program).  Within
  one bucket this is by construction: every micro batch is padded to the same rows x bucket
  shape and runs the same compiled SPMD program, so a row's inputs and operations do not
  depend on its companions or on the device it lands on.  Across buckets it was measured, not
  guaranteed.

The ``bitwise variants`` column of the report says what the run at hand measured.

Exit code 1 when any check fails or a layout (or a part of one: a cross-load, a DCP save or
load, the engine) could not run; 2 for bad arguments (no layouts, a layout given twice, ``--engine``
naming a layout not in ``--layouts``, a bad ``--crossload``, ``--seq`` < 2, ``--batch`` < 2).  ``--json`` writes
every number (all compared values, losses, norms, GRPO metrics, per-variant deviations,
engine metrics per transport, timings).  Layouts that need a different XLA host device count
than a Ray started by the caller provides are listed as skipped (as in
``benchmarks.lib.ray_session``); that alone does not fail the run.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.lib.layouts import grammar
from benchmarks.lib.parity.report import format_matrix
from benchmarks.lib.parity.run import run_parity
from benchmarks.lib.parity.settings import DEFAULT_LAYOUTS, LEARNING_RATE, TORCH_LAYOUTS


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or "python -m benchmarks.parity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=DEFAULT_LAYOUTS,
        help=f"default: {' '.join(DEFAULT_LAYOUTS)}; any of {' '.join(TORCH_LAYOUTS)}, or by the grammar {grammar()}",
    )
    parser.add_argument(
        "--model",
        default="llama",
        help="a core.testing tiny model (llama, qwen2, qwen3, tiny-qwen2, ...), tiny-llama-hd32, "
        "tiny-gpt2 (built here), a local HF path or a hub id",
    )
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument(
        "--crossload", default="ring", choices=["ring", "full"], help="which layout loads which export (see above)"
    )
    parser.add_argument(
        "--engine",
        nargs="*",
        metavar="LAYOUT",
        help="the vLLM token_mult_prob_error check: on every layout (no names) or on these; "
        "needs a model vLLM's CPU attention serves (head_dim 32: --model tiny-llama-hd32)",
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=24)
    parser.add_argument("--lr", type=float, default=LEARNING_RATE)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per layout (the benchmarks' budget)")
    parser.add_argument(
        "--precision",
        default="float32",
        choices=["float32", "bfloat16"],
        help="bfloat16: bf16 compute over fp32 master weights, judged by BF16_TOLERANCES",
    )
    parser.add_argument(
        "--exact",
        action="store_true",
        help="every layout in exact mode (policy.numerics exact, its own sampler); adds the bitwise "
        "exact_batch_invariance and exact_sampler checks (pass: 0)",
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    engine = False if args.engine is None else (args.engine or True)
    try:
        results = run_parity(
            args.layouts,
            args.model,
            batch=args.batch,
            seq=args.seq,
            threads=args.threads,
            crossload=args.crossload,
            lr=args.lr,
            engine=engine,
            precision=args.precision,
            exact=args.exact,
        )
    except (ValueError, OSError) as err:  # a bad argument, or a model that does not load
        print(f"parity: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    print(format_matrix(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
