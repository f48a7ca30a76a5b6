"""Context parallelism in the JAX backend: a (fsdp, cp, tp) mesh on 8 virtual CPU devices.

The rows are permuted into ``load_balanced_columns(width, cp)`` order inside the jitted
steps (positions, attention mask and next-token targets follow), the sequence axis of the
activations is split over ``cp``, and the results must be those of ``cp = 1``: logprobs
against HF torch, loss / gradient norm / three AdamW steps against a cp = 1 worker, greedy
KV-cache decoding (sequence replicated) against HF ``generate``.  Workers run in-process
(one ``JaxPolicyWorker`` owns the 8 devices); one test goes through Ray and ``Policy``.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P
from transformers import AutoModelForCausalLM

from backends.jax_pjit import steps, widths
from backends.jax_pjit.logical_axes import DECODE_RULES, RULES
from backends.jax_pjit.sharding import logical_to_mesh_spec, make_mesh
from core.config import ConfigError
from core.data import BatchedDataDict
from core.data.context_parallel import load_balanced_columns
from core.losses import ClippedPGLossFn
from core.policy.config import PolicyConfig
from core.testing.tiny_models import random_batch
from tests.jax_backend.conftest import mesh_config
from tests.torch_backends.conftest import SEQ, VOCAB, hf_logprobs, pg_batch, policy_config
from tests.unit.test_losses import BASE_CFG

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) jax devices")

MESHES = [pytest.param((2, 2, 2), id="fsdp2-cp2-tp2"), pytest.param((4, 2, 1), id="fsdp4-cp2")]


def jax_worker(model_dir, tokenizer, fsdp, cp, tp, **overrides):
    """An in-process ``JaxPolicyWorker`` on all 8 devices (what the Ray actor would build)."""
    from backends.jax_pjit.worker import JaxPolicyWorker

    cfg = policy_config(model_dir, "jax_pjit", **overrides)
    cfg["parallel"].update(fsdp_size=fsdp, context_parallel_size=cp, tensor_parallel_size=tp)
    return JaxPolicyWorker(PolicyConfig.checked(cfg), tokenizer)


def _ragged(batch, seed):
    return BatchedDataDict(zip(("input_ids", "input_lengths"), random_batch(batch, SEQ, VOCAB, seed=seed), strict=True))


# ------------------------------------------------------------------------- config / mesh
def test_mesh_has_cp_axis_between_fsdp_and_tp():
    mesh = make_mesh(mesh_config(-1, 2, cp=2))
    assert mesh.axis_names == ("fsdp", "cp", "tp") and dict(mesh.shape) == {"fsdp": 2, "cp": 2, "tp": 2}
    assert logical_to_mesh_spec(("batch", "seq", "act_embed"), RULES) == P("fsdp", "cp", None)
    assert logical_to_mesh_spec(("batch", "kv_seq", "act_heads", "head_dim"), RULES) == P("fsdp", None, "tp", None)
    assert logical_to_mesh_spec(("batch", "seq", "act_vocab"), DECODE_RULES) == P("fsdp", None, "tp")
    dims = PolicyConfig.checked(mesh_config(-1, 2, cp=2)).parallel_dims(8)
    assert (dims.fsdp, dims.cp, dims.tp, dims.dp) == (2, 2, 2, 2)


@pytest.mark.parametrize("fsdp, cp, tp", [(-1, 3, 1), (2, 2, 1), (4, 4, 1)])
def test_cp_that_does_not_fit_the_devices_is_named(fsdp, cp, tp):
    cfg = mesh_config(fsdp, tp, cp=cp)
    with pytest.raises(ValueError, match=re.escape(f"policy.parallel.context_parallel_size={cp}")):
        make_mesh(cfg)


def test_config_validation_names_context_parallel_size(model_dirs):
    cfg = policy_config(model_dirs["llama"], "jax_pjit")
    cfg["parallel"].update(fsdp_size=-1, context_parallel_size=3, tensor_parallel_size=1)
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "policy.parallel.context_parallel_size: tensor_parallel_size (1) x context_parallel_size (3) = 3 "
            "does not divide the world size (8)"
        ),
    ):
        PolicyConfig.checked(cfg, 8)
    cfg["parallel"].update(fsdp_size=4, context_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "policy.parallel.fsdp_size: fsdp_size (4) x context_parallel_size (2) x tensor_parallel_size (2) = 16"
        ),
    ):
        PolicyConfig.checked(cfg, 8)
    cfg["parallel"]["context_parallel_size"] = 0
    with pytest.raises(ConfigError, match=r"policy\.parallel\.context_parallel_size: must be >= 1"):
        PolicyConfig.checked(cfg)
    cfg["parallel"].update(fsdp_size=2, context_parallel_size=2, tensor_parallel_size=2)
    assert PolicyConfig.checked(cfg, 8).parallel.context_parallel_size == 2


def test_width_ladder_must_split_into_2cp_chunks():
    widths.check_cp_ladder(32, 2, 1)  # 16, 32: multiples of 4
    with pytest.raises(
        ValueError,
        match=r"sequence width 30 is not divisible by 4 .*set "
        r"policy\.make_sequence_length_divisible_by to a multiple of 4",
    ):
        widths.check_cp_ladder(30, 2, 1)
    with pytest.raises(ValueError, match=r"width 16 is not divisible by 6 .*make_sequence_length_divisible_by"):
        widths.check_cp_ladder(64, 3, 1)
    assert widths.length_buckets(30, multiple=4) == [16, 32]  # the fix the message asks for
    widths.check_cp_ladder(30, 2, 4)
    assert widths.length_buckets(64, multiple=6) == [18, 36, 66]
    widths.check_cp_ladder(64, 3, 6)
    assert widths.length_buckets(100) == [16, 32, 64, 100]  # multiple 1: the ladder as before


def test_worker_refuses_a_width_that_cannot_split(model_dirs, tokenizer):
    with pytest.raises(ValueError, match=r"policy\.make_sequence_length_divisible_by"):
        jax_worker(model_dirs["llama"], tokenizer, 2, 2, 2, max_total_sequence_length=30)


# ------------------------------------------------------------------------- numerics
@pytest.fixture(scope="module")
def cp1_reference(model_dirs, tokenizer):
    """cp = 1 (fsdp 4 x tp 2): the first step's loss and grad norm, three AdamW steps' losses
    and a probe's logprobs afterwards."""
    worker = jax_worker(model_dirs["qwen2"], tokenizer, 4, 1, 2)
    loss_fn = ClippedPGLossFn(BASE_CFG)
    results = [worker.train(pg_batch(4, seed=10 + i), loss_fn) for i in range(3)]
    probe = worker.get_logprobs(_ragged(4, seed=20))["logprobs"]
    return results, probe


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("model", ["llama", "qwen2", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_cp_logprobs_match_hf(model_dirs, tokenizer, model, mesh):
    worker = jax_worker(model_dirs[model], tokenizer, *mesh)
    data = _ragged(8, seed=1)
    out = worker.get_logprobs(data)["logprobs"]
    ref = hf_logprobs(
        AutoModelForCausalLM.from_pretrained(model_dirs[model]).eval(), data["input_ids"], data["input_lengths"]
    )
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    worker.get_logprobs(_ragged(5, seed=2))  # same bucket (16): no new program
    assert worker.compile_counts["logprobs_layout"] == 1 and worker.compile_counts["logprobs"] == 0
    # Rows still split over fsdp (and replicated over cp / tp) on the way in.
    assert worker.rows.device_batch({"x": np.zeros((mesh[0], 16), np.int32)})["x"].sharding.spec == P("fsdp")


# The training steps on the composed mesh in CI (fsdp x cp x tp: every axis the CP step touches);
# fsdp4-cp2 alone with the slow tests (its logprobs vs HF and step-level gradients stay fast).
@pytest.mark.parametrize("mesh", [MESHES[0], pytest.param(*MESHES[1].values, id=MESHES[1].id, marks=pytest.mark.slow)])
def test_cp_loss_grad_norm_and_adamw_steps_equal_cp1(model_dirs, tokenizer, cp1_reference, mesh):
    ref_results, ref_probe = cp1_reference
    worker = jax_worker(model_dirs["qwen2"], tokenizer, *mesh)
    loss_fn = ClippedPGLossFn(BASE_CFG)
    ours = [worker.train(pg_batch(4, seed=10 + i), loss_fn) for i in range(3)]
    first, ref_first = ours[0], ref_results[0]
    assert math.isclose(float(first.loss[0]), float(ref_first.loss[0]), rel_tol=1e-5, abs_tol=1e-7)
    assert math.isclose(float(first.grad_norm[0]), float(ref_first.grad_norm[0]), rel_tol=1e-5)
    for r, ref in zip(ours, ref_results, strict=True):
        assert math.isclose(float(r.loss[0]), float(ref.loss[0]), rel_tol=1e-4, abs_tol=1e-5)
    torch.testing.assert_close(worker.get_logprobs(_ragged(4, seed=20))["logprobs"], ref_probe, rtol=0, atol=1e-4)
    grads = [v for k, v in worker.compile_counts.items() if k.startswith("grad")]
    assert grads == [1]  # three steps in one bucket: one program


def test_cp_gradients_equal_cp1_step_level(model_dirs):
    """Every gradient leaf (not only the norm) of the layout grad step with cp = 2 on a
    2 x 2 x 2 mesh equals the plain grad step's on fsdp 8, micro batch by micro batch."""
    from backends.jax_pjit.hf_mapping import from_pretrained
    from backends.jax_pjit.models import logical_axes_tree, make_apply_fn
    from backends.jax_pjit.models.layers import activation_constraint
    from backends.jax_pjit.sharding import activation_constraint as make_constraint
    from backends.jax_pjit.sharding import tree_shardings

    model, _, _ = from_pretrained(model_dirs["qwen2"])
    apply_fn, params = make_apply_fn(model)
    loss_fn = ClippedPGLossFn(BASE_CFG)
    host = {k: v.numpy() for k, v in pg_batch(4, seed=3).items()}
    gseq, gtok = steps.global_valid_counts(host["sample_mask"], host["token_mask"], host["input_lengths"])
    grads, losses = [], []
    for fsdp, cp, tp in ((8, 1, 1), (2, 2, 2)):
        mesh = make_mesh(mesh_config(fsdp, tp, cp=cp))
        shardings = tree_shardings(logical_axes_tree(params), mesh)
        placed = jax.device_put(params, shardings)
        with mesh, activation_constraint(make_constraint(mesh)):
            acc, loss = steps.zero_grads(placed), 0.0
            step = (
                steps.make_grad_step(apply_fn, loss_fn, 1.0, shardings)
                if cp == 1
                else steps.make_layout_grad_step(apply_fn, loss_fn, 1.0, cp, shardings)
            )
            for start in (0, 2):
                mb = steps.pad_micro_batch({k: v[start : start + 2] for k, v in host.items()}, 2, 16)
                if cp == 1:
                    acc, metrics = step(placed, acc, mb, gseq, gtok)
                else:
                    acc, metrics = step(
                        placed, acc, steps.plain_rows(mb["input_ids"], mb["input_lengths"]), mb, gseq, gtok
                    )
                loss += float(metrics["loss"])
        grads.append(jax.device_get(acc))
        losses.append(loss)
    assert math.isclose(losses[1], losses[0], rel_tol=1e-5)
    for ref, ours in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        assert np.linalg.norm(ours - ref) <= 1e-5 * max(np.linalg.norm(ref), 1e-6) + 1e-7


def test_cp_greedy_decode_matches_hf_generate(model_dirs, tokenizer):
    """KV-cache decoding with cp = 2 runs with the sequence replicated (DECODE_RULES) and
    gives HF's greedy tokens and logprobs."""
    from backends.torch_common.generation import hf_generate

    worker = jax_worker(model_dirs["llama"], tokenizer, 2, 2, 2)
    prompts = BatchedDataDict(zip(("input_ids", "input_lengths"), random_batch(4, 6, VOCAB, seed=5), strict=True))
    out = worker.generate(prompts, greedy=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval()
    ref = hf_generate(hf, prompts, worker.cfg.generation, greedy=True, pad_token_id=0, eos_token_ids=[2])
    assert torch.equal(out["output_ids"], ref["output_ids"])
    torch.testing.assert_close(out["logprobs"], ref["logprobs"], rtol=0, atol=1e-5)


def test_layout_step_permutes_columns_for_load_balance():
    """The model sees the columns in load-balanced order (cp rank r: chunks r and 2cp-1-r)
    with positions and mask permuted alike; targets and the logprobs' column order are
    restored: a fake model whose logits depend on the position shows all of it."""
    import jax.numpy as jnp

    vocab, width, length = 16, 16, 12
    seen = {}

    def fake_apply(params, ids, mask, positions, allowed=None):
        seen["ids"], seen["positions"], seen["allowed"] = np.asarray(ids), np.asarray(positions), np.asarray(allowed)
        return 0.01 * positions[..., None] * jnp.arange(vocab)[None, None, :]  # (B, W, V)

    ids = ((np.arange(width) * 7 + 3) % vocab)[None].astype(np.int32)
    rows = {k: jnp.asarray(v) for k, v in steps.plain_rows(ids, np.array([length])).items()}
    lp = np.asarray(steps.layout_next_logprobs(fake_apply, None, rows, 2, 1.0))
    order = load_balanced_columns(width, 2).reshape(-1)
    np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
    np.testing.assert_array_equal(seen["positions"][0], order)
    np.testing.assert_array_equal(seen["ids"][0], ids[0, order])
    q, k = order[:, None], order[None, :]  # causal in columns, real tokens and padding apart
    np.testing.assert_array_equal(seen["allowed"][0], (k <= q) & ((q < length) == (k < length)))
    logits = 0.01 * np.arange(width)[:, None] * np.arange(vocab)[None, :]
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = log_softmax[np.arange(width - 1), ids[0, 1:]]  # column c scores ids[c + 1]
    np.testing.assert_allclose(lp[0], expected, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------- through Ray
def check_jax_policy_against_hf_and_torch(cfg, name, model_dir, tokenizer, data, batch, mesh=None):
    """A one-host JAX Policy of ``cfg``: logprobs of ``data`` vs HF (1e-5), and one ClippedPG
    step on ``batch`` vs single-process torch AdamW (loss and grad norm, rel 1e-5)."""
    from core.distributed import RayVirtualCluster
    from core.policy import Policy
    from tests.hf_reference import reference_adamw

    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=2)
    policy = Policy(cluster, cfg, tokenizer, name_prefix=name)
    try:
        if mesh is not None:
            assert policy.get_gpu_info()[0]["mesh"] == mesh
        ref = hf_logprobs(
            AutoModelForCausalLM.from_pretrained(model_dir).eval(), data["input_ids"], data["input_lengths"]
        )
        torch.testing.assert_close(policy.get_logprobs(data)["logprobs"], ref, rtol=0, atol=1e-5)
        loss_fn = ClippedPGLossFn(BASE_CFG)
        out = policy.train(batch, loss_fn)
        ref_losses, (ref_norm,), _ = reference_adamw(model_dir, cfg, [batch], loss_fn)
        assert math.isclose(float(out.loss[0]), ref_losses[0], rel_tol=1e-5)
        assert math.isclose(float(out.grad_norm[0]), ref_norm, rel_tol=1e-5)
    finally:
        policy.shutdown()
        cluster.shutdown()


@pytest.mark.slow  # ~11 s through Ray; the CP step's equality in-process runs fast above
def test_policy_with_cp_matches_hf_and_torch_step(ray_session, model_dirs, tokenizer):
    cfg = policy_config(model_dirs["qwen2"], "jax_pjit")
    cfg["parallel"].update(fsdp_size=-1, context_parallel_size=2, tensor_parallel_size=2)
    check_jax_policy_against_hf_and_torch(
        cfg,
        "jax_cp",
        model_dirs["qwen2"],
        tokenizer,
        _ragged(5, seed=3),
        pg_batch(4, seed=10),
        mesh={"fsdp": 2, "cp": 2, "tp": 2},
    )
