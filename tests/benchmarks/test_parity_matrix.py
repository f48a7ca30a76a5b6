"""``benchmarks.parity`` / ``dualrl parity``: the matrix on one layout per backend passes, and a
result outside a tolerance (fabricated, no workers) is reported as FAIL."""

from __future__ import annotations

import json
import re

import pytest
import torch

from benchmarks import parity as parity_cli
from benchmarks.lib.layouts import LayoutError, device_layout, parse_layout
from benchmarks.lib.models import save_tiny_gpt2
from benchmarks.lib.parity.checks import crossload_pairs, judge
from benchmarks.lib.parity.estimators import estimator_batch, estimator_loss_fn, group_size
from benchmarks.lib.parity.grpo import grpo_batch, grpo_summary
from benchmarks.lib.parity.hf_reference import HFReference
from benchmarks.lib.parity.models import jax_model_problem, layout_problem
from benchmarks.lib.parity.report import format_matrix
from benchmarks.lib.parity.run import dcp_ring, run_parity
from benchmarks.lib.parity.settings import (
    BF16_TOLERANCES,
    ESTIMATOR_ROWS,
    ESTIMATOR_SEED,
    HF,
    HF_LORA,
    LORA,
)
from benchmarks.lib.workload import default_policy_section, policy_config
from dualrl.cli import main as cli_main
from tests.benchmarks.fabricated_parity import (
    clean_measurements,
    engine_row,
    failed_checks,
    fused_step,
    grpo_step0,
    measurement,
    results_of,
)


def test_fabricated_results_within_tolerance_pass():
    results = results_of(clean_measurements())
    assert results["passed"] and not failed_checks(results)
    report = format_matrix(results)
    assert not re.search(r"e[+-]\d\d FAIL", report)  # no cell marked
    assert not any(line.startswith("FAIL") for line in report.splitlines())
    assert report.splitlines()[-1].startswith("PASS: ")
    json.dumps(results)  # every number is JSON-able
    assert sum(c["check"] == "logprobs" for c in results["checks"]) == 3
    assert {(c["a"], c["b"]) for c in results["checks"] if c["check"] == "crossload"} == {
        ("a", "hf"),
        ("b", "hf"),
        ("a", "b"),
        ("b", "a"),
    }
    assert sum(c["check"] == "grpo_step0" for c in results["checks"]) == 3  # hf, a, b: every pair
    assert sum(c["check"] == "grpo_fused" for c in results["checks"]) == 3
    # each layout's fused step (hf's too) against hf's separate-pass step on the same weights
    assert {c["a"] for c in results["checks"] if c["check"] == "grpo_fused_vs_separate"} == {"hf", "a", "b"}
    assert {(c["a"], c["b"]) for c in results["checks"] if c["check"] in ("dcp_crossload", "dcp_resume")} == {
        ("a", "b"),
        ("b", "a"),
    }
    assert "GRPO step 0 (ClippedPGLossFn" in report and "DCP cross-load (torch)" in report
    assert "fused GRPO step (old log-probs from the training forward" in report
    assert "vLLM engine" not in report  # no engine measurement, no engine table


def test_a_perturbed_logprob_is_reported_as_fail():
    measured = clean_measurements()
    measured["b"]["logprobs"][1, 2] += 1e-3  # one position of one layout, 100x the tolerance
    results = results_of(measured)
    assert not results["passed"]
    assert failed_checks(results) == {("logprobs", "hf", "b"), ("logprobs", "a", "b")}
    report = format_matrix(results)
    assert "FAIL logprobs: hf vs b: 1.000e-03 (needs <= 1e-05)" in report
    assert "FAIL logprobs: a vs b" in report
    assert "1.0e-03 FAIL" in report  # the matrix cell
    assert report.splitlines()[-1].startswith("FAIL: ")


