"""``dualrl bench`` (``benchmarks.compare``): layout names, FLOP accounting, and one tiny run of
every section on a torch and a JAX layout, with bad layouts reported while the others run."""

from __future__ import annotations

import json
import re
import types

import pytest

from benchmarks.lib import machine, refit
from benchmarks.lib.grpo_step import ASYNC_PHASES, PHASES, layout_overrides
from benchmarks.lib.layouts import LayoutError, check_fits, host_layout, parse_layout
from benchmarks.lib.pairing import ratio
from benchmarks.lib.ray_session import device_count_of, with_device_count
from benchmarks.lib.workload import make_batch, policy_config


def test_a_compiled_layout_turns_dtensor_compile_on_in_every_config_it_builds():
    """``dtensor-dp2 dtensor-dp2-compiled`` in one bench or parity run: eager vs compiled."""
    for name, on in (("dtensor-dp2", False), ("dtensor-dp2-compiled", True)):
        layout = parse_layout(name)
        cfg = policy_config("m", "t", layout, 4, 16, "float32")
        assert cfg["compile"] is on
        assert f"policy.compile={str(on).lower()}" in layout_overrides(layout)


def test_every_grpo_layout_gets_the_threads_of_the_run():
    """``--threads T`` on a CPU: a JAX worker T host devices, a torch layout's workers T / workers
    CPUs each (their threads and their colocated engines'); on a GPU one slot per device."""

    def cluster(name: str, threads: int | None) -> tuple[str, str]:
        out = [o for o in layout_overrides(parse_layout(name), threads) if o.startswith("cluster.")]
        return out[0].split("=")[1], out[2].split("=")[1]  # gpus_per_node, cpus_per_slot

    assert cluster("dtensor-dp1", 2) == ("1", "2")
    assert cluster("fsdp1-dp2", 2) == ("2", "1")
    assert cluster("fsdp1-dp2", 8) == ("2", "4")
    assert cluster("jax-fsdp2", 4) == ("4", "1")
    assert cluster("dtensor-dp1", None) == ("1", "1")


def test_layout_names():
    assert parse_layout("dtensor-tp2-sp") == parse_layout("dtensor-tp2-sp")
    lay = parse_layout("dtensor-dp2-tp2")
    assert (lay.backend, lay.dp, lay.tp, lay.devices, lay.workers) == ("torch_dtensor", 2, 2, 4, 4)
    jax = parse_layout("jax-fsdp4-tp2")
    assert (jax.backend, jax.dp, jax.tp, jax.devices, jax.workers) == ("jax_pjit", 4, 2, 8, 1)
    assert parse_layout("fsdp1-dp2").backend == "torch_fsdp"
    cp = parse_layout("dtensor-dp2-cp2-tp2-sp-packed")
    assert (cp.dp, cp.cp, cp.tp, cp.sp, cp.packed, cp.devices, cp.sequence_multiple) == (2, 2, 2, True, True, 8, 8)
    jcp = parse_layout("jax-fsdp2-cp2")
    assert (jcp.dp, jcp.cp, jcp.devices, jcp.workers, jcp.sequence_multiple) == (2, 2, 4, 1, 4)
    assert parse_layout("fsdp1-dp2-packed").packed and not parse_layout("fsdp1-dp2").packed
    compiled = parse_layout("dtensor-dp2-packed-compiled")
    assert compiled.compiled and compiled.packed and not parse_layout("dtensor-dp2").compiled
    for bad, words in (
        ("bogus", "unknown layout 'bogus'"),
        ("fsdp1-tp2", "the torch_fsdp backend does not support: FSDP1 shards every parameter"),
        ("dtensor-dp2-sp", "-sp"),
        ("jax-", "unknown layout"),
        ("dtensor-dp0", ">= 1"),
        ("fsdp1-dp2-cp2", "context parallel"),
        ("dtensor-packed", "unknown layout"),
        ("fsdp1-dp2-compiled", "-compiled asks for torch.compile of each transformer block (policy.compile), which"),
        ("jax-fsdp2-compiled", "which the jax_pjit backend does not support: its steps are always compiled"),
        ("jax-fsdp2-sp", "which the jax_pjit backend does not support"),
        ("dtensor-dp2-compiled-sp", "unknown layout"),
    ):
        with pytest.raises(LayoutError, match=re.escape(words)):
            parse_layout(bad)
    assert "needs 4 devices" in check_fits(parse_layout("dtensor-tp4"), 2, "--max-devices")
    assert host_layout("jax-tp2").tp == 2 and host_layout("dtensor-dp2") is None
    flags = with_device_count("--xla_foo=1 --xla_force_host_platform_device_count=8", 2)
    assert flags == "--xla_foo=1 --xla_force_host_platform_device_count=2"
    assert device_count_of(flags) == 2 and device_count_of(None) == 1


