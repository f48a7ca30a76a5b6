"""Turning measurements into pass/fail checks against the tolerances, and the run's results."""

from __future__ import annotations

import functools
import itertools
from typing import Any

from benchmarks.lib.layouts import LayoutError, parse_layout
from benchmarks.lib.parity.exact import exact_checks
from benchmarks.lib.parity.measure import max_abs_diff
from benchmarks.lib.parity.settings import (
    ESTIMATOR_ROWS,
    GRPO_CHECKS,
    GRPO_METRICS,
    HF,
    HF_LORA,
    MULTI_TURN_CHECKS,
    PAIRWISE,
    TOLERANCES,
)


def is_lora(name: str) -> bool:
    """Whether ``name`` (``hf``, ``hf-lora`` or a layout) trains LoRA adapters."""
    if name in (HF, HF_LORA):
        return name == HF_LORA
    try:
        return parse_layout(name).lora
    except LayoutError:
        return False


def same_kind(a: str, b: str) -> bool:
    """Pairwise checks compare only LoRA with LoRA and full with full: from step 0 on, the two
    train different parameters, so their losses, norms and trained logprobs differ by design."""
    return is_lora(a) == is_lora(b)


def scalar_diff(a: float, b: float) -> float:
    """Absolute below 1, relative above (see the tolerance table)."""
    return abs(a - b) / max(1.0, abs(a), abs(b))


def judge(check: str, value: float, tolerances: dict | None = None) -> bool:
    """Whether ``value`` passes ``check``; NaN never does."""
    op, tol = (tolerances or TOLERANCES)[check]
    return value <= tol if op == "<=" else value >= tol


def _record(check: str, a: str, b: str | None, value: float, tolerances: dict, **detail) -> dict:
    op, tol = tolerances[check]
    return {
        "check": check,
        "a": a,
        "b": b,
        "value": value,
        "op": op,
        "tol": tol,
        "pass": judge(check, value, tolerances),
        **detail,
    }


def grpo_diffs(x: dict, y: dict) -> dict[str, float]:
    """Per compared quantity of two GRPO step-0 summaries: the largest scalar measure over the steps."""

    def worst(p, q):
        return (
            max((scalar_diff(a, b) for a, b in zip(p, q, strict=True)), default=0.0)
            if len(p) == len(q)
            else float("nan")
        )

    out = {"grad_norm": worst(x["grad_norm"], y["grad_norm"]), "loss": worst(x["loss"], y["loss"])}
    for key in GRPO_METRICS:
        p, q = x["metrics"].get(key), y["metrics"].get(key)
        if p is not None or q is not None:  # reported by one side only: NaN, never a pass
            out[key] = worst(p, q) if p is not None and q is not None else float("nan")
    return out


def multi_turn_diffs(check: str, x: dict, y: dict) -> dict[str, float]:
    """Per compared quantity of two layouts' multi-turn measurements: ``grpo_multi_turn_step0``
    the GRPO step's (as :func:`grpo_diffs`) and the episodes' generation logprobs (max |a - b|),
    ``grpo_multi_turn_logprobs`` the updated logprobs, ``multi_turn_episodes`` every exact
    per-row field (max |a - b|: 0 when bitwise equal; NaN for a field of another shape)."""
    if check == "grpo_multi_turn_step0":
        diffs = grpo_diffs(x["grpo_multi_turn"], y["grpo_multi_turn"])
        a, b = x["multi_turn_generation_logprobs"], y["multi_turn_generation_logprobs"]
        diffs["generation_logprobs"] = max_abs_diff(a, b) if a.shape == b.shape else float("nan")
        return diffs
    if check == "grpo_multi_turn_logprobs":
        a, b = x["multi_turn_logprobs"], y["multi_turn_logprobs"]
        return {"logprobs": max_abs_diff(a, b) if a.shape == b.shape else float("nan")}
    import torch

    ex, ey = x["multi_turn_episodes"], y["multi_turn_episodes"]
    out = {}
    for key in sorted(set(ex) | set(ey)):
        a, b = (torch.tensor(e[key], dtype=torch.float64) if key in e else None for e in (ex, ey))
        same = a is not None and b is not None and a.shape == b.shape
        out[key] = max_abs_diff(a, b) if same else float("nan")
    return out


def pairwise_value(check: str, x: dict, y: dict) -> float:
    if check in ("logprobs", "trained_logprobs"):
        return max_abs_diff(x[check], y[check])
    if check == "loss_step0":
        return scalar_diff(x["loss"][0], y["loss"][0])
    if check == "grad_norm_step0":
        return scalar_diff(x["grad_norm"][0], y["grad_norm"][0])
    if check == "loss_curve":
        return max(scalar_diff(p, q) for p, q in zip(x["loss"], y["loss"], strict=True))
    if check in GRPO_CHECKS:
        return max(grpo_diffs(x[GRPO_CHECKS[check]], y[GRPO_CHECKS[check]]).values())
    raise KeyError(check)


