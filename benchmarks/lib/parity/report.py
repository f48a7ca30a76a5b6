"""The text report of a parity run: matrices, per-layout tables and the verdict."""

from __future__ import annotations

from benchmarks.lib.layouts import dcp_layouts
from benchmarks.lib.parity.exact import exact_table
from benchmarks.lib.parity.models import jax_devices
from benchmarks.lib.parity.settings import (
    ENGINE_NEW_TOKENS,
    ENGINE_PROMPTS,
    ESTIMATOR_ROWS,
    GRPO_CHECKS,
    GRPO_METRICS,
    HF,
    HF_LORA,
    MULTI_TURN_CHECKS,
    PAIRWISE,
    STEPS,
    VARIANTS,
)

TITLES = {
    "logprobs": "get_logprobs at the initial weights: max |a - b|",
    "loss_step0": "NLL loss of step 0: |a - b| / max(1, |a|, |b|)",
    "grad_norm_step0": "gradient norm (pre-clip) of step 0: |a - b| / max(1, |a|, |b|)",
    "loss_curve": f"loss curve over {STEPS} AdamW steps: max over steps of |a - b| / max(1, |a|, |b|)",
    "trained_logprobs": f"get_logprobs after {STEPS} steps: max |a - b|",
    "grpo_step0": f"GRPO step 0 (ClippedPGLossFn): max over {', '.join(GRPO_METRICS)}, grad_norm and the "
    "optimizer steps of |a - b| / max(1, |a|, |b|)",
    "grpo_fused": "fused GRPO step (old log-probs from the training forward, one optimizer step, after step 0): "
    "max over the same quantities",
    "grpo_multi_turn_step0": "multi-turn GRPO step (scripted tool-use episodes, after the fused step): max over "
    "the same quantities and the episodes' generation logprobs",
    "grpo_multi_turn_logprobs": "get_logprobs of the multi-turn episodes after that step: max |a - b|",
    "multi_turn_episodes": "multi-turn episodes (ids, lengths, token_mask, sample_mask, advantages, rewards, "
    "turns): max |a - b|",
    **{
        check: f"GRPO step with the {estimator} estimator's advantages, one sample masked out"
        + (", loss / (valid sequences x constant_token_budget)" if overrides.get("token_normalizer") else "")
        + " (after the multi-turn step): max over the grpo_step0 quantities"
        for check, (_, estimator, overrides) in ESTIMATOR_ROWS.items()
    },
}


def _cell(c: dict | None) -> str:
    if c is None:
        return "-"
    return f"{c['value']:.1e}" + ("" if c["pass"] else " FAIL")


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _tolerance(results: dict, check: str) -> str:
    t = results["tolerances"][check]
    return f"{t['op']} {t['tol']:g}"


def _pair_matrix(check: str, names: list[str], by_pair: dict, tolerance: str) -> list[str]:
    """Lower triangle: row layout vs column layout (``hf`` first)."""
    rows = [[""] + names[:-1]]
    for i, a in enumerate(names[1:], start=1):
        rows.append(
            [a]
            + [
                _cell(by_pair.get((check, names[j], a)) or by_pair.get((check, a, names[j]))) if j < i else ""
                for j in range(len(names) - 1)
            ]
        )
    return [f"{TITLES[check]}  (pass: {tolerance})", *_table(rows)]


def _per_layout_table(results: dict, by_one: dict) -> list[str]:
    rows = [
        [
            "layout",
            "losses (steps 0, 1, ...)",
            "grad norm step 0",
            "invariance max dev",
            "bitwise variants",
            "moved",
            "lora B=0 vs base",
            "seconds",
        ]
    ]
    for name, m in results["measured"].items():
        inv = by_one.get(("batch_invariance", name))
        moved = by_one.get(("weights_moved", name))
        bitwise = [k for k, v in (inv or {}).get("bitwise", {}).items() if v]
        rows.append(
            [
                name,
                " ".join(f"{x:.6f}" for x in m["loss"]),
                f"{m['grad_norm'][0]:.6f}",
                _cell(inv),
                ",".join(bitwise) or "none",
                _cell(moved),
                _cell(by_one.get(("lora_b0_is_base", name))),
                f"{results['seconds'].get(name, 0):.1f}",
            ]
        )
    return [
        f"per layout: losses, step-0 gradient norm, batch invariance (pass: "
        f"{_tolerance(results, 'batch_invariance')}; max over the variants below), logprob change over "
        f"the steps (pass: {_tolerance(results, 'weights_moved')})" + _lora_note(results, by_one),
        *_table(rows),
    ]


