"""Smoke test of ``python -m benchmarks.jax_backend`` on the smallest tiny model."""

from __future__ import annotations

from benchmarks import jax_backend as bench


def test_case_names_and_device_flags():
    assert bench.jax_layout("jax-fsdp2") == bench.JaxLayout(2, 1)
    assert bench.jax_layout("jax-tp2") == bench.JaxLayout(1, 2)
    assert bench.jax_layout("jax-fsdp4-tp2").devices == 8
    assert bench.jax_layout("jax-") is None and bench.jax_layout("dtensor-dp2") is None
    flags = bench.with_device_count("--xla_foo=1 --xla_force_host_platform_device_count=8", 2)
    assert flags == "--xla_foo=1 --xla_force_host_platform_device_count=2"
    assert bench.device_count_of(flags) == 2
    assert bench.device_count_of(None) == 1
    assert bench.device_count_of(flags, "3") == 3


def test_benchmark_runs_hf_and_a_jax_layout(ray_session, capsys):
    # The session's Ray belongs to the caller: its actors' device count is fixed (8 from
    # tests/conftest.py), so a JAX case needing another count is listed as skipped.
    n = bench.actor_device_count()
    case, other = f"jax-fsdp{n}", "jax-fsdp1" if n != 1 else "jax-fsdp2"
    rc = bench.main(["--model", "llama", "--batch", "2", "--seq", "16", "--iters", "1", "--warmup", "1",
                     "--cases", "hf", case, other])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAILED" not in out
    rows = {}  # the throughput table's row of each case (the first table)
    for line in out.splitlines():
        if line.startswith("| "):
            rows.setdefault(line.split("|")[1].strip(), line.split("|"))
    assert rows[case][2].strip() == f"1×{n}"
    assert float(rows[case][4]) > 0  # logprobs tok/s
    assert rows[other][4].strip() == "skipped"
    assert f"{case:15} mesh {{'fsdp': {n}, 'tp': 1}}" in out
    assert "get_compile_counts() at the end: {'logprobs': 1, 'grad[NLLLoss#0]': 1}" in out
