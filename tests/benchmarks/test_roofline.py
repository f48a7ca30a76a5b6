"""The roofline of ``dualrl bench`` (``benchmarks.lib.roofline``): the workload's products add up
to the bench's FLOP accounting, the achieved rates and shares are the arithmetic they claim, the
report and chart show them, and a peak measurement in a child process returns every engine."""

from __future__ import annotations

import types

import pytest

from benchmarks.lib import machine, roofline

CONFIG = types.SimpleNamespace(
    hidden_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=16,
    vocab_size=10,
)


def test_the_workload_products_are_three_times_the_forward_matmul_flops():
    tokens = 6
    products = roofline.workload_products(CONFIG, tokens)
    # forward, input gradient and weight gradient of every linear: 3 x 2 N per token
    assert sum(p.flops * p.count for p in products) == 3 * 2 * machine.matmul_params(CONFIG) * tokens
    # q and o (8->8, 2 layers each): forward and input gradient are one [6, 8] @ [8, 8] shape
    assert roofline.Product(tokens, 8, 8, 8) in products and roofline.Product(8, tokens, 8, 4) in products
    assert roofline.linear_shapes(CONFIG) == {(8, 8): 4, (8, 4): 4, (8, 16): 4, (16, 8): 2, (8, 10): 1}
    # the set's rate weights each product by its count
    two = [roofline.Product(10, 10, 10, 1), roofline.Product(10, 10, 10, 3)]
    assert roofline.combined_rate(two, [1e-6, 1e-6]) == pytest.approx(4 * 2000 / 4e-6 / 1e9)


def _results() -> dict:
    grpo = {
        "step_s": 2.0,
        "phases_s": {"generation": 0.5, "train": 1.0, "refit": 0.1},
        "response_length_mean": 6.0,
        "trl_phases_s": {"generation_s": [1.0, 1.0], "train_s": [2.0, 2.0]},
        "trl_completion_length": [8.0, 8.0],
    }
    row = {
        "case": "fsdp1-dp2",
        "logprobs_s": [0.5, 0.5],
        "train_s": [1.0, 3.0],
        "hf_logprobs_s": [0.5],
        "hf_train_s": [1.0],
        "grpo": grpo,
        "refit": {"transports": {"ipc": {"bytes": 2e9, "seconds": [1.0]}}, "memcpy": {"warm_s": 0.25}},
    }
    return {
        "size": "tiny",
        "machine": {"device_name": "cpu", "precision": "float32"},
        "tokens": 100,
        "seq": 32,
        "hf": {"case": "hf", "logprobs_s": [0.25], "train_s": [1.0]},
        "layouts": [row],
        "generation": {"sequences": 4, "prompt_tokens": 40, "tokens": 24, "seconds": 0.5},
        "grpo_workload": {"prompts": 2, "group": 2},
        "grpo_prompt_tokens_mean": 10.0,
        "roofline": {"tokens": 256, "peaks": {"xla": {"float32": 200.0}, "torch": {"float32": 100.0}}},
    }


def test_achieved_rates_and_shares_by_hand():
    results = _results()
    got = {(a.row, a.phase): a for a in roofline.achieved(results, CONFIG)}
    fwd = machine.flops_per_token(CONFIG, 32, False)
    # logprobs: 100 tokens x forward FLOPs in the median 0.5 s, against the best peak (xla, 200)
    lp = got[("fsdp1-dp2", "logprobs")]
    assert lp.rate == pytest.approx(100 * fwd / 0.5 / 1e9) and lp.share == pytest.approx(lp.rate / 200)
    assert got[("fsdp1-dp2", "train")].rate == pytest.approx(100 * 3 * fwd / 2.0 / 1e9)  # median of [1, 3]
    assert got[("hf", "logprobs")].rate == pytest.approx(100 * fwd / 0.25 / 1e9)
    # generation: prompt + generated tokens at their mean length (64 / 4 = 16)
    gen = got[("vLLM engine", "generation")]
    assert gen.rate == pytest.approx(64 * machine.flops_per_token(CONFIG, 16, False) / 0.5 / 1e9)
    # GRPO: 4 samples of 10 prompt + 6 (dualrl) / 8 (TRL) completion tokens
    train = got[("fsdp1-dp2", "GRPO train")]
    assert train.rate == pytest.approx(4 * 16 * 3 * machine.flops_per_token(CONFIG, 16, False) / 1.0 / 1e9)
    trl = got[("TRL beside fsdp1-dp2", "GRPO generation")]
    assert trl.rate == pytest.approx(4 * 18 * machine.flops_per_token(CONFIG, 18, False) / 1.0 / 1e9)
    # refit: bytes/s against memcpy's
    refit = got[("fsdp1-dp2", "refit ipc")]
    assert (refit.unit, refit.rate, refit.share) == ("GB/s", 2.0, 0.25)
    assert roofline.best_peak(results["roofline"], "float32") == ("xla", 200.0)
    assert roofline.best_peak(results["roofline"], "bfloat16") is None


