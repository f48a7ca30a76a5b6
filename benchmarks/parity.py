"""Numerical parity of the backend layouts: a pass/fail matrix against stated tolerances.

    python -m benchmarks.parity [--layouts fsdp1-dp2 dtensor-dp2 dtensor-tp2 jax-fsdp2 jax-tp2]
        [--model llama | tiny-qwen2 | PATH | HUB_ID] [--json OUT] [--crossload ring|full]
        [--batch 8] [--seq 24] [--lr 1e-3] [--threads 2]
    dualrl parity [--layouts ...] [--model ...] [--json OUT] [--crossload ...]

Every layout (``benchmarks.torch_backends.LAYOUTS`` and the ``jax-fsdp<F>[-tp<T>]`` /
``jax-tp<T>`` layouts of ``benchmarks.jax_backend``) runs one :class:`core.policy.Policy`, started
by those benchmarks' runners (same cluster shapes, thread budget, Ray/XLA set-up), on one fixed
ragged batch (``torch_backends.make_batch``: right-padded random ids of different lengths, seed
0, loss on every real token).  ``hf`` is a reference computed in this process: plain
``AutoModelForCausalLM`` in fp32, ``log_softmax`` (float64) + gather in the ``get_logprobs``
layout ``[0, logp(x_1), ..., 0 padding]`` -- what tests/torch_backends compares against.

What is compared (every layout against ``hf`` and against every other layout):

1. ``logprobs``: ``Policy.get_logprobs`` on the batch at the initial weights.
2. ``loss_step0`` / ``grad_norm_step0``: the NLL loss and the (pre-clipping) global gradient
   norm of the first ``policy.train`` call (``NLLLoss``, one AdamW step per call); ``hf``: the
   same loss code on full-batch HF logits, ``clip_grad_norm_`` and ``torch.optim.AdamW``.
   ``loss_curve``: the loss of 3 such steps on the same batch (each loss is taken before its
   step's update, so it covers the weights after 0, 1 and 2 updates).
   ``trained_logprobs``: ``get_logprobs`` after the 3 steps.
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
   by at least that much.  (Loading a DCP
   checkpoint of one backend into another is not compared here.)

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
=====================  ===========================================  =========

The scalar measure is absolute below 1 and relative above (losses of a 256-token vocabulary
are ~5.5, gradient norms of a real model can be hundreds).  AdamW normalises each update by
the gradient's running RMS, so an fp32 rounding difference in a near-zero gradient entry
becomes a full-size difference in that weight's step: hence 1e-4 after training.

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

Exit code 1 when any check fails or a layout could not run; 2 for bad arguments.  ``--json``
writes every number (all compared values, losses, norms, per-variant deviations, timings).
Layouts that need a different XLA host device count than a Ray started by the caller provides
are listed as skipped (as in ``benchmarks.jax_backend``).
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
from benchmarks import torch_backends as tb

HF = "hf"
DEFAULT_LAYOUTS = ["fsdp1-dp2", "dtensor-dp2", "dtensor-tp2", "jax-fsdp2", "jax-tp2"]
STEPS = 3
LEARNING_RATE = 1e-3
#: Seed of the companion rows of the ``mixed`` variant (the batch itself uses tb.SEED).
OTHER_SEED = 1

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
}
#: Checks between two layouts (every pair of ``hf`` + layouts), the rest are per layout.
PAIRWISE = ("logprobs", "loss_step0", "grad_norm_step0", "loss_curve", "trained_logprobs")
VARIANTS = ("alone", "alone_trimmed", "reversed", "mixed")


# ----------------------------------------------------------------------------- layouts / model


def check_layouts(layouts: list[str], batch: int) -> None:
    """Raise ``ValueError`` naming the first unknown layout or one the batch does not fit."""
    if not layouts:
        raise ValueError("no layouts given")
    for name in layouts:
        if name in tb.LAYOUTS:
            if batch % tb.LAYOUTS[name].dp:
                raise ValueError(f"layout {name}: batch {batch} is not divisible by its data-parallel "
                                 f"size {tb.LAYOUTS[name].dp}")
        elif jb.jax_layout(name) is None:
            raise ValueError(f"unknown layout {name!r}: one of {', '.join(tb.LAYOUTS)} "
                             "or jax-fsdp<F>[-tp<T>] / jax-tp<T>")
    if len(set(layouts)) != len(layouts):
        raise ValueError(f"a layout is given twice: {layouts}")


def jax_devices(name: str) -> int | None:
    """XLA host devices the layout's actor needs (``None``: a torch layout)."""
    layout = jb.jax_layout(name)
    return layout.devices if layout else None


