"""Numerical parity of the backend layouts: a pass/fail matrix against stated tolerances.

    python -m benchmarks.parity [--layouts fsdp1-dp2 dtensor-dp2 dtensor-tp2 jax-fsdp2 jax-tp2]
        [--model llama | tiny-llama-hd32 | tiny-qwen2 | tiny-gpt2 | PATH | HUB_ID] [--json OUT]
        [--crossload ring|full] [--engine [LAYOUT ...]] [--batch 8] [--seq 24] [--lr 1e-3] [--threads 2]
    dualrl parity [--layouts ...] [--model ...] [--json OUT] [--crossload ...]

Every layout (``benchmarks.torch_backends.LAYOUTS``, or any name of the ``benchmarks.layouts``
grammar: ``fsdp1-dp<D>``, ``dtensor-[dp<D>][-cp<C>][-tp<T>][-sp]``, ``jax-[fsdp<F>][-cp<C>][-tp<T>]``,
each optionally ``-packed`` -- so context parallelism and sequence packing are checked against
the plain layouts like any other layout) runs
one :class:`core.policy.Policy`, started by those benchmarks' runners (same cluster shapes,
thread budget, Ray/XLA set-up), on one fixed ragged batch (``torch_backends.make_batch``:
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
   follow the GRPO step of item 7 in the same start (no extra Policy start for it): they
   continue from the weights and the AdamW state its 2 updates left -- in ``hf`` too, which
   keeps one AdamW for both --, so "step 0" is the first NLL step, the run's third update.
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
   Opt-in: the engine costs ~15-18 s to start and ~6 s to warm up (first generate) on a
   2-core CPU, then ~2-3 s per layout -- about as much as the rest of a layout --, and vLLM's
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
   ``loss``, ``actor_loss``, ``kl_penalty``, ``clip_fraction``, ``probs_ratio`` of both steps and
   both gradient norms; the value is the largest scalar measure of them.  (At lr 1e-3 no ratio
   leaves the trust region: ``clip_fraction`` is 0 everywhere, compared anyway.)  The full GRPO
   step with generation, rewards and refit is proven equal across backends by
   tests/algorithms/test_grpo_runs.py (step 1 on the three backends within 1e-5).

Bad input.  Each layout is checked before it starts, and a layout that cannot run gets an
``ERROR <layout>: ...`` line naming it and why while every other layout still runs and is
checked (the exit code is then 1): an unknown name; a layout that does not fit; a batch its
data-parallel size does not divide; a model the JAX backend does not support (for a JAX layout:
``backends.jax_pjit.model.ModelConfig.from_hf`` on the model's config, which names the
``model_type`` and the supported ones -- llama, qwen2, mistral without a binding window --;
``--model tiny-gpt2`` builds a tiny GPT-2 locally to try it).  *Fits*: a torch layout of W
workers gets ``--threads // W`` CPUs per worker (``torch_backends.PolicyRunner``), so it fits
when W <= ``--threads`` (every worker a thread of its own) and W x (``--threads`` // W) <= the
CPUs of the Ray cluster; a JAX layout is one actor of ``--threads`` CPUs (its devices are XLA
host devices), so it fits when the Ray cluster has ``--threads`` CPUs.  With ``--engine`` the
engine's bundle of ``--threads`` CPUs lives next to one policy: Ray needs twice ``--threads``.

Tolerances (fp32 on CPU; ``--lr`` default 1e-3, constant, ``max_grad_norm`` 1.0 as
``core/configs/default.yaml``):

=====================  ===========================================  =========
check                  value                                         pass if
=====================  ===========================================  =========
logprobs               max |a - b| over all positions                <= 1e-5
loss_step0             |a - b| / max(1, |a|, |b|)                    <= 1e-5
grad_norm_step0        |a - b| / max(1, |a|, |b|)                    <= 1e-5
loss_curve             max over 3 steps of the loss measure          <= 1e-4
trained_logprobs       max |a - b| after 3 steps                     <= 1e-4
batch_invariance       max |row in variant - row in full batch|      <= 1e-5
crossload              max |target - source| logprobs                <= 1e-5
weights_moved          max |after 3 steps - initial| logprobs        >= 1e-3
dcp_crossload          max |target - source| logprobs                <= 1e-5
dcp_resume             max |target - source| after one more step     <= 1e-4
grpo_step0             max over metrics and steps of the measure     <= 1e-5
token_mult_prob_error  mean exp|lp_policy - lp_engine|               <= 1.0001
=====================  ===========================================  =========

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
naming a layout not in ``--layouts``, a bad ``--crossload``, ``--seq`` < 2).  ``--json`` writes
every number (all compared values, losses, norms, GRPO metrics, per-variant deviations,
engine metrics per transport, timings).  Layouts that need a different XLA host device count
than a Ray started by the caller provides are listed as skipped (as in
``benchmarks.jax_backend``); that alone does not fail the run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from benchmarks import jax_backend as jb
from benchmarks import layouts
from benchmarks import refit as rf
from benchmarks import torch_backends as tb
from benchmarks.layouts import GRAMMAR, Layout, torch_layout

HF = "hf"
DEFAULT_LAYOUTS = ["fsdp1-dp2", "dtensor-dp2", "dtensor-tp2", "jax-fsdp2", "jax-tp2"]
STEPS = 3
LEARNING_RATE = 1e-3
#: Seed of the companion rows of the ``mixed`` variant (the batch itself uses tb.SEED).
OTHER_SEED = 1
#: GRPO step 0: optimizer steps of the one ``train`` call, seed of the advantages.
GRPO_STEPS = 2
GRPO_SEED = 2
#: What ``grpo_step0`` compares besides the gradient norms (``ClippedPGLossFn`` metrics).
GRPO_METRICS = ("loss", "actor_loss", "kl_penalty", "clip_fraction", "probs_ratio")
#: The engine check: prompts x width, tokens sampled per prompt, seed of the prompts and samples.
ENGINE_PROMPTS = 4
ENGINE_PROMPT_WIDTH = 8
ENGINE_NEW_TOKENS = 8
ENGINE_SEED = 3
ENGINE_TRANSPORTS = ("ipc", "collective")

#: ``check -> (comparison, threshold)``; see the table in the module docstring.
TOLERANCES: dict[str, tuple[str, float]] = {
    "logprobs": ("<=", 1e-5),
    "loss_step0": ("<=", 1e-5),
    "grad_norm_step0": ("<=", 1e-5),
    "loss_curve": ("<=", 1e-4),
    "trained_logprobs": ("<=", 1e-4),
    "batch_invariance": ("<=", 1e-5),
    "crossload": ("<=", 1e-5),
    "weights_moved": (">=", 1e-3),
    "dcp_crossload": ("<=", 1e-5),
    "dcp_resume": ("<=", 1e-4),
    "grpo_step0": ("<=", 1e-5),
    "token_mult_prob_error": ("<=", 1.0001),
}
#: ``--precision bfloat16`` (bf16 compute, fp32 master weights and AdamW state, HF reference under
#: CPU autocast).  What differs between layouts is where bf16 rounds a matmul's *inputs*
#: (relative 2**-9 ~ 2e-3 per operand; CPU kernels accumulate in fp32): FSDP casts the norms'
#: weights too while autocast keeps them fp32, TP rounds partial products of other shapes.
#: Measured maxima on the tiny Llama, 5 layouts (README): logprobs 3.0e-3, loss 4.8e-5, grad
#: norm 1.7e-3 (rel), 3-step curve 1.3e-4, trained logprobs 7.5e-3, GRPO metrics 2.9e-3, batch
#: invariance 9.7e-4, cross-loads 4.2e-3.  The bands are ~3-4x those maxima -- far below what a
#: real error does (a wrong shard, mask or position moves logprobs by tenths of a nat or more).
#: Measured on CPU; a GPU's bf16 GEMMs (other accumulation orders) may need their own bands.
BF16_TOLERANCES: dict[str, tuple[str, float]] = {
    **TOLERANCES,
    "logprobs": ("<=", 1e-2),
    "loss_step0": ("<=", 2e-4),
    "grad_norm_step0": ("<=", 5e-3),
    "loss_curve": ("<=", 5e-4),
    "trained_logprobs": ("<=", 3e-2),
    "batch_invariance": ("<=", 4e-3),
    "crossload": ("<=", 1.5e-2),
    "dcp_crossload": ("<=", 1.5e-2),
    "dcp_resume": ("<=", 1.5e-2),
    "grpo_step0": ("<=", 1e-2),
    "token_mult_prob_error": ("<=", 1.01),  # not measured in bf16 here (the engine is opt-in)
}
#: Checks between two layouts (every pair of ``hf`` + layouts), the rest are per layout.
PAIRWISE = ("logprobs", "loss_step0", "grad_norm_step0", "loss_curve", "trained_logprobs", "grpo_step0")
VARIANTS = ("alone", "alone_trimmed", "reversed", "mixed")


# ----------------------------------------------------------------------------- layouts / model

def jax_devices(name: str) -> int | None:
    """XLA host devices the layout's actor needs (``None``: a torch layout)."""
    layout = jb.jax_layout(name)
    return layout.devices if layout else None


