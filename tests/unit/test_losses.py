"""The losses on torch and jax against float64 NumPy references: values, gradients,
micro-batch invariance, NeMo RL's worked cases, and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.losses import ClippedPGLossFn, DPOLossFn, LossInputError, NLLLoss, metrics_to_floats
from tests.unit.engines import ENGINES, to_engine, value_and_grad, x64
from tests.unit.test_kernels import np_clipped, np_kl, np_logprobs, np_truncated_is

EPS = 1e-8
B, S, V = 4, 7, 6

BASE_CFG = {
    "reference_policy_kl_penalty": 0.05,
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.2,
    "ratio_clip_c": None,
    "use_on_policy_kl_approximation": False,
    "use_importance_sampling_correction": False,
    "token_level_loss": True,
}

PG_VARIANTS = {
    "ppo_token": {},
    "ppo_sequence": {"token_level_loss": False},
    "clip_higher_dual_clip": {"ratio_clip_max": 0.28, "ratio_clip_c": 3.0},
    "reinforce": {"disable_ppo_ratio": True},
    "on_policy_kl_and_is": {"use_on_policy_kl_approximation": True, "use_importance_sampling_correction": True},
    "k1_clamped": {"reference_policy_kl_type": "k1", "kl_input_clamp_value": 0.5, "kl_output_clamp_value": 0.4},
    "k2": {"reference_policy_kl_type": "k2"},
    "tis": {"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 1.2},
    "icepop": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 1.3,
        "truncated_importance_sampling_ratio_min": 0.8,
    },
    "seq_mask_tis": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio": 1.1,
        "truncated_importance_sampling_ratio_min": 0.95,
    },
    "gspo": {
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
        "use_importance_sampling_correction": True,
    },
    "no_kl": {"reference_policy_kl_penalty": 0.0},
    # Dr. GRPO: token sums over valid sequences x a constant budget (KL term included).
    "dr_grpo_constant": {"token_normalizer": "constant", "constant_token_budget": 9},
}


def make_batch(seed=0, batch=B):
    """A ragged RL batch: prompts (mask 0), responses (mask 1), right padding, one masked sample."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, size=(batch, S))
    token_mask = np.zeros((batch, S))
    for b in range(batch):
        prompt, length = 1 + b % 2, S - (b % 3)
        token_mask[b, prompt:length] = 1
    sample_mask = np.ones(batch)
    sample_mask[min(2, batch - 1)] = 0 if batch > 2 else 1

    def logp():
        return -np.abs(rng.normal(size=(batch, S))) - 0.5

    return {
        "input_ids": ids,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": rng.normal(size=(batch, S)),
        "prev_logprobs": logp(),
        "generation_logprobs": logp(),
        "reference_policy_logprobs": logp(),
    }


def counts(data):
    m = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    return float(data["sample_mask"].sum()), float(m.sum())


# ----------------------------------------------------------------------------- references


def np_clipped_pg(logits, d, cfg, gseq=None, gtok=None):
    tm, sm = d["token_mask"][:, 1:], d["sample_mask"]
    m = tm * sm[:, None]
    A, prev, gen, ref = (
        np.where(m > 0, d[k][:, 1:], 0.0)
        for k in ("advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs")
    )
    curr = np.where(m > 0, np_logprobs(logits[:, :-1], d["input_ids"][:, 1:]), 0.0)
    gseq = sm.sum() if gseq is None else gseq
    gtok = m.sum() if gtok is None else gtok

    def reduce(x):
        if cfg.get("token_normalizer") == "constant":
            return (x * m).sum() / (gseq * cfg["constant_token_budget"] + EPS)
        if cfg["token_level_loss"]:
            return (x * m).sum() / (gtok + EPS)
        per_seq = (x * tm).sum(-1) / (tm.sum(-1) + EPS)
        return (per_seq * sm).sum() / (gseq + EPS)

    def seq_ratio(logr):
        return np.exp((logr * tm).sum(-1, keepdims=True) / (tm.sum(-1, keepdims=True) + EPS)) * np.ones_like(logr)

    kl = 0.0
    if cfg["reference_policy_kl_penalty"]:
        k = np_kl(
            curr,
            ref,
            cfg.get("reference_policy_kl_type", "k3"),
            cfg.get("kl_input_clamp_value", 20.0),
            cfg.get("kl_output_clamp_value", 10.0),
        )
        if cfg["use_on_policy_kl_approximation"]:
            k = np.exp(curr - gen) * k
        kl = cfg["reference_policy_kl_penalty"] * reduce(k)
    if cfg.get("disable_ppo_ratio"):
        tok = -A * curr
    else:
        r = seq_ratio(curr - prev) if cfg.get("sequence_level_importance_ratios") else np.exp(curr - prev)
        tok = np_clipped(r, A, cfg["ratio_clip_min"], cfg["ratio_clip_max"], cfg["ratio_clip_c"])
    w = np.ones_like(tok)
    if cfg["use_importance_sampling_correction"]:
        logw = prev - gen
        if cfg.get("truncated_importance_sampling_ratio") is not None:
            w = np_truncated_is(
                logw,
                tm,
                cfg.get("truncated_importance_sampling_type", "tis"),
                cfg["truncated_importance_sampling_ratio"],
                cfg.get("truncated_importance_sampling_ratio_min"),
            )
        elif cfg.get("sequence_level_importance_ratios"):
            w = seq_ratio(logw)
        else:
            w = np.exp(logw)
    return reduce(w * tok) + kl