def resolve_model(model: str) -> str:
    """``tiny-qwen2`` -> ``qwen2`` (a ``core.testing`` tiny model) unless a path of that name exists;
    anything else (tiny name, local path, hub id) goes to ``torch_backends.prepare_model`` as is."""
    from core.testing.tiny_models import TINY_MODELS

    if model.startswith("tiny-") and model[len("tiny-"):] in TINY_MODELS and not Path(model).exists():
        return model[len("tiny-"):]
    return model


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


def start_runner(name: str, model_path: str, tokenizer_path: str, tokenizer, args, session):
    """A runner of ``name`` on ``model_path``; Ray (re)started with the XLA devices it needs."""
    print(f"[parity] starting {name} on {model_path} ...", file=sys.stderr, flush=True)
    session.start(jax_devices(name))
    cls = JaxParityRunner if jax_devices(name) else TorchParityRunner
    return cls(name, model_path, tokenizer_path, tokenizer, args)


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


def measure(logprobs: Callable, step: Callable, data, other, steps: int) -> dict:
    """Initial logprobs, batch invariance, ``steps`` training steps, trained logprobs -- in this
    order, so the first two see the initial weights."""
    initial = logprobs(data["input_ids"], data["input_lengths"])
    invariance = batch_invariance(logprobs, data, other, initial)
    losses, norms = train_steps(step, steps)
    return {"logprobs": initial, "invariance": invariance, "loss": losses, "grad_norm": norms,
            "trained_logprobs": logprobs(data["input_ids"], data["input_lengths"])}


def measure_policy(runner, data, other, steps: int) -> dict:
    """:func:`measure` on a runner's Policy: ``NLLLoss``, the runner's gbs/mbs (one micro batch
    per data-parallel rank, one optimizer step per ``train`` call)."""
    from core.losses import NLLLoss

    policy = runner._policy  # the runners keep their Policy private; the benchmarks read it too

    def logprobs(ids, lengths):
        return policy.get_logprobs(_inputs(ids, lengths))["logprobs"]

    def step():
        out = policy.train(data, NLLLoss(), gbs=runner._gbs, mbs=runner._mbs)
        return float(out["loss"][0]), float(out["grad_norm"][0])

    return measure(logprobs, step, data, other, steps)


class HFReference:
    """Single-process ``AutoModelForCausalLM`` in fp32: the reference every layout is held to."""

    def __init__(self, model_path: str, cfg: dict) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.cfg = cfg

    def logprobs(self, ids, lengths):
        """``[0, logp...]``, padding 0; log_softmax in float64 as tests/torch_backends does."""
        import torch

        mask = torch.arange(ids.shape[1])[None] < lengths[:, None]
        self.model.eval()
        with torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=mask.long()).logits.double()
        lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        lp = torch.cat([torch.zeros(lp.shape[0], 1, dtype=lp.dtype), lp], 1)
        return (lp * mask).float()

    def trainer(self, data) -> Callable[[], tuple[float, float]]:
        """One step = full-batch forward, ``NLLLoss`` (the workers' loss code), backward,
        pre-clipping global norm, clipping and AdamW with the policy section's settings."""
        import torch

        from core.losses import NLLLoss

        kwargs = dict(self.cfg["optimizer"]["kwargs"])
        kwargs["betas"] = tuple(kwargs["betas"])
        params = list(self.model.parameters())
        opt = torch.optim.AdamW(params, **kwargs)
        max_norm = self.cfg["max_grad_norm"]
        ids = data["input_ids"]
        mask = (torch.arange(ids.shape[1])[None] < data["input_lengths"][:, None]).long()

        def step():
            self.model.train()
            opt.zero_grad(set_to_none=True)
            loss = NLLLoss()(self.model(input_ids=ids, attention_mask=mask).logits, data, None, None)[0]
            loss.backward()
            grads = [p.grad for p in params if p.grad is not None]
            norm = (torch.nn.utils.clip_grad_norm_(params, max_norm) if max_norm is not None
                    else torch.nn.utils.get_total_norm(grads))
            opt.step()
            return float(loss.detach()), float(norm)

        return step

    def measure(self, data, other, steps: int) -> dict:
        return measure(self.logprobs, self.trainer(data), data, other, steps)


