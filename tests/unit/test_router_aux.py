"""The router's load-balancing loss (core.kernels.moe, core.losses.router_aux): HF's value for a
sequence, the same on torch and jax (values and gradients), a batch mean independent of how the
batch is split, and the policy.moe options refused where they cannot apply."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from core.kernels.moe import router_load_balancing_loss
from core.losses.router_aux import AUX_METRIC, RouterAux, aux_loss_coef, moe_top_k
from tests.unit.engines import ENGINES, to_engine, to_numpy, value_and_grad

LAYERS, ROWS, WIDTH, EXPERTS, TOP_K = 3, 4, 7, 8, 2
LENGTHS = np.array([7, 3, 5, 0])  # the last row has no tokens (a padding row)


def _logits(seed=0):
    return np.random.default_rng(seed).normal(size=(LAYERS, ROWS, WIDTH, EXPERTS)).astype(np.float32)


def _hf_per_row(logits):
    """HF's loss of each row alone: its real tokens, every layer."""
    out = []
    for b, n in enumerate(LENGTHS):
        gates = tuple(torch.from_numpy(logits[layer, b, :n]) for layer in range(LAYERS))
        out.append(float(load_balancing_loss_func(gates, EXPERTS, TOP_K)) if n else 0.0)
    return np.array(out)


# One engine here (eager jax compiles every op: ~2 s a test); the gradient test below holds
# jax to torch, values included.
@pytest.mark.parametrize("engine", ["torch"])
def test_per_sequence_loss_is_hfs_value_for_each_sequence(engine):
    logits = _logits()
    ours = router_load_balancing_loss(to_engine(engine, logits), to_engine(engine, LENGTHS), TOP_K)
    np.testing.assert_allclose(to_numpy(ours), _hf_per_row(logits), rtol=1e-6, atol=1e-7)
    # Uniform routing probabilities and load give exactly top_k.
    flat = np.zeros((1, 1, EXPERTS * 4, EXPERTS), np.float32)
    flat[0, 0, np.arange(EXPERTS * 4), np.arange(EXPERTS * 4) % EXPERTS] = 1e-3  # ties broken evenly
    uniform = router_load_balancing_loss(to_engine(engine, flat), to_engine(engine, np.array([EXPERTS * 4])), 1)
    assert float(to_numpy(uniform)[0]) == pytest.approx(1.0, rel=1e-3)


def test_torch_and_jax_gradients_agree():
    logits = _logits(1)

    def total(engine):
        lengths = to_engine(engine, LENGTHS)
        fn = lambda x: router_load_balancing_loss(x, lengths, TOP_K).sum()  # noqa: E731
        if engine == "jax":  # one compiled program instead of every op compiled eagerly
            import jax

            return jax.jit(fn)
        return fn

    (v_t, g_t), (v_j, g_j) = (value_and_grad(e, total(e), logits) for e in ENGINES)
    assert v_t == pytest.approx(v_j, rel=1e-6)
    np.testing.assert_allclose(g_t, g_j, rtol=1e-5, atol=1e-8)
    assert np.abs(g_t[:, 3]).max() == 0  # the padding row gets no gradient
    hf = torch.from_numpy(logits[:, 0]).requires_grad_(True)  # row 0 alone, all 7 tokens
    load_balancing_loss_func(tuple(hf), EXPERTS, TOP_K).backward()
    np.testing.assert_allclose(g_t[:, 0], hf.grad.numpy(), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("engine", ["torch"])
def test_batch_value_is_the_mean_over_valid_sequences_however_split(engine):
    """Summed over micro batches (and ranks) the metric is the mean over the global batch's
    valid sequences, whatever the split; coef scales what joins the loss."""
    logits = _logits(2)
    sample_mask = np.array([1, 1, 0, 0], np.float32)  # row 2 masked out of the loss, row 3 padding
    want = _hf_per_row(logits)[:2].mean()
    aux = RouterAux(coef=0.5, top_k=TOP_K)
    total, loss_total = 0.0, 0.0
    for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):
        batch = {"input_lengths": LENGTHS[rows], "sample_mask": sample_mask[rows]}
        zero = to_engine(engine, np.zeros((), np.float32))
        loss, metrics = aux.add_to(zero, {}, to_engine(engine, logits[:, rows]), to_engine(engine, batch), 2.0, None)
        total += to_numpy(metrics[AUX_METRIC]).item()
        loss_total += to_numpy(loss).item()
        assert to_numpy(metrics["loss"]).item() == pytest.approx(to_numpy(loss).item())
    assert total == pytest.approx(want, rel=1e-6)
    assert loss_total == pytest.approx(0.5 * want, rel=1e-6)