def evaluate(
    measured: dict[str, dict],
    crossloaded: dict[tuple[str, str], Any],
    tolerances: dict | None = None,
    dcp: dict[tuple[str, str], dict] | None = None,
) -> list[dict]:
    """Every check on raw measurements: ``measured[name]`` as :func:`measure_policy` returns it
    (``hf`` first; with ``grpo`` / ``engine`` / ``resumed`` entries where those ran),
    ``crossloaded[(source, target)]`` the target's logprobs of the source's export,
    ``dcp[(source, target)]`` the target's ``logprobs`` after loading the source's DCP
    checkpoint and its ``resumed`` measurement after one more step.  ``measured["hf-lora"]``
    carries ``base_logprobs`` (the plain HF model's at the initial weights): every LoRA
    measurement's initial logprobs are held to them (``lora_b0_is_base``)."""
    tolerances = tolerances or TOLERANCES
    names = list(measured)
    checks = []
    for check in PAIRWISE:
        for a, b in itertools.combinations(names, 2):
            if not same_kind(a, b):
                continue
            if check in MULTI_TURN_CHECKS:
                if MULTI_TURN_CHECKS[check] in measured[a] and MULTI_TURN_CHECKS[check] in measured[b]:
                    diffs = multi_turn_diffs(check, measured[a], measured[b])
                    checks.append(_record(check, a, b, max(diffs.values()), tolerances, per_quantity=diffs))
                continue
            if check in GRPO_CHECKS:
                key = GRPO_CHECKS[check]
                if key in measured[a] and key in measured[b]:
                    diffs = grpo_diffs(measured[a][key], measured[b][key])
                    checks.append(_record(check, a, b, max(diffs.values()), tolerances, per_quantity=diffs))
                continue
            checks.append(_record(check, a, b, pairwise_value(check, measured[a], measured[b]), tolerances))
    for name in names:
        inv = measured[name]["invariance"]
        checks.append(
            _record(
                "batch_invariance",
                name,
                None,
                max(inv.values()),
                tolerances,
                variants=dict(inv),
                bitwise={k: v == 0.0 for k, v in inv.items()},
            )
        )
        separate = measured.get(HF_LORA if is_lora(name) else HF, {}).get("grpo_fused_separate")
        if separate is not None and "grpo_fused" in measured[name]:
            diffs = grpo_diffs(measured[name]["grpo_fused"], separate)
            checks.append(
                _record("grpo_fused_vs_separate", name, None, max(diffs.values()), tolerances, per_quantity=diffs)
            )
        if is_lora(name):
            base = measured[HF_LORA]["base_logprobs"] if HF_LORA in measured else None
            value = max_abs_diff(measured[name]["logprobs"], base) if base is not None else float("nan")
            checks.append(_record("lora_b0_is_base", name, None, value, tolerances))
        checks += exact_checks(name, measured[name], functools.partial(_record, a=name, b=None, tolerances=tolerances))
        moved = max_abs_diff(measured[name]["trained_logprobs"], measured[name]["logprobs"])
        checks.append(_record("weights_moved", name, None, moved, tolerances))
        if "engine" in measured[name]:
            engine = measured[name]["engine"]
            checks.append(
                _record(
                    "token_mult_prob_error",
                    name,
                    None,
                    engine["token_mult_prob_error"],
                    tolerances,
                    transports=engine["transports"],
                )
            )
    for (src, tgt), logprobs in crossloaded.items():
        value = max_abs_diff(logprobs, measured[src]["trained_logprobs"])
        checks.append(_record("crossload", src, tgt, value, tolerances))
    for (src, tgt), loaded in (dcp or {}).items():
        checks.append(
            _record(
                "dcp_crossload",
                src,
                tgt,
                max_abs_diff(loaded["logprobs"], measured[src]["trained_logprobs"]),
                tolerances,
            )
        )
        source = measured[src]["resumed"]
        checks.append(
            _record(
                "dcp_resume",
                src,
                tgt,
                max_abs_diff(loaded["resumed"]["logprobs"], source["logprobs"]),
                tolerances,
                loss=[source["loss"], loaded["resumed"]["loss"]],
                grad_norm=[source["grad_norm"], loaded["resumed"]["grad_norm"]],
            )
        )
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


def collect(
    measured: dict[str, dict],
    crossloaded: dict[tuple[str, str], Any],
    *,
    errors: dict | None = None,
    skipped: dict | None = None,
    seconds: dict | None = None,
    tolerances: dict | None = None,
    dcp: dict[tuple[str, str], dict] | None = None,
    **meta,
) -> dict:
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


#: What a measurement keeps in the results besides losses, norms and invariance.
SUMMARY_KEYS = (
    "startup_s",
    "seconds",
    "grpo",
    "grpo_fused",
    "grpo_fused_separate",
    "grpo_multi_turn",
    "multi_turn_episodes",
    "grpo_s",
    "engine",
    "exact",
    *(key for key, _, _ in ESTIMATOR_ROWS.values()),
)


def _summary(m: dict) -> dict:
    """The JSON-able numbers of one measurement (the logprob tensors stay out)."""
    out = {
        "loss": m["loss"],
        "grad_norm": m["grad_norm"],
        "invariance": m["invariance"],
        **{k: m[k] for k in SUMMARY_KEYS if k in m},
    }
    if "resumed" in m:
        out["resumed"] = {k: m["resumed"][k] for k in ("loss", "grad_norm")}
    return out


def passed(checks: list[dict], errors: dict) -> bool:
    return not errors and all(c["pass"] for c in checks)
