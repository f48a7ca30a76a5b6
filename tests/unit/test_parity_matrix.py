"""``benchmarks.parity`` / ``dualrl parity``: the matrix on one layout per backend passes, and a
result outside a tolerance (fabricated, no workers) is reported as FAIL."""

from __future__ import annotations

import json
import re

import pytest
import torch

from benchmarks import jax_backend, parity
from core.cli import main as cli_main

# ----------------------------------------------------------------------------- fabricated results


def _measurement(logprobs: torch.Tensor, losses=(5.5, 5.25, 5.0), norms=(2.0, 1.9, 1.8), moved=0.01) -> dict:
    return {"logprobs": logprobs, "invariance": {v: 0.0 for v in parity.VARIANTS}, "loss": list(losses),
            "grad_norm": list(norms), "trained_logprobs": logprobs - moved}


def _results(measured: dict, errors: dict | None = None) -> dict:
    """``collect`` on fabricated measurements; every layout's export loaded by the next one."""
    names = [n for n in measured if n != parity.HF]
    crossloaded = {(src, tgt): measured[src]["trained_logprobs"].clone()
                   for src, tgt in [(n, parity.HF) for n in names] + parity.crossload_pairs(names, "ring")}
    return parity.collect(measured, crossloaded, errors=errors, seconds={"total": 1.0}, model="fabricated",
                          layouts=names, batch=4, seq=6, real_tokens=20, steps=3, lr=1e-3, max_grad_norm=1.0,
                          crossload="ring")


def _clean() -> dict:
    lp = -torch.rand(4, 6, generator=torch.Generator().manual_seed(0)) * 5
    return {parity.HF: _measurement(lp), "a": _measurement(lp.clone()), "b": _measurement(lp + 3e-7)}


def _failed(results: dict) -> set[tuple]:
    return {(c["check"], c["a"], c["b"]) for c in results["checks"] if not c["pass"]}


def test_fabricated_results_within_tolerance_pass():
    results = _results(_clean())
    assert results["passed"] and not _failed(results)
    report = parity.format_matrix(results)
    assert not re.search(r"e[+-]\d\d FAIL", report)  # no cell marked
    assert not any(line.startswith("FAIL") for line in report.splitlines())
    assert report.splitlines()[-1].startswith("PASS: ")
    json.dumps(results)  # every number is JSON-able
    assert sum(c["check"] == "logprobs" for c in results["checks"]) == 3
    assert {(c["a"], c["b"]) for c in results["checks"] if c["check"] == "crossload"} == {
        ("a", "hf"), ("b", "hf"), ("a", "b"), ("b", "a")}


def test_a_perturbed_logprob_is_reported_as_fail():
    measured = _clean()
    measured["b"]["logprobs"][1, 2] += 1e-3  # one position of one layout, 100x the tolerance
    results = _results(measured)
    assert not results["passed"]
    assert _failed(results) == {("logprobs", "hf", "b"), ("logprobs", "a", "b")}
    report = parity.format_matrix(results)
    assert "FAIL logprobs: hf vs b: 1.000e-03 (needs <= 1e-05)" in report
    assert "FAIL logprobs: a vs b" in report
    assert "1.0e-03 FAIL" in report  # the matrix cell
    assert report.splitlines()[-1].startswith("FAIL: ")


def test_each_tolerance_is_applied():
    measured = _clean()
    measured["a"]["loss"][0] += 2e-5  # 2e-5 / 5.5 = 3.6e-6 relative: within 1e-5
    measured["a"]["grad_norm"][0] = float("nan")  # NaN never passes
    measured["b"]["loss"][2] += 1e-3  # the curve's tolerance is 1e-4 (x 5.0)
    measured["b"]["invariance"]["reversed"] = 1e-4  # above 1e-5
    measured["hf"]["invariance"]["alone"] = 1e-6  # within, but not bitwise
    measured["hf"]["trained_logprobs"] = measured["hf"]["logprobs"] - 1e-4  # training did not move it
    results = _results(measured)
    failed = _failed(results)
    assert ("loss_step0", "hf", "a") not in failed
    assert {("grad_norm_step0", "hf", "a"), ("grad_norm_step0", "a", "b")} <= failed
    assert {("loss_curve", "hf", "b"), ("loss_curve", "a", "b")} <= failed
    assert ("batch_invariance", "b", None) in failed and ("batch_invariance", "hf", None) not in failed
    assert ("weights_moved", "hf", None) in failed
    inv = next(c for c in results["checks"] if c["check"] == "batch_invariance" and c["a"] == "hf")
    assert inv["bitwise"] == {"alone": False, "alone_trimmed": True, "reversed": True, "mixed": True}


def test_a_layout_that_did_not_run_fails_the_run():
    results = _results(_clean(), errors={"jax-tp2": "jax-tp2: RuntimeError: boom"})
    assert not results["passed"]
    assert "ERROR jax-tp2: RuntimeError: boom" in parity.format_matrix(results)


def test_exit_code_follows_the_verdict(monkeypatch, tmp_path, capsys):
    measured = _clean()
    measured["a"]["grad_norm"][0] += 1.0
    for results, rc in ((_results(_clean()), 0), (_results(measured), 1)):
        monkeypatch.setattr(parity, "run_parity", lambda *a, _r=results, **k: _r)
        out = tmp_path / f"rc{rc}.json"
        assert cli_main(["parity", "--layouts", "fsdp1-dp2", "--json", str(out)]) == rc
        assert json.loads(out.read_text())["passed"] is (rc == 0)
    assert "FAIL grad_norm_step0: hf vs a" in capsys.readouterr().out


def test_bad_arguments_are_named_before_anything_starts(capsys):
    with pytest.raises(ValueError, match="unknown layout 'jax-bogus'"):
        parity.run_parity(["fsdp1-dp2", "jax-bogus"])
    with pytest.raises(ValueError, match="layout dtensor-dp2: batch 3"):
        parity.run_parity(["dtensor-dp2"], batch=3)
    assert cli_main(["parity", "--layouts", "fsdp1-dp2", "nope"]) == 2
    assert "unknown layout 'nope'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the real matrix


def test_tiny_matrix_one_layout_per_backend_passes(ray_session):
    # The session's Ray fixes the XLA host devices of its actors (8, tests/conftest.py): the
    # JAX layout uses all of them (a JAX actor's mesh must cover every device it sees).
    n = jax_backend.actor_device_count()
    layouts = ["fsdp1-dp2", "dtensor-tp2", f"jax-fsdp{n}"]
    results = parity.run_parity(layouts, "llama")
    report = parity.format_matrix(results)
    print(report)
    assert results["passed"], report
    assert list(results["measured"]) == ["hf", *layouts] and not results["skipped"]
    checks = results["checks"]
    assert sum(c["check"] == "logprobs" for c in checks) == 6  # hf + 3 layouts, every pair
    crossed = {(c["a"], c["b"]) for c in checks if c["check"] == "crossload"}
    assert crossed == {*((name, "hf") for name in layouts), *parity.crossload_pairs(layouts, "ring")}
    json.dumps(results)