def test_each_tolerance_is_applied():
    measured = clean_measurements()
    measured["a"]["loss"][0] += 2e-5  # 2e-5 / 5.5 = 3.6e-6 relative: within 1e-5
    measured["a"]["grad_norm"][0] = float("nan")  # NaN never passes
    measured["b"]["loss"][2] += 1e-3  # the curve's tolerance is 1e-4 (x 5.0)
    measured["b"]["invariance"]["reversed"] = 1e-4  # above 1e-5
    measured["hf"]["invariance"]["alone"] = 1e-6  # within, but not bitwise
    measured["hf"]["trained_logprobs"] = measured["hf"]["logprobs"] - 1e-4  # training did not move it
    results = results_of(measured)
    failed = failed_checks(results)
    assert ("loss_step0", "hf", "a") not in failed
    assert {("grad_norm_step0", "hf", "a"), ("grad_norm_step0", "a", "b")} <= failed
    assert {("loss_curve", "hf", "b"), ("loss_curve", "a", "b")} <= failed
    assert ("batch_invariance", "b", None) in failed and ("batch_invariance", "hf", None) not in failed
    assert ("weights_moved", "hf", None) in failed
    inv = next(c for c in results["checks"] if c["check"] == "batch_invariance" and c["a"] == "hf")
    assert inv["bitwise"] == {"alone": False, "alone_trimmed": True, "reversed": True, "mixed": True}


def test_a_layout_that_did_not_run_fails_the_run():
    results = results_of(clean_measurements(), errors={"jax-tp2": "jax-tp2: RuntimeError: boom"})
    assert not results["passed"]
    assert "ERROR jax-tp2: RuntimeError: boom" in format_matrix(results)


def test_exit_code_follows_the_verdict(monkeypatch, tmp_path, capsys):
    measured = clean_measurements()
    measured["a"]["grad_norm"][0] += 1.0
    for results, rc in ((results_of(clean_measurements()), 0), (results_of(measured), 1)):
        monkeypatch.setattr(parity_cli, "run_parity", lambda *a, _r=results, **k: _r)  # what main() calls
        out = tmp_path / f"rc{rc}.json"
        assert cli_main(["parity", "--layouts", "fsdp1-dp2", "--json", str(out)]) == rc
        assert json.loads(out.read_text())["passed"] is (rc == 0)
    assert "FAIL grad_norm_step0: hf vs a" in capsys.readouterr().out


def test_a_grpo_metric_out_of_tolerance_fails_its_pairs():
    measured = clean_measurements()
    measured["b"]["grpo"]["metrics"]["kl_penalty"][1] += 1e-4  # 10x the tolerance (absolute below 1)
    measured["a"]["grpo"]["grad_norm"][0] *= 1 + 5e-6  # relative 5e-6: within
    results = results_of(measured)
    assert failed_checks(results) == {("grpo_step0", "hf", "b"), ("grpo_step0", "a", "b")}
    worst = next(c for c in results["checks"] if (c["check"], c["a"], c["b"]) == ("grpo_step0", "hf", "b"))
    assert max(worst["per_quantity"], key=worst["per_quantity"].get) == "kl_penalty"
    report = format_matrix(results)
    assert "FAIL grpo_step0: hf vs b: 1.000e-04 (needs <= 1e-05)" in report
    # A measurement without a GRPO summary is left out of the GRPO pairs, not failed.
    del measured["b"]["grpo"]
    assert {(c["a"], c["b"]) for c in results_of(measured)["checks"] if c["check"] == "grpo_step0"} == {("hf", "a")}


def test_a_fused_step_off_the_separate_path_fails_both_checks():
    measured = clean_measurements()
    measured["a"]["grpo_fused"]["metrics"]["kl_penalty"][0] += 1e-4  # 10x the tolerance (absolute below 1)
    results = results_of(measured)
    assert failed_checks(results) == {
        ("grpo_fused_vs_separate", "a", None),
        ("grpo_fused", "hf", "a"),
        ("grpo_fused", "a", "b"),
    }
    report = format_matrix(results)
    assert "FAIL grpo_fused_vs_separate: a: 1.000e-04 (needs <= 1e-05)" in report
    # Without hf's separate-pass step there is nothing to hold the fused step to: no check.
    del measured[HF]["grpo_fused_separate"]
    assert not any(c["check"] == "grpo_fused_vs_separate" for c in results_of(measured)["checks"])


