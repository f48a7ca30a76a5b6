"""Bad input fails fast and names its cause; options (dynamic batching, bf16, activation
checkpointing, offload) and the diagnostics methods work."""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from core.data import BatchedDataDict
from core.distributed import RayVirtualCluster, WorkerGroupError
from core.losses import ClippedPGLossFn, LossInputError, NLLLoss
from core.policy import BatchError, Policy
from core.testing.tiny_models import random_batch, tiny_tokenizer
from tests.hf_reference import PG_CFG
from tests.torch_backends.conftest import SEQ, VOCAB, count_collectives, hf_logprobs, pg_batch, policy_config

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def dynamic_policy(ray_session, model_dirs, tokenizer):
    """FSDP1 dp=2 with token-budget (dynamic) micro batches (rows are sorted by length and
    dealt over ranks, so the caller's order must be restored) and a sampling temperature
    of 0.7, which get_logprobs and train must both apply."""
    cfg = policy_config(model_dirs["llama"], "torch_fsdp")
    cfg["generation"]["temperature"] = TEMPERATURE
    cfg["dynamic_batching"] = {
        "enabled": True,
        "train_mb_tokens": 24,
        "logprob_mb_tokens": 24,
        "sequence_length_round": 4,
    }
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, cfg, tokenizer)
    yield {"policy": policy, "cfg": cfg, "model_dir": model_dirs["llama"]}
    policy.shutdown()
    cluster.shutdown()


def test_dynamic_batching_keeps_caller_order(dynamic_policy):
    ids, lens = random_batch(7, SEQ, VOCAB, seed=60)
    out = dynamic_policy["policy"].get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))["logprobs"]
    ref = hf_logprobs(
        AutoModelForCausalLM.from_pretrained(dynamic_policy["model_dir"]).eval(), ids, lens, temperature=TEMPERATURE
    )
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_dynamic_batching_train_loss_matches_full_batch(dynamic_policy):
    data = pg_batch(4, seed=61)
    loss_fn = ClippedPGLossFn(PG_CFG)
    model = AutoModelForCausalLM.from_pretrained(dynamic_policy["model_dir"])
    mask = (torch.arange(SEQ)[None] < data["input_lengths"][:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"], attention_mask=mask).logits / TEMPERATURE
        ref = float(loss_fn(logits, data, None, None)[0])
    got = float(dynamic_policy["policy"].train(data, loss_fn, eval_mode=True).loss[0])
    assert math.isclose(got, ref, rel_tol=1e-5, abs_tol=1e-6)


def test_batch_errors_fail_before_dispatch(dynamic_policy):
    policy = dynamic_policy["policy"]
    data = pg_batch(4, seed=62)
    with pytest.raises(BatchError, match="not divisible by data-parallel size 2 x micro batch size 2"):
        policy.train(data, NLLLoss(), gbs=3)
    with pytest.raises(BatchError, match="not a positive multiple of the global batch size 4"):
        policy.train(data.slice(0, 2), NLLLoss())
    long_ids, long_lens = random_batch(2, 40, VOCAB, seed=63)
    with pytest.raises(BatchError, match="40 tokens but policy.max_total_sequence_length is 32"):
        policy.get_logprobs(BatchedDataDict(input_ids=long_ids, input_lengths=long_lens))
    bad = BatchedDataDict(data)
    del bad["sample_mask"]
    with pytest.raises(BatchError, match="sample_mask"):
        policy.train(bad, NLLLoss())


def test_loss_input_errors_name_the_key(dynamic_policy):
    """Checked on the driver: the error names the key and the workers stay usable."""
    data = pg_batch(4, seed=64)
    data["advantages"] = data["advantages"][:, :5]
    with pytest.raises(LossInputError, match=r"data\['advantages'\] has shape \(4, 5\)"):
        dynamic_policy["policy"].train(data, ClippedPGLossFn(PG_CFG))
    data = pg_batch(4, seed=64)
    data["input_ids"][1, 2] = VOCAB + 5
    with pytest.raises(BatchError, match="outside the vocabulary"):
        dynamic_policy["policy"].train(data, ClippedPGLossFn(PG_CFG))


def test_diagnostics(dynamic_policy):
    policy = dynamic_policy["policy"]
    ids = policy.report_device_id()
    assert len(ids) == 2 and len(set(ids)) == 2 and all(i.startswith("cpu:") for i in ids)
    info = policy.get_gpu_info()
    assert [i["rank"] for i in info] == [0, 1] and all(i["device_type"] == "cpu" for i in info)
    assert all(i["rss_bytes"] > 0 and i["torch_num_threads"] >= 1 for i in info)
    policy.reset_peak_memory_stats()
    policy.start_gpu_profiling()
    policy.get_logprobs(
        BatchedDataDict(zip(("input_ids", "input_lengths"), random_batch(2, SEQ, VOCAB, seed=65), strict=True))
    )
    traces = policy.stop_gpu_profiling()
    assert len(traces) == 2
    for path in traces:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        assert any("aten::" in e.get("name", "") for e in events)
        os.remove(path)


def test_dead_worker_is_reported_within_seconds(dynamic_policy):
    """Last test of the module: it kills a rank of the shared policy."""
    import ray

    policy = dynamic_policy["policy"]
    ray.kill(policy.worker_group.workers[1])
    start = time.monotonic()
    with pytest.raises(WorkerGroupError, match="rank"):
        policy.get_logprobs(
            BatchedDataDict(zip(("input_ids", "input_lengths"), random_batch(4, SEQ, VOCAB), strict=True))
        )
    assert time.monotonic() - start < 15


# ----------------------------------------------------------------------------- construction errors


def test_tokenizer_larger_than_vocab_is_refused(ray_session, model_dirs):
    cfg = policy_config(model_dirs["llama"], "torch_dtensor")
    cluster = RayVirtualCluster([2], use_gpus=False)
    try:
        with pytest.raises(ValueError, match="tokenizer has 300 tokens but model .* has vocab_size 256"):
            Policy(cluster, cfg, tiny_tokenizer(vocab_size=300))
    finally:
        cluster.shutdown()


def test_tp_must_divide_heads(ray_session, tmp_path, tokenizer):
    LlamaConfig(
        vocab_size=256,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=3,
        num_key_value_heads=1,
    ).save_pretrained(tmp_path)
    cfg = policy_config(tmp_path, "torch_dtensor", tp=2)
    cluster = RayVirtualCluster([2], use_gpus=False)
    try:
        with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide .*num_attention_heads=3"):
            Policy(cluster, cfg, tokenizer)
    finally:
        cluster.shutdown()


# slow (one more CP policy start): CP's equality with the plain path stays fast in
# tests/torch_backends/test_context_parallel_and_packing.py (dtensor-cp2-llama).
@pytest.mark.slow
def test_context_parallel_derives_its_sequence_multiple(ray_session, model_dirs, tokenizer):
    """Context parallelism splits every row into 2 x cp chunks: the torch_dtensor worker pads
    the width to that multiple itself (make_sequence_length_divisible_by is not asked to say
    so), so cp=2 with the default multiple of 1 starts and scores a width-11 batch as HF does."""
    cfg = policy_config(model_dirs["llama"], "torch_dtensor")
    cfg["parallel"]["context_parallel_size"] = 2
    assert cfg["make_sequence_length_divisible_by"] == 1
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = None
    try:
        policy = Policy(cluster, cfg, tokenizer)
        ids, lens = random_batch(4, 11, VOCAB, seed=5)  # 11: not a multiple of 2 x cp
        out = policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))["logprobs"]
        ref = hf_logprobs(AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval(), ids, lens)
        assert out.shape == ids.shape
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    finally:
        if policy is not None:
            policy.shutdown()
        cluster.shutdown()


