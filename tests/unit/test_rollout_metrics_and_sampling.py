"""The rollout metrics (generation vs policy logprobs) on torch and jax against NumPy, and the
engine-independent sampling rules of ``core.generation.sampling``."""

from __future__ import annotations

import numpy as np
import pytest

from core import reporting
from core.generation.sampling import (
    assemble_output,
    assemble_padded,
    first_stop_string_hit,
    logprobs_mode,
    sampling_kwargs,
    stop_token_ids,
)
from core.kernels import generation_policy_kl, token_mult_prob_error
from core.policy.generation_config import GenerationConfig
from tests.logs import no_warning, warns
from tests.unit.engines import ENGINES, to_engine, to_numpy, x64

RNG = np.random.default_rng(0)

# ============================================================================ rollout metrics


def np_mult_prob_error(gen, pol, mask):
    valid = mask.astype(bool)
    return np.exp(np.abs(gen[valid] - pol[valid])).sum() / (valid.sum() + 1e-8)


def np_kl(gen, pol, mask, kind="k3"):
    valid = mask.astype(bool)
    logr = pol[valid] - gen[valid]
    kl = {"k1": -logr, "k2": logr**2 / 2, "k3": np.exp(logr) - 1 - logr}[kind]
    return kl.sum() / (valid.sum() + 1e-8)


def logprob_batch(shape=(3, 9), seed=0):
    rng = np.random.default_rng(seed)
    gen = -rng.exponential(2.0, size=shape)
    pol = gen + rng.normal(0, 0.3, size=shape)
    mask = (rng.random(shape) < 0.7).astype(np.float64)
    mask[0, 0] = 1.0
    return gen, pol, mask


@pytest.mark.parametrize("engine", ENGINES)
def test_token_mult_prob_error_matches_numpy(engine):
    gen, pol, mask = logprob_batch()
    with x64(engine):
        out = token_mult_prob_error(to_engine(engine, gen), to_engine(engine, pol), to_engine(engine, mask))
        np.testing.assert_allclose(to_numpy(out), np_mult_prob_error(gen, pol, mask), rtol=1e-12)
    assert float(to_numpy(out)) > 1.0


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_generation_policy_kl_matches_numpy(engine, kind):
    gen, pol, mask = logprob_batch(seed=1)
    with x64(engine):
        out = generation_policy_kl(to_engine(engine, gen), to_engine(engine, pol), to_engine(engine, mask), kind)
        np.testing.assert_allclose(to_numpy(out), np_kl(gen, pol, mask, kind), rtol=1e-12)