def np_nll(logits, d, gtok=None):
    m = d["token_mask"][:, 1:] * d["sample_mask"][:, None]
    lp = np_logprobs(logits[:, :-1], d["input_ids"][:, 1:])
    return -(lp * m).sum() / ((m.sum() if gtok is None else gtok) + EPS)


def np_dpo(logits, d, cfg, gseq=None):
    m = d["token_mask"][:, 1:] * d["sample_mask"][:, None]
    sm = d["sample_mask"]
    lp = np_logprobs(logits[:, :-1], d["input_ids"][:, 1:])
    ref = np.where(m > 0, d["reference_policy_logprobs"][:, 1:], 0.0)
    ntok = np.maximum(m.sum(-1), 1.0)
    rewards = ((lp - ref) * m).sum(-1)
    if cfg["preference_average_log_probs"]:
        rewards = rewards / ntok
    pairs = (sm.sum() if gseq is None else gseq) / 2
    delta = cfg["reference_policy_kl_penalty"] * (rewards[0::2] - rewards[1::2])
    pref = (np.log1p(np.exp(-delta)) * sm[0::2]).sum() / (pairs + EPS)
    nll = -(lp * m).sum(-1)
    if cfg["sft_average_log_probs"]:
        nll = nll / ntok
    sft = (nll[0::2] * sm[0::2]).sum() / (pairs + EPS)
    return cfg["preference_loss_weight"] * pref + cfg["sft_loss_weight"] * sft


DPO_CFG = {
    "reference_policy_kl_penalty": 0.1,
    "preference_loss_weight": 1.0,
    "sft_loss_weight": 0.5,
    "preference_average_log_probs": False,
    "sft_average_log_probs": True,
}


def loss_on(engine, loss_fn, data, gseq, gtok):
    """fn(logits) -> loss, with ``data`` already on the engine."""

    def fn(logits):
        return loss_fn(logits, data, gseq, gtok)[0]

    return fn


# ----------------------------------------------------------------------------- values and grads