def test_the_estimator_rows_are_pairwise_grpo_checks_in_the_report():
    keys = {check: key for check, (key, _, _) in ESTIMATOR_ROWS.items()}
    assert set(keys) == {"grpo_dr_grpo_step", "grpo_rloo_step"}
    measured = {name: {**m, **{key: grpo_step0() for key in keys.values()}} for name, m in clean_measurements().items()}
    results = results_of(measured)
    assert results["passed"], format_matrix(results)
    for check in keys:
        assert sum(c["check"] == check for c in results["checks"]) == 3, check  # hf, a, b: every pair
    measured["a"]["grpo_dr_grpo"]["loss"][1] += 2e-5  # 2x the tolerance
    results = results_of(measured)
    assert failed_checks(results) == {("grpo_dr_grpo_step", "hf", "a"), ("grpo_dr_grpo_step", "a", "b")}
    report = format_matrix(results)
    assert "FAIL grpo_dr_grpo_step: hf vs a: 2.000e-05 (needs <= 1e-05)" in report
    assert "loss / (valid sequences x constant_token_budget)" in report  # the row's title
    assert re.search(r"^a +dr_grpo +0\.170000 -0\.579980", report, re.M)  # its line in the GRPO table
    assert results["measured"]["a"]["grpo_rloo"] == grpo_step0()  # kept in the JSON


def test_the_estimator_batch_has_the_estimators_advantages_and_one_sample_masked_out():
    ids = torch.arange(48).reshape(8, 6)
    lengths = torch.tensor([6, 5, 6, 4, 6, 3, 6, 5])
    base = grpo_batch({"input_ids": ids, "input_lengths": lengths}, -torch.ones(8, 6))
    rewards = torch.rand(8, generator=torch.Generator().manual_seed(ESTIMATOR_SEED))
    groups = rewards.reshape(2, 4)
    dr_grpo = estimator_batch(base, "dr_grpo")
    assert dr_grpo["sample_mask"].tolist() == [1.0] * 7 + [0.0]
    hand = (groups - groups.mean(1, keepdim=True)).reshape(-1)  # no std division
    torch.testing.assert_close(dr_grpo["advantages"], hand[:, None] * base["token_mask"])
    loo = (groups - (groups.sum(1, keepdim=True) - groups) / 3).reshape(-1)  # the other 3 samples' mean
    torch.testing.assert_close(estimator_batch(base, "rloo")["advantages"], loo[:, None] * base["token_mask"])
    constant = estimator_loss_fn({"token_normalizer": "constant"}, width=6).cfg
    assert (constant.token_normalizer, constant.constant_token_budget) == ("constant", 6)
    assert estimator_loss_fn({}, width=6).cfg.constant_token_budget is None
    assert (group_size(8), group_size(6), group_size(3)) == (4, 2, 3)


def test_a_dcp_load_or_resume_out_of_tolerance_fails():
    measured = clean_measurements()
    bad_load = {"logprobs": measured["b"]["trained_logprobs"] + 2e-5, "resumed": dict(measured["b"]["resumed"])}
    resumed = dict(measured["a"]["resumed"], logprobs=measured["a"]["resumed"]["logprobs"] + 2e-4)
    results = results_of(
        measured,
        dcp={
            ("a", "b"): {"logprobs": measured["a"]["trained_logprobs"].clone(), "resumed": resumed},
            ("b", "a"): bad_load,
        },
    )
    assert failed_checks(results) == {("dcp_crossload", "b", "a"), ("dcp_resume", "a", "b")}
    report = format_matrix(results)
    assert re.search(r"FAIL dcp_crossload: b vs a: 2\.00\de-05 \(needs <= 1e-05\)", report)
    assert re.search(r"FAIL dcp_resume: a vs b: 2\.00\de-04 \(needs <= 0\.0001\)", report)
    assert re.search(r"b -> a +2\.0e-05 FAIL +0\.0e\+00", report)  # the table row: loaded FAIL, resumed OK


def _multi_turn(seed: int = 0) -> dict:
    """The multi-turn row's measurement keys as ``multi_turn_step`` makes them (2 rows)."""
    lp = -torch.rand(2, 5, generator=torch.Generator().manual_seed(seed)) * 5
    mask = [[0.0, 1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0, 0.0]]
    return {
        "grpo_multi_turn": grpo_step0(),
        "multi_turn_episodes": {
            "input_ids": [[1, 7, 8, 9, 10], [1, 7, 8, 0, 0]],
            "token_mask": mask,
            "advantages": [[a * m for m in row] for a, row in zip((1.0, -1.0), mask, strict=True)],
            "rewards": [1.0, 0.0],
        },
        "multi_turn_generation_logprobs": lp * torch.tensor(mask),
        "multi_turn_logprobs": lp - 0.1,
    }