# ----------------------------------------------------------------------------- precision and memory options


@pytest.mark.parametrize("backend", ["torch_fsdp", pytest.param("torch_dtensor", marks=pytest.mark.slow)])
def test_bf16_with_activation_checkpointing_and_offload(backend, ray_session, model_dirs, tokenizer):
    """bf16 compute over fp32 master weights with activation checkpointing: logprobs near the
    fp32 HF reference, training lowers the loss.  The offload flags are accepted; on CPU
    workers they are no-ops (parameters already live in host memory)."""
    cfg = policy_config(
        model_dirs["llama"],
        backend,
        precision="bfloat16",
        activation_checkpointing=True,
        cpu_offload=True,
    )
    cfg["optimizer"]["kwargs"]["lr"] = 3e-3
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, cfg, tokenizer)
    try:
        # policy.matmul_precision left out with bf16 compute: the fast path (TF32 allowed).
        assert [i["float32_matmul_precision"] for i in policy.get_gpu_info()] == ["high", "high"]
        ids, lens = random_batch(4, SEQ, VOCAB, seed=70)
        out = policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))["logprobs"]
        ref = hf_logprobs(AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval(), ids, lens)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=0, atol=0.1)  # bf16 compute
        data = pg_batch(4, seed=71)
        # 2 micro batches per rank.  FSDP2 holds the unreduced gradients back in fp32 (one
        # reduce-scatter per unit and step); FSDP1 would hold them in bf16, so it keeps one
        # reduce-scatter per micro batch (fp32 shard accumulation): 3 units x 2.
        results = []  # the first step's TrainResult
        counts = count_collectives(policy, lambda: results.append(policy.train(data, NLLLoss(), mbs=1)))
        assert counts["reduce_scatter"] == (6 if backend == "torch_fsdp" else 3), counts
        losses = [float(results[0].loss[0])] + [float(policy.train(data, NLLLoss(), mbs=1).loss[0]) for _ in range(2)]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    finally:
        policy.shutdown()
        cluster.shutdown()