def test_flops_per_token_by_hand():
    cfg = types.SimpleNamespace(
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=16,
        vocab_size=10,
    )
    # per layer: q,o 8x8 each + k,v 8x4 each = 192; mlp 3*8*16 = 384; head 8*10 = 80
    assert machine.matmul_params(cfg) == 2 * (192 + 384) + 80
    assert machine.flops_per_token(cfg, seq=4, train=False) == 2 * 1232 + 4 * 2 * 4 * 8
    assert machine.flops_per_token(cfg, seq=4, train=True) == 3 * (2 * 1232 + 256)
    assert machine.datasheet_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0
    assert machine.datasheet_tflops("Intel Xeon", "bfloat16") is None


def test_ratio_uses_the_paired_hf_calls_and_memcpy_baseline():
    hf = {"case": "hf", "logprobs_s": [1.0, 1.0]}
    case = {"case": "x", "logprobs_s": [0.5, 0.5], "hf_logprobs_s": [2.0, 2.0]}
    assert ratio(case, hf, "logprobs") == 4.0  # paired hf, not the pooled hf row
    assert ratio({"case": "y", "logprobs_s": [0.5]}, hf, "logprobs") == 2.0
    copy = refit.memcpy_seconds(1 << 20, copies=3)
    assert copy["threads"] == 1 and copy["warm_s"] > 0


def _bench(tmp_path, capsys, cli, layouts: list[str], *extra: str) -> tuple[int, str, dict]:
    """One tiny run through ``dualrl bench`` on the test session's Ray; TRL's row is left out
    (``no_trl``: CI installs no ``bench`` extra; test_trl_grpo.py runs it)."""
    rc = cli(
        [
            "bench",
            "--size",
            "tiny",
            "--layouts",
            *layouts,
            "bogus",
            "dtensor-tp16",
            "--max-devices",
            "8",
            "--iters",
            "1",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
            "--no-progress",
            *extra,
        ]
    )
    out = capsys.readouterr().out
    assert rc == 1, out  # the two bad layouts
    assert "ERROR bogus: unknown layout 'bogus'" in out
    assert "ERROR dtensor-tp16: layout 'dtensor-tp16' needs 16 devices/workers" in out
    results = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert [r["case"] for r in results["layouts"]] == layouts  # the bad ones did not stop the others
    for row in results["layouts"]:
        name = row["case"]
        assert "error" not in row and "skipped" not in row, row
        assert row["logprobs_s"] and row["train_s"] and row["hf_train_s"], name
        assert all(b and b > 50 * 2**20 for b in row["peak_memory_bytes"]), row["peak_memory_bytes"]
        for transport in ("ipc", "collective"):
            t = row["refit"]["transports"][transport]
            assert "error" not in t and t["seconds"] and t["bytes"] > 1e6, (name, t)
        grpo = row["grpo"]
        assert "error" not in grpo, grpo
        assert grpo["step_s"] > 0 and set(grpo["phases_s"]) == set(PHASES)
        assert 1.0 <= grpo["token_mult_prob_error"] < 1.001, grpo
        assert len(grpo["threads"]["policy"]) == parse_layout(name).workers and grpo["threads"]["engines"], grpo
        assert re.search(rf"\| {name} \| sync \| [\d.]+ \| - \| - \|", out)  # GRPO row, no TRL
        if "--grpo-async" in extra:
            grpo = row["grpo_async"]
            assert "error" not in grpo, grpo
            assert grpo["step_s"] > 0 and set(grpo["phases_s"]) == set(ASYNC_PHASES)
            assert grpo["producer_s"]["generation"] > 0 and grpo["trajectory_age_mean"] == 1.0
            assert 1.0 <= grpo["token_mult_prob_error"] < 1.1, grpo  # age-1 rollouts vs the trained policy
            assert re.search(rf"\| {name} \| async \| [\d.]+ \| - \| - \|", out)
    assert results["generation"]["tokens_per_s"] > 0
    assert "### vLLM generation:" in out and "TRL GRPOTrainer row skipped" in out
    assert results["machine"]["matmul_tflops"] > 0 and results["params"] > 1e6
    return rc, out, results


# slow (~80 s, ~30 s more for the async GRPO row): the whole bench on one layout; the layout grammar,
# errors and tables stay in CI above (and the GRPO flags in test_bench_grpo_flags.py)
@pytest.mark.slow
def test_every_section_on_a_torch_layout_bad_layouts_named(ray_session, no_trl, tmp_path, capsys, cli):
    # --threads 1: the shared refit engine's bundle takes 1 CPU, so the async row's own engine (1) and
    # the policy (2) still fit the test session's 4 Ray CPUs
    _, out, _ = _bench(tmp_path, capsys, cli, ["fsdp1-dp2"], "--grpo-async", "--threads", "1")
    assert re.search(r"\| fsdp1-dp2 \| 2 \| [\d.]+ \| [\d.]+ / [\d.]+ \| [\d,]+ \| [\d.]+ \|", out)


@pytest.mark.slow
def test_every_section_on_a_torch_and_a_jax_layout(ray_session, no_trl, tmp_path, capsys, cli):
    """The test session's JAX actors see 8 XLA host devices, hence jax-fsdp4-tp2."""
    _bench(tmp_path, capsys, cli, ["fsdp1-dp2", "jax-fsdp4-tp2"])


