"""``dualrl bench --gpu`` (``benchmarks.gpu``, ``benchmarks.lib.gpu``): the FLOP and peak accounting, the
report, the plain-torch reference it holds the backends to, and real runs on the CPU with a tiny
model (in a process of their own: the mode starts its own Ray with one XLA host device, as a
one-GPU bundle gives JAX one GPU).  Performance numbers come from running it, never from here."""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import types
from pathlib import Path

import pytest

from benchmarks.gpu import parse
from benchmarks.lib import machine
from benchmarks.lib.gpu.report import failed, report
from benchmarks.lib.gpu.sections import vllm_skip_reason
from benchmarks.lib.gpu.workload import (
    BACKENDS,
    COMPILED,
    default_backends,
    loss_measure,
    mfu_peak,
    timing,
    tokens_per_s,
    worst_diff,
)
from benchmarks.lib.hf import hf_steps
from benchmarks.lib.machine import mfu
from benchmarks.lib.models import param_count
from benchmarks.lib.sizes import GPU_SIZES as SIZES
from benchmarks.lib.workload import full_batch, optimizer_kwargs

LLAMA_1B = types.SimpleNamespace(**SIZES["1b"].shape)


# ----------------------------------------------------------------------------- pure parts


def test_flops_per_token_of_the_1b_shape_by_hand():
    d, layers, vocab, inter, seq = 2048, 16, 128256, 8192, 2048
    head_dim = d // 32
    per_layer = d * head_dim * (2 * 32 + 2 * 8) + 3 * d * inter  # q, o + k, v (GQA 8) + SwiGLU
    n = layers * per_layer + d * vocab  # + the LM head (tied: still a matmul)
    forward = 2 * n + 4 * layers * seq * d
    assert machine.flops_per_token(LLAMA_1B, seq, train=False) == forward
    assert machine.flops_per_token(LLAMA_1B, seq, train=True) == 3 * forward
    # 16 k tokens/s of training on an H100 = this MFU (6N + 12LSd per token)
    assert mfu(16_384.0, 3 * forward, 989.0) == pytest.approx(16_384 * 3 * forward / 989e12)
    assert mfu(None, forward, 989.0) is None and mfu(1.0, forward, None) is None


def test_the_1b_shape_has_llama_3_2_1b_parameter_count():
    from transformers import LlamaConfig

    assert param_count(LlamaConfig(**SIZES["1b"].shape)) == 1_235_814_400  # Llama-3.2-1B's count


def test_mfu_peak_table_override_and_n_a():
    assert mfu_peak("cuda", "NVIDIA H100 80GB HBM3", "bfloat16", None)[0] == 989.0
    assert mfu_peak("cuda", "NVIDIA H200", "bfloat16", None)[0] == 989.0
    assert mfu_peak("cuda", "NVIDIA A100-SXM4-80GB", "bfloat16", None)[0] == 312.0
    peak, why = mfu_peak("cuda", "NVIDIA GeForce GTX 1080", "bfloat16", None)
    assert peak is None and "--peak-tflops" in why and "GTX 1080" in why
    peak, why = mfu_peak("cpu", "AMD EPYC", "bfloat16", None)
    assert peak is None and "CPU" in why
    assert mfu_peak("cuda", "NVIDIA H100", "float32", None)[0] is None  # fp32 = "highest", no TF32 peak
    assert mfu_peak("cpu", "AMD EPYC", "float32", 1.5) == (1.5, "--peak-tflops")


def test_vllm_skip_reason_and_versions():
    assert "--no-vllm" in vllm_skip_reason(True)
    assert vllm_skip_reason(False)  # installed or not, this mode names why its engine rows are absent
    import torch

    versions = machine.software_versions(("torch", "no-such-distribution-here"))
    assert versions == {"torch": torch.__version__, "no-such-distribution-here": None}


def test_loss_measure_and_timing():
    assert loss_measure(0.5, 0.5 + 1e-6) == pytest.approx(1e-6)  # absolute below 1
    assert loss_measure(10.0, 10.001) == pytest.approx(1e-3 / 10.001)  # relative above (to the larger)
    assert math.isnan(worst_diff([1.0, math.nan], [1.0, 1.0]))
    t = timing([9.0, 1.0, 3.0, 2.0], warmup=1)  # the first (compile) call is left out
    assert (t["first_s"], t["median_s"], t["times_s"]) == (9.0, 2.0, [1.0, 3.0, 2.0])
    assert tokens_per_s(100, t) == 50.0


