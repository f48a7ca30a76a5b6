"""The JAX backend through ``core.policy.Policy``: one Ray actor owning 8 virtual CPU devices.

Same checks as the torch backends: logprob parity with HF, three AdamW steps against the
single-process torch reference, reference logprobs, resume, HF export <-> torch import,
and no recompilation within a shape bucket.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.data import BatchedDataDict
from core.distributed import RayVirtualCluster
from core.losses import ClippedPGLossFn
from core.policy import Policy
from core.testing.tiny_models import random_batch
from tests.torch_backends.conftest import SEQ, VOCAB, hf_logprobs, pg_batch, policy_config
from tests.torch_backends.test_torch_policy import _reference_adamw
from tests.unit.test_losses import BASE_CFG


def _jax_policy(model_dir, tokenizer, fsdp, tp, **kwargs):
    cfg = policy_config(model_dir, "jax_pjit")
    cfg["jax_cfg"].update(fsdp_size=fsdp, tensor_parallel_size=tp)
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=2)
    return cfg, cluster, Policy(cluster, cfg, tokenizer, **kwargs)


@pytest.fixture(scope="module")
def qwen_policy(ray_session, model_dirs, tokenizer):
    cfg, cluster, policy = _jax_policy(model_dirs["qwen2"], tokenizer, 4, 2)
    yield {"policy": policy, "cfg": cfg, "model_dir": model_dirs["qwen2"]}
    policy.shutdown()
    cluster.shutdown()


def _ragged(batch, seed):
    return BatchedDataDict(zip(("input_ids", "input_lengths"), random_batch(batch, SEQ, VOCAB, seed=seed), strict=True))


def _compile_counts(policy):
    group = policy.worker_group
    return group.get_all_worker_results(group.run_all_workers_single_data("get_compile_counts"))[0]


def test_logprobs_match_hf_and_compile_once(qwen_policy):
    policy = qwen_policy["policy"]
    data = _ragged(5, seed=1)
    out = policy.get_logprobs(data)["logprobs"]
    ref = hf_logprobs(
        AutoModelForCausalLM.from_pretrained(qwen_policy["model_dir"]).eval(), data["input_ids"], data["input_lengths"]
    )
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    policy.get_logprobs(_ragged(3, seed=2))  # same length bucket: no new program
    assert _compile_counts(policy)["logprobs"] == 1


def test_greedy_generate_matches_torch_hf_generate(qwen_policy):
    """Before training (weights = the HF checkpoint): JAX KV-cache decoding gives the HF
    tokens, and its logprobs are the policy's own get_logprobs of the output."""
    from backends.torch_common.generation import hf_generate

    policy, cfg = qwen_policy["policy"], qwen_policy["cfg"]
    prompts = BatchedDataDict(zip(("input_ids", "input_lengths"), random_batch(3, 6, VOCAB, seed=5), strict=True))
    out = policy.generate(prompts, greedy=True)
    hf = AutoModelForCausalLM.from_pretrained(qwen_policy["model_dir"]).eval()
    ref = hf_generate(hf, prompts, cfg["generation"], greedy=True, pad_token_id=0, eos_token_ids=[2])
    assert torch.equal(out["output_ids"], ref["output_ids"])
    assert torch.equal(out["generation_lengths"], ref["generation_lengths"])
    torch.testing.assert_close(out["logprobs"], ref["logprobs"], rtol=0, atol=1e-5)


def test_three_adamw_steps_track_torch(qwen_policy):
    policy, cfg = qwen_policy["policy"], qwen_policy["cfg"]
    loss_fn = ClippedPGLossFn(BASE_CFG)
    batches = [pg_batch(4, seed=10 + i) for i in range(3)]
    ours = [policy.train(b, loss_fn) for b in batches]
    ref_losses, ref_norm, ref_model = _reference_adamw(qwen_policy["model_dir"], cfg, batches, loss_fn)
    assert math.isclose(float(ours[0]["loss"][0]), ref_losses[0], rel_tol=1e-5)
    assert math.isclose(float(ours[0]["grad_norm"][0]), ref_norm, rel_tol=1e-5)
    for r, ref in zip(ours, ref_losses, strict=True):
        assert math.isclose(float(r["loss"][0]), ref, rel_tol=1e-4, abs_tol=1e-5)
    probe = _ragged(4, seed=20)
    torch.testing.assert_close(
        policy.get_logprobs(probe)["logprobs"],
        hf_logprobs(ref_model, probe["input_ids"], probe["input_lengths"]),
        rtol=0,
        atol=1e-4,
    )
    grad_programs = [v for k, v in _compile_counts(policy).items() if k.startswith("grad")]
    assert grad_programs == [1]  # three steps, one bucket, one program


def test_reference_logprobs_unchanged(qwen_policy):
    data = _ragged(4, seed=30)
    ref = qwen_policy["policy"].get_reference_policy_logprobs(data)["reference_logprobs"]
    initial = hf_logprobs(
        AutoModelForCausalLM.from_pretrained(qwen_policy["model_dir"]).eval(), data["input_ids"], data["input_lengths"]
    )
    torch.testing.assert_close(ref, initial, rtol=0, atol=1e-5)