def hf_export_logprobs(path: str, data):
    """Logprobs of an HF export loaded in this process (the ``hf`` cross-load target)."""
    return HFReference(path, {}).logprobs(data["input_ids"], data["input_lengths"])


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


def pairwise_value(check: str, x: dict, y: dict) -> float:
    if check in ("logprobs", "trained_logprobs"):
        return max_abs_diff(x[check], y[check])
    if check == "loss_step0":
        return scalar_diff(x["loss"][0], y["loss"][0])
    if check == "grad_norm_step0":
        return scalar_diff(x["grad_norm"][0], y["grad_norm"][0])
    if check == "loss_curve":
        return max(scalar_diff(p, q) for p, q in zip(x["loss"], y["loss"]))
    raise KeyError(check)


def evaluate(measured: dict[str, dict], crossloaded: dict[tuple[str, str], Any],
             tolerances: dict | None = None) -> list[dict]:
    """Every check on raw measurements: ``measured[name]`` as :func:`measure_policy` returns it
    (``hf`` first), ``crossloaded[(source, target)]`` the target's logprobs of the source's export."""
    tolerances = tolerances or TOLERANCES
    names = list(measured)
    checks = []
    for check in PAIRWISE:
        for a, b in itertools.combinations(names, 2):
            checks.append(_record(check, a, b, pairwise_value(check, measured[a], measured[b]), tolerances))
    for name in names:
        inv = measured[name]["invariance"]
        checks.append(_record("batch_invariance", name, None, max(inv.values()), tolerances,
                              variants=dict(inv), bitwise={k: v == 0.0 for k, v in inv.items()}))
        moved = max_abs_diff(measured[name]["trained_logprobs"], measured[name]["logprobs"])
        checks.append(_record("weights_moved", name, None, moved, tolerances))
    for (src, tgt), logprobs in crossloaded.items():
        value = max_abs_diff(logprobs, measured[src]["trained_logprobs"])
        checks.append(_record("crossload", src, tgt, value, tolerances))
    return checks


def crossload_pairs(names: list[str], mode: str) -> list[tuple[str, str]]:
    """(source, target) pairs of layouts; ``hf`` as a target of every source is added by the caller."""
    if len(names) < 2:
        return []
    if mode == "full":
        return [(a, b) for a in names for b in names if a != b]
    if mode == "ring":  # with two layouts: each loads the other's export
        return [(names[i], names[(i + 1) % len(names)]) for i in range(len(names))]
    raise ValueError(f"crossload mode {mode!r}: ring or full")


# ----------------------------------------------------------------------------- run


def _error(what: str, err: BaseException) -> str:
    """One line for the report (called in the ``except`` block: the traceback goes to stderr)."""
    traceback.print_exc()
    lines = str(err).strip().splitlines()
    return f"{what}: {type(err).__name__}: {lines[-1] if lines else ''}"


def _measure_layout(name, paths, tokenizer, args, session, data, other, export: Path) -> dict:
    """Start ``name`` on the initial model, measure it, export its trained weights, shut it down."""
    t0 = time.perf_counter()
    runner = start_runner(name, paths[0], paths[1], tokenizer, args, session)
    try:
        startup = time.perf_counter() - t0
        out = measure_policy(runner, data, other, args.steps)
        runner._policy.save_hf_checkpoint(str(export))
        out.update(startup_s=startup, seconds=time.perf_counter() - t0, export=str(export))
        return out
    finally:
        runner.close()


