"""The JAX steps on the flax model sharded over 8 CPU devices vs HF torch.

Logprobs and the ClippedPG loss and gradients (mapped to HF names) are compared with
single-process HF torch on the same weights and batch; the second call in the same shape
bucket must not compile again.  AdamW steps through the worker: tests/backends/test_parity.py.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from transformers import AutoModelForCausalLM

from backends.jax_pjit import steps, widths
from backends.jax_pjit.hf_mapping import from_pretrained, jax_to_hf_tensors
from backends.jax_pjit.models import logical_axes_tree, make_apply_fn
from backends.jax_pjit.models.layers import activation_constraint
from backends.jax_pjit.sharding import activation_constraint as make_constraint
from backends.jax_pjit.sharding import make_mesh, tree_shardings
from core.config.loader import DEFAULT_CONFIG_PATH, load_raw_config
from core.losses import ClippedPGLossFn
from core.testing.tiny_models import save_tiny_model
from tests.torch_backends.conftest import SEQ, hf_logprobs, pg_batch
from tests.unit.test_losses import BASE_CFG

MESHES = [pytest.param((8, 1), id="fsdp8"), pytest.param((4, 2), id="fsdp4-tp2"), pytest.param((1, 2), id="tp2")]


def _policy_cfg(fsdp: int, tp: int) -> dict:
    cfg = copy.deepcopy(load_raw_config(DEFAULT_CONFIG_PATH)["policy"])
    cfg["backend"] = "jax_pjit"
    cfg["parallel"].update(fsdp_size=fsdp, tensor_parallel_size=tp)
    cfg["optimizer"]["kwargs"].update(lr=1e-2, weight_decay=0.01)
    cfg["scheduler"] = [
        {
            "name": "torch.optim.lr_scheduler.LinearLR",
            "kwargs": {"start_factor": 0.5, "end_factor": 1.0, "total_iters": 2},
        }
    ]
    cfg["max_grad_norm"] = 1.0
    return cfg


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model("qwen2", tmp_path_factory.mktemp("jax_steps") / "qwen2")


def _setup(model_dir, fsdp, tp):
    devices = jax.devices()[: fsdp * tp]
    cfg = _policy_cfg(fsdp, tp)
    mesh = make_mesh(cfg, devices)
    model, mcfg, _ = from_pretrained(model_dir)
    apply_fn, params = make_apply_fn(model)
    shardings = tree_shardings(logical_axes_tree(params), mesh)
    return cfg, mesh, mcfg, apply_fn, jax.device_put(params, shardings), shardings


def _on_mesh(batch: dict, mesh) -> dict:
    """Host arrays -> replicated device arrays (micro batches may be smaller than fsdp)."""
    return {k: jax.device_put(jnp.asarray(v), NamedSharding(mesh, P())) for k, v in batch.items()}


def _host(batch) -> dict:
    return {k: v.numpy() for k, v in batch.items()}


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_logprob_step_matches_hf(model_dir, mesh_shape):
    cfg, mesh, _, apply_fn, params, _ = _setup(model_dir, *mesh_shape)
    data = pg_batch(8, seed=1)
    width = widths.bucket_for(SEQ, 32)
    host = steps.pad_micro_batch(
        {"input_ids": data["input_ids"].numpy(), "input_lengths": data["input_lengths"].numpy()}, 8, width
    )
    step = steps.make_logprob_step(apply_fn, temperature=1.0)
    with mesh, activation_constraint(make_constraint(mesh)):
        dev = _on_mesh(host, mesh)
        out = np.asarray(step(params, dev["input_ids"], dev["input_lengths"]))[:, :SEQ]
        step(params, dev["input_ids"], dev["input_lengths"])  # same bucket: no new program
    ref = hf_logprobs(AutoModelForCausalLM.from_pretrained(model_dir).eval(), data["input_ids"], data["input_lengths"])
    np.testing.assert_allclose(out, ref.numpy(), rtol=0, atol=1e-5)
    assert steps.CompileCounter(logprobs=step).counts() == {"logprobs": 1}


def _torch_grads(model_dir, data, loss_fn):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    mask = (torch.arange(SEQ)[None] < data["input_lengths"][:, None]).long()
    loss = loss_fn(model(input_ids=data["input_ids"], attention_mask=mask).logits, data, None, None)[0]
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return float(loss.detach()), grads


def _accumulate(apply_fn, params, loss_fn, data, mbs, width, mesh):
    """Gradient of the whole batch by micro batches of ``mbs`` rows, globally normalised."""
    shardings = jax.tree.map(lambda x: x.sharding, params)
    grad_step = steps.make_grad_step(apply_fn, loss_fn, temperature=1.0, grad_shardings=shardings)
    host = _host(data)
    gseq, gtok = steps.global_valid_counts(host["sample_mask"], host["token_mask"], host["input_lengths"])
    acc = steps.zero_grads(params)
    loss = 0.0
    for start in range(0, len(host["input_ids"]), mbs):
        mb = steps.pad_micro_batch({k: v[start : start + mbs] for k, v in host.items()}, mbs, width)
        acc, metrics = grad_step(params, acc, _on_mesh(mb, mesh), gseq, gtok)
        loss += float(metrics["loss"])
    return loss, acc, grad_step


# Every parameter's gradient on one sharded mesh fast (the Policy-level loss and grad norm on
# every JAX layout: tests/backends/test_parity.py); the other meshes in the slow run.
@pytest.mark.parametrize(
    "mesh_shape",
    [p if p.id == "fsdp4-tp2" else pytest.param(*p.values, id=p.id, marks=pytest.mark.slow) for p in MESHES],
)
def test_loss_and_grads_match_torch(model_dir, mesh_shape):
    cfg, mesh, mcfg, apply_fn, params, _ = _setup(model_dir, *mesh_shape)
    data = pg_batch(4, seed=3)
    loss_fn = ClippedPGLossFn(BASE_CFG)
    ref_loss, ref_grads = _torch_grads(model_dir, data, loss_fn)
    width = widths.bucket_for(SEQ, 32)
    with mesh, activation_constraint(make_constraint(mesh)):
        for mbs in (1, 2, 4):
            loss, grads, grad_step = _accumulate(apply_fn, params, loss_fn, data, mbs, width, mesh)
            assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), mbs
            ours = jax_to_hf_tensors(grads, mcfg)
            assert set(ours) == set(ref_grads)
            for name, g in ref_grads.items():
                np.testing.assert_allclose(ours[name], g, rtol=1e-4, atol=1e-6, err_msg=name)
                assert np.linalg.norm(ours[name] - g) <= 1e-5 * max(np.linalg.norm(g), 1e-6) + 1e-7, name
            assert steps.CompileCounter(grad=grad_step).counts() == {"grad": 1}


def test_bfloat16_compute_over_fp32_params(model_dir):
    """precision bfloat16: bf16 activations over fp32 master params; logprobs stay near fp32
    HF and a gradient step gives finite fp32 gradients."""
    devices = jax.devices()
    cfg = _policy_cfg(4, 2)
    mesh = make_mesh(cfg, devices)
    model, _, _ = from_pretrained(model_dir, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    apply_fn, params = make_apply_fn(model)
    shardings = tree_shardings(logical_axes_tree(params), mesh)
    params = jax.device_put(params, shardings)
    data = pg_batch(4, seed=7)
    width = widths.bucket_for(SEQ, 32)
    host = steps.pad_micro_batch(_host(data), 4, width)
    with mesh, activation_constraint(make_constraint(mesh)):
        dev = _on_mesh(host, mesh)
        lp = np.asarray(steps.make_logprob_step(apply_fn, 1.0)(params, dev["input_ids"], dev["input_lengths"]))
        gseq, gtok = steps.global_valid_counts(host["sample_mask"], host["token_mask"], host["input_lengths"])
        grad_step = steps.make_grad_step(apply_fn, ClippedPGLossFn(BASE_CFG), 1.0, shardings)
        grads, metrics = grad_step(params, steps.zero_grads(params), dev, gseq, gtok)
    ref = hf_logprobs(AutoModelForCausalLM.from_pretrained(model_dir).eval(), data["input_ids"], data["input_lengths"])
    np.testing.assert_allclose(lp[:, :SEQ], ref.numpy(), rtol=0, atol=0.1)
    assert all(g.dtype == jnp.float32 and bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    assert np.isfinite(float(metrics["loss"]))


def test_zero_grads_are_one_program_sharded_like_the_params(model_dir):
    _, _, _, _, params, shardings = _setup(model_dir, 4, 2)
    before = steps._zeros_program.cache_info()
    acc = steps.zero_grads(params)
    again = steps.zero_grads(params)
    after = steps._zeros_program.cache_info()
    assert after.hits - before.hits >= 1 and after.misses - before.misses <= 1  # one program per params tree
    leaves = zip(jax.tree.leaves(acc), jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True)
    for zero, param, sharding in leaves:
        assert zero.shape == param.shape and zero.dtype == param.dtype
        assert zero.sharding.is_equivalent_to(sharding, param.ndim) and not np.asarray(zero).any()
    fresh = zip(jax.tree.leaves(acc), jax.tree.leaves(again), strict=True)
    assert all(a is not b for a, b in fresh)  # new buffers each call: the grad step donates them