@pytest.mark.parametrize("variant", sorted(PG_VARIANTS))
def test_clipped_pg_matches_numpy_and_torch_grad_equals_jax_grad(variant):
    cfg = {**BASE_CFG, **PG_VARIANTS[variant]}
    data = make_batch(1)
    logits = np.random.default_rng(2).normal(size=(B, S, V))
    gseq, gtok = counts(data)
    expected = np_clipped_pg(logits, data, cfg)
    loss_fn = ClippedPGLossFn(cfg)
    grads = {}
    for engine in ENGINES:
        with x64(engine):
            val, grads[engine] = value_and_grad(
                engine, loss_on(engine, loss_fn, to_engine(engine, data), gseq, gtok), logits
            )
        assert val == pytest.approx(expected, rel=1e-10, abs=1e-12), engine
    scale = np.abs(grads["torch"]).max()
    assert scale > 0
    np.testing.assert_allclose(grads["jax"], grads["torch"], rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("variant", ["ppo_token", "ppo_sequence", "gspo", "tis"])
def test_clipped_pg_gradient_matches_finite_differences(variant):
    cfg = {**BASE_CFG, **PG_VARIANTS[variant]}
    data = make_batch(3)
    logits = np.random.default_rng(4).normal(size=(B, S, V))
    with x64("torch"):
        _, grad = value_and_grad(
            "torch", loss_on("torch", ClippedPGLossFn(cfg), to_engine("torch", data), None, None), logits
        )
    fd = np.zeros_like(logits)
    eps = 1e-6
    for idx in np.ndindex(logits.shape):
        up, dn = logits.copy(), logits.copy()
        up[idx] += eps
        dn[idx] -= eps
        fd[idx] = (np_clipped_pg(up, data, cfg) - np_clipped_pg(dn, data, cfg)) / (2 * eps)
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("engine", ENGINES)
def test_nll_matches_numpy(engine):
    data = make_batch(5)
    logits = np.random.default_rng(6).normal(size=(B, S, V))
    with x64(engine):
        loss, metrics = NLLLoss()(to_engine(engine, logits), to_engine(engine, data), None, None)
    assert float(loss) == pytest.approx(np_nll(logits, data), rel=1e-12)
    m = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    assert float(metrics["num_unmasked_tokens"]) == m.sum()
    assert float(metrics["num_valid_samples"]) == data["sample_mask"].sum()


@pytest.mark.parametrize("avg", [(False, True), (True, False)])
def test_dpo_matches_numpy_and_grads_agree(avg):
    cfg = {**DPO_CFG, "preference_average_log_probs": avg[0], "sft_average_log_probs": avg[1]}
    data = make_batch(7)
    data["sample_mask"] = np.ones(B)
    logits = np.random.default_rng(8).normal(size=(B, S, V))
    loss_fn = DPOLossFn(cfg)
    grads = {}
    for engine in ENGINES:
        with x64(engine):
            val, grads[engine] = value_and_grad(
                engine, loss_on(engine, loss_fn, to_engine(engine, data), B, None), logits
            )
        assert val == pytest.approx(np_dpo(logits, data, cfg), rel=1e-10)
    np.testing.assert_allclose(grads["jax"], grads["torch"], rtol=1e-6, atol=1e-12)


def test_clipped_pg_metrics_match_numpy():
    cfg = {**BASE_CFG, "use_importance_sampling_correction": True}
    data = make_batch(9)
    logits = np.random.default_rng(10).normal(size=(B, S, V))
    with x64("torch"):
        _, metrics = ClippedPGLossFn(cfg)(to_engine("torch", logits), to_engine("torch", data), None, None)
    metrics = metrics_to_floats(metrics)
    m = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    curr = np.where(m > 0, np_logprobs(logits[:, :-1], data["input_ids"][:, 1:]), 0.0)
    prev = np.where(m > 0, data["prev_logprobs"][:, 1:], 0.0)
    gen = np.where(m > 0, data["generation_logprobs"][:, 1:], 0.0)
    ref = np.where(m > 0, data["reference_policy_logprobs"][:, 1:], 0.0)

    def tok_mean(x):
        return (x * m).sum() / (m.sum() + EPS)

    assert metrics["probs_ratio"] == pytest.approx(tok_mean(np.exp(curr - prev)), rel=1e-10)
    assert metrics["token_mult_prob_error"] == pytest.approx(tok_mean(np.exp(np.abs(gen - prev))), rel=1e-10)
    assert metrics["sampling_importance_ratio"] == pytest.approx(tok_mean(np.exp(prev - gen)), rel=1e-10)
    assert metrics["approx_entropy"] == pytest.approx(tok_mean(-np.exp(curr - gen) * curr), rel=1e-10)
    assert metrics["kl_penalty"] == pytest.approx(tok_mean(np_kl(curr, ref, "k3", 20.0, 10.0)), rel=1e-10)
    assert metrics["num_valid_samples"] == data["sample_mask"].sum()
    assert metrics["loss"] == pytest.approx(np_clipped_pg(logits, data, cfg), rel=1e-10)


# ----------------------------------------------------------------------------- micro-batch invariance


def _split_sum(engine, loss_fn, logits, data, mbs):
    """Sum of micro-batch losses/grads/metrics with the global counts of the whole batch."""
    gseq, gtok = counts(data)
    total, grad, metrics = 0.0, np.zeros_like(logits), {}
    for start in range(0, logits.shape[0], mbs):
        sl = slice(start, start + mbs)
        mb = to_engine(engine, {k: v[sl] for k, v in data.items()})
        val, g = value_and_grad(engine, loss_on(engine, loss_fn, mb, gseq, gtok), logits[sl])
        _, mb_metrics = loss_fn(to_engine(engine, logits[sl]), mb, gseq, gtok)
        for k, v in metrics_to_floats(mb_metrics).items():
            metrics[k] = metrics.get(k, 0.0) + v
        total += val
        grad[sl] = g
    return total, grad, metrics


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "loss_name", ["ppo_token", "ppo_sequence", "gspo", "seq_mask_tis", "dr_grpo_constant", "nll", "dpo"]
)
def test_micro_batch_invariance(engine, loss_name):
    if loss_name == "nll":
        loss_fn = NLLLoss()
    elif loss_name == "dpo":
        loss_fn = DPOLossFn(DPO_CFG)
    else:
        loss_fn = ClippedPGLossFn({**BASE_CFG, **PG_VARIANTS[loss_name]})
    data = make_batch(11)
    logits = np.random.default_rng(12).normal(size=(B, S, V))
    with x64(engine):
        whole, whole_grad, whole_metrics = _split_sum(engine, loss_fn, logits, data, B)
        for mbs in [2] if loss_name == "dpo" else [1, 2]:
            total, grad, metrics = _split_sum(engine, loss_fn, logits, data, mbs)
            assert total == pytest.approx(whole, rel=1e-6, abs=1e-12), mbs
            np.testing.assert_allclose(grad, whole_grad, rtol=1e-6, atol=1e-12)
            for k in ("loss", "num_valid_samples"):
                assert metrics[k] == pytest.approx(whole_metrics[k], rel=1e-6, abs=1e-12)


