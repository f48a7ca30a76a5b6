"""``backends.jax_pjit.generate``: KV-cache generation against HF torch on the tiny models.

References: the torch backends' ``hf_generate`` (same ``GenerationOutputSpec``) on the same
weights, and one full forward pass of each returned sequence for the ``get_logprobs``
layout log-probabilities.  All float32 on CPU.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest
import torch

from backends.jax_pjit import generate as gen_mod
from backends.jax_pjit.generate import compile_cache_sizes, filter_logits, generate, make_decode_fns
from backends.jax_pjit.hf_mapping import from_pretrained
from backends.torch_common.generation import hf_generate
from core.data import BatchedDataDict
from core.kernels import apply_temperature, logprobs_to_sequence_layout, next_token_logprobs
from core.testing.tiny_models import PAD_ID, random_batch, save_tiny_model
from tests.min_new_tokens_checks import assert_min_length, assert_stops_at_once, stop_heavy_ids
from tests.unit.test_hf_generation import N_NEW, TEMPERATURE, gen_cfg  # one generation section for HF and JAX


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``models(name) -> (jax CausalLM, DecodeFns, HF torch model)``, each built once."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(name):
        if name not in cache:
            path = save_tiny_model(name, tmp_path_factory.mktemp(name))
            model, _, _ = from_pretrained(path)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[name] = (model, make_decode_fns(model), hf)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def batch():
    """Ragged right-padded prompts [4, 7]; row 0 fills the width."""
    ids, lengths = random_batch(4, 7, 256, seed=3)
    assert len(set(lengths.tolist())) > 1
    return ids.numpy(), lengths.numpy()


def run_jax(fns, batch, cfg, **kw):
    kw.setdefault("greedy", True)
    return generate(fns, None, batch[0], batch[1], cfg, pad_token_id=PAD_ID, **kw)


def run_hf(hf_model, batch, cfg, **kw):
    data = BatchedDataDict(input_ids=torch.as_tensor(batch[0]), input_lengths=torch.as_tensor(batch[1]))
    out = hf_generate(hf_model, data, cfg, pad_token_id=PAD_ID, greedy=kw.pop("greedy", True), **kw)
    return {k: v.numpy() for k, v in out.items()}


def generated_rows(out, batch) -> list[list[int]]:
    lengths = batch[1]
    return [
        out["output_ids"][b, lengths[b] : out["unpadded_sequence_lengths"][b]].tolist() for b in range(len(lengths))
    ]


def full_forward(hf_model, out, temperature):
    """(get_logprobs-layout logprobs [B, S+N], temperature-scaled logits [B, S+N, V]) of the outputs."""
    ids = torch.as_tensor(out["output_ids"])
    lengths = torch.as_tensor(out["unpadded_sequence_lengths"])
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        logits = apply_temperature(hf_model(input_ids=ids, attention_mask=mask).logits.float(), temperature)
        logprobs = logprobs_to_sequence_layout(next_token_logprobs(logits, ids), lengths)
    return logprobs.numpy(), logits.numpy()


def generated_mask(out, batch) -> np.ndarray:
    cols = np.arange(out["output_ids"].shape[1])[None, :]
    return (cols >= batch[1][:, None]) & (cols < out["unpadded_sequence_lengths"][:, None])


def check_spec(out, batch, expected_lengths):
    ids, lengths = batch
    b, s = ids.shape
    assert out["output_ids"].shape == (b, s + N_NEW) and out["output_ids"].dtype == np.int64
    assert out["logprobs"].shape == (b, s + N_NEW) and out["logprobs"].dtype == np.float32
    np.testing.assert_array_equal(out["generation_lengths"], expected_lengths)
    np.testing.assert_array_equal(out["unpadded_sequence_lengths"], lengths + np.asarray(expected_lengths))
    cols = np.arange(s + N_NEW)[None, :]
    prompt = cols < lengths[:, None]
    np.testing.assert_array_equal(out["output_ids"][:, :s][prompt[:, :s]], ids[prompt[:, :s]])
    tail = cols >= out["unpadded_sequence_lengths"][:, None]
    assert (out["output_ids"][tail] == PAD_ID).all()
    assert (out["logprobs"][~generated_mask(out, batch)] == 0).all()


def check_logprobs(out, batch, hf_model, temperature):
    ref, _ = full_forward(hf_model, out, temperature)
    gen = generated_mask(out, batch)
    np.testing.assert_allclose(out["logprobs"][gen], ref[gen], atol=1e-5, rtol=0)
    assert (out["logprobs"][gen] < 0).all()


# ----------------------------------------------------------------------------- greedy


# gemma3: prompts up to 7 + 8 new tokens past its sliding window of 4 (slow: ~5 s more compile)
@pytest.mark.parametrize("name", ["llama", "qwen2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_greedy_matches_hf_generate(models, batch, name):
    _, fns, hf = models(name)
    out = run_jax(fns, batch, gen_cfg())
    ref = run_hf(hf, batch, gen_cfg())
    check_spec(out, batch, [N_NEW] * len(batch[1]))
    np.testing.assert_array_equal(out["output_ids"], ref["output_ids"])
    np.testing.assert_array_equal(out["generation_lengths"], ref["generation_lengths"])
    np.testing.assert_allclose(out["logprobs"], ref["logprobs"], atol=1e-5, rtol=0)
    check_logprobs(out, batch, hf, TEMPERATURE)


def test_greedy_is_argmax_of_full_forward(models, batch):
    """Each generated token is the argmax of the full forward at the previous position."""
    _, fns, hf = models("llama")
    out = run_jax(fns, batch, gen_cfg())
    _, logits = full_forward(hf, out, 1.0)
    for b, row in enumerate(generated_rows(out, batch)):
        start = batch[1][b]
        assert row == logits[b, start - 1 : start - 1 + N_NEW].argmax(-1).tolist()


# ----------------------------------------------------------------------------- stopping


@pytest.fixture(scope="module")
def baseline(models, batch):
    _, fns, _ = models("llama")
    out = run_jax(fns, batch, gen_cfg())
    return generated_rows(out, batch)


def test_stop_token(models, batch, baseline):
    _, fns, hf = models("llama")
    stop = baseline[0][2]
    expected = [row.index(stop) + 1 if stop in row else N_NEW for row in baseline]
    assert expected[0] <= 3 and max(expected) == N_NEW, expected  # one row stops, another runs on
    cfg = gen_cfg(stop_token_ids=[stop])
    out = run_jax(fns, batch, cfg)
    check_spec(out, batch, expected)
    assert generated_rows(out, batch) == [row[:n] for row, n in zip(baseline, expected, strict=True)]
    assert out["output_ids"][0, batch[1][0] + expected[0] - 1] == stop
    ref = run_hf(hf, batch, cfg)
    np.testing.assert_array_equal(out["output_ids"], ref["output_ids"])
    np.testing.assert_array_equal(out["generation_lengths"], ref["generation_lengths"])
    # eos_token_ids are stop tokens too
    out_eos = run_jax(fns, batch, gen_cfg(), eos_token_ids=[stop])
    np.testing.assert_array_equal(out_eos["output_ids"], out["output_ids"])
    check_logprobs(out, batch, hf, TEMPERATURE)


def test_stop_strings(models, batch, baseline, tokenizer):
    _, fns, hf = models("llama")
    word = tokenizer.decode([baseline[1][3]])
    assert " " not in word

    def first_match(row):
        return next((t for t in range(1, len(row) + 1) if word in tokenizer.decode(row[:t])), N_NEW)

    expected = [first_match(row) for row in baseline]
    assert expected[1] <= 4 and max(expected) == N_NEW, expected
    cfg = gen_cfg(stop_strings=[word])
    with pytest.raises(ValueError, match="tokenizer"):
        run_jax(fns, batch, cfg)
    out = run_jax(fns, batch, cfg, tokenizer=tokenizer)
    check_spec(out, batch, expected)
    assert generated_rows(out, batch) == [row[:n] for row, n in zip(baseline, expected, strict=True)]
    ref = run_hf(hf, batch, cfg, tokenizer=tokenizer)
    np.testing.assert_array_equal(out["output_ids"], ref["output_ids"])
    # per-row strings (data['stop_strings']): only row 1 gets it
    per_row = run_jax(fns, batch, gen_cfg(), tokenizer=tokenizer, stop_strings=[None, [word], None, None])
    np.testing.assert_array_equal(per_row["generation_lengths"], [N_NEW, expected[1]] + [N_NEW] * (len(expected) - 2))


def test_loop_stops_once_every_row_is_done(models, batch, monkeypatch):
    """Every token a stop token: each row ends after one token and the host loop stops
    after at most one (queued-ahead) step instead of running all N - 1."""
    _, fns, _ = models("llama")
    calls = []
    real_step = gen_mod._step

    def counting_step(*args, **kwargs):
        calls.append(1)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(gen_mod, "_step", counting_step)
    out = run_jax(fns, batch, gen_cfg(stop_token_ids=list(range(256))))
    check_spec(out, batch, [1] * len(batch[1]))
    assert len(calls) <= 1


def test_min_new_tokens_matches_hf_and_keeps_rows_full_length(models, batch):
    """With nearly every id a stop token, rows end at once; ``min_new_tokens`` masks them
    until a row has that many: greedy tokens equal HF generate's under the same minimum,
    sampled rows (one key and per-row seeds) are full length, logprobs stay the unmasked
    ``get_logprobs`` ones, 0 changes nothing, and the minimum is a traced knob (no recompile)."""
    _, fns, hf = models("llama")
    stop = stop_heavy_ids()
    plain = run_jax(fns, batch, gen_cfg(), eos_token_ids=stop)
    assert_stops_at_once(plain)
    before = compile_cache_sizes()
    assert_same_outputs(run_jax(fns, batch, gen_cfg(min_new_tokens=0), eos_token_ids=stop), plain)
    for min_new in (3, N_NEW):
        cfg = gen_cfg(min_new_tokens=min_new)
        out = run_jax(fns, batch, cfg, eos_token_ids=stop)
        assert_min_length(out, batch[1], min_new, N_NEW, stop)
        ref = run_hf(hf, batch, cfg, eos_token_ids=stop)
        np.testing.assert_array_equal(out["output_ids"], ref["output_ids"])
        np.testing.assert_array_equal(out["generation_lengths"], ref["generation_lengths"])
        check_logprobs(out, batch, hf, TEMPERATURE)
    assert compile_cache_sizes() == before
    cfg = gen_cfg(min_new_tokens=N_NEW, top_k=8)
    for kw in (dict(rng=3), dict(sample_seeds=SEEDS)):
        out = run_jax(fns, batch, cfg, greedy=False, eos_token_ids=stop, **kw)
        assert_min_length(out, batch[1], N_NEW, N_NEW, stop)
        check_spec(out, batch, [N_NEW] * len(batch[1]))
        check_logprobs(out, batch, hf, TEMPERATURE)


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_sampling(models, batch, name):
    _, fns, hf = models(name)
    top_k, top_p = 8, 0.9
    cfg = gen_cfg(top_k=top_k, top_p=top_p)
    out = run_jax(fns, batch, cfg, greedy=False, rng=123)
    again = run_jax(fns, batch, cfg, greedy=False, rng=jax.random.key(123))
    other = run_jax(fns, batch, cfg, greedy=False, rng=7)
    for key in out:
        np.testing.assert_array_equal(out[key], again[key])
    assert not np.array_equal(out["output_ids"], other["output_ids"])
    check_spec(out, batch, [N_NEW] * len(batch[1]))
    check_logprobs(out, batch, hf, TEMPERATURE)

    # every sampled token survives top-k, then top-p, of the reference distribution
    _, logits = full_forward(hf, out, TEMPERATURE)
    for b, row in enumerate(generated_rows(out, batch)):
        for t, token in enumerate(row):
            scores = logits[b, batch[1][b] - 1 + t]
            order = np.argsort(-scores)
            rank = int(np.nonzero(order == token)[0][0])
            assert rank < top_k
            probs = np.exp(scores[order[:top_k]] - scores[order[:top_k]].max())
            probs /= probs.sum()
            assert probs[:rank].sum() < top_p + 1e-6

    # top_k=1 (and a tiny top_p) reduce sampling to argmax, through the same programs
    greedy_ids = run_jax(fns, batch, gen_cfg())["output_ids"]
    before = compile_cache_sizes()
    for knobs in (dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, temperature=1.3)):
        np.testing.assert_array_equal(run_jax(fns, batch, gen_cfg(**knobs), greedy=False)["output_ids"], greedy_ids)
    assert compile_cache_sizes() == before


SEEDS = np.array([11, 2**32 - 1, 0, 7], np.int64)


def rows_of(batch, rows):
    return batch[0][rows], batch[1][rows]


def assert_same_outputs(out, ref):
    np.testing.assert_array_equal(out["output_ids"], ref["output_ids"])
    np.testing.assert_array_equal(out["generation_lengths"], ref["generation_lengths"])
    np.testing.assert_allclose(out["logprobs"], ref["logprobs"], atol=1e-5, rtol=0)


def test_sample_seeds_make_each_row_a_function_of_its_seed(models, batch):
    _, fns, hf = models("llama")
    top_k = 8
    cfg = gen_cfg(top_k=top_k, top_p=0.9)
    first = run_jax(fns, batch, cfg, greedy=False, sample_seeds=SEEDS, rng=1)
    assert_same_outputs(run_jax(fns, batch, cfg, greedy=False, sample_seeds=SEEDS, rng=2), first)  # rng unused
    perm = [2, 0, 3, 1]
    permuted = run_jax(fns, rows_of(batch, perm), cfg, greedy=False, sample_seeds=SEEDS[perm])
    assert_same_outputs(permuted, {k: v[perm] for k, v in first.items()})
    for b in range(len(SEEDS)):  # a row alone
        alone = run_jax(fns, rows_of(batch, [b]), cfg, greedy=False, sample_seeds=SEEDS[[b]])
        assert_same_outputs(alone, {k: v[[b]] for k, v in first.items()})
    other = run_jax(fns, batch, cfg, greedy=False, sample_seeds=(SEEDS + 1) % 2**32)
    assert (other["output_ids"] != first["output_ids"]).any(axis=1).sum() >= 2
    # Sampled (not argmax) from the top-k, with get_logprobs logprobs.
    check_logprobs(first, batch, hf, TEMPERATURE)
    _, logits = full_forward(hf, first, TEMPERATURE)
    ranks = [
        int((logits[b, batch[1][b] - 1 + t] > logits[b, batch[1][b] - 1 + t][token]).sum())
        for b, row in enumerate(generated_rows(first, batch))
        for t, token in enumerate(row)
    ]
    assert 0 < max(ranks) < top_k
    # Greedy ignores them.
    assert_same_outputs(run_jax(fns, batch, cfg, sample_seeds=SEEDS), run_jax(fns, batch, cfg))


@pytest.mark.parametrize(
    "seeds, match",
    [
        (SEEDS[:3], r"\[B\] = \(4,\) integer"),
        (SEEDS.astype(np.float32), "integer"),
        (np.array([1, -1, 2, 3]), r"row 1 has -1"),
        (np.array([1, 2, 2**32, 3]), r"\[0, 2\*\*32\); row 2 has 4294967296"),
    ],
)
def test_bad_sample_seeds(models, batch, seeds, match):
    _, fns, _ = models("llama")
    with pytest.raises(ValueError, match=match):
        run_jax(fns, batch, gen_cfg(), greedy=False, sample_seeds=seeds)


def test_filter_logits():
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.15, 0.2, 0.5]], np.float32))
    jitted = jax.jit(filter_logits)
    kept = lambda k, p: np.isfinite(np.asarray(jitted(logits, np.int32(k), np.float32(p))))  # noqa: E731
    np.testing.assert_array_equal(kept(0, 1.0), np.ones_like(logits, bool))
    np.testing.assert_array_equal(kept(2, 1.0)[0], [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(kept(0, 0.6)[0], [1, 1, 0, 0, 0])  # 0.5 < 0.6 <= 0.7
    np.testing.assert_array_equal(kept(0, 0.5)[1], [0, 0, 0, 0, 1])  # the top token alone reaches 0.5
    np.testing.assert_array_equal(kept(3, 0.9)[0], [1, 1, 1, 0, 0])  # renormalised over the top 3
    np.testing.assert_array_equal(kept(0, 1e-9)[1], [0, 0, 0, 0, 1])


# ----------------------------------------------------------------------------- compiling


PROGRAMS = ["jit(_prefill)", "jit(_step)"]


@contextlib.contextmanager
def backend_compiles():
    """Counts XLA compilations (``jax.monitoring``'s backend-compile events) in the block."""
    names = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_second_call_compiles_nothing(models):
    """One prefill and one step program per (B, S, N, greedy); knobs (min_new_tokens too), stop
    ids, pad id and the seed are traced, so later calls of the same shapes compile nothing."""
    model, fns, _ = models("llama")
    ids, lengths = random_batch(2, 5, 256, seed=11)
    small = (ids.numpy(), lengths.numpy())
    cfg = dict(backend="hf", max_new_tokens=3, temperature=0.7, top_k=None, top_p=1.0)
    start = compile_cache_sizes()
    with backend_compiles() as compiled:
        generate(fns, None, *small, cfg, greedy=False, pad_token_id=PAD_ID, rng=0)
    first = compile_cache_sizes()
    assert first == {k: v + 1 for k, v in start.items()}
    assert sorted(c for c in compiled if c in PROGRAMS) == PROGRAMS  # (others: eager helpers such as the seed)
    with backend_compiles() as compiled:
        generate(
            fns,
            None,
            *small,
            dict(cfg, temperature=1.1, top_k=5, top_p=0.8, stop_token_ids=[3], min_new_tokens=2),
            greedy=False,
            pad_token_id=1,
            eos_token_ids=[2],
            rng=5,
        )
        # a CausalLM (re-split on every call) reuses the programs too
        generate(model, None, *small, cfg, greedy=False, pad_token_id=PAD_ID, rng=jax.random.key(1))
    assert compile_cache_sizes() == first
    assert compiled == []


def test_sharded_params_on_mesh(models):
    """Params sharded fsdp=4 x tp=2 with the activation-constraint hook installed, as the
    worker runs it: HF's greedy output, and no compilation after the first call.

    (jit's dispatch cache -- ``_cache_size()`` -- may gain an entry for the step's own
    outputs fed back, but nothing is traced or compiled again, which is what is counted.)
    """
    from jax.sharding import Mesh

    from backends.jax_pjit.models import logical_axes_tree
    from backends.jax_pjit.models.layers import activation_constraint
    from backends.jax_pjit.sharding import activation_constraint as make_constraint
    from backends.jax_pjit.sharding import tree_shardings

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (virtual) devices")
    _, fns, hf = models("qwen2")
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tp"))
    params = jax.device_put(fns.params, tree_shardings(logical_axes_tree(fns.params), mesh))
    ids, lengths = random_batch(8, 6, 256, seed=5)  # batch divisible by fsdp
    batch = (ids.numpy(), lengths.numpy())
    expected = run_hf(hf, batch, gen_cfg())
    for call in range(2):
        with backend_compiles() as compiled, jax.set_mesh(mesh), activation_constraint(make_constraint(mesh)):
            out = generate(fns, params, *batch, gen_cfg(), greedy=True, pad_token_id=PAD_ID)
        np.testing.assert_array_equal(out["output_ids"], expected["output_ids"])
        np.testing.assert_allclose(out["logprobs"], expected["logprobs"], atol=1e-5, rtol=0)
        if call == 0:
            assert sorted(c for c in compiled if c in PROGRAMS) == PROGRAMS
        else:
            assert compiled == []


def test_sample_seeds_on_a_sharded_mesh(models):
    """Seeded sampling with params and rows sharded as the worker runs it gives the
    unsharded rows; a second seeded call (other seeds) compiles nothing."""
    from jax.sharding import Mesh

    from backends.jax_pjit.models import logical_axes_tree
    from backends.jax_pjit.models.layers import activation_constraint
    from backends.jax_pjit.sharding import activation_constraint as make_constraint
    from backends.jax_pjit.sharding import tree_shardings

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (virtual) devices")
    _, fns, _ = models("qwen2")
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tp"))
    params = jax.device_put(fns.params, tree_shardings(logical_axes_tree(fns.params), mesh))
    ids, lengths = random_batch(8, 6, 256, seed=5)
    batch = (ids.numpy(), lengths.numpy())
    seeds = np.arange(8, dtype=np.int64) * 1000 + 3
    for call, row_seeds in enumerate((seeds, seeds + 1)):
        expected = run_jax(fns, batch, gen_cfg(), greedy=False, sample_seeds=row_seeds)
        with backend_compiles() as compiled, jax.set_mesh(mesh), activation_constraint(make_constraint(mesh)):
            out = generate(fns, params, *batch, gen_cfg(), greedy=False, pad_token_id=PAD_ID, sample_seeds=row_seeds)
        assert_same_outputs(out, expected)
        if call == 1:
            assert compiled == []