def _lora_note(results: dict, by_one: dict) -> str:
    if not any(check == "lora_b0_is_base" for check, _ in by_one):
        return ""
    return f", LoRA's initial logprobs vs the base model's (pass: {_tolerance(results, 'lora_b0_is_base')})"


def _variant_table(results: dict) -> list[str]:
    rows = [["layout", *VARIANTS]]
    for name, m in results["measured"].items():
        rows.append([name, *(f"{m['invariance'][v]:.1e}" if v in m["invariance"] else "-" for v in VARIANTS)])
    return ["batch invariance per variant: max |row in variant - row in full batch| (0.0e+00 = bitwise)", *_table(rows)]


def _grpo_table(results: dict, by_one: dict) -> list[str]:
    """Per layout: GRPO step 0 and the fused step after it (and, for hf, that step computed
    with a separate old-log-prob pass), with the fused step's distance to that separate path;
    then the multi-turn step."""
    keys = [k for k in GRPO_METRICS if k != "loss"]
    rows = [["layout", "step", "loss (per step)", *keys, "grad norm", "fused vs separate", "seconds"]]
    steps = (
        ("grpo", "0"),
        ("grpo_fused", "fused"),
        ("grpo_fused_separate", "separate"),
        ("grpo_multi_turn", "multi-turn"),
        *((key, estimator) for key, estimator, _ in ESTIMATOR_ROWS.values()),
    )
    for name, m in results["measured"].items():
        for key, label in steps:
            g = m.get(key)
            if g is None:
                continue
            vs = _cell(by_one.get(("grpo_fused_vs_separate", name))) if key == "grpo_fused" else ""
            rows.append(
                [
                    name,
                    label,
                    " ".join(f"{x:.6f}" for x in g["loss"]),
                    *(" ".join(f"{x:.3g}" for x in g["metrics"].get(k, [])) or "-" for k in keys),
                    " ".join(f"{x:.6f}" for x in g["grad_norm"]),
                    vs,
                    f"{m.get('grpo_s', 0):.1f}" if key == "grpo" else "",
                ]
            )
    tol = _tolerance(results, "grpo_fused_vs_separate") if "grpo_fused_vs_separate" in results["tolerances"] else ""
    return [
        "GRPO per layout (values per optimizer step; hf: in this process): step 0, then the fused step, "
        "then (where they ran) the multi-turn step and the estimator rows; "
        f"fused vs separate: the layout's fused step against hf's separate-pass step on the same weights "
        f"(pass: {tol})",
        *_table(rows),
    ]


def _engine_table(results: dict, checks: list[dict]) -> list[str]:
    rows = [
        ["layout", "transport", "token_mult_prob_error", "max |lp_policy - lp_engine|", "gen KL", "tokens", "refit s"]
    ]
    for c in (c for c in checks if c["check"] == "token_mult_prob_error"):
        for transport, t in c["transports"].items():
            worst = t["token_mult_prob_error"] == c["value"]
            cell = f"{t['token_mult_prob_error']:.7f}" + (" FAIL" if worst and not c["pass"] else "")
            rows.append(
                [
                    c["a"],
                    transport,
                    cell,
                    f"{t['max_abs_diff']:.1e}",
                    f"{t['gen_kl_error']:.1e}",
                    str(t["tokens"]),
                    f"{t['refit_s']:.2f}",
                ]
            )
    start = results["seconds"].get("engine start")
    started = f"; engine start-up {start:.1f} s" if start else ""
    return (
        [
            f"vLLM engine refit from each layout after its {results['steps']} steps, {ENGINE_PROMPTS} prompts x "
            f"{ENGINE_NEW_TOKENS} sampled tokens: token_mult_prob_error = mean exp|lp_policy - lp_engine| (pass: "
            f"{_tolerance(results, 'token_mult_prob_error')}, the larger transport counts){started}",
            *_table(rows),
        ]
        if len(rows) > 1
        else []
    )


