"""Padded vocabulary under tensor parallelism in the JAX backend (issue 12, item 4).

A vocabulary of 301 does not divide ``tp=2``: the backend stores the embedding /
lm_head with 302 rows (the extra one zero), masks the padded logit, and hands out 301
rows everywhere else.  Tiny Llama (untied) and Qwen2 (tied, like the real Qwen2.5 small
models) with ``vocab_size=301``, in-process ``JaxPolicyWorker``s on 8 virtual CPU devices
(4x2 = fsdp x tp; 8x1 as the unpadded reference), plus one Policy-level run.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from backends.jax_pjit import hf_mapping
from backends.jax_pjit.hf_mapping import from_pretrained, read_hf_safetensors
from backends.jax_pjit.models import abstract_model
from core.data import BatchedDataDict
from core.losses import ClippedPGLossFn
from core.testing.tiny_models import random_batch, tiny_config, tiny_tokenizer
from tests.torch_backends.conftest import SEQ, hf_logprobs, pg_batch, policy_config
from tests.unit.test_losses import BASE_CFG

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) jax devices")

VOCAB = 301  # not divisible by tp=2 -> stored as 302
PADDED = 302
FAMILIES = {"llama": ("llama", False), "qwen2_tied": ("qwen2", True)}


def _save_model(name: str, path):
    """A tiny model of ``TINY_MODELS[family]`` with vocab_size=301 (and its 301-word tokenizer)."""
    family, tied = FAMILIES[name]
    cfg = tiny_config(family)
    cfg.vocab_size, cfg.tie_word_embeddings = VOCAB, tied
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("_proj.bias"):
                p.normal_(0.0, 0.02)
    model.save_pretrained(path)
    tiny_tokenizer(VOCAB).save_pretrained(path / "tokenizer")
    return path


@pytest.fixture(scope="module")
def model_dirs301(tmp_path_factory):
    root = tmp_path_factory.mktemp("padded_vocab")
    return {name: _save_model(name, root / name) for name in FAMILIES}


def _worker(model_dir, fsdp, tp):
    from backends.jax_pjit.worker import JaxPolicyWorker

    cfg = policy_config(model_dir, "jax_pjit")
    cfg["jax_cfg"].update(fsdp_size=fsdp, tensor_parallel_size=tp)
    return JaxPolicyWorker(cfg, tiny_tokenizer(VOCAB))


@pytest.fixture(scope="module")
def workers(model_dirs301):
    """``workers(name, (fsdp, tp)) -> JaxPolicyWorker``, each built once."""
    cache = {}

    def get(name, mesh=(4, 2)):
        if (name, mesh) not in cache:
            cache[name, mesh] = _worker(model_dirs301[name], *mesh)
        return cache[name, mesh]

    return get


def _ragged(batch, seed):
    return BatchedDataDict(zip(("input_ids", "input_lengths"), random_batch(batch, SEQ, VOCAB, seed=seed), strict=True))


def _train_batch(seed):
    """pg_batch, its ids re-drawn over all 301 tokens (the last real ids included)."""
    data = pg_batch(4, seed=seed)
    ids, _ = random_batch(4, SEQ, VOCAB, seed=seed)
    valid = torch.arange(SEQ)[None] < data["input_lengths"][:, None]
    data["input_ids"] = torch.where(valid, ids.clamp(min=4), data["input_ids"])
    data["input_ids"][:, -1] = torch.where(valid[:, -1], VOCAB - 1, data["input_ids"][:, -1])
    return data


def _vocab_params(worker) -> dict[str, np.ndarray]:
    """The stored (padded) embedding and lm_head, host copies: HF-like name -> [Vp, E]."""
    params = jax.device_get(worker.params)
    out = {"embed": np.asarray(params["embed_tokens"]["embedding"][...])}
    if not worker.model_cfg.tie_word_embeddings:
        out["lm_head"] = np.asarray(params["lm_head"]["kernel"][...]).T
    return out


# --------------------------------------------------------------------------- model / mapping


def test_padded_model_logits_and_mapping_round_trip(model_dirs301):
    """Padding is invisible: the real logits equal the unpadded model's, the padded ones
    hold the lowest float32, and HF tensors round-trip bit for bit with the original shapes."""
    path = model_dirs301["qwen2_tied"]
    base, base_cfg, _ = from_pretrained(path)
    padded, cfg, _ = from_pretrained(path, tp=2)
    wide, wide_cfg, _ = from_pretrained(path, make_vocab_size_divisible_by=64)
    assert (base_cfg.padded_vocab_size, cfg.padded_vocab_size, wide_cfg.padded_vocab_size) == (VOCAB, PADDED, 320)
    assert cfg.vocab_size == wide_cfg.vocab_size == VOCAB and cfg.unpadded() == base_cfg
    emb = np.asarray(padded.embed_tokens.embedding[...])
    assert emb.shape == (PADDED, 64) and not emb[VOCAB:].any()

    ids, lengths = random_batch(3, SEQ, VOCAB, seed=0)
    mask = (torch.arange(SEQ)[None] < lengths[:, None]).numpy().astype(np.int32)
    ref = np.asarray(base(ids.numpy(), mask))
    for model, size in ((padded, PADDED), (wide, 320)):
        logits = np.asarray(model(ids.numpy(), mask))
        assert logits.shape[-1] == size
        np.testing.assert_allclose(logits[..., :VOCAB], ref, rtol=0, atol=1e-6)
        assert (logits[..., VOCAB:] == np.finfo(np.float32).min).all()

    original = read_hf_safetensors(path)
    exported = hf_mapping.jax_to_hf_tensors(padded, cfg)
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in original.items()}
    assert all(np.array_equal(exported[k], original[k]) for k in exported)
    assert [e.hf_shape for e in hf_mapping.expected_entries(cfg)] == [
        e.hf_shape for e in hf_mapping.expected_entries(base_cfg)
    ]


# --------------------------------------------------------------------------- workers


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logprobs_match_hf_on_fsdp4_tp2(workers, model_dirs301, name):
    worker = workers(name)
    assert (worker.model_cfg.vocab_size, worker.model_cfg.padded_vocab_size) == (VOCAB, PADDED)
    for rows in _vocab_params(worker).values():
        assert rows.shape == (PADDED, 64) and not rows[VOCAB:].any()
    data = _ragged(5, seed=1)
    out = worker.get_logprobs(data)["logprobs"]
    ref = hf_logprobs(
        AutoModelForCausalLM.from_pretrained(model_dirs301[name]).eval(), data["input_ids"], data["input_lengths"]
    )
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    # The reference policy (padded params in host memory) gives the same, over real tokens only.
    torch.testing.assert_close(worker.get_reference_policy_logprobs(data)["reference_logprobs"], ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_train_matches_tp1_and_padding_stays_zero(workers, name):
    """Two AdamW steps (weight decay on) on 4x2 (padded to 302) vs 8x1 (unpadded 301):
    equal loss and grad norm, equal logprobs after, and the padded rows still exactly 0."""
    padded, plain = workers(name), workers(name, (8, 1))
    assert plain.model_cfg.padded_vocab_size == VOCAB
    loss_fn = ClippedPGLossFn(BASE_CFG)
    for seed in (10, 11):
        batch = _train_batch(seed)
        ours, ref = padded.train(batch, loss_fn), plain.train(batch, loss_fn)
        assert math.isclose(float(ours["global_loss"][0]), float(ref["global_loss"][0]), rel_tol=0, abs_tol=1e-5)
        assert math.isclose(float(ours["grad_norm"][0]), float(ref["grad_norm"][0]), rel_tol=0, abs_tol=1e-5)
        assert float(ours["grad_norm"][0]) > 0
    for key, rows in _vocab_params(padded).items():
        assert not rows[VOCAB:].any(), f"{key}: padded rows moved"
        # Adam divides by sqrt(v): 1e-7 gradient differences become ~1e-5 parameter ones.
        np.testing.assert_allclose(rows[:VOCAB], _vocab_params(plain)[key], rtol=0, atol=1e-4)
    probe = _ragged(4, seed=12)
    torch.testing.assert_close(
        padded.get_logprobs(probe)["logprobs"], plain.get_logprobs(probe)["logprobs"], rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_export_and_refit_have_the_original_vocab(workers, name, tmp_path):
    """After training: the HF export has [301, H] tensors and config vocab_size 301, loads
    in transformers with the worker's logprobs; refit tensors/info carry the same shapes."""
    worker = workers(name)
    worker.save_hf_checkpoint(str(tmp_path))
    exported = read_hf_safetensors(tmp_path)
    assert exported["model.embed_tokens.weight"].shape == (VOCAB, 64)
    assert ("lm_head.weight" in exported) != worker.model_cfg.tie_word_embeddings
    if "lm_head.weight" in exported:
        assert exported["lm_head.weight"].shape == (VOCAB, 64)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.vocab_size == VOCAB and hf.config.tie_word_embeddings == worker.model_cfg.tie_word_embeddings
    probe = _ragged(5, seed=3)
    torch.testing.assert_close(
        worker.get_logprobs(probe)["logprobs"],
        hf_logprobs(hf, probe["input_ids"], probe["input_lengths"]),
        rtol=0,
        atol=1e-5,
    )

    streamed = dict(worker.iter_full_weights())
    assert streamed.keys() == exported.keys()
    assert all(np.array_equal(streamed[k], exported[k]) for k in exported)
    info = worker.prepare_refit_info()
    assert {k: shape for k, (shape, _) in info.items()} == {k: tuple(v.shape) for k, v in exported.items()}