def test_orbax_resume_and_hf_export_to_torch(qwen_policy, ray_session, tokenizer, tmp_path):
    policy, cfg = qwen_policy["policy"], qwen_policy["cfg"]
    loss_fn = ClippedPGLossFn(BASE_CFG)
    policy.save_checkpoint(tmp_path / "w", tmp_path / "o")
    policy.save_hf_checkpoint(tmp_path / "hf")
    probe = _ragged(4, seed=40)
    before = policy.get_logprobs(probe)["logprobs"]
    expected = policy.train(pg_batch(4, seed=41), loss_fn)

    # The HF export loads into the torch DTensor backend with the same logprobs.
    torch_cfg = policy_config(tmp_path / "hf", "torch_dtensor", tp=2)
    torch_cfg["tokenizer"]["name"] = cfg["tokenizer"]["name"]
    cluster = RayVirtualCluster([2], use_gpus=False)
    torch_policy = Policy(cluster, torch_cfg, tokenizer, name_prefix="torch_policy")  # the jax one is alive
    try:
        torch.testing.assert_close(torch_policy.get_logprobs(probe)["logprobs"], before, rtol=0, atol=1e-5)
    finally:
        torch_policy.shutdown()
        cluster.shutdown()

    # Orbax resume: the next step equals the uninterrupted one.
    _, cluster, resumed = _jax_policy(
        qwen_policy["model_dir"],
        tokenizer,
        4,
        2,
        name_prefix="resumed",
        weights_path=tmp_path / "w",
        optimizer_path=tmp_path / "o",
    )
    try:
        step = resumed.train(pg_batch(4, seed=41), loss_fn)
        assert math.isclose(float(step["loss"][0]), float(expected["loss"][0]), rel_tol=1e-6)
        assert step["lr"] == pytest.approx(expected["lr"])
    finally:
        resumed.shutdown()
        cluster.shutdown()


def test_torch_export_loads_into_jax_fsdp8(ray_session, model_dirs, tokenizer, tmp_path):
    """A torch FSDP1 export (after a step, so the weights are not the initial ones) loads
    into JAX on an fsdp=8 mesh with identical logprobs; tied embeddings included."""
    cfg = policy_config(model_dirs["llama_tied"], "torch_fsdp")
    cluster = RayVirtualCluster([2], use_gpus=False)
    torch_policy = Policy(cluster, cfg, tokenizer, name_prefix="fsdp_export")
    probe = _ragged(8, seed=50)
    try:
        torch_policy.train(pg_batch(4, seed=51), ClippedPGLossFn(BASE_CFG))
        torch_policy.save_hf_checkpoint(tmp_path / "hf")
        expected = torch_policy.get_logprobs(probe)["logprobs"]
    finally:
        torch_policy.shutdown()
        cluster.shutdown()
    _, cluster, jax_policy = _jax_policy(tmp_path / "hf", tokenizer, 8, 1, name_prefix="jax_import")
    try:
        torch.testing.assert_close(jax_policy.get_logprobs(probe)["logprobs"], expected, rtol=0, atol=1e-5)
    finally:
        jax_policy.shutdown()
        cluster.shutdown()


def test_mesh_that_does_not_divide_the_devices_is_named(ray_session, model_dirs, tokenizer):
    from core.distributed import WorkerGroupError

    cfg = policy_config(model_dirs["llama"], "jax_pjit")
    cfg["jax_cfg"].update(fsdp_size=3, tensor_parallel_size=2)  # 6 of the host's 8 devices
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=2)
    try:
        with pytest.raises(WorkerGroupError, match="policy.jax_cfg"):
            Policy(cluster, cfg, tokenizer, name_prefix="bad_mesh")
    finally:
        cluster.shutdown()


def test_tp_that_does_not_divide_kv_heads_is_refused_on_the_driver(ray_session, model_dirs, tokenizer):
    cfg = policy_config(model_dirs["llama"], "jax_pjit")
    cfg["jax_cfg"].update(fsdp_size=2, tensor_parallel_size=4)
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=2)
    try:
        with pytest.raises(
            ValueError, match="policy.jax_cfg.tensor_parallel_size=4 does not divide .*num_key_value_heads=2"
        ):
            Policy(cluster, cfg, tokenizer)
    finally:
        cluster.shutdown()


def test_offload_round_trip_keeps_the_weights(qwen_policy):
    policy = qwen_policy["policy"]
    probe = _ragged(4, seed=55)
    before = policy.get_logprobs(probe)["logprobs"]
    policy.offload_before_refit()
    policy.offload_after_refit()  # params and optimizer state now in host memory
    policy.prepare_for_training()
    torch.testing.assert_close(policy.get_logprobs(probe)["logprobs"], before, rtol=0, atol=0)
    assert math.isfinite(float(policy.train(pg_batch(4, seed=56), ClippedPGLossFn(BASE_CFG))["loss"][0]))


def test_diagnostics_and_profiling(qwen_policy):
    policy = qwen_policy["policy"]
    (info,) = policy.get_gpu_info()
    assert info["device_type"] == "cpu" and info["local_devices"] == 8 and info["mesh"] == {"fsdp": 4, "cp": 1, "tp": 2}
    assert policy.report_device_id()[0].startswith("cpu:")
    policy.start_gpu_profiling()
    policy.get_logprobs(_ragged(2, seed=60))
    (trace_dir,) = policy.stop_gpu_profiling()
    import pathlib
    import shutil

    assert any(pathlib.Path(trace_dir).rglob("*.xplane.pb"))
    shutil.rmtree(trace_dir)