def test_parse_defaults_and_bad_micro_batches(capsys):
    a = parse(["--size", "1b"])
    assert (a.batch, a.seq, a.mbs, a.precision, a.warmup, a.iters) == (8, 2048, [1, 2, 4], "bfloat16", 2, 3)
    with pytest.raises(SystemExit):
        parse(["--size", "tiny", "--mbs", "3"])
    assert "do not divide --batch 4" in capsys.readouterr().err


def test_the_prepared_gpu_session_runs_valid_bench_stages_over_every_backend():
    """tools/gpu_session.sh (a lent GPU's prepared run) parses, and each stage's arguments are the
    GPU mode's own, with its default micro batches and every backend."""
    script = Path(__file__).resolve().parents[2] / "tools" / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    backends = shlex.split(re.search(r"^backends=\((.*)\)$", text, re.M).group(1))
    assert sorted(backends) == sorted(BACKENDS)
    mbs = shlex.split(re.search(r"MBS:-([^}]*)\}", text).group(1))
    stages = [shlex.split(line)[3:] for line in text.splitlines() if line.startswith("stage ")]
    assert [s[s.index("--sections") + 1] for s in stages] == ["throughput", "loss"]
    for args in stages:
        expanded = []
        for arg in args:
            expanded += {"${mbs[@]}": mbs, "${backends[@]}": backends}.get(arg, [arg])
        a = parse(["--size", "1b", "--device", "cpu", *expanded])
        assert a.backends == backends
        assert a.mbs == ([int(m) for m in mbs] if "--mbs" in expanded else list(SIZES["1b"].mbs))


def _records(device="cuda", peak=989.0) -> list[dict]:
    flops = {"forward": 1e9, "train": 3e9}
    m = {
        "kind": "machine",
        "device": device,
        "device_name": "NVIDIA H100 80GB HBM3",
        "matmul_tflops": 700.0,
        "cores": 16,
        "threads": 8,
        "precision": "bfloat16",
        "peak_tflops": peak,
        "peak_source": "datasheet",
        "versions": {"torch": "2.11", "vllm": None},
        "size": "1b",
        "params": 1000,
        "batch": 8,
        "seq": 2048,
        "tokens": 16384,
        "flops_per_token": flops,
    }
    t = lambda s: {"first_s": 5 * s, "times_s": [s], "median_s": s}  # noqa: E731
    roof = {
        "kind": "roofline",
        "tokens": 8192,
        "peaks": {"torch": {"bfloat16": 700e3}, "xla": {"bfloat16": 500e3}},  # GFLOP/s
        "errors": {"torch float32": "not measured here"},
        "copy_gb_s": 2000.0,
        "copy_bytes": 2e9,
    }
    return [
        m,
        roof,
        {"kind": "skipped", "row": "vLLM generation", "reason": "vLLM is not installed on this machine"},
        {
            "kind": "throughput",
            "backend": "jax_pjit",
            "mbs": 1,
            "logprobs": t(0.5),
            "train": t(2.0),
            "peak_bytes": 3 * 2**30,
            "memory": "device",
            "startup_s": 9.0,
        },
        {
            "kind": "throughput",
            "backend": "hf eager",
            "mbs": 1,
            "logprobs": t(0.25),
            "train": t(1.0),
            "peak_bytes": 2**30,
            "memory": "device",
        },
        {"kind": "throughput", "backend": "jax_pjit", "mbs": 4, "error": "XlaRuntimeError: RESOURCE_EXHAUSTED"},
        {
            "kind": "refit",
            "backend": "torch_fsdp",
            "info_s": 0.1,
            "tensors": 3,
            "bytes": 2e9,
            "dtype": "bfloat16",
            "first_s": 6.0,
            "times_s": [4.0],
            "median_s": 4.0,
            "buckets": 1,
            "transport": ["cuda_ipc"],
        },
        {"kind": "loss", "backend": "torch reference", "losses": [2.0, 1.5], "grad_norms": [1.0, 1.0]},
        {
            "kind": "loss",
            "backend": "jax_pjit",
            "losses": [2.0, 1.5 + 4e-5],
            "grad_norms": [1.0, 1.0],
            "max_loss_diff": 4e-5 / 1.5,
            "max_grad_norm_diff": 0.0,
            "passed": False,
        },
    ]