def _unmasked_last_logits(cfg, host_params, ids, lengths) -> np.ndarray:
    """[B, Vp] logits at each row's last prompt token of the same weights *without* the
    mask (a config whose vocab_size is the padded size), on one device."""
    model = abstract_model(dataclasses.replace(cfg, vocab_size=cfg.padded_vocab_size))
    nnx.update(model, host_params)
    mask = (np.arange(ids.shape[1])[None] < lengths[:, None]).astype(np.int32)
    logits = np.asarray(model(ids, mask))
    return logits[np.arange(len(ids)), lengths - 1]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_generate_never_emits_padded_ids(workers, name):
    """The padded row is made to win the argmax (checked on the unmasked logits): greedy
    and sampled decoding still stay below 301 -- the mask, not the zero weights, keeps
    padded ids out."""
    worker = workers(name)
    saved = worker.params
    host = jax.device_get(saved)
    tied = worker.model_cfg.tie_word_embeddings
    var = host["embed_tokens"]["embedding"] if tied else host["lm_head"]["kernel"]
    weights = np.asarray(var[...]).copy()
    rows = weights if tied else weights.T  # [Vp, E] view
    ids, lengths = (t.numpy() for t in random_batch(4, 6, VOCAB, seed=5))
    for sign in (1.0, -1.0):  # padded row = +-1000 x the summed real rows: +-1000 x the logits' sum
        rows[VOCAB] = sign * 1000 * rows[:VOCAB].sum(0)
        var.set_value(weights)
        if (_unmasked_last_logits(worker.model_cfg, host, ids, lengths).argmax(-1) == VOCAB).any():
            break
    else:
        pytest.fail("could not make the padded row win an unmasked argmax")
    worker.params = jax.device_put(host, worker.shardings)
    try:
        prompts = BatchedDataDict(input_ids=torch.from_numpy(ids), input_lengths=torch.from_numpy(lengths))
        for greedy in (True, False):
            out = worker.generate(prompts, greedy=greedy)
            assert int(out["output_ids"].max()) < VOCAB
            assert torch.isfinite(out["logprobs"]).all()
            assert int(out["generation_lengths"].sum()) > 0
    finally:
        worker.params = saved