def test_the_multi_turn_row_holds_episodes_exactly_and_the_step_to_its_tolerances():
    measured = {name: {**m, **_multi_turn()} for name, m in clean_measurements().items()}
    results = results_of(measured)
    assert results["passed"], format_matrix(results)
    for check in ("grpo_multi_turn_step0", "grpo_multi_turn_logprobs", "multi_turn_episodes"):
        assert sum(c["check"] == check for c in results["checks"]) == 3, check  # hf, a, b: every pair
    json.dumps(results)
    measured["a"]["multi_turn_episodes"]["token_mask"][1][4] = 1.0  # one observation token trained on
    measured["b"]["multi_turn_generation_logprobs"][0, 1] += 2e-5  # 2x the tolerance
    measured["b"]["multi_turn_logprobs"][1, 2] += 5e-5  # within 1e-4 after training
    measured["hf"]["grpo_multi_turn"]["metrics"]["probs_ratio"][1] += 1e-6  # within 1e-5
    results = results_of(measured)
    assert failed_checks(results) == {
        ("multi_turn_episodes", "hf", "a"),
        ("multi_turn_episodes", "a", "b"),
        ("grpo_multi_turn_step0", "hf", "b"),
        ("grpo_multi_turn_step0", "a", "b"),
    }
    mask = next(c for c in results["checks"] if (c["check"], c["a"], c["b"]) == ("multi_turn_episodes", "hf", "a"))
    assert mask["per_quantity"]["token_mask"] == 1.0 and mask["per_quantity"]["rewards"] == 0.0
    report = format_matrix(results)
    assert "FAIL multi_turn_episodes: hf vs a: 1.000e+00 (needs <= 0)" in report
    assert "multi-turn GRPO step (scripted tool-use episodes" in report
    del measured["b"]["multi_turn_episodes"]["rewards"]  # a field one side lacks: NaN, never a pass
    assert ("multi_turn_episodes", "a", "b") in failed_checks(results_of(measured))


def test_the_multi_turn_episodes_come_from_the_tool_environment_and_mask_the_scripted_turns():
    import benchmarks.lib.parity.multi_turn as mt

    workload = mt.MultiTurnWorkload.build(vocab_size=256, max_total_tokens=24)
    data, exact = workload.batch(lambda ids, lengths: -torch.ones(ids.shape))
    tok = workload.tokenizer
    scripted = [turns for _, _, episodes in mt.SCRIPTS for turns in episodes]
    assert exact["turns"] == [len(t) for t in scripted] == [2, 1, 3, 2, 2, 2, 2, 1]
    assert exact["rewards"] == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]  # the environment's judge
    for row, turns in enumerate(scripted):
        ids = data["input_ids"][row, : int(data["input_lengths"][row])]
        trained = ids[data["token_mask"][row, : len(ids)] == 1].tolist()
        want = [i for t in turns for i in [*tok.encode(t, add_special_tokens=False), tok.eos_token_id]]
        assert trained == want, row  # exactly the generated ids, every turn's stop token included
        assert (data["generation_logprobs"][row] == -data["token_mask"][row]).all()
    text = tok.decode(data["input_ids"][3].tolist())  # the unknown tool's error came back as an observation
    assert "<tool_response> <unk>" in text and text.count("<tool_call>") == 1
    assert tok.decode(data["input_ids"][2].tolist()).count("<tool_response> ") == 2  # 690, then 702
    advantages = data["advantages"].sum(1) / data["token_mask"].sum(1)
    assert torch.allclose(advantages, torch.tensor([1.0, -1.0, 0.0, 0.0, 1.0, -1.0, 0.0, 0.0]))
    # --seq too small for the scripts, or a vocabulary too small: refused by name before anything starts
    with pytest.raises(ValueError, match="the scripted conversations are 19 tokens long, --seq is 18"):
        mt.MultiTurnWorkload.build(256, 18)
    with pytest.raises(ValueError, match=r"tokenizer has \d+ ids, the model's vocabulary 20"):
        mt.MultiTurnWorkload.build(20, 24)
    # ... and played anyway (no dry run): an episode cut short is never trained on
    with pytest.raises(ValueError, match=r"turn 1: 5 live episodes, scripted 6 .*\(cut by --seq 16\?\)"):
        mt.MultiTurnWorkload(tok, 16, workload.cfg).batch(lambda ids, lengths: torch.zeros(ids.shape))
    with pytest.raises(ValueError, match="episode 2, turn 2: the scripted turn does not fit within 18 tokens"):
        mt.MultiTurnWorkload(tok, 18, workload.cfg).batch(lambda ids, lengths: torch.zeros(ids.shape))