def test_the_report_and_the_chart_show_the_roofline(tmp_path):
    import dataclasses

    from benchmarks.lib.compare.plot import panels, plot, roofline_panel
    from benchmarks.lib.compare.report import roofline_lines

    results = _results()
    results["roofline"]["achieved"] = [dataclasses.asdict(a) for a in roofline.achieved(results, CONFIG)]
    text = "\n".join(roofline_lines(results))
    assert "| xla | 200 | - |" in text and "| torch | 100 | - |" in text
    assert "best measured peak, 200 GFLOP/s (xla, float32)" in text
    assert "| fsdp1-dp2 | refit ipc | 2.0 GB/s | 25.0 |" in text
    lp = next(a for a in results["roofline"]["achieved"] if a["phase"] == "logprobs" and a["row"] == "fsdp1-dp2")
    assert f"| fsdp1-dp2 | logprobs | {lp['rate']:,.0f} GFLOP/s | {100 * lp['share']:.1f} |" in text
    assert roofline_panel in panels(results)
    assert plot(results, tmp_path / "bench.png").stat().st_size > 10_000
    assert roofline_lines({**results, "roofline": None}) == []


def test_peaks_are_measured_in_worker_set_up_children_for_every_engine():
    """Tiny products of two shapes (every width 64), one repeat: every present engine answers in
    fp32 and bf16 -- except oneDNN in bf16 on a CPU without AVX-512 (no bf16 inner product there),
    which is reported by name while the rest still count."""
    widths = dict(hidden_size=64, intermediate_size=64, vocab_size=64, num_key_value_heads=2)
    tiny = types.SimpleNamespace(**{**vars(CONFIG), **widths})
    assert len(roofline.workload_products(tiny, 32)) == 2
    out = roofline.measure_peaks(tiny, 32, "cpu", threads=1, repeats=1)
    assert set(out["errors"]) <= {"torch-onednn bfloat16"}, out["errors"]
    engines = roofline.present_engines("cpu")
    assert set(out["peaks"]) == {e for family in engines.values() for e in family} >= {"torch", "xla"}
    for engine, rates in out["peaks"].items():
        for dtype in roofline.DTYPES:
            assert (rates.get(dtype, 0) > 0) != (f"{engine} {dtype}" in out["errors"]), (engine, dtype)
    env, pin = roofline.worker_env("xla", "cpu", threads=1)
    assert "--xla_cpu_multi_thread_eigen=false" in env["XLA_FLAGS"] and "device_count=1" in env["XLA_FLAGS"]


def test_the_grpo_table_gives_the_ratio_per_completion_token():
    from benchmarks.lib.compare.report import grpo_lines, per_token_ratio

    g = {"step_s": 2.0, "response_length_mean": 8.0}
    # TRL: 3 s for 12-token completions (0.25 s/token); dualrl: 2 s for 8 (0.25 s/token)
    assert per_token_ratio(g, 3.0, 12.0) == pytest.approx(1.0)
    assert per_token_ratio(g, 3.0, None) is None
    results = _results()
    results["grpo_workload"].update(new_tokens=16, full_length=False)
    results["grpo_generation"] = "vllm"
    results["layouts"][0]["grpo"]["trl_step_s"] = [3.0, 3.0]
    row = next(line for line in grpo_lines(results) if line.startswith("| fsdp1-dp2 |"))
    # step 2.0 s for 6-token completions; TRL 3.0 s for 8: 1.5x a step, (3 / 8) / (2 / 6) = 1.125x a token
    assert row.startswith("| fsdp1-dp2 | sync | 2.00 | 1.50 | 1.12 | 3.00 |"), row