def test_a_model_the_jax_backend_cannot_run_is_named_before_any_worker_starts():
    import argparse

    from transformers import GPT2Config

    from benchmarks.lib.bench import Bench
    from benchmarks.lib.compare.run import jax_unsupported
    from benchmarks.lib.sizes import SIZES

    bench = Bench(
        args=argparse.Namespace(model="tiny-gpt2"),
        size=SIZES["tiny"],
        config=GPT2Config(n_layer=1, n_embd=16, n_head=2),
    )
    why = jax_unsupported(bench, parse_layout("jax-fsdp2"))
    assert "model 'tiny-gpt2' is not supported by the JAX backend" in why and "'gpt2'" in why
    assert jax_unsupported(bench, parse_layout("dtensor-dp2")) is None  # torch runs any HF model


def test_a_dynamic_layout_plans_token_budget_micro_batches_and_parity_splits_a_ranks_rows():
    """``-dynamic`` (every backend): budgets of one padded micro batch in bench configs, half of it
    in parity's, where each data-parallel rank's rows of the parity batch fall into micro batches
    of different widths -- so the parity row measures gradient accumulation over a real plan."""
    from benchmarks.lib.parity.models import parity_settings
    from core.data.batched_data_dict import DynamicBatchingArgs

    # the rank's rows are one micro batch of all 4 of them; the round is a multiple of the
    # layout's sequence multiple (2 x cp x tp under sequence parallel)
    for name, round_to in (
        ("fsdp1-dp2-dynamic", 4),
        ("dtensor-dp2-dynamic", 4),
        ("jax-fsdp2-dynamic", 4),
        ("dtensor-dp2-cp2-tp2-sp-dynamic", 8),
    ):
        layout = parse_layout(name)
        assert layout.dynamic and layout.policy_settings()["dynamic_batching.enabled"] is True
        cfg = policy_config("m", "t", layout, 8, 24, "float32")
        assert cfg["dynamic_batching"] == {
            "enabled": True,
            "train_mb_tokens": 4 * 24,
            "logprob_mb_tokens": 4 * 24,
            "sequence_length_round": round_to,
        }
        assert not cfg["sequence_packing"]["enabled"]
    parity = parity_settings(policy_config("m", "t", parse_layout("fsdp1-dp2-dynamic"), 8, 24, "float32"), 1e-3)
    budget = parity["dynamic_batching"]["train_mb_tokens"]
    assert budget == parity["dynamic_batching"]["logprob_mb_tokens"] == 48
    args = DynamicBatchingArgs(
        input_key="input_ids",
        input_lengths_key="input_lengths",
        sequence_length_round=4,
        max_tokens_per_microbatch=budget,
    )
    shards, _ = make_batch(8, 24, 50).shard_by_batch_size(2, dynamic_batching_args=args)
    for shard in shards:
        assert len(shard.micro_batch_lengths[0]) >= 2 and len(set(shard.micro_batch_lengths[0])) >= 2
    assert not parse_layout("fsdp1-dp2").dynamic
    with pytest.raises(LayoutError, match="-packed and -dynamic are two ways of batching by tokens"):
        parse_layout("dtensor-dp2-packed-dynamic")
    with pytest.raises(LayoutError, match="unknown layout"):
        parse_layout("dtensor-dp2-dynamic-packed")  # the grammar's order
    with pytest.raises(LayoutError, match="has no -dynamic"):
        parse_layout("dtensor-dp2").dynamic_batching(64)


def test_shared_layouts_pack_with_shared_prompts():
    """``-shared``: packing with shared prompts on every backend; the GRPO bench gives its packed
    rows two full-length sequences' tokens; ``-packed-shared`` and ``-shared-dynamic`` are refused."""
    from benchmarks.lib.grpo_step import token_batching_overrides

    for name in ("fsdp1-dp2-shared", "dtensor-dp2-shared", "jax-fsdp2-shared"):
        layout = parse_layout(name)
        assert layout.packed and layout.shared
        cfg = policy_config("m", "t", layout, 8, 24, "float32")
        assert cfg["sequence_packing"]["enabled"] and cfg["sequence_packing"]["shared_prompts"]
    overrides = token_batching_overrides(parse_layout("dtensor-dp2-shared"), 512, 256)
    assert "policy.sequence_packing.shared_prompts=true" in overrides
    assert "policy.sequence_packing.train_mb_tokens=256" in overrides
    assert "policy.dynamic_batching.enabled=false" in overrides
    plain = token_batching_overrides(parse_layout("dtensor-dp2"), 512, 256)
    assert "policy.sequence_packing.enabled=false" in plain and "policy.sequence_packing.shared_prompts=false" in plain
    assert not parse_layout("dtensor-dp2-packed").shared
    with pytest.raises(LayoutError, match="-shared and -dynamic are two ways of batching by tokens"):
        parse_layout("dtensor-dp2-shared-dynamic")
    with pytest.raises(LayoutError, match="-shared is sequence packing with shared prompts; drop -packed"):
        parse_layout("dtensor-dp2-packed-shared")