def test_token_mult_prob_error_band():
    measured = clean_measurements()
    measured["a"]["engine"] = engine_row(1.0000026)  # what vLLM on CPU measures
    measured["b"]["engine"] = engine_row(1.0012)  # a refit that mangled a tensor would be far above
    results = results_of(measured)
    assert failed_checks(results) == {("token_mult_prob_error", "b", None)}
    report = format_matrix(results)
    assert "FAIL token_mult_prob_error: b: 1.001e+00 (needs <= 1.0001)" in report
    assert re.search(r"^a +ipc +1\.0000026 ", report, re.M)
    assert re.search(r"^b +collective +1\.0012000 FAIL", report, re.M)
    json.dumps(results)


def test_layout_problems_name_the_layout_and_why():
    assert layout_problem("fsdp1-dp2", 8, threads=2, ray_cpus=4) is None
    assert layout_problem("dtensor-tp2-sp", 8, threads=2, ray_cpus=4) is None
    assert layout_problem("jax-fsdp8", 8, threads=2, ray_cpus=4) is None
    assert "unknown layout 'bogus-layout'" in layout_problem("bogus-layout", 8, 2, 4)
    assert "unknown layout 'fsdp1-tp2'" in layout_problem("fsdp1-tp2", 8, 2, 4)  # FSDP1 has no TP
    tp4 = layout_problem("dtensor-tp4", 8, threads=2, ray_cpus=4)
    assert tp4.startswith("does not fit: dtensor-tp4 needs 4 workers") and "--threads 2" in tp4
    assert layout_problem("dtensor-tp4", 8, threads=4, ray_cpus=4) is None  # 4 threads: fits
    assert "needs 4 x 1 CPUs (the Ray cluster has 2 CPUs)" in layout_problem("dtensor-dp4", 8, 4, 2)
    assert "is one actor of --threads 8 CPUs" in layout_problem("jax-tp2", 8, 8, 4)
    assert "batch 3 is not divisible by its data-parallel size 2" in layout_problem("dtensor-dp2", 3, 2, 4)
    lay = device_layout("dtensor-dp2-tp2-sp")
    assert (lay.backend, lay.dp, lay.tp, lay.sp) == ("torch_dtensor", 2, 2, True)


def test_a_model_the_jax_backend_does_not_support_is_named(tmp_path, model_dirs):
    gpt2 = save_tiny_gpt2(tmp_path / "gpt2")
    problem = jax_model_problem("tiny-gpt2", str(gpt2))
    assert problem.startswith("model 'tiny-gpt2' is not supported by the JAX backend (jax_pjit): ")
    assert "unsupported model_type 'gpt2'" in problem and "llama" in problem
    assert jax_model_problem("llama", str(model_dirs["llama"])) is None


def test_bad_arguments_are_named_before_anything_starts(capsys):
    with pytest.raises(ValueError, match="no layouts"):
        run_parity([])
    with pytest.raises(ValueError, match="given twice"):
        run_parity(["fsdp1-dp2", "fsdp1-dp2"])
    with pytest.raises(ValueError, match="--engine jax-tp2: not among the layouts"):
        run_parity(["fsdp1-dp2"], engine=["jax-tp2"])
    with pytest.raises(ValueError, match="crossload mode 'star'"):
        run_parity(["fsdp1-dp2"], crossload="star")
    with pytest.raises(ValueError, match="batch must be >= 2 \\(grpo_rloo_step's leave-one-out"):
        run_parity(["fsdp1-dp2"], batch=1)
    assert cli_main(["parity", "--layouts", "fsdp1-dp2", "fsdp1-dp2"]) == 2
    assert "given twice" in capsys.readouterr().err