def test_coefficient_and_top_k_come_from_the_config_and_the_model():
    from core.testing.tiny_models import tiny_config

    moe, dense = tiny_config("qwen3_moe"), tiny_config("llama")
    assert moe_top_k(moe) == 2 and moe_top_k(dense) is None
    assert aux_loss_coef(None, moe) == 0.0  # output_router_logits is false: reported only
    moe.output_router_logits, moe.router_aux_loss_coef = True, 0.003
    assert aux_loss_coef(None, moe) == 0.003  # as HF / TRL train it
    assert aux_loss_coef(0.0, moe) == 0.0 and aux_loss_coef(0.1, moe) == 0.1  # the policy section decides


def test_moe_options_on_a_dense_model_are_refused_by_name():
    from core.policy.config import PolicyConfig
    from core.policy.preflight import check_moe_options
    from core.testing.tiny_models import tiny_config

    base = {"model_name": "m", "backend": "torch_fsdp", "logprob_batch_size": 2, "train_global_batch_size": 4,
            "train_micro_batch_size": 2, "max_total_sequence_length": 64, "precision": "float32",
            "max_grad_norm": None, "tokenizer": {"name": "m"}}  # fmt: skip
    weighted = PolicyConfig.coerce(base | {"moe": {"router_aux_loss_coef": 0.01}}, path="policy")
    with pytest.raises(ValueError, match=r"policy.moe.router_aux_loss_coef=0.01: model_type 'llama' has no"):
        check_moe_options(tiny_config("llama"), weighted)
    check_moe_options(tiny_config("qwen3_moe"), weighted)
    check_moe_options(tiny_config("llama"), PolicyConfig.coerce(base, path="policy"))  # the default passes
    blocked = PolicyConfig.coerce(base | {"backend": "jax_pjit", "jax_cfg": {"moe_dispatch": "blocked"}}, path="policy")
    [(field, message)] = blocked.spec.model_checks(blocked, tiny_config("llama"))  # the JAX spec's own rule
    assert field == "jax_cfg.moe_dispatch" and message.startswith("blocked: model_type 'llama' has no")
    assert list(blocked.spec.model_checks(blocked, tiny_config("qwen3_moe"))) == []
    check_moe_options(tiny_config("qwen3_moe"), blocked)


def test_expert_parallel_sizes_are_checked_on_the_driver():
    """``policy.parallel.expert_parallel_size``: refused on a dense model, when it does not
    divide the experts, and when it is not the fsdp size (statically, and against the world)."""
    from core.config import ConfigError
    from core.policy.config import PolicyConfig
    from core.policy.preflight import check_moe_options
    from core.testing.tiny_models import tiny_config

    base = {"model_name": "m", "backend": "jax_pjit", "logprob_batch_size": 2, "train_global_batch_size": 4,
            "train_micro_batch_size": 2, "max_total_sequence_length": 64, "precision": "float32",
            "max_grad_norm": None, "tokenizer": {"name": "m"}}  # fmt: skip

    def policy(ep: int, fsdp: int = -1) -> PolicyConfig:
        return PolicyConfig.coerce(base | {"parallel": {"fsdp_size": fsdp, "expert_parallel_size": ep}}, path="policy")

    with pytest.raises(ValueError, match=r"policy.parallel.expert_parallel_size=2: model_type 'llama' has no"):
        check_moe_options(tiny_config("llama"), policy(2))
    check_moe_options(tiny_config("qwen3_moe"), policy(4))  # 8 experts
    with pytest.raises(ValueError, match=r"expert_parallel_size=3 does not divide the model's num_experts=8"):
        check_moe_options(tiny_config("qwen3_moe"), policy(3))
    with pytest.raises(ConfigError, match=r"policy.parallel.expert_parallel_size: 2 must be 1 or the fsdp size \(4\)"):
        policy(2, fsdp=4)
    with pytest.raises(ConfigError, match=r"policy.parallel.expert_parallel_size: 4 must be 1 or the fsdp size \(2\)"):
        PolicyConfig.checked(base | {"parallel": {"expert_parallel_size": 4}}, world_size=2)
    PolicyConfig.checked(base | {"parallel": {"expert_parallel_size": 2}}, world_size=2)