def test_report_ratios_mfu_memory_skips_and_errors():
    records = _records()
    text = report(records, 1e-5)
    # hf eager first at its micro batch, = 1.00; JAX at half its speed; MFU = tok/s x FLOPs / peak
    lp_mfu, train_mfu = 100 * 65536 * 1e9 / 989e12, 100 * 16384 * 3e9 / 989e12
    # % roof: the same FLOP/s over the best measured engine in the run's precision (torch, 700 TFLOP/s)
    lp_roof, train_roof = 100 * 65536 * 1e9 / 700e12, 100 * 16384 * 3e9 / 700e12
    assert (
        f"| hf eager | 1 | 65,536 | 1.00 | 16,384 | 1.00 | {lp_mfu:.1f} | {train_mfu:.1f} | {lp_roof:.1f} | "
        f"{train_roof:.1f} | 1,024 (device)" in text
    )
    assert "| torch | - | 700 | torch.matmul" in text and "| xla | - | 500 | jax.jit" in text
    assert "roof: 700 TFLOP/s (torch, bfloat16)" in text and "copy: 2,000 GB/s (dst.copy_(src) of 2 GB" in text
    assert "roofline engine torch float32 not measured: not measured here" in text
    assert text.index("### Roofline") < text.index("### Throughput")
    assert (
        "| jax_pjit | 1 | 32,768 | 0.50 | 8,192 | 0.50 | " in text and "3,072 (device) | 2.50 / 10.00 | 9.0 |" in text
    )
    assert text.index("| hf eager | 1") < text.index("| jax_pjit | 1") < text.index("| jax_pjit | 4 | FAILED")
    assert "ERROR jax_pjit mbs 4 (throughput): XlaRuntimeError: RESOURCE_EXHAUSTED" in text
    # 0.5 GB/s of a 2,000 GB/s copy: 0.025 %
    assert "| torch_fsdp | 3 | 2.000 bfloat16 | 0.10 | 6.00 | 4.00 | 0.50 | 0.0 | 1 x cuda_ipc |" in text
    assert "SKIPPED vLLM generation: vLLM is not installed on this machine" in text
    assert "| jax_pjit | 2.0000000 | 1.5000400 | 2.67e-05 | 0.00e+00 | FAIL |" in text
    assert "torch 2.11" in text and "vllm" not in text.split("\n")[2]  # absent packages are not listed
    assert failed(records)
    ok = [r for r in records if "error" not in r and r.get("passed") is not False]
    assert not failed(ok)
    cpu = report(_records("cpu", None), 1e-5)
    assert f"| hf eager | 1 | 65,536 | 1.00 | 16,384 | 1.00 | - | - | {lp_roof:.1f} |" in cpu  # MFU n/a, roof not
    no_roof = report([r for r in _records() if r["kind"] != "roofline"], 1e-5)
    assert "### Roofline" not in no_roof and f"| {train_mfu:.1f} | - | - | 1,024 (device)" in no_roof
    failed_roof = [
        {"kind": "roofline", "error": "RuntimeError: no device"} if r["kind"] == "roofline" else r for r in records
    ]
    text = report(failed_roof, 1e-5)
    assert "ERROR roofline (roofline): RuntimeError: no device" in text and "### Roofline" not in text


def test_reference_steps_do_not_depend_on_the_micro_batch(tmp_path):
    """The plain-torch reference (and the HF yardstick) accumulate micro batches into the
    whole batch's token mean, as the workers' loss normalisation does."""
    import torch

    from core.testing.tiny_models import build_tiny_model

    data = full_batch(4, 16, 256)
    ids = data["input_ids"]
    out = {}
    for mbs in (1, 2, 4):
        model = build_tiny_model("llama").train()
        steps = hf_steps(model, data, mbs, False, optimizer_kwargs(lr=1e-3), 1.0)
        out[mbs] = [tuple(float(v) for v in steps["train"]()) for _ in range(2)]
    model = build_tiny_model("llama")
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).mean()
    assert out[1][0][0] == pytest.approx(float(nll), abs=1e-6)
    for mbs in (2, 4):
        for (l1, n1), (l2, n2) in zip(out[1], out[mbs], strict=True):
            assert l1 == pytest.approx(l2, abs=1e-6) and n1 == pytest.approx(n2, rel=1e-5)
    assert out[1][1][0] < out[1][0][0]  # the step moved the weights


# ----------------------------------------------------------------------------- real runs (CPU, tiny)


def _run(run_cli, tmp_path, *args: str) -> tuple:
    """``dualrl bench --gpu`` on the CPU in a process of its own; its result and JSON rows."""
    path = tmp_path / "rows.jsonl"
    proc = run_cli("bench", "--gpu", "--size", "tiny", "--device", "cpu", "--no-vllm", "--json", str(path), *args)
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return proc, rows


EAGER = default_backends("cpu")  # what a CPU run measures by default: every row but the compiled one


