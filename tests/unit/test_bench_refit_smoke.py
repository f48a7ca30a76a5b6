"""Smoke test of ``python -m benchmarks.refit`` on the smallest model vLLM's CPU attention runs."""

from __future__ import annotations

import pytest

from benchmarks import jax_backend as jb
from benchmarks import refit as bench


def test_arguments_and_memcpy_baseline():
    args = bench._parse([])
    assert args.cases == bench.CASES and args.transports == list(bench.TRANSPORTS)
    assert (args.model, args.repeats, args.warmup, args.bucket_gb) == ("llama_bench", 3, 1, None)
    assert bench._parse(["--iters", "2", "--bucket-gb", "0.5"]).repeats == 2  # --iters: the shared name
    assert bench._parse(["--cases", "dtensor-dp2", "jax-fsdp2-tp2"]).cases == ["dtensor-dp2", "jax-fsdp2-tp2"]
    with pytest.raises(SystemExit):
        bench._parse(["--cases", "hf"])  # no Policy, nothing to refit
    copy = bench.memcpy_seconds(1 << 20, copies=3)
    assert copy["threads"] == 1 and copy["warm_s"] > 0 and copy["cold_s"] > 0


def test_benchmark_refits_a_torch_layout_over_both_transports(ray_session, capsys):
    # The session's Ray belongs to the caller (8 XLA host devices per actor, tests/conftest.py):
    # a JAX case needing another count is listed as skipped, which costs nothing.
    other = "jax-fsdp1" if jb.actor_device_count() != 1 else "jax-fsdp2"
    # A bucket size below the model's 1.3 MB: several buckets per refit.
    rc = bench.main(["--model", "llama_gen", "--batch", "2", "--seq", "16", "--repeats", "1",
                     "--bucket-gb", "0.0004", "--cases", "fsdp1-dp2", other])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAILED" not in out
    rows = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("| case"):
            cells = [c.strip() for c in line.split("|")[1:-1]]
            rows[(cells[0], cells[1])] = cells
    for transport in bench.TRANSPORTS:
        case, _, layout, gb, buckets, first_s, seconds, gb_s, memcpy_ms, ratio = rows[("fsdp1-dp2", transport)]
        assert layout == "2×1"
        assert float(gb) > 0 and int(buckets) > 1
        assert float(seconds) > 0 and float(gb_s) > 0 and float(memcpy_ms) > 0 and float(ratio) > 0
        assert rows[(other, transport)][6] == "skipped"