def check_arguments(layouts: list[str], engine: Any, crossload: str, seq: int, steps: int) -> None:
    """``ValueError`` for what makes the whole run meaningless (before anything starts); a bad
    *layout* is not one of them (:func:`layout_problem`: that layout gets an error line)."""
    if not layouts:
        raise ValueError("no layouts given")
    if len(set(layouts)) != len(layouts):
        raise ValueError(f"a layout is given twice: {layouts}")
    if isinstance(engine, (list, tuple)) and (unknown := [n for n in engine if n not in layouts]):
        raise ValueError(f"--engine {' '.join(unknown)}: not among the layouts {layouts}")
    crossload_pairs(layouts, crossload)
    if seq < 2 or steps < 1:
        raise ValueError(f"seq must be >= 2 and steps >= 1, got seq={seq}, steps={steps}")


def layout_problem(name: str, batch: int, threads: int, ray_cpus: float | None) -> str | None:
    """Why ``name`` cannot run here (unknown, does not fit, batch), or ``None``.  See "Bad
    input" in the module docstring for what *fits* means."""
    jax = jb.jax_layout(name)
    layout = torch_layout(name)
    if jax is None and layout is None:
        return (f"unknown layout {name!r}: one of {', '.join(tb.LAYOUTS)}, or by the grammar "
                f"{GRAMMAR}")
    cpus = "" if ray_cpus is None else f" (the Ray cluster has {ray_cpus:g} CPUs)"
    if layout is not None:
        if layout.workers > threads:
            return (f"does not fit: {name} needs {layout.workers} workers, each with a CPU thread of its own; "
                    f"the thread budget --threads {threads} gives at most {threads}{cpus}")
        need = layout.workers * (threads // layout.workers)
        if ray_cpus is not None and need > ray_cpus:
            return f"does not fit: {name} needs {layout.workers} x {threads // layout.workers} CPUs{cpus}"
        if batch % layout.dp:
            return f"batch {batch} is not divisible by its data-parallel size {layout.dp}"
    elif ray_cpus is not None and threads > ray_cpus:
        return f"does not fit: {name} is one actor of --threads {threads} CPUs{cpus}"
    return None


def jax_model_problem(model: str, model_path: str) -> str | None:
    """Why the JAX backend cannot load this model (its own check on the HF config), or ``None``."""
    from transformers import AutoConfig

    return layouts.jax_model_problem(AutoConfig.from_pretrained(model_path), model)


def resolve_model(model: str) -> str:
    """``tiny-qwen2`` -> ``qwen2`` (a ``core.testing`` tiny model) unless a path of that name exists;
    anything else (tiny name, local path, hub id) goes to ``torch_backends.prepare_model`` as is."""
    from core.testing.tiny_models import TINY_MODELS

    if model.startswith("tiny-") and model[len("tiny-"):] in TINY_MODELS and not Path(model).exists():
        return model[len("tiny-"):]
    return model


def save_tiny_gpt2(path: Path) -> Path:
    """A random tiny GPT-2 (a family the JAX backend does not support), saved like the
    ``core.testing`` tiny models: the model in ``path``, the word-level tokenizer in ``path/tokenizer``."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    from core.testing.tiny_models import BOS_ID, EOS_ID, MAX_POSITIONS, PAD_ID, TINY_VOCAB_SIZE, tiny_tokenizer

    torch.manual_seed(0)
    # No dropout (GPT-2's default is 0.1): a training step must be a function of the weights.
    config = GPT2Config(vocab_size=TINY_VOCAB_SIZE, n_positions=MAX_POSITIONS, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path / "tokenizer")
    return path


def save_tiny_llama_hd32(path: Path) -> Path:
    """Tiny llama with head_dim 32 (``core.testing``'s ``llama`` at hidden 128 / intermediate 256,
    same 4 heads, 2 kv heads, init and seed): vLLM's CPU attention has kernels for head_dim 32,
    not for the 16 of ``llama``, so this is the tiny llama the engine check can serve.  (``llama_gen``
    serves too, but its wide init makes logits large and fp32 rounding on the TP layouts exceed
    the tolerances above.)"""
    import torch
    from transformers import AutoModelForCausalLM

    from core.testing.tiny_models import tiny_config, tiny_tokenizer

    config = tiny_config("llama")
    config.hidden_size, config.intermediate_size = 128, 256
    config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path / "tokenizer")
    return path


#: Tiny models built here (no download): name -> builder of the model dir (tokenizer in ``tokenizer/``).
LOCAL_MODELS: dict[str, Callable[[Path], Path]] = {"tiny-gpt2": save_tiny_gpt2,
                                                   "tiny-llama-hd32": save_tiny_llama_hd32}


def prepare_model(model: str, root: Path) -> tuple[str, str]:
    """``(model path, tokenizer path)``: :data:`LOCAL_MODELS` built here, the rest by ``torch_backends``."""
    if model in LOCAL_MODELS and not Path(model).exists():
        path = LOCAL_MODELS[model](root / model)
        return str(path), str(path / "tokenizer")
    return tb.prepare_model(resolve_model(model), root)


def parity_settings(cfg: dict, lr: float) -> dict:
    """The policy section of a parity run: a constant learning rate large enough that 3 steps
    move the weights visibly (the default 5e-6 with a 10-step warm-up barely does), so that the
    loss curve and the cross-loaded export test trained weights, not the initial ones."""
    cfg["optimizer"]["kwargs"]["lr"] = lr
    cfg["scheduler"] = None
    return cfg


# ----------------------------------------------------------------------------- policy runners


class _ParitySettings:
    """Mixin over the benchmark runners: their cluster/Policy start-up, with ``parity_settings``."""

    def _start(self, name, cfg, tokenizer, args, *rest):
        super()._start(name, parity_settings(cfg, args.lr), tokenizer, args, *rest)


class TorchParityRunner(_ParitySettings, tb.PolicyRunner):
    """A torch layout as ``benchmarks.torch_backends`` starts it (one micro batch per rank)."""


class JaxParityRunner(_ParitySettings, jb.JaxPolicyRunner):
    """A JAX layout as ``benchmarks.jax_backend`` starts it (one actor, one micro batch)."""


class TorchPolicyStart(tb.PolicyRunner):
    """A torch layout started the way ``torch_backends.PolicyRunner`` starts one (its ``close``) -- its policy
    section (``policy_config`` + ``parity_settings``), a cluster of one bundle of
    ``--threads // workers`` CPUs per worker, gbs = the batch, one micro batch per rank -- for
    what that runner does not do: a layout name it does not list, and a Policy constructed
    from a DCP checkpoint (``weights_path`` / ``optimizer_path``)."""

    def __init__(self, layout: Layout, model_path: str, tokenizer_path: str, tokenizer, args,
                 weights_path: str | None = None, optimizer_path: str | None = None, tag: str = "parity") -> None:
        from core.distributed import RayVirtualCluster
        from core.policy import Policy

        cfg = parity_settings(tb.policy_config(model_path, tokenizer_path, layout, args.batch, args.seq,
                                               args.precision), args.lr)
        self.name = layout.name
        self._gbs, self._mbs = args.batch, cfg["train_micro_batch_size"]
        self._cluster = RayVirtualCluster([layout.workers], use_gpus=False,
                                          num_cpus_per_bundle=max(1, args.threads // layout.workers),
                                          name=f"{tag}-{layout.name}")
        self._policy = None
        try:
            t0 = time.perf_counter()
            self._policy = Policy(self._cluster, cfg, tokenizer, name_prefix=f"{tag}-{layout.name}",
                                  weights_path=weights_path, optimizer_path=optimizer_path)
            self.startup_s = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise


def new_runner(name: str, model_path: str, tokenizer_path: str, tokenizer, args):
    """The runner of ``name`` on ``model_path`` (Ray must already be up with the right devices)."""
    print(f"[parity] starting {name} on {model_path} ...", file=sys.stderr, flush=True)
    if jax_devices(name):
        return JaxParityRunner(name, model_path, tokenizer_path, tokenizer, args)
    if name in tb.LAYOUTS:
        return TorchParityRunner(name, model_path, tokenizer_path, tokenizer, args)
    return TorchPolicyStart(torch_layout(name), model_path, tokenizer_path, tokenizer, args)


# ----------------------------------------------------------------------------- measurements


def _inputs(ids, lengths):
    from core.data import BatchedDataDict

    return BatchedDataDict(input_ids=ids.contiguous(), input_lengths=lengths.contiguous())


def max_abs_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def batch_invariance(logprobs: Callable, data, other, full) -> dict[str, float]:
    """Largest deviation per variant of a row's logprobs from the same row in ``full``, the
    logprobs of the whole batch on the same weights (``logprobs(ids, lengths) -> [b, s]``)."""
    import torch

    ids, lengths = data["input_ids"], data["input_lengths"]
    rows = len(ids)
    dev = {}
    # A batch of one at the same width: the longest row and the last one.
    dev["alone"] = max(max_abs_diff(logprobs(ids[r:r + 1], lengths[r:r + 1])[0], full[r]) for r in {0, rows - 1})
    # A batch of only the shortest row is only as wide as that row (the width is a batch property).
    r = int(torch.argmin(lengths))
    n = int(lengths[r])
    dev["alone_trimmed"] = max_abs_diff(logprobs(ids[r:r + 1, :n], lengths[r:r + 1])[0], full[r, :n])
    order = torch.arange(rows).flip(0)
    dev["reversed"] = max_abs_diff(logprobs(ids[order], lengths[order]).flip(0), full)
    # Rows 0..h-1 at the even positions, companions from another batch at the odd ones: on a
    # dp=2 layout this changes both the rank a row lands on and its micro-batch neighbours.
    h = max(1, rows // 2)
    mixed_ids = torch.stack([t for pair in zip(ids[:h], other["input_ids"][:h]) for t in pair])
    mixed_len = torch.stack([t for pair in zip(lengths[:h], other["input_lengths"][:h]) for t in pair])
    dev["mixed"] = max_abs_diff(logprobs(mixed_ids, mixed_len)[0::2], full[:h])
    return dev


def train_steps(step: Callable, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` calls of ``step() -> (loss, grad_norm)``; the losses and norms."""
    losses, norms = [], []
    for _ in range(steps):
        loss, norm = step()
        losses.append(loss)
        norms.append(norm)
    return losses, norms


def measure(logprobs: Callable, step: Callable, data, other, steps: int, grpo: Callable | None = None) -> dict:
    """Initial logprobs, batch invariance, GRPO step 0 (``grpo() -> summary``, if given),
    ``steps`` NLL training steps, trained logprobs -- in this order, so the first three see the
    initial weights (and GRPO a fresh optimizer)."""
    initial = logprobs(data["input_ids"], data["input_lengths"])
    out = {"logprobs": initial, "invariance": batch_invariance(logprobs, data, other, initial)}
    if grpo is not None:
        t0 = time.perf_counter()
        out["grpo"] = grpo()
        out["grpo_s"] = time.perf_counter() - t0
    out["loss"], out["grad_norm"] = train_steps(step, steps)
    out["trained_logprobs"] = logprobs(data["input_ids"], data["input_lengths"])
    return out


def policy_logprobs(policy, ids, lengths):
    return policy.get_logprobs(_inputs(ids, lengths))["logprobs"]


def nll_step(runner, data) -> tuple[float, float]:
    """One ``policy.train`` call of ``NLLLoss`` with the runner's gbs/mbs; (loss, grad norm)."""
    from core.losses import NLLLoss

    out = runner._policy.train(data, NLLLoss(), gbs=runner._gbs, mbs=runner._mbs)
    return float(out["loss"][0]), float(out["grad_norm"][0])


def measure_policy(runner, data, other, steps: int, grpo_base=None, grpo_steps: int = GRPO_STEPS) -> dict:
    """:func:`measure` on a runner's Policy: ``NLLLoss``, the runner's gbs/mbs (one micro batch
    per data-parallel rank, one optimizer step per ``train`` call); GRPO on ``grpo_base``."""
    policy = runner._policy  # the runners keep their Policy private; the benchmarks read it too
    grpo = None if grpo_base is None else (lambda: grpo_policy(runner, grpo_base, grpo_steps))
    return measure(lambda ids, lengths: policy_logprobs(policy, ids, lengths), lambda: nll_step(runner, data),
                   data, other, steps, grpo)


def after_one_more_step(runner, data) -> dict:
    """``dcp_resume``'s measurement: one more NLL step, then the logprobs of the batch."""
    loss, norm = nll_step(runner, data)
    return {"loss": loss, "grad_norm": norm,
            "logprobs": policy_logprobs(runner._policy, data["input_ids"], data["input_lengths"])}


# ----------------------------------------------------------------------------- GRPO step 0


def grpo_loss_fn():
    """``ClippedPGLossFn`` as ``core/configs/default.yaml``'s ``loss_fn`` section configures it."""
    from core.config.loader import DEFAULT_CONFIG_PATH, load_config
    from core.losses import ClippedPGLossFn

    return ClippedPGLossFn(load_config(DEFAULT_CONFIG_PATH)["loss_fn"])


def grpo_batch(data, generation_logprobs, seed: int = GRPO_SEED):
    """The GRPO train batch of the parity batch, keyed and masked as
    ``core.algorithms.rollouts.training_batch`` builds one: the first third of each ragged row
    (at least one token) is its "prompt", the rest its "response" (``token_mask`` = 1 there);
    advantages: a seeded normal draw per row; ``generation_logprobs``: given (``hf``'s)."""
    import torch

    from core.data import BatchedDataDict

    ids, lengths = data["input_ids"], data["input_lengths"]
    prompt = (lengths // 3).clamp_min(1)
    cols = torch.arange(ids.shape[1])[None]
    mask = ((cols >= prompt[:, None]) & (cols < lengths[:, None])).float()
    advantages = torch.randn(len(ids), generator=torch.Generator().manual_seed(seed))
    return BatchedDataDict(input_ids=ids.clone(), input_lengths=lengths.clone(), token_mask=mask,
                           sample_mask=torch.ones(len(ids)), advantages=advantages[:, None] * mask,
                           generation_logprobs=generation_logprobs.float() * mask)


def grpo_summary(losses, norms, metrics: dict[str, list[float]]) -> dict:
    """The JSON-able GRPO step-0 numbers: per optimizer step loss, grad norm and the compared metrics."""
    return {"loss": [float(x) for x in losses], "grad_norm": [float(x) for x in norms],
            "metrics": {k: [float(x) for x in metrics[k]] for k in GRPO_METRICS if k in metrics and k != "loss"}}


def grpo_policy(runner, base, steps: int = GRPO_STEPS) -> dict:
    """The training part of ``core.algorithms.grpo.grpo_step`` on a layout at its initial weights:
    prev and reference logprobs from the policy itself, then one ``train`` call of ``steps``
    global batches (``mbs`` = one micro batch per data-parallel rank)."""
    from core.data import BatchedDataDict

    policy = runner._policy
    rows = base["input_ids"].shape[0]
    if rows % (steps * policy.dp):
        raise ValueError(f"grpo_step0 needs the batch ({rows}) divisible by {steps} steps x dp {policy.dp}")
    gbs = rows // steps
    data = BatchedDataDict(dict(base))
    policy.prepare_for_lp_inference()
    data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
    data["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    policy.prepare_for_training()
    result = policy.train(data, grpo_loss_fn(), gbs=gbs, mbs=gbs // policy.dp)
    policy.finish_training()
    return grpo_summary(result["loss"].tolist(), result["grad_norm"].tolist(),
                        {k: v.tolist() for k, v in result["metrics"].items()})


# ----------------------------------------------------------------------------- hf reference


class HFReference:
    """Single-process ``AutoModelForCausalLM`` in fp32: the reference every layout is held to."""

    def __init__(self, model_path: str, cfg: dict, precision: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.cfg = cfg
        # bf16: the workers' recipe (bf16 compute over fp32 weights) as CPU autocast does it
        self.autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16")
        self._opt = None  # one AdamW for every train step (GRPO's, then NLL's), as a Policy has

    def logprobs(self, ids, lengths):
        """``[0, logp...]``, padding 0; log_softmax in float64 as tests/torch_backends does."""
        import torch

        mask = torch.arange(ids.shape[1])[None] < lengths[:, None]
        self.model.eval()
        with torch.no_grad(), self.autocast():
            logits = self.model(input_ids=ids, attention_mask=mask.long()).logits.double()
        lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        lp = torch.cat([torch.zeros(lp.shape[0], 1, dtype=lp.dtype), lp], 1)
        return (lp * mask).float()

    def trainer(self, data, loss_fn=None) -> Callable[[], tuple[float, float, dict]]:
        """One step = full-batch forward, the workers' loss code (``NLLLoss`` by default),
        backward, pre-clipping global norm, clipping and AdamW with the policy section's
        settings; a step returns (loss, grad norm, the loss's metrics)."""
        import torch

        from core.losses import NLLLoss

        loss_fn = loss_fn or NLLLoss()
        params = list(self.model.parameters())
        if self._opt is None:
            kwargs = dict(self.cfg["optimizer"]["kwargs"])
            kwargs["betas"] = tuple(kwargs["betas"])
            self._opt = torch.optim.AdamW(params, **kwargs)
        opt = self._opt
        max_norm = self.cfg["max_grad_norm"]

        def step(batch=data):
            ids = batch["input_ids"]
            mask = (torch.arange(ids.shape[1])[None] < batch["input_lengths"][:, None]).long()
            self.model.train()
            opt.zero_grad(set_to_none=True)
            with self.autocast():
                logits = self.model(input_ids=ids, attention_mask=mask).logits
            loss, metrics = loss_fn(logits.float(), batch, None, None)
            loss.backward()
            grads = [p.grad for p in params if p.grad is not None]
            norm = (torch.nn.utils.clip_grad_norm_(params, max_norm) if max_norm is not None
                    else torch.nn.utils.get_total_norm(grads))
            opt.step()
            return float(loss.detach()), float(norm), {k: float(v) for k, v in metrics.items()}

        return step

    def measure(self, data, other, steps: int, grpo_base=None, grpo_steps: int = GRPO_STEPS) -> dict:
        step = self.trainer(data)
        grpo = None if grpo_base is None else (lambda: self.grpo(grpo_base, grpo_steps))
        return measure(self.logprobs, lambda: step()[:2], data, other, steps, grpo)

    def grpo(self, base, steps: int = GRPO_STEPS) -> dict:
        """:func:`grpo_policy` in this process, at the current weights."""
        data = dict(base)
        data["prev_logprobs"] = data["reference_policy_logprobs"] = self.logprobs(data["input_ids"],
                                                                                  data["input_lengths"])
        step = self.trainer(data, grpo_loss_fn())
        gbs = len(data["input_ids"]) // steps
        losses, norms, metrics = [], [], {}
        for g in range(steps):
            loss, norm, m = step({k: v[g * gbs:(g + 1) * gbs] for k, v in data.items()})
            losses.append(loss)
            norms.append(norm)
            for k, v in m.items():
                metrics.setdefault(k, []).append(v)
        return grpo_summary(losses, norms, metrics)


def hf_export_logprobs(path: str, data, precision: str = "float32"):
    """Logprobs of an HF export loaded in this process (the ``hf`` cross-load target)."""
    return HFReference(path, {}, precision).logprobs(data["input_ids"], data["input_lengths"])


# ----------------------------------------------------------------------------- vLLM engine


def engine_prompts(vocab: int, bos_id: int | None):
    """The engine check's prompts: ragged random ids (BOS first), seeded per-row sampling."""
    from core.algorithms.rollouts import sample_seeds
    from core.data import BatchedDataDict
    from core.testing.tiny_models import random_batch

    ids, lengths = random_batch(ENGINE_PROMPTS, ENGINE_PROMPT_WIDTH, vocab, seed=ENGINE_SEED, min_len=3)
    if bos_id is not None:
        ids[:, 0] = bos_id
    return BatchedDataDict(input_ids=ids, input_lengths=lengths,
                           sample_seeds=sample_seeds(ENGINE_SEED, 0, ENGINE_PROMPTS))


def parity_engine(model_path: str, tokenizer_path: str, tokenizer, args):
    """One vLLM engine (``benchmarks.refit.Engine``: ``VllmGeneration``, tensor parallel 1, a one-bundle
    cluster of ``--threads`` CPUs) with the run's policy section, fp32, ``ENGINE_NEW_TOKENS`` sampled
    tokens at temperature 1."""
    cfg = tb.policy_config(model_path, tokenizer_path, Layout("engine", "torch_fsdp"), args.batch, args.seq,
                           args.precision)
    cfg["generation"].update(backend="vllm", max_new_tokens=ENGINE_NEW_TOKENS, temperature=1.0, top_p=1.0,
                             top_k=None)
    cfg["generation"]["vllm_cfg"].update(max_model_len=args.seq, precision=args.precision)
    return rf.Engine(model_path, tokenizer_path, tokenizer, args, cfg=cfg, name="parity-vllm")


def engine_check(policy, generation, prompts, transports=ENGINE_TRANSPORTS) -> dict:
    """Per transport: refit ``generation`` from ``policy``, sample, and compare the engine's
    logprobs of the sampled tokens with ``policy.get_logprobs`` of the sequences."""
    from core.algorithms.rollouts import generation_mask
    from core.kernels import generation_policy_kl, token_mult_prob_error
    from core.refit import refit_policy_generation

    per = {}
    for transport in transports:
        stats = refit_policy_generation(policy, generation, transport)
        out = generation.generate(prompts, greedy=False)
        lp = policy_logprobs(policy, out["output_ids"], out["unpadded_sequence_lengths"])
        mask = generation_mask(out, prompts["input_lengths"])
        if not int(mask.sum()):
            raise RuntimeError(f"the engine generated no tokens after the {transport} refit")
        gen = out["logprobs"].float()
        per[transport] = {
            "token_mult_prob_error": float(token_mult_prob_error(gen, lp, mask)),
            "max_abs_diff": float(((gen.double() - lp.double()).abs() * mask).max()),
            "gen_kl_error": float(generation_policy_kl(gen, lp, mask)),
            "tokens": int(mask.sum()), "refit_s": stats.seconds,
        }
    worst = max(per, key=lambda t: per[t]["token_mult_prob_error"])
    return {"token_mult_prob_error": per[worst]["token_mult_prob_error"], "transports": per}


# ----------------------------------------------------------------------------- comparison


def scalar_diff(a: float, b: float) -> float:
    """Absolute below 1, relative above (see the tolerance table)."""
    return abs(a - b) / max(1.0, abs(a), abs(b))


def judge(check: str, value: float, tolerances: dict | None = None) -> bool:
    """Whether ``value`` passes ``check``; NaN never does."""
    op, tol = (tolerances or TOLERANCES)[check]
    return value <= tol if op == "<=" else value >= tol


def _record(check: str, a: str, b: str | None, value: float, tolerances: dict, **detail) -> dict:
    op, tol = tolerances[check]
    return {"check": check, "a": a, "b": b, "value": value, "op": op, "tol": tol,
            "pass": judge(check, value, tolerances), **detail}


def grpo_diffs(x: dict, y: dict) -> dict[str, float]:
    """Per compared quantity of two GRPO step-0 summaries: the largest scalar measure over the steps."""
    def worst(p, q):
        return max((scalar_diff(a, b) for a, b in zip(p, q)), default=0.0) if len(p) == len(q) else float("nan")

    out = {"grad_norm": worst(x["grad_norm"], y["grad_norm"]), "loss": worst(x["loss"], y["loss"])}
    for key in GRPO_METRICS:
        p, q = x["metrics"].get(key), y["metrics"].get(key)
        if p is not None or q is not None:  # reported by one side only: NaN, never a pass
            out[key] = worst(p, q) if p is not None and q is not None else float("nan")
    return out


def pairwise_value(check: str, x: dict, y: dict) -> float:
    if check in ("logprobs", "trained_logprobs"):
        return max_abs_diff(x[check], y[check])
    if check == "loss_step0":
        return scalar_diff(x["loss"][0], y["loss"][0])
    if check == "grad_norm_step0":
        return scalar_diff(x["grad_norm"][0], y["grad_norm"][0])
    if check == "loss_curve":
        return max(scalar_diff(p, q) for p, q in zip(x["loss"], y["loss"]))
    if check == "grpo_step0":
        return max(grpo_diffs(x["grpo"], y["grpo"]).values())
    raise KeyError(check)


def evaluate(measured: dict[str, dict], crossloaded: dict[tuple[str, str], Any],
             tolerances: dict | None = None, dcp: dict[tuple[str, str], dict] | None = None) -> list[dict]:
    """Every check on raw measurements: ``measured[name]`` as :func:`measure_policy` returns it
    (``hf`` first; with ``grpo`` / ``engine`` / ``resumed`` entries where those ran),
    ``crossloaded[(source, target)]`` the target's logprobs of the source's export,
    ``dcp[(source, target)]`` the target's ``logprobs`` after loading the source's DCP
    checkpoint and its ``resumed`` measurement after one more step."""
    tolerances = tolerances or TOLERANCES
    names = list(measured)
    checks = []
    for check in PAIRWISE:
        for a, b in itertools.combinations(names, 2):
            if check == "grpo_step0":
                if "grpo" in measured[a] and "grpo" in measured[b]:
                    diffs = grpo_diffs(measured[a]["grpo"], measured[b]["grpo"])
                    checks.append(_record(check, a, b, max(diffs.values()), tolerances, per_quantity=diffs))
                continue
            checks.append(_record(check, a, b, pairwise_value(check, measured[a], measured[b]), tolerances))
    for name in names:
        inv = measured[name]["invariance"]
        checks.append(_record("batch_invariance", name, None, max(inv.values()), tolerances,
                              variants=dict(inv), bitwise={k: v == 0.0 for k, v in inv.items()}))
        moved = max_abs_diff(measured[name]["trained_logprobs"], measured[name]["logprobs"])
        checks.append(_record("weights_moved", name, None, moved, tolerances))
        if "engine" in measured[name]:
            engine = measured[name]["engine"]
            checks.append(_record("token_mult_prob_error", name, None, engine["token_mult_prob_error"], tolerances,
                                  transports=engine["transports"]))
    for (src, tgt), logprobs in crossloaded.items():
        value = max_abs_diff(logprobs, measured[src]["trained_logprobs"])
        checks.append(_record("crossload", src, tgt, value, tolerances))
    for (src, tgt), loaded in (dcp or {}).items():
        checks.append(_record("dcp_crossload", src, tgt, max_abs_diff(loaded["logprobs"],
                                                                      measured[src]["trained_logprobs"]), tolerances))
        source = measured[src]["resumed"]
        checks.append(_record("dcp_resume", src, tgt, max_abs_diff(loaded["resumed"]["logprobs"], source["logprobs"]),
                              tolerances, loss=[source["loss"], loaded["resumed"]["loss"]],
                              grad_norm=[source["grad_norm"], loaded["resumed"]["grad_norm"]]))
    return checks


def crossload_pairs(names: list[str], mode: str) -> list[tuple[str, str]]:
    """(source, target) pairs of layouts; ``hf`` as a target of every source is added by the caller."""
    if mode not in ("ring", "full"):
        raise ValueError(f"crossload mode {mode!r}: ring or full")
    if len(names) < 2:
        return []
    if mode == "full":
        return [(a, b) for a in names for b in names if a != b]
    # ring; with two layouts each loads the other's export
    return [(names[i], names[(i + 1) % len(names)]) for i in range(len(names))]


# ----------------------------------------------------------------------------- run


def _error(what: str, err: BaseException) -> str:
    """One line for the report (called in the ``except`` block: the traceback goes to stderr)."""
    traceback.print_exc()
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{what}: {type(err).__name__}: {lines[-1].strip() if lines else ''}"


class ParityRun:
    """The state of one :func:`run_parity`: model, batches, Ray session, the engine, results."""

    def __init__(self, args, model_path: str, tokenizer_path: str, tokenizer, session, tmp: Path) -> None:
        self.args, self.session, self.tmp = args, session, tmp
        self.paths, self.tokenizer = (model_path, tokenizer_path), tokenizer
        self.measured: dict[str, dict] = {}
        self.crossloaded: dict[tuple[str, str], Any] = {}
        self.dcp: dict[tuple[str, str], dict] = {}
        self.errors: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self.timings: dict[str, float] = {}
        self.engine: rf.Engine | None = None
        self.engine_error: str | None = None
        self.engine_startup_s: list[float] = []

    # ------------------------------------------------------------------ Ray / engine
    def start(self, name: str, model_path: str | None = None):
        """A runner of ``name`` (initial model by default); Ray restarted first if the layout
        needs another XLA device count (the engine is closed first: it would die with Ray)."""
        devices = jax_devices(name)
        if (self.engine is not None and self.session.owned and devices is not None
                and devices != self.session.devices):
            self.close_engine()
        self.session.start(devices)
        return new_runner(name, model_path or self.paths[0], self.paths[1], self.tokenizer, self.args)

    def get_engine(self) -> rf.Engine | None:
        """The engine (started on first use, replaced if it died); ``None`` once it failed to start."""
        if self.engine_error is not None:
            return None
        if self.engine is not None and not self.engine.alive():
            self.close_engine()
        if self.engine is None:
            try:
                self.engine = parity_engine(*self.paths, self.tokenizer, self.args)
                self.engine_startup_s.append(self.engine.startup_s)
            except Exception as err:  # noqa: BLE001 -- one error line, every other check still runs
                self.engine_error = _error("token_mult_prob_error: the vLLM engine did not start", err)
                self.errors["engine"] = self.engine_error
                return None
        return self.engine

    def close_engine(self) -> None:
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:  # noqa: BLE001 -- a dead engine's shutdown may fail; nothing left to free
                traceback.print_exc()
            self.engine = None

    # ------------------------------------------------------------------ phases
    def measure_layout(self, name: str, data, other, grpo_base, grpo_steps: int, engine: bool, prompts,
                       dcp_source: bool) -> None:
        """Start ``name`` on the initial model; measure (GRPO step 0 included); export (HF); the
        engine check; the DCP checkpoint and one more step (a DCP source); shut it down."""
        t0 = time.perf_counter()
        runner = self.start(name)
        try:
            startup = time.perf_counter() - t0
            out = measure_policy(runner, data, other, self.args.steps, grpo_base, grpo_steps)
            export = self.tmp / f"export-{name}"
            runner._policy.save_hf_checkpoint(str(export))
            out.update(startup_s=startup, export=str(export))
            self.measured[name] = out
            if engine:
                self.engine_layout(name, runner._policy, prompts)
            if dcp_source:
                self.dcp_save(name, runner, data)
        finally:
            runner.close()
            if name in self.measured:
                self.measured[name]["seconds"] = time.perf_counter() - t0

    def dcp_save(self, name: str, runner, data) -> None:
        """``save_checkpoint`` (weights + optimizer) of the trained policy, then one more step."""
        out = self.measured[name]
        try:
            weights, optim = self.tmp / f"dcp-{name}" / "weights", self.tmp / f"dcp-{name}" / "optim"
            runner._policy.save_checkpoint(str(weights), str(optim))
            resumed = after_one_more_step(runner, data)
            out.update(dcp={"weights": str(weights), "optimizer": str(optim)}, resumed=resumed)
        except Exception as err:  # noqa: BLE001 -- the layout's other checks stand
            self.errors[f"dcp {name}"] = _error(f"dcp_crossload {name}: save_checkpoint", err)

    def engine_layout(self, name: str, policy, prompts) -> None:
        generation = self.get_engine()
        if generation is None:
            return
        try:
            t0 = time.perf_counter()
            self.measured[name]["engine"] = engine_check(policy, generation.generation, prompts)
            self.timings[f"engine {name}"] = time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001
            message = _error(f"token_mult_prob_error {name}", err)
            if "head_dim" in message:  # the model, not the layout: the next layouts would fail alike
                message += " (vLLM's CPU attention has no kernel for this head_dim: try --model tiny-llama-hd32)"
                self.engine_error = message
            self.errors[f"engine {name}"] = message

    def crossload(self, src: str, tgt: str, data) -> None:
        """``tgt``'s logprobs of ``src``'s export (``tgt`` = ``hf``: loaded in this process)."""
        export = self.measured[src]["export"]
        t0 = time.perf_counter()
        try:
            if tgt == HF:
                self.crossloaded[(src, tgt)] = hf_export_logprobs(export, data, self.args.precision)
            else:
                runner = self.start(tgt, export)
                try:
                    self.crossloaded[(src, tgt)] = policy_logprobs(runner._policy, data["input_ids"],
                                                                   data["input_lengths"])
                finally:
                    runner.close()
            self.timings[f"{src} -> {tgt}"] = time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001
            self.errors[f"{src} -> {tgt}"] = _error(f"crossload {src} -> {tgt}", err)

    def dcp_load(self, src: str, tgt: str, data) -> None:
        """``tgt`` started on the initial model with ``src``'s DCP checkpoint: its logprobs, then
        one more step (from the loaded optimizer state) and its logprobs."""
        ckpt = self.measured[src]["dcp"]
        print(f"[parity] starting {tgt} from {src}'s DCP checkpoint ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            self.session.start(None)
            runner = TorchPolicyStart(torch_layout(tgt), *self.paths, self.tokenizer, self.args,
                                      weights_path=ckpt["weights"], optimizer_path=ckpt["optimizer"], tag="parity-dcp")
            try:
                loaded = {"logprobs": policy_logprobs(runner._policy, data["input_ids"], data["input_lengths"])}
                loaded["resumed"] = after_one_more_step(runner, data)
            finally:
                runner.close()
            self.dcp[(src, tgt)] = loaded
            self.timings[f"dcp {src} -> {tgt}"] = time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001
            self.errors[f"dcp {src} -> {tgt}"] = _error(f"dcp_crossload {src} -> {tgt}", err)


def dcp_ring(names: list[str]) -> list[tuple[str, str]]:
    """(source, target) DCP pairs: a ring over the torch layouts (none with fewer than two)."""
    torch_names = [n for n in names if torch_layout(n) is not None]
    return crossload_pairs(torch_names, "ring")


def _ray_cpus() -> float | None:
    import ray

    return ray.cluster_resources().get("CPU") if ray.is_initialized() else None


def run_parity(layouts: list[str] | None = None, model: str = "llama", *, batch: int = 8, seq: int = 24,
               threads: int = 2, crossload: str = "ring", lr: float = LEARNING_RATE, steps: int = STEPS,
               engine: bool | list[str] = False, tolerances: dict | None = None, precision: str = "float32") -> dict:
    """Measure ``hf`` and every layout, compare them; the results (plain JSON-able data).

    ``engine``: the ``token_mult_prob_error`` check on every layout (``True``) or on the named
    ones.  A layout that cannot run is reported (``errors``) and the others still run;
    ``ValueError`` only for arguments that make the whole run meaningless."""
    layouts = list(DEFAULT_LAYOUTS if layouts is None else layouts)
    check_arguments(layouts, engine, crossload, seq, steps)
    engine_layouts = list(layouts) if engine is True else list(engine or [])
    import ray

    from core.testing.tiny_models import random_batch

    if precision not in ("float32", "bfloat16"):
        raise ValueError(f"precision must be float32 or bfloat16, got {precision!r}")
    tolerances = tolerances or (BF16_TOLERANCES if precision == "bfloat16" else TOLERANCES)
    args = argparse.Namespace(batch=batch, seq=seq, precision=precision, threads=threads, cases=layouts,
                              lr=lr, steps=steps)
    # Ray (when started here) sized for a policy plus, with the engine, its bundle of --threads CPUs.
    ray_threads = threads * (2 if engine_layouts else 1)
    torch_need = [layout.workers * (threads // layout.workers) for layout in map(torch_layout, layouts)
                  if layout is not None and layout.workers <= threads]
    session_args = argparse.Namespace(**{**vars(args), "threads": ray_threads,
                                         "ray_cpus": max([4, ray_threads, *torch_need])})
    wall0 = time.perf_counter()
    cfg = parity_settings(tb.default_policy_section(), lr)
    with tempfile.TemporaryDirectory(prefix="dualrl-parity-") as tmp:
        model_path, tokenizer_path = prepare_model(model, Path(tmp))
        tokenizer = tb.load_tokenizer(tokenizer_path)
        vocab = tb.vocab_size(model_path)
        data = tb.make_batch(batch, seq, vocab)
        ids, lengths = random_batch(batch, seq, vocab, seed=OTHER_SEED)
        other = {"input_ids": ids, "input_lengths": lengths}
        session = jb.RaySession(session_args)
        run = ParityRun(args, model_path, tokenizer_path, tokenizer, session, Path(tmp))
        t0 = time.perf_counter()
        hf = HFReference(model_path, cfg, precision)
        # GRPO's batch: hf's initial logprobs stand in for the engine's
        base = grpo_batch(data, hf.logprobs(data["input_ids"], data["input_lengths"]))
        grpo_steps = GRPO_STEPS if batch % GRPO_STEPS == 0 else 1
        run.measured[HF] = hf.measure(data, other, steps, base, grpo_steps)
        run.timings[HF] = time.perf_counter() - t0
        prompts = engine_prompts(vocab, getattr(tokenizer, "bos_token_id", None)) if engine_layouts else None
        try:
            first_jax = next((jax_devices(n) for n in layouts if jax_devices(n)), None)
            if session.owned:
                session.start(first_jax)  # once, before any layout (a JAX layout may restart it)
            ray_cpus = _ray_cpus()
            if engine_layouts and ray_cpus is not None and 2 * threads > ray_cpus:
                run.engine_error = run.errors["engine"] = (
                    f"token_mult_prob_error: the vLLM engine does not fit: its bundle of --threads {threads} CPUs "
                    f"next to a policy's needs {2 * threads}, the Ray cluster has {ray_cpus:g}")
            runnable, jax_model = [], None
            for name in layouts:
                problem = layout_problem(name, batch, threads, ray_cpus)
                if problem is None and jax_devices(name) is not None:
                    if jax_model is None:
                        jax_model = jax_model_problem(model, model_path) or ""
                    problem = jax_model or None
                if problem is not None:
                    run.errors[name] = f"{name}: {problem}"
                elif jax_devices(name) is not None and not session.fits(jax_devices(name)):
                    run.skipped[name] = (f"needs {jax_devices(name)} XLA host devices per actor; the caller's "
                                         f"Ray gives {session.devices}")
                else:
                    runnable.append(name)
            dcp_pairs = dcp_ring(runnable)
            dcp_sources = {src for src, _ in dcp_pairs}
            for name in runnable:
                try:
                    run.measure_layout(name, data, other, base, grpo_steps, name in engine_layouts, prompts,
                                       name in dcp_sources)
                    run.timings[name] = run.measured[name]["seconds"]
                except Exception as err:  # noqa: BLE001 -- report it, go on with the other layouts
                    run.measured.pop(name, None)
                    run.errors[name] = _error(name, err)
            run.close_engine()
            ran = [n for n in runnable if n in run.measured]
            for src, tgt in [(n, HF) for n in ran] + crossload_pairs(ran, crossload):
                run.crossload(src, tgt, data)
            for src, tgt in dcp_pairs:
                if "dcp" in run.measured.get(src, {}) and tgt in ran:
                    run.dcp_load(src, tgt, data)
        finally:
            run.close_engine()
            if session.owned and ray.is_initialized():
                ray.shutdown()
        real_tokens = int(data["input_lengths"].sum())
    run.timings["total"] = time.perf_counter() - wall0
    if run.engine_startup_s:
        run.timings["engine start"] = sum(run.engine_startup_s)
    return collect(run.measured, run.crossloaded, errors=run.errors, skipped=run.skipped, seconds=run.timings,
                   tolerances=tolerances, dcp=run.dcp, model=model, layouts=layouts, batch=batch, seq=seq,
                   precision=precision,
                   real_tokens=real_tokens, steps=steps, lr=lr, max_grad_norm=cfg["max_grad_norm"],
                   crossload=crossload, engine_layouts=engine_layouts, grpo_steps=grpo_steps)


def collect(measured: dict[str, dict], crossloaded: dict[tuple[str, str], Any], *, errors: dict | None = None,
            skipped: dict | None = None, seconds: dict | None = None, tolerances: dict | None = None,
            dcp: dict[tuple[str, str], dict] | None = None, **meta) -> dict:
    """The results of a run: ``meta`` (model, batch, ...), every check of :func:`evaluate`, the
    JSON-able numbers of every measurement, errors and skipped layouts, and the verdict."""
    tolerances = tolerances or TOLERANCES
    checks = evaluate(measured, crossloaded, tolerances, dcp)
    errors = dict(errors or {})
    return {
        **meta,
        "tolerances": {k: {"op": op, "tol": tol} for k, (op, tol) in tolerances.items()},
        "measured": {name: _summary(m) for name, m in measured.items()},
        "checks": checks,
        "errors": errors,
        "skipped": dict(skipped or {}),
        "seconds": dict(seconds or {}),
        "passed": passed(checks, errors),
    }


def _summary(m: dict) -> dict:
    """The JSON-able numbers of one measurement (the logprob tensors stay out)."""
    out = {"loss": m["loss"], "grad_norm": m["grad_norm"], "invariance": m["invariance"],
           **{k: m[k] for k in ("startup_s", "seconds", "grpo", "grpo_s", "engine") if k in m}}
    if "resumed" in m:
        out["resumed"] = {k: m["resumed"][k] for k in ("loss", "grad_norm")}
    return out


def passed(checks: list[dict], errors: dict) -> bool:
    return not errors and all(c["pass"] for c in checks)


# ----------------------------------------------------------------------------- report


TITLES = {
    "logprobs": "get_logprobs at the initial weights: max |a - b|",
    "loss_step0": "NLL loss of step 0: |a - b| / max(1, |a|, |b|)",
    "grad_norm_step0": "gradient norm (pre-clip) of step 0: |a - b| / max(1, |a|, |b|)",
    "loss_curve": f"loss curve over {STEPS} AdamW steps: max over steps of |a - b| / max(1, |a|, |b|)",
    "trained_logprobs": f"get_logprobs after {STEPS} steps: max |a - b|",
    "grpo_step0": f"GRPO step 0 (ClippedPGLossFn): max over {', '.join(GRPO_METRICS)}, grad_norm and the "
                  "optimizer steps of |a - b| / max(1, |a|, |b|)",
}


def _cell(c: dict | None) -> str:
    if c is None:
        return "-"
    return f"{c['value']:.1e}" + ("" if c["pass"] else " FAIL")


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def _tolerance(results: dict, check: str) -> str:
    t = results["tolerances"][check]
    return f"{t['op']} {t['tol']:g}"


def _pair_matrix(check: str, names: list[str], by_pair: dict, tolerance: str) -> list[str]:
    """Lower triangle: row layout vs column layout (``hf`` first)."""
    rows = [[""] + names[:-1]]
    for i, a in enumerate(names[1:], start=1):
        rows.append([a] + [_cell(by_pair.get((check, names[j], a)) or by_pair.get((check, a, names[j])))
                           if j < i else "" for j in range(len(names) - 1)])
    return [f"{TITLES[check]}  (pass: {tolerance})", *_table(rows)]


def _per_layout_table(results: dict, by_one: dict) -> list[str]:
    rows = [["layout", "losses (steps 0, 1, ...)", "grad norm step 0", "invariance max dev", "bitwise variants",
             "moved", "seconds"]]
    for name, m in results["measured"].items():
        inv = by_one.get(("batch_invariance", name))
        moved = by_one.get(("weights_moved", name))
        bitwise = [k for k, v in (inv or {}).get("bitwise", {}).items() if v]
        rows.append([name, " ".join(f"{x:.6f}" for x in m["loss"]), f"{m['grad_norm'][0]:.6f}", _cell(inv),
                     ",".join(bitwise) or "none", _cell(moved), f"{results['seconds'].get(name, 0):.1f}"])
    return [f"per layout: losses, step-0 gradient norm, batch invariance (pass: "
            f"{_tolerance(results, 'batch_invariance')}; max over the variants below), logprob change over "
            f"the steps (pass: {_tolerance(results, 'weights_moved')})", *_table(rows)]


def _variant_table(results: dict) -> list[str]:
    rows = [["layout", *VARIANTS]]
    for name, m in results["measured"].items():
        rows.append([name, *(f"{m['invariance'][v]:.1e}" if v in m["invariance"] else "-" for v in VARIANTS)])
    return ["batch invariance per variant: max |row in variant - row in full batch| (0.0e+00 = bitwise)",
            *_table(rows)]


def _grpo_table(results: dict) -> list[str]:
    keys = [k for k in GRPO_METRICS if k != "loss"]
    rows = [["layout", "loss (per step)", *keys, "grad norm", "seconds"]]
    for name, m in results["measured"].items():
        g = m.get("grpo")
        if g is None:
            continue
        rows.append([name, " ".join(f"{x:.6f}" for x in g["loss"]),
                     *(" ".join(f"{x:.3g}" for x in g["metrics"].get(k, [])) or "-" for k in keys),
                     " ".join(f"{x:.6f}" for x in g["grad_norm"]), f"{m.get('grpo_s', 0):.1f}"])
    return ["GRPO step 0 per layout (values per optimizer step; hf: in this process)", *_table(rows)]


def _engine_table(results: dict, checks: list[dict]) -> list[str]:
    rows = [["layout", "transport", "token_mult_prob_error", "max |lp_policy - lp_engine|", "gen KL", "tokens",
             "refit s"]]
    for c in (c for c in checks if c["check"] == "token_mult_prob_error"):
        for transport, t in c["transports"].items():
            worst = t["token_mult_prob_error"] == c["value"]
            cell = f"{t['token_mult_prob_error']:.7f}" + (" FAIL" if worst and not c["pass"] else "")
            rows.append([c["a"], transport, cell, f"{t['max_abs_diff']:.1e}", f"{t['gen_kl_error']:.1e}",
                         str(t["tokens"]), f"{t['refit_s']:.2f}"])
    start = results["seconds"].get("engine start")
    started = f"; engine start-up {start:.1f} s" if start else ""
    return [f"vLLM engine refit from each layout after its {results['steps']} steps, {ENGINE_PROMPTS} prompts x "
            f"{ENGINE_NEW_TOKENS} sampled tokens: token_mult_prob_error = mean exp|lp_policy - lp_engine| (pass: "
            f"{_tolerance(results, 'token_mult_prob_error')}, the larger transport counts){started}",
            *_table(rows)] if len(rows) > 1 else []


def _dcp_table(results: dict, checks: list[dict]) -> list[str]:
    loaded = {(c["a"], c["b"]): c for c in checks if c["check"] == "dcp_crossload"}
    resumed = {(c["a"], c["b"]): c for c in checks if c["check"] == "dcp_resume"}
    lines = []
    if loaded:
        rows = [["source -> target", "loaded: max |diff|", "one more step: max |diff|", "loss of that step"]]
        for pair, c in loaded.items():
            r = resumed.get(pair)
            rows.append([f"{pair[0]} -> {pair[1]}", _cell(c), _cell(r),
                         " vs ".join(f"{x:.6f}" for x in r["loss"]) if r else "-"])
        lines += [f"DCP cross-load (torch): the target started from the source's save_checkpoint(weights, optimizer) "
                  f"(pass: {_tolerance(results, 'dcp_crossload')} loaded, {_tolerance(results, 'dcp_resume')} after "
                  "one more step from the loaded optimizer state)", *_table(rows)]
    names = [n for n in results["measured"] if n != HF]
    torch_names = [n for n in names if torch_layout(n) is not None]
    jax_names = [n for n in names if jax_devices(n) is not None]
    if torch_names and jax_names:
        lines.append("torch DCP <-> JAX: no direct load (the JAX backend checkpoints orbax); "
                     f"{', '.join(torch_names)} <-> {', '.join(jax_names)} go through the HF export (cross-load above)")
    if len(torch_names) == 1:
        lines.append(f"DCP cross-load: needs two torch layouts, ran {torch_names[0]} only")
    return lines + [""] if lines else []


def format_matrix(results: dict) -> str:
    """The report: one lower-triangular matrix per pairwise check, per-layout, GRPO, engine
    and cross-load tables, failures, errors and skipped layouts, and a one-line verdict."""
    checks = results["checks"]
    by_pair = {(c["check"], c["a"], c["b"]): c for c in checks if c["b"] is not None}
    by_one = {(c["check"], c["a"]): c for c in checks if c["b"] is None}
    names = list(results["measured"])
    precision = {"float32": "fp32", "bfloat16": "bf16 compute, fp32 masters"}[results.get("precision", "float32")]
    lines = [f"parity: {results['model']}, {precision}, batch {results['batch']} x seq {results['seq']} "
             f"({results['real_tokens']} real tokens), {results['steps']} AdamW steps at lr {results['lr']:g} "
             f"(max_grad_norm {results['max_grad_norm']}); hf = single-process AutoModelForCausalLM; "
             "cells: the value, marked FAIL when outside its tolerance", ""]
    if len(names) > 1:
        for check in PAIRWISE:
            if check == "grpo_step0" and not any(c["check"] == check for c in checks):
                continue
            lines += [*_pair_matrix(check, names, by_pair, _tolerance(results, check)), ""]
    if names:
        lines += [*_per_layout_table(results, by_one), "", *_variant_table(results), ""]
    if any("grpo" in m for m in results["measured"].values()):
        lines += [*_grpo_table(results), ""]
    cross = [c for c in checks if c["check"] == "crossload"]
    if cross:
        lines += [f"cross-load: source's HF export loaded by the target; max |target - source| logprobs "
                  f"(pass: {_tolerance(results, 'crossload')})", *_table([["source -> target", "max |diff|"]] +
                                                  [[f"{c['a']} -> {c['b']}", _cell(c)] for c in cross]), ""]
    lines += _dcp_table(results, checks)
    engine = _engine_table(results, checks)
    if engine:
        lines += [*engine, ""]
    failed = [c for c in checks if not c["pass"]]
    for c in failed:
        pair = c["a"] + (f" vs {c['b']}" if c["b"] else "")
        lines.append(f"FAIL {c['check']}: {pair}: {c['value']:.3e} (needs {c['op']} {c['tol']:g})")
    for what, msg in results["errors"].items():
        lines.append(f"ERROR {msg}")
    for name, why in results["skipped"].items():
        lines.append(f"SKIPPED {name}: {why}")
    verdict = "PASS" if results["passed"] else "FAIL"
    lines.append(f"{verdict}: {len(checks) - len(failed)} of {len(checks)} checks within tolerance, "
                 f"{len(results['errors'])} error(s), {len(results['skipped'])} layout(s) skipped; "
                 f"{results['seconds'].get('total', 0):.0f} s")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog or "python -m benchmarks.parity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS,
                        help=f"default: {' '.join(DEFAULT_LAYOUTS)}; any of {' '.join(tb.LAYOUTS)}, or by the "
                             f"grammar {GRAMMAR}")
    parser.add_argument("--model", default="llama",
                        help="a core.testing tiny model (llama, qwen2, tiny-qwen2, ...), tiny-llama-hd32, "
                             "tiny-gpt2 (built here), a local HF path or a hub id")
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument("--crossload", default="ring", choices=["ring", "full"],
                        help="which layout loads which export (see above)")
    parser.add_argument("--engine", nargs="*", metavar="LAYOUT",
                        help="the vLLM token_mult_prob_error check: on every layout (no names) or on these; "
                             "needs a model vLLM's CPU attention serves (head_dim 32: --model tiny-llama-hd32)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=24)
    parser.add_argument("--lr", type=float, default=LEARNING_RATE)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per layout (torch_backends' budget)")
    parser.add_argument("--precision", default="float32", choices=["float32", "bfloat16"],
                        help="bfloat16: bf16 compute over fp32 master weights, judged by BF16_TOLERANCES")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    engine = False if args.engine is None else (args.engine or True)
    try:
        results = run_parity(args.layouts, args.model, batch=args.batch, seq=args.seq, threads=args.threads,
                             crossload=args.crossload, lr=args.lr, engine=engine, precision=args.precision)
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