# ----------------------------------------------------------------------------- worked cases


def one_sequence(curr, prev=None, gen=None, ref=None, adv=None, token_mask=None):
    """A [1, 4] sequence whose 3 next-token logprobs are exactly ``curr`` (vocab of 2)."""
    curr = np.asarray(curr, dtype=np.float64)
    other = np.log1p(-np.exp(curr), where=curr < 0, out=np.full_like(curr, -1e30))
    logits = np.zeros((1, 4, 2))
    logits[0, :3, 0], logits[0, :3, 1] = curr, other

    def col(x, default):
        x = default if x is None else np.asarray(x, dtype=np.float64)
        return np.concatenate([[0.0], x])[None]

    data = {
        "input_ids": np.zeros((1, 4), dtype=np.int64),
        "token_mask": col(token_mask, np.ones(3)),
        "sample_mask": np.ones(1),
        "advantages": col(adv, np.zeros(3)),
        "prev_logprobs": col(prev, curr),
        "generation_logprobs": col(gen if gen is not None else prev, curr),
        "reference_policy_logprobs": col(ref, curr),
    }
    return logits, data


WORKED = {
    "ppo_clip": (
        {"reference_policy_kl_penalty": 0.0},
        dict(curr=np.log([0.5, 1, 1.5]) - 1, prev=[-1, -1, -1], adv=[1, -1, 2]),
        -0.633333,
    ),
    "reinforce": (
        {"reference_policy_kl_penalty": 0.0, "disable_ppo_ratio": True},
        dict(curr=[-0.5, -1, -1.5], adv=[1, -1, 2]),
        0.833333,
    ),
    "kl_only": (
        {"reference_policy_kl_penalty": 0.1},
        dict(curr=[0.0, -1, -2], ref=[-1, -1, -1]),
        0.036205,
    ),
    "dual_clip": (
        {"reference_policy_kl_penalty": 0.0, "ratio_clip_c": 3.0},
        dict(curr=np.log([0.5, 1, 10]) + np.array([-1, -1, -3]), prev=[-1, -1, -3], adv=[1, -1, -4]),
        4.166667,
    ),
    # ratio 1: token losses -A = [-1, 1, -2]; sum -2 over 1 sequence x a budget of 4 (the
    # token mean would be -2/3)
    "dr_grpo_constant": (
        {"reference_policy_kl_penalty": 0.0, "token_normalizer": "constant", "constant_token_budget": 4},
        dict(curr=[-0.5, -1, -1.5], adv=[1, -1, 2]),
        -0.5,
    ),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", sorted(WORKED))
def test_worked_cases(engine, case):
    overrides, seq, expected = WORKED[case]
    logits, data = one_sequence(**seq)
    with x64(engine):
        loss, _ = ClippedPGLossFn({**BASE_CFG, **overrides})(to_engine(engine, logits), to_engine(engine, data), 1, 3)
    assert float(loss) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("engine", ENGINES)
def test_all_zero_token_mask_gives_exactly_zero(engine):
    logits, data = one_sequence(curr=[-0.5, -1, -1.5], prev=[-1, -1, -1], adv=[1, -1, 2], token_mask=[0, 0, 0])
    for loss_fn in (ClippedPGLossFn(BASE_CFG), NLLLoss()):
        loss, _ = loss_fn(to_engine(engine, logits.astype(np.float32)), to_engine(engine, data), 1, 0)
        assert float(loss) == 0.0


@pytest.mark.parametrize("engine", ENGINES)
def test_dpo_zero_logits_zero_reference_is_ln2(engine):
    data = {
        "input_ids": np.zeros((2, 5), dtype=np.int64),
        "token_mask": np.ones((2, 5)),
        "sample_mask": np.ones(2),
        "reference_policy_logprobs": np.zeros((2, 5)),
    }
    cfg = {**DPO_CFG, "sft_loss_weight": 0.0}
    loss, _ = DPOLossFn(cfg)(to_engine(engine, np.zeros((2, 5, 11), dtype=np.float32)), to_engine(engine, data), 2, 8)
    assert float(loss) == pytest.approx(math.log(2), abs=1e-6)


# ----------------------------------------------------------------------------- jax inside jit


def test_loss_under_jax_jit_matches_eager():
    import jax

    cfg = {**BASE_CFG, **PG_VARIANTS["on_policy_kl_and_is"]}
    loss_fn = ClippedPGLossFn(cfg)
    data = to_engine(
        "jax", {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in make_batch(13).items()}
    )
    logits = to_engine("jax", np.random.default_rng(14).normal(size=(B, S, V)).astype(np.float32))

    def f(lg, d):
        return loss_fn(lg, d, 3.0, 14.0)

    (l_jit, m_jit), g_jit = jax.jit(jax.value_and_grad(f, has_aux=True))(logits, data)
    (l_eag, m_eag), g_eag = jax.value_and_grad(f, has_aux=True)(logits, data)
    assert float(l_jit) == pytest.approx(float(l_eag), rel=1e-5)
    np.testing.assert_allclose(np.asarray(g_jit), np.asarray(g_eag), rtol=1e-4, atol=1e-7)
    assert float(m_jit["probs_ratio"]) == pytest.approx(float(m_eag["probs_ratio"]), rel=1e-5)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("engine", ENGINES)
def test_bad_input_is_named(engine):
    loss_fn = ClippedPGLossFn(BASE_CFG)
    data = make_batch(15)
    logits = np.zeros((B, S, V), dtype=np.float32)

    def call(d, lg=logits):
        return loss_fn(to_engine(engine, lg), to_engine(engine, d), None, None)

    with pytest.raises(LossInputError, match=r"ClippedPGLossFn: data is missing key\(s\) \['advantages'\]"):
        call({k: v for k, v in data.items() if k != "advantages"})
    with pytest.raises(LossInputError, match=r"data\['prev_logprobs'\] has shape \(4, 6\)"):
        call({**data, "prev_logprobs": data["prev_logprobs"][:, :-1]})
    with pytest.raises(LossInputError, match=r"sample_mask'\] must have shape \(4,\)"):
        call({**data, "sample_mask": np.ones((4, 1))})
    with pytest.raises(LossInputError, match=r"next_token_logits must be \[B, S, V\]"):
        call(data, logits[:, :-1])
    bad = data["advantages"].copy()
    bad[0, 3] = np.nan
    with pytest.raises(LossInputError, match=r"data\['advantages'\] has non-finite values"):
        call({**data, "advantages": bad})
    bad = data["generation_logprobs"].copy()
    bad[1, 4] = -np.inf
    with pytest.raises(LossInputError, match=r"data\['generation_logprobs'\] has non-finite"):
        call({**data, "generation_logprobs": bad})
    with pytest.raises(LossInputError, match="empty batch"):
        call({k: v[:0] for k, v in data.items()}, logits[:0])
    ids = data["input_ids"].copy()
    ids[0, 2] = V
    with pytest.raises(LossInputError, match=r"token ids in \[0, 6\] outside the vocabulary \[0, 6\)"):
        call({**data, "input_ids": ids})


@pytest.mark.parametrize("engine", ENGINES)
def test_non_finite_values_outside_the_mask_are_ignored(engine):
    data = make_batch(16)
    data["prev_logprobs"][:, 0] = np.nan  # column 0 is never read
    data["advantages"][data["token_mask"] == 0] = np.inf  # padding / prompt positions
    logits = np.random.default_rng(17).normal(size=(B, S, V))
    with x64(engine):
        val, grad = value_and_grad(
            engine, loss_on(engine, ClippedPGLossFn(BASE_CFG), to_engine(engine, data), None, None), logits
        )
    assert np.isfinite(val) and np.isfinite(grad).all()
    clean = make_batch(16)
    assert val == pytest.approx(np_clipped_pg(logits, clean, BASE_CFG), rel=1e-10)


def test_dpo_odd_batch_is_an_error():
    import torch

    data = {
        "input_ids": torch.zeros(3, 4, dtype=torch.long),
        "token_mask": torch.ones(3, 4),
        "sample_mask": torch.ones(3),
        "reference_policy_logprobs": torch.zeros(3, 4),
    }
    with pytest.raises(LossInputError, match="DPOLossFn: needs .* pairs but the batch has 3 rows"):
        DPOLossFn(DPO_CFG)(torch.zeros(3, 4, 5), data, None, None)


def test_bad_loss_config_names_the_field():
    from core.config import ConfigError

    def errors(loss_cls, cfg):
        with pytest.raises(ConfigError) as info:
            loss_cls(cfg)
        return info.value.errors

    assert errors(ClippedPGLossFn, {**BASE_CFG, "ratio_clip_c": 0.5}) == [
        "loss_fn.ratio_clip_c: must be > 1 (or null to disable dual clipping), got 0.5"
    ]
    assert errors(ClippedPGLossFn, {**BASE_CFG, "ratio_clip_mn": 0.2}) == [
        "loss_fn.ratio_clip_mn: unknown key (did you mean 'ratio_clip_min'?)"
    ]
    assert errors(ClippedPGLossFn, {**BASE_CFG, "reference_policy_kl_type": "k5"}) == [
        "loss_fn.reference_policy_kl_type: expected one of 'k1', 'k2', 'k3', got 'k5'"
    ]
    assert errors(DPOLossFn, {**DPO_CFG, "sft_loss_weight": "high"}) == [
        "loss_fn.sft_loss_weight: expected float, got str ('high')"
    ]
    assert errors(ClippedPGLossFn, {**BASE_CFG, "token_normalizer": "constant", "token_level_loss": False}) == [
        "loss_fn.token_normalizer: constant needs token_level_loss: true (a sequence-level loss divides each "
        "sequence by its own length, which is what the constant normaliser replaces)"
    ]
    assert errors(ClippedPGLossFn, {**BASE_CFG, "constant_token_budget": 64}) == [
        "loss_fn.constant_token_budget: is set (64) but token_normalizer is 'global_tokens'; only the constant "
        "normaliser reads it"
    ]
    assert errors(ClippedPGLossFn, {**BASE_CFG, "token_normalizer": "per_sequence"}) == [
        "loss_fn.token_normalizer: expected one of 'global_tokens', 'constant', got 'per_sequence'"
    ]
    with pytest.raises(ValueError, match="loss_fn.constant_token_budget is null"):
        ClippedPGLossFn({**BASE_CFG, "token_normalizer": "constant"})


def test_loss_functions_take_the_typed_section_or_its_mapping():
    from core.losses.config import ClippedPGLossConfig, DPOLossConfig

    typed = ClippedPGLossConfig.coerce(BASE_CFG, "loss_fn")
    assert ClippedPGLossFn(typed).cfg == ClippedPGLossFn(BASE_CFG).cfg == typed
    assert DPOLossFn(DPOLossConfig.coerce(DPO_CFG, "dpo")).cfg == DPOLossFn(DPO_CFG).cfg