def test_the_compiled_row_is_torch_dtensor_with_compile_on_and_runs_by_default_on_a_gpu_only():
    from benchmarks.lib.gpu.policy_rows import backend_config

    assert default_backends("cuda") == list(BACKENDS) and COMPILED not in EAGER and len(EAGER) == 3
    bench = types.SimpleNamespace(args=types.SimpleNamespace(batch=4, seq=16), model_path="m")
    for backend, on in (("torch_dtensor", False), (COMPILED, True)):
        cfg = backend_config(bench, backend, "float32", 2)
        assert cfg["backend"] == "torch_dtensor" and cfg["compile"] is on


def _finite(*xs) -> bool:
    return all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in xs)


# slow: every backend's Policy plus HF and the roofline's children; the report and JSON rows are checked fast above
@pytest.mark.slow
def test_cpu_run_every_backend_row_next_to_hf_and_vllm_rows_skipped(run_cli, tmp_path):
    proc, rows = _run(run_cli, tmp_path, "--sections", "throughput", "refit", "--iters", "1", "--refit-repeats", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    m, roof = rows[0], rows[1]
    assert m["kind"] == "machine" and m["device"] == "cpu" and m["peak_tflops"] is None and m["params"] > 1e5
    # the roofline at the largest micro batch's tokens, in the run's precision only; the copy of fp32 weights
    assert roof["kind"] == "roofline" and roof["tokens"] == 2 * 64 and roof["copy_bytes"] == 4 * m["params"]
    assert {"xla", "torch"} <= set(roof["peaks"]) and _finite(roof["copy_gb_s"]), roof
    assert all(set(rates) == {"float32"} and _finite(*rates.values()) for rates in roof["peaks"].values()), roof
    tput = {r["backend"]: r for r in rows if r["kind"] == "throughput"}
    assert set(tput) == {"hf eager", *EAGER}
    for name, r in tput.items():
        assert "error" not in r and r["mbs"] == 2, r
        assert _finite(r["logprobs"]["median_s"], r["train"]["median_s"], float(r["peak_bytes"])), r
        assert all(math.isfinite(x) for x in r["losses"]) and len(r["losses"]) == 2, r  # warm-up + timed
        if name != "hf eager":  # random weights: ~ -ln(vocab) per token
            assert -2 * math.log(64) < r["mean_logprob"] < 0, r
    refit = {r["backend"]: r for r in rows if r["kind"] == "refit"}
    assert set(refit) == set(EAGER)
    for r in refit.values():
        assert "error" not in r and r["transport"] == ["shm"] and _finite(r["first_s"], r["info_s"] + 1e-9), r
        # the whole fp32 model; the torch backends also stream the tied lm_head.weight (an alias)
        tied = SIZES["tiny"].shape["vocab_size"] * SIZES["tiny"].shape["hidden_size"]
        assert r["bytes"] in (4 * m["params"], 4 * (m["params"] + tied)) and r["dtype"] == "float32", r
    skipped = {r["row"]: r["reason"] for r in rows if r["kind"] == "skipped"}
    assert skipped == {
        "refit into the vLLM engine": "vLLM treated as absent (--no-vllm)",
        "vLLM generation": "vLLM treated as absent (--no-vllm)",
    }
    out = proc.stdout
    assert "| hf eager | 2 |" in out and "| 1.00 |" in out and "SKIPPED vLLM generation: vLLM treated as absent" in out
    for name in EAGER:
        assert f"| {name} | 2 | " in out and f"| {name} | {refit[name]['tensors']} |" in out
    assert "MFU peak: MFU n/a on a CPU" in out and "ERROR" not in out and "roof: " in out and "% of copy" in out


@pytest.mark.slow  # ~80 s on 2 cores: four fresh fp32 Policies (one compiled) and the reference process
def test_cpu_fp32_loss_curves_match_the_plain_torch_reference(run_cli, tmp_path):
    proc, rows = _run(run_cli, tmp_path, "--sections", "loss", "--backends", *BACKENDS)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    loss = {r["backend"]: r for r in rows if r["kind"] == "loss"}
    assert set(loss) == {"torch reference", *BACKENDS}
    ref = loss.pop("torch reference")["losses"]
    assert len(ref) == 5 and ref[-1] < ref[0] - 1e-2  # the weights really moved
    for r in loss.values():
        assert r["passed"] and r["max_loss_diff"] <= 1e-5, r
    assert "| jax_pjit | " in proc.stdout and "PASS |" in proc.stdout and "FAIL" not in proc.stdout
