"""Fabricated parity measurements (no workers) for the tests of the matrix's verdicts: a layout's
measured values, the GRPO summaries, an engine row, and ``collect`` over them."""

from __future__ import annotations

import torch

from benchmarks.lib.parity.checks import collect, crossload_pairs
from benchmarks.lib.parity.grpo import grpo_summary
from benchmarks.lib.parity.settings import (
    ENGINE_TRANSPORTS,
    HF,
    HF_LORA,
    VARIANTS,
)


def grpo_step0() -> dict:
    """A GRPO step-0 summary as ``grpo_summary`` makes one (two optimizer steps)."""
    return grpo_summary(
        [0.17, -0.58],
        [1.72, 1.47],
        {
            "loss": [0.17, -0.58],
            "actor_loss": [0.17, -0.58],
            "kl_penalty": [0.0, 4.6e-4],
            "clip_fraction": [0.0, 0.0],
            "probs_ratio": [1.0, 0.998],
        },
    )


def fused_step() -> dict:
    """A fused-step summary (one optimizer step; the ratio is 1 by construction)."""
    return grpo_summary(
        [-0.21],
        [1.31],
        {
            "loss": [-0.21],
            "actor_loss": [-0.21],
            "kl_penalty": [9.1e-4],
            "clip_fraction": [0.0],
            "probs_ratio": [1.0],
        },
    )


def measurement(logprobs: torch.Tensor, losses=(5.5, 5.25, 5.0), norms=(2.0, 1.9, 1.8), moved=0.01) -> dict:
    """One layout's measured values: ``logprobs``, its three training steps, the logprobs after
    them (``moved`` lower) and its resume."""
    trained = logprobs - moved
    return {
        "logprobs": logprobs,
        "invariance": {v: 0.0 for v in VARIANTS},
        "loss": list(losses),
        "grad_norm": list(norms),
        "trained_logprobs": trained,
        "grpo": grpo_step0(),
        "grpo_fused": fused_step(),
        "resumed": {"loss": 4.8, "grad_norm": 1.7, "logprobs": trained - moved},
    }


def engine_row(value: float) -> dict:
    """An engine row whose every transport disagrees with the policy by ``value``."""
    per = {
        t: {"token_mult_prob_error": value, "max_abs_diff": 2e-5, "gen_kl_error": 1e-9, "tokens": 30, "refit_s": 0.1}
        for t in ENGINE_TRANSPORTS
    }
    return {"token_mult_prob_error": value, "transports": per}


def results_of(measured: dict, errors: dict | None = None, dcp: dict | None = None) -> dict:
    """``collect`` on fabricated measurements; every layout's export loaded by the next one, and
    (unless ``dcp`` is given) its DCP checkpoint too, exactly."""
    names = [n for n in measured if n not in (HF, HF_LORA)]
    crossloaded = {
        (src, tgt): measured[src]["trained_logprobs"].clone()
        for src, tgt in [(n, HF) for n in names] + crossload_pairs(names, "ring")
    }
    if dcp is None:
        dcp = {
            (src, tgt): {
                "logprobs": measured[src]["trained_logprobs"].clone(),
                "resumed": dict(measured[src]["resumed"]),
            }
            for src, tgt in crossload_pairs(names, "ring")
        }
    return collect(
        measured,
        crossloaded,
        errors=errors,
        seconds={"total": 1.0},
        model="fabricated",
        layouts=names,
        batch=4,
        seq=6,
        real_tokens=20,
        steps=3,
        lr=1e-3,
        max_grad_norm=1.0,
        crossload="ring",
        dcp=dcp,
    )


def clean_measurements() -> dict:
    """HF and two layouts that agree within every tolerance."""
    lp = -torch.rand(4, 6, generator=torch.Generator().manual_seed(0)) * 5
    hf = {**measurement(lp), "grpo_fused_separate": fused_step()}
    return {HF: hf, "a": measurement(lp.clone()), "b": measurement(lp + 3e-7)}


def failed_checks(results: dict) -> set[tuple]:
    """The (check, a, b) of every failed check."""
    return {(c["check"], c["a"], c["b"]) for c in results["checks"] if not c["pass"]}
