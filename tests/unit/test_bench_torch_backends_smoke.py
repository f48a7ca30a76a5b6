"""Smoke test of ``python -m benchmarks.torch_backends`` on the smallest tiny model."""

from __future__ import annotations

import os

from benchmarks import torch_backends as bench


def test_ratio_uses_the_paired_hf_calls():
    hf = {"case": "hf", "logprobs_s": [1.0, 1.0]}
    case = {"case": "x", "logprobs_s": [0.5, 0.5], "hf_logprobs_s": [2.0, 2.0]}
    assert bench.ratio(case, hf, "logprobs") == 4.0  # paired hf, not the pooled hf row
    assert bench.ratio({"case": "y", "logprobs_s": [0.5]}, hf, "logprobs") == 2.0  # fallback: hf row


def test_benchmark_runs_hf_and_two_layouts(ray_session, capsys):
    omp_exported = "OMP_NUM_THREADS" in os.environ  # then Ray passes it to every worker as is
    rc = bench.main(["--model", "llama", "--batch", "2", "--seq", "16", "--iters", "1", "--warmup", "1",
                     "--cases", "hf", "dtensor-dp1", "fsdp1-dp2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAILED" not in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"hf", "dtensor-dp1", "fsdp1-dp2"} <= set(rows)
    if omp_exported:
        return
    # threads/worker as the workers report them: the 2-thread budget split over 2 workers
    assert rows["fsdp1-dp2"].split("|")[3].strip() == "1"
    assert rows["dtensor-dp1"].split("|")[3].strip() == "2"