def test_bad_layouts_and_an_unsupported_model_get_error_lines_the_rest_runs(actor_devices):
    # tiny GPT-2 with only layouts that cannot run: hf (in this process) runs, no worker starts.
    n = actor_devices
    results = run_parity([f"jax-fsdp{n}", "nope", "dtensor-tp4", "dtensor-dp2"], "tiny-gpt2", batch=3)
    report = format_matrix(results)
    assert list(results["measured"]) == ["hf"] and not results["passed"]
    assert set(results["errors"]) == {f"jax-fsdp{n}", "nope", "dtensor-tp4", "dtensor-dp2"}
    assert f"ERROR jax-fsdp{n}: model 'tiny-gpt2' is not supported by the JAX backend (jax_pjit): " in report
    assert "ERROR nope: unknown layout 'nope'" in report
    assert "ERROR dtensor-tp4: does not fit: dtensor-tp4 needs 4 workers" in report
    assert "ERROR dtensor-dp2: batch 3 is not divisible by its data-parallel size 2" in report
    assert results["measured"]["hf"]["grpo"]["grad_norm"][0] > 0  # the hf row's checks still ran
    assert report.splitlines()[-1].startswith("FAIL: ") and " 4 error(s)" in report


# ----------------------------------------------------------------------------- the real matrix


# slow (~90 s): three layouts, two vLLM engines; the fast tests above run the matrix's hf row,
# its error lines and its report, and tests/backends checks every layout against HF
@pytest.mark.slow
def test_tiny_matrix_one_layout_per_backend_passes(actor_devices):
    # The session's Ray fixes the XLA host devices of its actors (8, tests/conftest.py): the
    # JAX layout uses all of them (a JAX actor's mesh must cover every device it sees).
    # tiny-llama-hd32: the tiny llama at head_dim 32, which vLLM's CPU attention serves, so the
    # engine check runs on one torch / JAX pair.  Two layouts that cannot run are named and
    # the others still run and are checked.
    n = actor_devices
    layouts = ["fsdp1-dp2", "dtensor-tp2", f"jax-fsdp{n}"]
    results = run_parity(
        [*layouts, "bogus-layout", "dtensor-tp4"], "tiny-llama-hd32", engine=["fsdp1-dp2", f"jax-fsdp{n}"]
    )
    report = format_matrix(results)
    print(report)
    assert all(c["pass"] for c in results["checks"]), report
    assert set(results["errors"]) == {"bogus-layout", "dtensor-tp4"}, report
    assert "ERROR bogus-layout: unknown layout 'bogus-layout'" in report
    assert "ERROR dtensor-tp4: does not fit: dtensor-tp4 needs 4 workers" in report
    assert not results["passed"]  # the two bad layouts make the exit code 1
    assert list(results["measured"]) == ["hf", *layouts] and not results["skipped"]
    checks = results["checks"]
    # ... the multi-turn GRPO step among them: the same scripted tool-use episodes (bitwise
    # equal ids, masks, rewards, advantages), the step and its updated logprobs on every backend
    multi_turn = ("grpo_multi_turn_step0", "grpo_multi_turn_logprobs", "multi_turn_episodes")
    # ... and the estimator rows (Dr. GRPO's constant normaliser, RLOO) on every backend
    for check in ("logprobs", "grpo_step0", "grpo_fused", *multi_turn, *ESTIMATOR_ROWS):
        assert sum(c["check"] == check for c in checks) == 6, check  # hf + 3 layouts, every pair
    assert results["measured"]["hf"]["multi_turn_episodes"]["turns"] == [2, 1, 3, 2, 2, 2, 2, 1]
    assert {c["a"] for c in checks if c["check"] == "grpo_fused_vs_separate"} == {"hf", *layouts}
    crossed = {(c["a"], c["b"]) for c in checks if c["check"] == "crossload"}
    assert crossed == {*((name, "hf") for name in layouts), *crossload_pairs(layouts, "ring")}
    for check in ("dcp_crossload", "dcp_resume"):
        assert {(c["a"], c["b"]) for c in checks if c["check"] == check} == {
            ("fsdp1-dp2", "dtensor-tp2"),
            ("dtensor-tp2", "fsdp1-dp2"),
        }
    engine = {c["a"]: c for c in checks if c["check"] == "token_mult_prob_error"}
    assert set(engine) == {"fsdp1-dp2", f"jax-fsdp{n}"}
    assert all(set(c["transports"]) == {"ipc", "collective"} and 1.0 <= c["value"] for c in engine.values())
    json.dumps(results)


