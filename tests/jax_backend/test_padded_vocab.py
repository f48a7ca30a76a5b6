"""Padded vocabulary in the JAX model and decoder (the padded policy on every layout --
logprobs, training against HF, export, refit, checkpoints: tests/backends/test_padded_vocab.py).

A vocabulary of 301 does not divide ``tp=2``: the model stores the embedding / lm_head with
302 rows (the extra one zero) and masks the padded logit.  Here: the padded model's logits
and the HF mapping's round trip in this process, and that decoding never emits a padded id
even when the padded row would win the argmax -- tiny Llama (untied) and Qwen2 (tied) with
``vocab_size=301`` in in-process ``JaxPolicyWorker``s on 8 virtual CPU devices (fsdp 4 x tp 2).
"""

from __future__ import annotations

import dataclasses

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
from core.testing.tiny_models import random_batch, tiny_config, tiny_tokenizer
from tests.torch_backends.conftest import SEQ, policy_config

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
    cfg["parallel"].update(fsdp_size=fsdp, tensor_parallel_size=tp)
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


def _unmasked_last_logits(cfg, host_params, ids, lengths) -> np.ndarray:
    """[B, Vp] logits at each row's last prompt token of the same weights *without* the
    mask (a config whose vocab_size is the padded size), on one device."""
    model = abstract_model(dataclasses.replace(cfg, vocab_size=cfg.padded_vocab_size))
    nnx.update(model, host_params)
    mask = (np.arange(ids.shape[1])[None] < lengths[:, None]).astype(np.int32)
    logits = np.asarray(model(ids, mask))
    return logits[np.arange(len(ids)), lengths - 1]


# Tied (the padded row is the embedding's) in CI, untied (the lm_head's) with -m slow.
@pytest.mark.parametrize("name", ["qwen2_tied", pytest.param("llama", marks=pytest.mark.slow)])
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