def test_orbax_round_trip_keeps_the_padded_layout(workers, tmp_path):
    worker = workers("llama")
    worker.save_checkpoint(str(tmp_path / "w"), str(tmp_path / "o"))
    saved = _vocab_params(worker)
    step = worker.train_step
    worker.train(_train_batch(20), ClippedPGLossFn(BASE_CFG))
    assert not np.array_equal(_vocab_params(worker)["lm_head"], saved["lm_head"])
    worker.load_checkpoint(str(tmp_path / "w"), str(tmp_path / "o"))
    assert worker.train_step == step
    for key, rows in _vocab_params(worker).items():
        assert rows.shape == (PADDED, 64)
        np.testing.assert_array_equal(rows, saved[key])


# --------------------------------------------------------------------------- Policy


def test_policy_fsdp4_tp2_with_vocab_301(ray_session, model_dirs301, tmp_path):
    """Through ``core.policy.Policy`` (driver preflight + one Ray worker): logprobs equal HF,
    the HF export has the original vocabulary."""
    from core.distributed import RayVirtualCluster
    from core.policy import Policy

    path = model_dirs301["qwen2_tied"]
    cfg = policy_config(path, "jax_pjit")
    cfg["jax_cfg"].update(fsdp_size=4, tensor_parallel_size=2)
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=2)
    policy = Policy(cluster, cfg, tiny_tokenizer(VOCAB), name_prefix="padded_vocab_policy")
    try:
        data = _ragged(5, seed=7)
        ref = hf_logprobs(AutoModelForCausalLM.from_pretrained(path).eval(), data["input_ids"], data["input_lengths"])
        torch.testing.assert_close(policy.get_logprobs(data)["logprobs"], ref, rtol=0, atol=1e-5)
        policy.save_hf_checkpoint(str(tmp_path / "hf"))
        assert read_hf_safetensors(tmp_path / "hf")["model.embed_tokens.weight"].shape == (VOCAB, 64)
    finally:
        policy.shutdown()
        cluster.shutdown()