def _crossload(src: str, tgt: str, export: str, tokenizer_path: str, tokenizer, args, session, data):
    """``tgt``'s logprobs of ``src``'s export (``tgt`` = ``hf``: loaded in this process)."""
    if tgt == HF:
        return hf_export_logprobs(export, data)
    runner = start_runner(tgt, export, tokenizer_path, tokenizer, args, session)
    try:
        return runner._policy.get_logprobs(_inputs(data["input_ids"], data["input_lengths"]))["logprobs"]
    finally:
        runner.close()


def run_parity(layouts: list[str] | None = None, model: str = "llama", *, batch: int = 8, seq: int = 24,
               threads: int = 2, crossload: str = "ring", lr: float = LEARNING_RATE, steps: int = STEPS,
               tolerances: dict | None = None) -> dict:
    """Measure ``hf`` and every layout, compare them; the results (plain JSON-able data)."""
    layouts = list(layouts or DEFAULT_LAYOUTS)
    check_layouts(layouts, batch)
    crossload_pairs(layouts, crossload)  # a bad mode fails before anything starts
    if seq < 2 or steps < 1:
        raise ValueError(f"seq must be >= 2 and steps >= 1, got seq={seq}, steps={steps}")
    import ray

    from core.testing.tiny_models import random_batch

    args = argparse.Namespace(batch=batch, seq=seq, precision="float32", threads=threads, cases=layouts,
                              lr=lr, steps=steps)
    wall0 = time.perf_counter()
    measured, crossloaded, errors, skipped, timings = {}, {}, {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="dualrl-parity-") as tmp:
        model_path, tokenizer_path = tb.prepare_model(resolve_model(model), Path(tmp))
        tokenizer = tb.load_tokenizer(tokenizer_path)
        vocab = tb.vocab_size(model_path)
        data = tb.make_batch(batch, seq, vocab)
        ids, lengths = random_batch(batch, seq, vocab, seed=OTHER_SEED)
        other = {"input_ids": ids, "input_lengths": lengths}
        cfg = parity_settings(tb.default_policy_section(), lr)
        t0 = time.perf_counter()
        measured[HF] = HFReference(model_path, cfg).measure(data, other, steps)
        timings[HF] = time.perf_counter() - t0
        session = jb.RaySession(args)
        try:
            first_jax = next((jax_devices(n) for n in layouts if jax_devices(n)), None)
            if session.owned:
                session.start(first_jax)  # once, before any layout (a JAX layout may restart it)
            for name in layouts:
                if jax_devices(name) is not None and not session.fits(jax_devices(name)):
                    skipped[name] = (f"needs {jax_devices(name)} XLA host devices per actor; the caller's "
                                     f"Ray gives {session.devices}")
                    continue
                try:
                    measured[name] = _measure_layout(name, (model_path, tokenizer_path), tokenizer, args, session,
                                                     data, other, Path(tmp) / f"export-{name}")
                    timings[name] = measured[name]["seconds"]
                except Exception as err:  # noqa: BLE001 -- report it, go on with the other layouts
                    errors[name] = _error(name, err)
            ran = [n for n in layouts if n in measured]
            for src, tgt in [(n, HF) for n in ran] + crossload_pairs(ran, crossload):
                try:
                    t0 = time.perf_counter()
                    crossloaded[(src, tgt)] = _crossload(src, tgt, measured[src]["export"], tokenizer_path,
                                                         tokenizer, args, session, data)
                    timings[f"{src} -> {tgt}"] = time.perf_counter() - t0
                except Exception as err:  # noqa: BLE001
                    errors[f"{src} -> {tgt}"] = _error(f"crossload {src} -> {tgt}", err)
        finally:
            if session.owned and ray.is_initialized():
                ray.shutdown()
        real_tokens = int(data["input_lengths"].sum())
    timings["total"] = time.perf_counter() - wall0
    return collect(measured, crossloaded, errors=errors, skipped=skipped, seconds=timings, tolerances=tolerances,
                   model=model, layouts=layouts, batch=batch, seq=seq, real_tokens=real_tokens, steps=steps, lr=lr,
                   max_grad_norm=cfg["max_grad_norm"], crossload=crossload)


