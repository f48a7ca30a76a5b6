"""vLLM engine with dummy weights -> refit from each backend -> the engine serves the policy.

One fp32 engine (tiny Llama) for the module; every test first refits it from its own
policy, so the tests do not depend on each other's weights.  The dead-engine test kills
the engine and therefore comes last.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import ray
import torch

from core.distributed import RayVirtualCluster
from core.policy import Policy
from core.refit import RefitError, refit_policy_generation
from core.refit.shm import ShmBucketWriter
from core.testing.tiny_models import PAD_ID
from tests.generation.conftest import (
    MAX_NEW,
    generated_rows,
    hf_greedy,
    hf_model_from,
    one_engine,
    prompts,
    refit_config,
    rollout_agreement,
)
from tests.min_new_tokens_checks import assert_min_length, assert_stops_at_once, stop_heavy_ids
from tests.torch_backends.conftest import pg_batch

# Smaller than the largest tensor (embed/lm_head: 256 x 128 fp32 = 128 KiB): that tensor
# travels alone, the others are grouped.
SMALL_BUCKET = 48 * 1024


@pytest.fixture(scope="module")
def engine(ray_session, gen_model_dirs, tokenizer):
    with one_engine(gen_model_dirs["llama_gen"], tokenizer, "vllm_llama") as generation:
        yield generation


def _policy(cfg, tokenizer, name, bundles=(2,), cpus=1):
    cluster = RayVirtualCluster(list(bundles), use_gpus=False, num_cpus_per_bundle=cpus, name=name)
    return cluster, Policy(cluster, cfg, tokenizer, name_prefix=name)


def _assert_serves(policy, engine, hf_model, data, label):
    out = engine.generate(data, greedy=True)
    assert generated_rows(out, data) == hf_greedy(hf_model, data), f"{label}: greedy differs from HF generate"
    mult, kl = rollout_agreement(policy, out, data)
    assert 1.0 <= mult <= 1.001, f"{label}: token_mult_prob_error {mult}"
    assert abs(kl) < 1e-4, f"{label}: KL(gen || policy) {kl}"
    return out


def test_engine_refuses_to_generate_before_the_first_refit(engine):
    with pytest.raises(RefitError, match="dummy weights"):
        engine.generate(prompts(), greedy=True)
    assert not engine.weights_valid()


def test_fsdp1_dp2_refit_both_transports_and_after_a_train_step(engine, gen_model_dirs, tokenizer, tmp_path):
    model_dir = gen_model_dirs["llama_gen"]
    cfg = refit_config(model_dir, "torch_fsdp", bucket_bytes=SMALL_BUCKET)
    cluster, policy = _policy(cfg, tokenizer, "refit_fsdp1")
    try:
        from transformers import AutoModelForCausalLM

        data = prompts()
        stats = refit_policy_generation(policy, engine, "ipc")
        assert stats.buckets > 3 and stats.bytes == sum(
            p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters()
        )
        initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        before = _assert_serves(policy, engine, initial, data, "fsdp1 ipc")

        from core.config.loader import DEFAULT_CONFIG_PATH, load_raw_config
        from core.losses import ClippedPGLossFn

        loss = ClippedPGLossFn(load_raw_config(DEFAULT_CONFIG_PATH)["loss_fn"])
        policy.train(pg_batch(4, seed=5), loss)
        refit_policy_generation(policy, engine, "collective")
        trained = hf_model_from(policy, tmp_path / "trained")
        after = _assert_serves(policy, engine, trained, data, "fsdp1 collective after train")
        assert not torch.equal(before["logprobs"], after["logprobs"]), "the engine did not pick up the new weights"
    finally:
        policy.shutdown()
        cluster.shutdown()


def test_jax_fsdp4_tp2_refit_both_transports_and_after_a_train_step(engine, gen_model_dirs, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from core.config.loader import DEFAULT_CONFIG_PATH, load_raw_config
    from core.losses import ClippedPGLossFn

    model_dir = gen_model_dirs["llama_gen"]
    cfg = refit_config(model_dir, "jax_pjit", bucket_bytes=SMALL_BUCKET)
    cluster, policy = _policy(cfg, tokenizer, "refit_jax", bundles=(1,), cpus=2)
    try:
        data = prompts(seed=4)
        refit_policy_generation(policy, engine, "collective")
        initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        _assert_serves(policy, engine, initial, data, "jax collective")

        policy.train(pg_batch(4, seed=6), ClippedPGLossFn(load_raw_config(DEFAULT_CONFIG_PATH)["loss_fn"]))
        refit_policy_generation(policy, engine, "ipc")
        _assert_serves(policy, engine, hf_model_from(policy, tmp_path / "trained"), data, "jax ipc after train")
    finally:
        policy.shutdown()
        cluster.shutdown()


# ---------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def fsdp_policy(engine, gen_model_dirs, tokenizer):
    cfg = refit_config(gen_model_dirs["llama_gen"], "torch_fsdp", bucket_bytes=SMALL_BUCKET)
    cluster, policy = _policy(cfg, tokenizer, "refit_bad_input")
    refit_policy_generation(policy, engine, "ipc")
    yield policy
    policy.shutdown()
    cluster.shutdown()


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda info: {**info, "model.layers.0.mlp.extra.weight": ((4,), "float32")},
            "unknown tensor 'model.layers.0.mlp.extra.weight'",
        ),
        (
            lambda info: {**info, "model.norm.weight": ((64,), "float32")},
            r"'model.norm.weight': stream shape \[64\] but the vLLM engine .* expects \[128\]",
        ),
        (
            lambda info: {n: (s, "bfloat16") for n, (s, _) in info.items()},
            "stream dtype bfloat16 but the vLLM engine .* serves float32",
        ),
        (lambda info: {n: v for n, v in info.items() if n != "lm_head.weight"}, "missing tensor 'lm_head.weight'"),
    ],
)
def test_a_bad_manifest_is_refused_before_any_weight_moves(engine, fsdp_policy, change, message):
    data = prompts(seed=7)
    reference = engine.generate(data, greedy=True)
    with pytest.raises(RefitError, match=message):
        engine.prepare_refit_info(change(fsdp_policy.prepare_refit_info()))
    assert engine.weights_valid()
    assert torch.equal(engine.generate(data, greedy=True)["output_ids"], reference["output_ids"])


def test_an_incomplete_stream_leaves_the_engine_stale_until_a_full_refit(engine, fsdp_policy):
    data = prompts(seed=8)
    reference = engine.generate(data, greedy=True)
    engine.prepare_refit_info(fsdp_policy.prepare_refit_info())
    plan = fsdp_policy.prepare_weights_for_ipc()
    engine.update_weights_from_ipc_handles(fsdp_policy.get_weights_ipc_handles(plan[0]))
    fsdp_policy.finish_refit_stream()
    with pytest.raises(RefitError, match="incomplete refit stream"):
        engine.finish_refit()
    assert not engine.weights_valid()
    with pytest.raises(RefitError, match="refuses to generate"):
        engine.generate(data, greedy=True)
    refit_policy_generation(fsdp_policy, engine, "ipc")
    assert torch.equal(engine.generate(data, greedy=True)["output_ids"], reference["output_ids"])


def test_a_bucket_that_contradicts_the_manifest_is_refused(engine, fsdp_policy):
    info = fsdp_policy.prepare_refit_info()
    engine.prepare_refit_info(info)
    writer = ShmBucketWriter()
    try:
        wrong = [("model.norm.weight", torch.ones(64))]
        with pytest.raises(RefitError, match=r"'model.norm.weight': bucket shape \[64\] but the manifest says \[128\]"):
            engine.update_weights_from_ipc_handles(writer.write(wrong))
        unknown = [("model.bogus.weight", torch.ones(128))]
        engine.prepare_refit_info(info)
        with pytest.raises(RefitError, match="unknown tensor 'model.bogus.weight'"):
            engine.update_weights_from_ipc_handles(writer.write(unknown))
    finally:
        writer.release()
    assert engine.weights_valid()  # refused before loading: the old weights are intact
    refit_policy_generation(fsdp_policy, engine, "collective")


def test_stop_strings_follow_the_same_rule_as_the_policy_generate(engine, fsdp_policy, tokenizer):
    data = prompts(seed=9)
    free = engine.generate(data, greedy=True)
    n0 = int(data["input_lengths"][0])
    third = tokenizer.decode([int(free["output_ids"][0, n0 + 2])])  # row 0 stops after 3 tokens
    data["stop_strings"] = [[third], None, ["never-generated"], None]
    out = engine.generate(data, greedy=True)
    assert out["generation_lengths"][0] == 3
    assert torch.equal(out["generation_lengths"][1:], free["generation_lengths"][1:])
    reference = fsdp_policy.generate(data, greedy=True)  # HF generate with its stop-string criterion
    assert torch.equal(out["output_ids"], reference["output_ids"])
    assert torch.equal(out["generation_lengths"], reference["generation_lengths"])
    torch.testing.assert_close(out["logprobs"], reference["logprobs"], atol=2e-4, rtol=0)


@pytest.mark.slow  # ~14 s; min_new_tokens on HF and JAX generate runs fast (tests/min_new_tokens_checks.py)
def test_min_new_tokens_keeps_every_row_full_length(fsdp_policy, gen_model_dirs, tokenizer):
    """An engine with ``min_new_tokens = max_new_tokens`` and nearly every id a stop token (HF
    generate on the same weights stops at once without the minimum): every row is full length,
    greedy (the tokens HF generate picks under the same minimum) and sampled, and the logprobs
    are still the policy's (vLLM's raw logprobs at temperature 1 are taken before its mask)."""
    from transformers import AutoModelForCausalLM

    from backends.torch_common.generation import hf_generate

    stop = stop_heavy_ids()
    settings = dict(min_new_tokens=MAX_NEW, stop_token_ids=stop)
    data = prompts(seed=10)
    data["sample_seeds"] = torch.tensor([1, 2, 3, 4])
    model = AutoModelForCausalLM.from_pretrained(gen_model_dirs["llama_gen"], dtype=torch.float32).eval()
    hf_cfg = {**refit_config(gen_model_dirs["llama_gen"], "torch_fsdp")["generation"], "backend": "hf"}
    hf_cfg.update(stop_token_ids=stop, vllm_cfg=None)
    assert_stops_at_once(hf_generate(model, data, hf_cfg, greedy=True, pad_token_id=PAD_ID))
    reference = hf_generate(model, data, {**hf_cfg, **settings}, greedy=True, pad_token_id=PAD_ID)
    with one_engine(gen_model_dirs["llama_gen"], tokenizer, "vllm_min_new", generation=settings) as full:
        refit_policy_generation(fsdp_policy, full, "ipc")  # fsdp_policy holds the initial weights
        greedy, sampled = full.generate(data, greedy=True), full.generate(data, greedy=False)
    for out in (greedy, sampled):
        assert_min_length(out, data["input_lengths"], MAX_NEW, MAX_NEW, stop)
        assert (out["generation_lengths"] == MAX_NEW).all()
        mult, _ = rollout_agreement(fsdp_policy, out, data)
        assert 1.0 <= mult <= 1.001, mult
    assert torch.equal(greedy["output_ids"], reference["output_ids"])


def _file_stores() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("vllm_dist_*"))


def test_a_shut_down_engine_leaves_no_world_store_file(ray_session, gen_model_dirs, tokenizer):
    """vLLM gives each engine's process groups a file store of its own in the temporary
    directory; shutting the engine down deletes it (a killed actor would leave it behind)."""
    before = _file_stores()
    with one_engine(gen_model_dirs["llama_gen"], tokenizer, "vllm_store"):
        created = _file_stores() - before
        assert created, "the engine made no file store: this test no longer checks anything"
    assert not [p for p in created if p.exists()], "the engine's file store outlived it"


def test_a_dead_engine_gives_a_clear_error_not_a_hang(engine, fsdp_policy):
    """Last in the module: it kills the shared engine."""
    for actor in engine.engines:
        ray.kill(actor)
    with pytest.raises(RuntimeError, match="vLLM generation engine 0 is dead"):
        refit_policy_generation(fsdp_policy, engine, "collective")
    with pytest.raises(RuntimeError, match="vLLM generation engine 0 is dead"):
        engine.generate(prompts(), greedy=True)