# slow (~60 s): two layouts; the fast proof that a -dynamic layout's rows split into micro
# batches of different widths is tests/benchmarks/test_bench_compare.py
@pytest.mark.slow
def test_dynamic_batching_layouts_pass_the_matrix(actor_devices):
    """``-dynamic`` on a torch and a JAX layout: every check against hf and each other passes."""
    layouts = ["fsdp1-dp2-dynamic", f"jax-fsdp{actor_devices}-dynamic"]
    results = run_parity(layouts, "llama")
    report = format_matrix(results)
    assert results["passed"], report
    assert list(results["measured"]) == ["hf", *layouts]
    checks = results["checks"]
    for check in ("logprobs", "loss_step0", "grad_norm_step0", "grpo_step0", "grpo_fused"):
        assert sum(c["check"] == check for c in checks) == 3, check  # hf + 2 layouts, every pair


def test_bf16_bands_are_used_for_bf16_runs_and_are_tighter_than_a_real_error():
    assert judge("logprobs", 5e-3, BF16_TOLERANCES) and not judge("logprobs", 5e-3)
    assert not judge("logprobs", 0.1, BF16_TOLERANCES)  # a tenth of a nat: a real error
    with pytest.raises(ValueError, match="precision must be float32 or bfloat16"):
        run_parity(["fsdp1-dp2"], precision="float16")


# ----------------------------------------------------------------------------- -lora layouts


def test_lora_layouts_parse_and_only_parity_runs_them(tmp_path):
    layout = parse_layout("dtensor-tp2-sp-packed-lora-compiled")
    assert (layout.lora, layout.packed, layout.compiled, layout.tp) == (True, True, True, 2)
    assert parse_layout("jax-fsdp2-lora").lora and not parse_layout("fsdp1-dp2").lora
    with pytest.raises(LayoutError, match="unknown layout"):
        parse_layout("fsdp1-dp2-lora-packed")  # -lora comes after -packed
    args = (tmp_path, tmp_path, parse_layout("fsdp1-dp2-lora"), 4, 6, "float32")
    with pytest.raises(LayoutError, match="-lora"):  # a benchmark without LoRA settings
        policy_config(*args)
    assert policy_config(*args, lora=LORA)["lora"] == {**default_policy_section()["lora"], "enabled": True, **LORA}


def _lora_run(b0_offset: float = 0.0) -> dict:
    """hf + one plain layout, hf-lora + two LoRA layouts; LoRA trains differently (other losses,
    norms, trained logprobs, GRPO metrics) but starts at the base logprobs."""
    lp = -torch.rand(4, 6, generator=torch.Generator().manual_seed(0)) * 5
    lora = {"losses": (5.5, 5.4, 5.3), "norms": (0.3, 0.29, 0.28), "moved": 0.002}
    separate = fused_step()
    lora_separate = grpo_summary([-0.2], [0.3], {k: v for k, v in separate["metrics"].items()})

    def lora_measurement(logprobs):
        return {**measurement(logprobs, **lora), "grpo_fused": lora_separate}

    return {
        HF: {**measurement(lp), "grpo_fused_separate": separate},
        HF_LORA: {**lora_measurement(lp.clone()), "grpo_fused_separate": lora_separate, "base_logprobs": lp.clone()},
        "fsdp1-dp2": measurement(lp.clone()),
        "fsdp1-dp2-lora": lora_measurement(lp.clone()),
        "jax-fsdp2-lora": lora_measurement(lp + b0_offset),
    }


def test_a_mixed_run_compares_lora_with_lora_and_full_with_full():
    results = results_of(_lora_run())
    assert results["passed"], failed_checks(results)
    lora = {HF_LORA, "fsdp1-dp2-lora", "jax-fsdp2-lora"}
    pairs = {(c["a"], c["b"]) for c in results["checks"] if c["check"] == "loss_curve"}
    assert pairs == {(HF, "fsdp1-dp2"), (HF_LORA, "fsdp1-dp2-lora"), (HF_LORA, "jax-fsdp2-lora"),
                     ("fsdp1-dp2-lora", "jax-fsdp2-lora")}  # fmt: skip
    b0 = {c["a"] for c in results["checks"] if c["check"] == "lora_b0_is_base"}
    assert b0 == lora
    assert "lora B=0 vs base" in format_matrix(results)
    # DCP only within a kind: one plain torch layout has no partner, the two LoRA ones load each other
    names = ["fsdp1-dp2", "dtensor-dp2-lora", "jax-fsdp2", "fsdp1-dp2-lora"]
    assert dcp_ring(names) == [("dtensor-dp2-lora", "fsdp1-dp2-lora"), ("fsdp1-dp2-lora", "dtensor-dp2-lora")]