def test_agreement_is_the_share_of_the_same_experts():
    from core.kernels.moe import routed_experts_of, routing_agreement

    logits = torch.from_numpy(_logits(3))
    own = routed_experts_of(logits, TOP_K)  # (B, S, L, K)
    assert torch.equal(routing_agreement(logits, own), torch.ones(ROWS, WIDTH))
    swapped = own.flip(-1)  # the same sets in another order
    assert torch.equal(routing_agreement(logits, swapped), torch.ones(ROWS, WIDTH))
    other = own.clone()
    unused = [next(e for e in range(EXPERTS) if e not in own[0, 0, 0].tolist())]
    other[0, 0, 0, 1] = unused[0]  # one of two experts differs, in one of three layers
    agree = routing_agreement(logits, other)
    assert float(agree[0, 0]) == pytest.approx(1 - 0.5 / LAYERS) and float(agree.sum()) == pytest.approx(
        ROWS * WIDTH - 0.5 / LAYERS
    )


def test_agreement_metric_is_over_the_trained_tokens():
    from core.kernels.moe import routed_experts_of

    logits = torch.from_numpy(_logits(4))
    routed = routed_experts_of(logits, TOP_K).clone()
    routed[:, 4:, :, :] = (routed[:, 4:, :, :] + 1) % EXPERTS  # tokens 4.. route elsewhere
    token_mask = torch.zeros(ROWS, WIDTH)
    token_mask[:, 2:6] = 1  # positions 2..5 trained: 2, 3 agree, 4, 5 do not
    data = {"input_lengths": torch.from_numpy(LENGTHS), "sample_mask": torch.tensor([1.0, 1, 1, 0]),
            "token_mask": token_mask, "routed_experts": routed}  # fmt: skip
    trained = float((token_mask[:, 1:] * data["sample_mask"][:, None]).sum())
    _, metrics = RouterAux(0.0, TOP_K).add_to(torch.zeros(()), {}, logits, data, 3.0, trained)
    from core.kernels.moe import routing_agreement

    per_token = routing_agreement(logits, routed)[:, 1:]
    want = float((per_token * token_mask[:, 1:] * data["sample_mask"][:, None]).sum()) / trained
    assert float(metrics["moe_routing_agreement"]) == pytest.approx(want, rel=1e-6)
    assert per_token[:3, 1:3].min() == 1 and per_token[:3, 3:5].max() < 1  # 2, 3 agree; 4, 5 do not


@pytest.mark.parametrize(
    "path, overrides, named",
    [
        ("GRPO", ["policy.moe.routing_replay.enabled=true"], "policy.moe.routing_replay.enabled: true, but this run's"),
        ("GRPO", ["policy.moe.log_routing_agreement=true"], "policy.moe.log_routing_agreement: true, but this run's"),
        (
            "GRPO",
            ["policy.moe.routing_replay.enabled=true", "policy.moe.routing_replay.source=engine"],
            "policy.moe.routing_replay.source: 'engine': the engine's expert choices are not available",
        ),
        (
            "GRPO",
            ["grpo.fuse_old_logprobs=false", "policy.moe.log_routing_agreement=true",
             "policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=512",
             "policy.sequence_packing.logprob_mb_tokens=512"],
            "policy.moe.log_routing_agreement: true with policy.sequence_packing.enabled",
        ),
        ("SFT", ["policy.moe.routing_replay.enabled=true"], "true, but dualrl sft has no old-policy logprob pass"),
    ],
)  # fmt: skip
def test_routing_options_where_they_cannot_apply_are_refused_by_name(path, overrides, named):
    from tests.unit.config.cases import GRPO, SFT, load_errors

    errors = load_errors({"GRPO": GRPO, "SFT": SFT}[path], *overrides)
    assert any(named in e for e in errors), errors
    if path == "GRPO" and "source=engine" not in overrides[-1] and "packing" not in str(overrides):
        from core.algorithms.config import run_config_class
        from core.config.loader import load_raw_config

        raw = load_raw_config(GRPO, [*overrides, "grpo.fuse_old_logprobs=false"])
        run_config_class(raw).model_validate(raw)  # with a separate old-logprob pass: accepted