def test_hand_computed_values():
    import torch

    gen = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    pol = torch.tensor([[-1.5, -2.0, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    # (e^0.5 + e^0) / 2 and k3 of logr = [-0.5, 0]: (e^-0.5 - 1 + 0.5 + 0) / 2; the masked
    # mean divides by (count + 1e-8) as NeMo RL does
    assert token_mult_prob_error(gen, pol, mask).item() == pytest.approx((np.exp(0.5) + 1) / (2 + 1e-8), rel=1e-12)
    assert generation_policy_kl(gen, pol, mask).item() == pytest.approx((np.exp(-0.5) - 0.5) / (2 + 1e-8), rel=1e-12)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_identical_logprobs_are_exactly_one_and_zero(engine, dtype):
    gen, _, mask = logprob_batch(seed=2)
    lp = to_engine(engine, gen.astype(np.float32))
    if dtype == "bfloat16":
        lp = lp.to(__import__("torch").bfloat16) if engine == "torch" else lp.astype("bfloat16")
    m = to_engine(engine, mask.astype(np.float32))
    assert float(to_numpy(token_mult_prob_error(lp, lp, m))) == 1.0
    assert float(to_numpy(generation_policy_kl(lp, lp, m))) == 0.0


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("garbage", [-1e4, -np.inf, np.nan, 80.0, 100.0])
def test_masked_positions_do_not_matter(engine, garbage):
    """Prompt / padding positions may hold anything (the engine writes 0, the policy
    anything, -inf included); only the masked-in tokens count."""
    gen, pol, mask = logprob_batch(seed=3)
    gen32, pol32 = gen.astype(np.float32), pol.astype(np.float32)
    wild_gen, wild_pol = gen32.copy(), pol32.copy()
    wild_gen[mask == 0] = 0.0
    wild_pol[mask == 0] = garbage
    for kind_of_mask in (mask.astype(np.float32), mask.astype(bool), mask.astype(np.int64)):
        m = to_engine(engine, kind_of_mask)
        err = float(to_numpy(token_mult_prob_error(to_engine(engine, wild_gen), to_engine(engine, wild_pol), m)))
        kl = float(to_numpy(generation_policy_kl(to_engine(engine, wild_gen), to_engine(engine, wild_pol), m)))
        assert np.isfinite(err) and np.isfinite(kl)
        np.testing.assert_allclose(
            err, np_mult_prob_error(gen32.astype(np.float64), pol32.astype(np.float64), mask), rtol=1e-6
        )
        np.testing.assert_allclose(kl, np_kl(gen32.astype(np.float64), pol32.astype(np.float64), mask), rtol=1e-5)
        # and swapped: the garbage on the generation side
        err2 = float(to_numpy(token_mult_prob_error(to_engine(engine, wild_pol), to_engine(engine, wild_gen), m)))
        kl2 = float(to_numpy(generation_policy_kl(to_engine(engine, wild_pol), to_engine(engine, wild_gen), m)))
        np.testing.assert_allclose(err2, err, rtol=1e-6)
        np.testing.assert_allclose(kl2, np_kl(pol32.astype(np.float64), gen32.astype(np.float64), mask), rtol=1e-5)


@pytest.mark.parametrize("engine", ENGINES)
def test_all_masked_is_zero(engine):
    gen, pol, mask = logprob_batch(seed=4)
    m = to_engine(engine, np.zeros_like(mask))
    assert float(to_numpy(token_mult_prob_error(to_engine(engine, gen), to_engine(engine, pol), m))) == 0.0
    assert float(to_numpy(generation_policy_kl(to_engine(engine, gen), to_engine(engine, pol), m))) == 0.0


# ============================================================================ sampling


def gen(**settings) -> GenerationConfig:
    """A validated ``policy.generation`` section with these settings."""
    return GenerationConfig.coerce(
        {"backend": "vllm", "max_new_tokens": 16, "vllm_cfg": {"max_model_len": 64}, **settings}, "policy.generation"
    )


def test_sampling_kwargs_greedy():
    cfg = gen(temperature=1.0, top_p=0.9, top_k=50, stop_token_ids=[7])
    kw = sampling_kwargs(cfg, greedy=True, max_new_tokens=12, eos_token_ids=[2], seed=5)
    assert kw == dict(
        n=1,
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        max_tokens=12,
        min_tokens=0,  # policy.generation.min_new_tokens' default: vLLM's own
        logprobs=0,
        stop_token_ids=[7, 2],
        detokenize=False,
        skip_special_tokens=False,
    )  # no seed


def test_sampling_kwargs_sampling():
    cfg = gen(temperature=0.7, top_p=0.9, top_k=None)
    kw = sampling_kwargs(cfg, greedy=False, max_new_tokens=3, eos_token_ids=[2], seed=11)
    assert kw["temperature"] == 0.7 and kw["top_p"] == 0.9 and kw["top_k"] == -1
    assert kw["seed"] == 11 and kw["max_tokens"] == 3 and kw["stop_token_ids"] == [2]
    kw = sampling_kwargs(gen(top_k=20), greedy=False, max_new_tokens=3, eos_token_ids=[])
    assert kw["temperature"] == 1.0 and kw["top_p"] == 1.0 and kw["top_k"] == 20
    assert "seed" not in kw and kw["stop_token_ids"] == []


def test_min_new_tokens_is_vllm_min_tokens_and_is_checked():
    kw = sampling_kwargs(gen(min_new_tokens=16), greedy=False, max_new_tokens=12, eos_token_ids=[2], min_new_tokens=12)
    assert (kw["min_tokens"], kw["max_tokens"]) == (12, 12)
    with pytest.raises(ValueError, match=r"min_new_tokens must be in \[0, max_new_tokens=3\], got 4"):
        sampling_kwargs(gen(), greedy=False, max_new_tokens=3, eos_token_ids=[2], min_new_tokens=4)
    # the section: >= 0 and <= max_new_tokens, each refused by name
    with pytest.raises(ValueError, match=r"policy\.generation\.min_new_tokens: 17 > max_new_tokens \(16\)"):
        gen(min_new_tokens=17)
    with pytest.raises(ValueError, match=r"policy\.generation\.min_new_tokens"):
        gen(min_new_tokens=-1)
    assert gen().min_new_tokens == 0 and gen(min_new_tokens=16).min_new_tokens == 16


@pytest.mark.parametrize("temperature", [0.0, -0.5])
@pytest.mark.parametrize("greedy", [False, True])
def test_sampling_kwargs_rejects_non_positive_temperature(temperature, greedy):
    with pytest.raises(ValueError, match=r"policy\.generation\.temperature: must be > 0.*greedy=True"):
        gen(temperature=temperature)  # the section refuses it up front
    cfg = gen()
    cfg.temperature = temperature  # a type-correct assignment is not re-checked: the engine's own guard
    with pytest.raises(ValueError, match="temperature must be > 0.*greedy=True"):
        sampling_kwargs(cfg, greedy=greedy, max_new_tokens=3, eos_token_ids=[2])


def test_greedy_with_temperature_warns(caplog, monkeypatch):
    with warns(caplog, "greedy vLLM generation reports logprobs at temperature 1.0", monkeypatch):
        kw = sampling_kwargs(gen(temperature=0.7), greedy=True, max_new_tokens=3, eos_token_ids=[2])
    assert kw["temperature"] == 0.0
    monkeypatch.setattr(reporting, "_warned", set())
    with no_warning(caplog):
        sampling_kwargs(gen(temperature=1.0), greedy=True, max_new_tokens=3, eos_token_ids=[2])
        sampling_kwargs(gen(temperature=0.7), greedy=False, max_new_tokens=3, eos_token_ids=[2])


def test_stop_token_ids_merge_in_order():
    assert stop_token_ids(gen(stop_token_ids=[7, 2, 7, 9]), [2, 3, 3]) == [7, 2, 9, 3]
    assert stop_token_ids(gen(stop_token_ids=None), [2]) == [2]
    assert stop_token_ids(gen(), []) == []
    # eos ids come from tokenizers, sometimes as numpy ints; the result is plain ints.
    assert stop_token_ids(gen(stop_token_ids=[5]), (np.int32(5), np.int64(6))) == [5, 6]
    assert all(type(t) is int for t in stop_token_ids(gen(stop_token_ids=[5]), [np.int32(6)]))
    with pytest.raises(ValueError, match="stop_token_ids"):  # the section holds plain ints only
        gen(stop_token_ids=[np.int64(5)])


def test_logprobs_mode():
    assert logprobs_mode(gen(temperature=1.0)) == "raw_logprobs"
    assert logprobs_mode(gen()) == "raw_logprobs"
    assert logprobs_mode(gen(temperature=1)) == "raw_logprobs"
    assert logprobs_mode(gen(temperature=0.7)) == "processed_logprobs"
    assert logprobs_mode(gen(temperature=1.5)) == "processed_logprobs"


def ids(tokenizer, text):
    out = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(out) == len(text.split())  # word-level: one token per word
    return out


def test_first_stop_string_hit(tokenizer):
    tokens = ids(tokenizer, "a b c d e")
    assert tokenizer.decode(tokens) == "a b c d e"
    assert first_stop_string_hit(tokenizer, tokens, ["c d"]) == 4
    assert first_stop_string_hit(tokenizer, tokens, ["a"]) == 1
    assert first_stop_string_hit(tokenizer, tokens, ["e"]) == 5
    assert first_stop_string_hit(tokenizer, tokens, ["zz", "b c"]) == 3  # the earliest of several
    assert first_stop_string_hit(tokenizer, tokens, ["d c"]) is None
    assert first_stop_string_hit(tokenizer, tokens, ["x"]) is None
    assert first_stop_string_hit(tokenizer, tokens, []) is None
    assert first_stop_string_hit(tokenizer, [], ["a"]) is None


def test_first_stop_string_hit_after_min_new_tokens(tokenizer):
    """No stop string ends a row before ``min_new_tokens``; after it, only one the newest token
    completes (an occurrence inside the minimum never ends the row later): the rule HF and JAX
    generate share (``stop_string_ends_row``)."""
    tokens = ids(tokenizer, "a b c a d")
    assert first_stop_string_hit(tokenizer, tokens, ["a"], min_new_tokens=0) == 1
    assert first_stop_string_hit(tokenizer, tokens, ["a"], min_new_tokens=1) == 4
    assert first_stop_string_hit(tokenizer, tokens, ["a"], min_new_tokens=4) is None
    assert first_stop_string_hit(tokenizer, tokens, ["b c"], min_new_tokens=2) == 3
    assert first_stop_string_hit(tokenizer, tokens, ["b c"], min_new_tokens=3) is None  # not "still in the text"
    assert first_stop_string_hit(tokenizer, tokens, ["c a"], min_new_tokens=3) == 4  # spans the minimum


def test_first_stop_string_hit_inside_a_token_and_far_in(tokenizer):
    # "w4" is completed by the token "w42" (the string ends inside the token)
    tokens = ids(tokenizer, "a b w42 c")
    assert first_stop_string_hit(tokenizer, tokens, ["w4"]) == 3
    # a hit far beyond the window length is still found (the window slides)
    long = ids(tokenizer, " ".join(["a"] * 40 + ["q", "r"] + ["a"] * 5))
    assert first_stop_string_hit(tokenizer, long, ["q r"]) == 42


def test_assemble_output_layout():
    input_ids = np.array([[5, 6, 7], [8, 9, 0]], dtype=np.int64)
    input_lengths = np.array([3, 2])
    rows_tokens = [[10, 11], [12, 13, 14, 15]]  # row 1 generated one token past max_new_tokens
    rows_logprobs = [[-0.5, -1.0], [-0.1, -0.2, -0.3, -0.4]]
    out = assemble_output(input_ids, input_lengths, rows_tokens, rows_logprobs, max_new_tokens=3, pad_token_id=99)
    np.testing.assert_array_equal(out["output_ids"], [[5, 6, 7, 10, 11, 99], [8, 9, 12, 13, 14, 99]])
    np.testing.assert_array_equal(
        out["logprobs"], np.array([[0, 0, 0, -0.5, -1.0, 0], [0, 0, -0.1, -0.2, -0.3, 0]], dtype=np.float32)
    )
    np.testing.assert_array_equal(out["generation_lengths"], [2, 3])
    np.testing.assert_array_equal(out["unpadded_sequence_lengths"], [5, 5])
    assert out["output_ids"].dtype == np.int64 and out["logprobs"].dtype == np.float32
    assert out["generation_lengths"].dtype == np.int64 and out["unpadded_sequence_lengths"].dtype == np.int64


def test_assemble_output_empty_generation_and_padding():
    input_ids = np.array([[4, 0, 0, 0], [4, 5, 6, 7]], dtype=np.int64)
    out = assemble_output(
        input_ids, np.array([1, 4], dtype=np.int32), [[], [9]], [[], [-2.0]], max_new_tokens=2, pad_token_id=0
    )
    np.testing.assert_array_equal(out["output_ids"], [[4, 0, 0, 0, 0, 0], [4, 5, 6, 7, 9, 0]])
    np.testing.assert_array_equal(out["logprobs"], [[0, 0, 0, 0, 0, 0], [0, 0, 0, 0, -2.0, 0]])
    np.testing.assert_array_equal(out["generation_lengths"], [0, 1])
    np.testing.assert_array_equal(out["unpadded_sequence_lengths"], [1, 5])
    assert out["unpadded_sequence_lengths"].dtype == np.int64


def test_assemble_padded_cuts_each_row_at_its_budget():
    out = assemble_padded(
        np.array([[4, 5, 0], [4, 5, 6]]),
        np.array([2, 3]),
        np.array([[7, 8, 9], [10, 11, 12]]),
        np.full((2, 3), -1.0, np.float32),
        np.array([3, 2]),
        max_new_tokens=3,
        pad_token_id=0,
        row_budgets=np.array([1, 3]),
    )
    np.testing.assert_array_equal(out["output_ids"], [[4, 5, 7, 0, 0, 0], [4, 5, 6, 10, 11, 0]])
    np.testing.assert_array_equal(out["generation_lengths"], [1, 2])
    np.testing.assert_array_equal(out["logprobs"][0], [0, 0, -1.0, 0, 0, 0])


def test_row_budgets_are_each_rows_own_room():
    import torch

    from core.policy.generation_args import GenerationArgs, with_row_budgets

    section = gen(max_new_tokens=8, min_new_tokens=5)
    args = GenerationArgs(section, 0, [2], max_new_tokens=2, min_new_tokens=2)  # cut by the widest row (30 of 32)
    assert with_row_budgets(args, {"input_lengths": torch.tensor([30, 3])}, 32) is args  # no key: unchanged
    data = {"input_lengths": torch.tensor([30, 3, 3]), "max_new_tokens": torch.tensor([100, 100, 4])}
    got = with_row_budgets(args, data, 32)
    assert got.row_budgets.tolist() == [2, 8, 4] and got.max_new_tokens == 8 and got.min_new_tokens == 5
    for bad, match in [
        (torch.tensor([1.0, 2.0, 3.0]), r"max_new_tokens'\] must be a \[B\] = \(3,\) integer"),
        (torch.tensor([1, 2]), r"\(3,\) integer array"),
        (torch.tensor([1, 0, 3]), r"must be >= 1; row 1 has 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            with_row_budgets(args, {**data, "max_new_tokens": bad}, 32)