def test_lora_off_the_base_model_at_init_fails_lora_b0_is_base():
    results = results_of(_lora_run(b0_offset=2e-5))
    failed = failed_checks(results)
    assert ("lora_b0_is_base", "jax-fsdp2-lora", None) in failed
    assert ("lora_b0_is_base", "fsdp1-dp2-lora", None) not in failed
    assert "FAIL lora_b0_is_base: jax-fsdp2-lora" in format_matrix(results)


def test_the_hf_lora_reference_starts_as_the_base_model_and_trains_adapters_only(model_dirs):
    cfg = default_policy_section()
    plain, lora = HFReference(str(model_dirs["llama"]), cfg), HFReference(str(model_dirs["llama"]), cfg, lora=LORA)
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([6, 4])
    assert torch.equal(lora.logprobs(ids, lengths), plain.logprobs(ids, lengths))  # B = 0, exactly
    before = {k: v.clone() for k, v in lora.model.state_dict().items()}
    lora.trainer({"input_ids": ids, "input_lengths": lengths, "token_mask": torch.ones_like(ids),
                  "sample_mask": torch.ones(2)})()  # fmt: skip
    moved = {k for k, v in lora.model.state_dict().items() if not torch.equal(v, before[k])}
    assert moved and all(".lora_" in k for k in moved)
    assert {id(p) for g in lora._opt.param_groups for p in g["params"]} == {
        id(p) for n, p in lora.model.named_parameters() if ".lora_" in n
    }


# slow (~60 s): two torch layouts, one plain and one LoRA; the fast tests above check the rules
# on fabricated results, tests/backends/test_lora_backends.py each backend's LoRA step
@pytest.mark.slow
def test_a_real_mixed_run_passes_with_two_references(ray_session):
    results = run_parity(["fsdp1-dp2", "dtensor-tp2-lora"], "llama")
    report = format_matrix(results)
    assert results["passed"], report
    assert list(results["measured"]) == [HF, HF_LORA, "fsdp1-dp2", "dtensor-tp2-lora"]
    pairs = {(c["a"], c["b"]) for c in results["checks"] if c["check"] == "trained_logprobs"}
    assert pairs == {(HF, "fsdp1-dp2"), (HF_LORA, "dtensor-tp2-lora")}
    assert {c["a"] for c in results["checks"] if c["check"] == "lora_b0_is_base"} == {HF_LORA, "dtensor-tp2-lora"}
    # the merged export crosses kinds both ways; no DCP pair (one torch layout per kind)
    crossed = {(c["a"], c["b"]) for c in results["checks"] if c["check"] == "crossload"}
    assert ("fsdp1-dp2", "dtensor-tp2-lora") in crossed and ("dtensor-tp2-lora", "fsdp1-dp2") in crossed
    assert not any(c["check"] == "dcp_crossload" for c in results["checks"])


def test_exact_rows_fail_at_one_bit():
    """``--exact``: the sampler's logprob of one token one fp32 ulp off fails ``exact_sampler``,
    and a batch-invariance deviation of one ulp fails ``exact_batch_invariance`` (both pass at 0)."""
    measured = clean_measurements()
    exact = {"max_abs_vs_policy": 0.0, "max_abs_alone_vs_batch": 0.0, "rows_with_other_tokens_alone": 0, "tokens": 9}
    measured["a"]["exact"] = {**exact, "value": 0.0}
    measured["b"]["exact"] = {**exact, "value": 4.8e-7, "max_abs_vs_policy": 4.8e-7}
    measured["b"]["invariance"]["alone_trimmed"] = 4.8e-7  # within batch_invariance's 1e-5
    results = results_of(measured)
    assert failed_checks(results) == {("exact_sampler", "b", None), ("exact_batch_invariance", "b", None)}
    report = format_matrix(results)
    assert "FAIL exact_sampler: b: 4.800e-07 (needs <= 0)" in report
    assert "a  exact_sampler: 0.0e+00  (9 tokens" in report