def _dcp_table(results: dict, checks: list[dict]) -> list[str]:
    loaded = {(c["a"], c["b"]): c for c in checks if c["check"] == "dcp_crossload"}
    resumed = {(c["a"], c["b"]): c for c in checks if c["check"] == "dcp_resume"}
    lines = []
    if loaded:
        rows = [["source -> target", "loaded: max |diff|", "one more step: max |diff|", "loss of that step"]]
        for pair, c in loaded.items():
            r = resumed.get(pair)
            rows.append(
                [
                    f"{pair[0]} -> {pair[1]}",
                    _cell(c),
                    _cell(r),
                    " vs ".join(f"{x:.6f}" for x in r["loss"]) if r else "-",
                ]
            )
        lines += [
            f"DCP cross-load (torch): the target started from the source's save_checkpoint(weights, optimizer) "
            f"(pass: {_tolerance(results, 'dcp_crossload')} loaded, {_tolerance(results, 'dcp_resume')} after "
            "one more step from the loaded optimizer state)",
            *_table(rows),
        ]
    names = [n for n in results["measured"] if n not in (HF, HF_LORA)]
    torch_names = dcp_layouts(names)
    jax_names = [n for n in names if jax_devices(n) is not None]
    if torch_names and jax_names:
        lines.append(
            "torch DCP <-> JAX: no direct load (the JAX backend checkpoints orbax); "
            f"{', '.join(torch_names)} <-> {', '.join(jax_names)} go through the HF export (cross-load above)"
        )
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
    lines = [
        f"parity: {results['model']}, {precision}, batch {results['batch']} x seq {results['seq']} "
        f"({results['real_tokens']} real tokens), {results['steps']} AdamW steps at lr {results['lr']:g} "
        f"(max_grad_norm {results['max_grad_norm']}); hf = single-process AutoModelForCausalLM; "
        + ("hf-lora = the same with the seeded LoRA adapters (pairs within a kind only); " if HF_LORA in names else "")
        + "cells: the value, marked FAIL when outside its tolerance",
        "",
    ]
    if len(names) > 1:
        for check in PAIRWISE:
            optional = check in GRPO_CHECKS or check in MULTI_TURN_CHECKS
            if optional and not any(c["check"] == check for c in checks):
                continue
            lines += [*_pair_matrix(check, names, by_pair, _tolerance(results, check)), ""]
    if names:
        lines += [*_per_layout_table(results, by_one), "", *_variant_table(results), ""]
    if any("grpo" in m for m in results["measured"].values()):
        lines += [*_grpo_table(results, by_one), ""]
    cross = [c for c in checks if c["check"] == "crossload"]
    if cross:
        lines += [
            f"cross-load: source's HF export loaded by the target; max |target - source| logprobs "
            f"(pass: {_tolerance(results, 'crossload')})",
            *_table([["source -> target", "max |diff|"]] + [[f"{c['a']} -> {c['b']}", _cell(c)] for c in cross]),
            "",
        ]
    lines += _dcp_table(results, checks)
    lines += exact_table(checks)
    engine = _engine_table(results, checks)
    if engine:
        lines += [*engine, ""]
    failed = [c for c in checks if not c["pass"]]
    for c in failed:
        pair = c["a"] + (f" vs {c['b']}" if c["b"] else "")
        lines.append(f"FAIL {c['check']}: {pair}: {c['value']:.3e} (needs {c['op']} {c['tol']:g})")
    for msg in results["errors"].values():
        lines.append(f"ERROR {msg}")
    for name, why in results["skipped"].items():
        lines.append(f"SKIPPED {name}: {why}")
    verdict = "PASS" if results["passed"] else "FAIL"
    lines.append(
        f"{verdict}: {len(checks) - len(failed)} of {len(checks)} checks within tolerance, "
        f"{len(results['errors'])} error(s), {len(results['skipped'])} layout(s) skipped; "
        f"{results['seconds'].get('total', 0):.0f} s"
    )
    return "\n".join(lines)