def collect(measured: dict[str, dict], crossloaded: dict[tuple[str, str], Any], *, errors: dict | None = None,
            skipped: dict | None = None, seconds: dict | None = None, tolerances: dict | None = None,
            **meta) -> dict:
    """The results of a run: ``meta`` (model, batch, ...), every check of :func:`evaluate`, the
    JSON-able numbers of every measurement, errors and skipped layouts, and the verdict."""
    tolerances = tolerances or TOLERANCES
    checks = evaluate(measured, crossloaded, tolerances)
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
    return {"loss": m["loss"], "grad_norm": m["grad_norm"], "invariance": m["invariance"],
            **{k: m[k] for k in ("startup_s", "seconds") if k in m}}


def passed(checks: list[dict], errors: dict) -> bool:
    return not errors and all(c["pass"] for c in checks)


# ----------------------------------------------------------------------------- report


TITLES = {
    "logprobs": "get_logprobs at the initial weights: max |a - b|",
    "loss_step0": "NLL loss of step 0: |a - b| / max(1, |a|, |b|)",
    "grad_norm_step0": "gradient norm (pre-clip) of step 0: |a - b| / max(1, |a|, |b|)",
    "loss_curve": f"loss curve over {STEPS} AdamW steps: max over steps of |a - b| / max(1, |a|, |b|)",
    "trained_logprobs": f"get_logprobs after {STEPS} steps: max |a - b|",
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


def format_matrix(results: dict) -> str:
    """The report: one lower-triangular matrix per pairwise check, per-layout and cross-load
    tables, failures, errors and skipped layouts, and a one-line verdict."""
    checks = results["checks"]
    by_pair = {(c["check"], c["a"], c["b"]): c for c in checks if c["b"] is not None}
    by_one = {(c["check"], c["a"]): c for c in checks if c["b"] is None}
    names = list(results["measured"])
    lines = [f"parity: {results['model']}, fp32, batch {results['batch']} x seq {results['seq']} "
             f"({results['real_tokens']} real tokens), {results['steps']} AdamW steps at lr {results['lr']:g} "
             f"(max_grad_norm {results['max_grad_norm']}); hf = single-process AutoModelForCausalLM; "
             "cells: the value, marked FAIL when outside its tolerance", ""]
    if len(names) > 1:
        for check in PAIRWISE:
            lines += [*_pair_matrix(check, names, by_pair, _tolerance(results, check)), ""]
    if names:
        lines += [*_per_layout_table(results, by_one), "", *_variant_table(results), ""]
    cross = [c for c in checks if c["check"] == "crossload"]
    if cross:
        lines += [f"cross-load: source's HF export loaded by the target; max |target - source| logprobs "
                  f"(pass: {_tolerance(results, 'crossload')})", *_table([["source -> target", "max |diff|"]] +
                                                  [[f"{c['a']} -> {c['b']}", _cell(c)] for c in cross]), ""]
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
                        help=f"default: {' '.join(DEFAULT_LAYOUTS)}; any of {' '.join(tb.LAYOUTS)}, "
                             "jax-fsdp<F>[-tp<T>], jax-tp<T>")
    parser.add_argument("--model", default="llama",
                        help="a core.testing tiny model (llama, qwen2, tiny-qwen2, ...), a local HF path or a hub id")
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument("--crossload", default="ring", choices=["ring", "full"],
                        help="which layout loads which export (see above)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=24)
    parser.add_argument("--lr", type=float, default=LEARNING_RATE)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per layout (torch_backends' budget)")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        results = run_parity(args.layouts, args.model, batch=args.batch, seq=args.seq, threads=args.threads,
                             crossload=args.crossload, lr=args.lr)
    except (ValueError, OSError) as err:  # a bad layout / argument, or a model that does not load
        print(f"parity: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    print(format_matrix(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
