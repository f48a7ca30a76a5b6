"""The same tinker SDK programs against ``dualrl serve`` on every backend (slow: a server and
several policy starts per backend).

* step 1 through the API: the backends agree on the loss and gradient norm of one
  forward_backward + optim_step (the parity bar, 1e-5), and each equals the direct
  ``Policy`` path (``Policy.train`` with ``NLLLoss`` on the same rows built without the server:
  NLL's mean x tokens = Tinker's cross-entropy sum);
* SFT: the loss falls; a saved state (weights and Adam's moments) continues exactly;
* RL (cookbook-shaped, importance sampling) from the warm-started built-in model learns the
  arithmetic task: the greedy accuracy on held-out problems rises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks import tinker_client
from tests.tinker_api.conftest import server_config, service_client, serving

BACKENDS = ("torch_fsdp", "torch_dtensor", "jax_pjit")
BASE = "builtin:arithmetic-llama-base"
WARM = "builtin:arithmetic-llama"
PARITY = 1e-5

pytestmark = pytest.mark.slow


def scalar_diff(a: float, b: float) -> float:
    """The parity checks' measure: absolute below 1, relative above."""
    return abs(a - b) / max(1.0, abs(a), abs(b))


def new_trainer(client: Any, model: str = BASE, rank: int = 8) -> tuple[Any, Any]:
    tc = client.create_lora_training_client(model, rank=rank, seed=0, train_unembed=False).result()
    return tc, tc.get_tokenizer()


def run_base_programs(backend: str, checkpoint_dir: Any) -> dict[str, Any]:
    """First step, SFT, and a state saved then resumed, each in its own session."""
    out: dict[str, Any] = {}
    with serving(backend, BASE, checkpoint_dir) as server:
        client = service_client(server)
        tc, tok = new_trainer(client)
        out["first_step"] = tinker_client.first_step(tc, tok)
        client.close("success").result()

        client = service_client(server)
        tc, tok = new_trainer(client)
        out["sft"] = tinker_client.sft_loop(tc, tok, steps=10, batch=16, lr=5e-3)
        tinker_client.sft_loop(tc, tok, steps=2, batch=16, lr=5e-3)
        path = tc.save_state("two-more").result().path
        out["continued"] = tinker_client.first_step(tc, tok)
        client.close("success").result()

        client = service_client(server)
        tc = client.create_training_client_from_state_with_optimizer(path).result()
        out["resumed"] = tinker_client.first_step(tc, tok)
        out["resumed_path"] = path
        client.close("success").result()

        client = service_client(server)
        tc = full_weight_trainer(client)
        out["full_info"] = tc.get_info()
        out["full_step"] = tinker_client.first_step(tc, tok)
        client.close("success").result()
    return out


def full_weight_trainer(client: Any) -> Any:
    """A training client of the whole model: the SDK's own create request without a LoRA
    config, sent through its client (its public methods always send one)."""
    import time

    from tinker import types
    from tinker.lib.api_future_impl import _APIFuture
    from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
    from tinker.lib.public_interfaces.training_client import TrainingClient, fetch_training_info

    holder = client.holder
    seq, session = holder.get_training_client_id(), holder.get_session_id()

    async def create() -> Any:
        request = types.CreateModelRequest(session_id=session, model_seq_id=seq, base_model=BASE)
        with holder.aclient(ClientConnectionPoolType.TRAIN) as api:
            future = await api.models.create(request=request)
        created = await _APIFuture(types.CreateModelResponse, holder, future, time.time(), "CreateModel").result_async()
        info = await fetch_training_info(holder, created.model_id)
        return TrainingClient(holder, model_seq_id=seq, model_id=created.model_id, info=info)

    return holder.run_coroutine_threadsafe(create()).result()


def direct_first_step(backend: str) -> tuple[float, float, float]:
    """Loss (sum over the answer tokens), gradient norm and loss after the step of the first
    step of the same batch on a Policy started directly, trained with NLLLoss (a mean over the
    N answer tokens) on rows built here.  Its AdamW (from the config, not set per step) has
    the client's settings with eps / N: Adam's first step on the mean's gradient g / N is then
    exactly the one on the sum's g, lr x g / (|g| + eps)."""
    from core.algorithms.placement import policy_cluster
    from core.algorithms.run_setup import load_tokenizer
    from core.algorithms.warm_start import resolve_model
    from core.data import BatchedDataDict
    from core.losses import NLLLoss
    from core.policy import Policy

    cfg = resolve_model(server_config(backend, BASE, "unused"), [])
    cfg.policy.lora.enabled, cfg.policy.lora.rank = True, 8
    cfg.policy.lora.target_modules, cfg.policy.lora.init_seed = "all-linear", 0
    adam = tinker_client.adam(tinker_client.FIRST_STEP_LR)
    tok = load_tokenizer(cfg.policy)
    rows = tinker_client.problems(seed=11, start=0, count=16)  # first_step's batch
    seqs = [
        tok.encode(r["prompt"]) + tok.encode(r["answer"], add_special_tokens=False) + [tok.eos_token_id] for r in rows
    ]
    width = max(map(len, seqs))
    ids, mask = torch.zeros(len(seqs), width, dtype=torch.int64), torch.zeros(len(seqs), width)
    for i, (r, s) in enumerate(zip(rows, seqs, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, len(tok.encode(r["prompt"])) : len(s)] = 1.0
    data = BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.tensor([len(s) for s in seqs]),
        token_mask=mask,
        sample_mask=torch.ones(len(seqs)),
    )
    tokens = float(mask[:, 1:].sum())
    cfg.policy.optimizer.kwargs = {"lr": adam.learning_rate, "betas": [adam.beta1, adam.beta2],
                                   "eps": adam.eps / tokens, "weight_decay": adam.weight_decay}  # fmt: skip
    cluster = policy_cluster(cfg, name="direct")
    policy = Policy(cluster, cfg.policy, tok, init_reference_model=False)
    try:
        result = policy.train(data, NLLLoss(), gbs=len(seqs), mbs=8)
        after = policy.get_logprobs(data)["logprobs"]
    finally:
        policy.shutdown()
        cluster.shutdown()
    return result.loss[0] * tokens, result.grad_norm[0] * tokens, -float((after * mask).sum())


@pytest.fixture(scope="module")
def base_runs(serve_cache, tmp_path_factory):
    return {b: run_base_programs(b, tmp_path_factory.mktemp(f"ckpt-{b}")) for b in BACKENDS}


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_one_equals_the_direct_policy_path(base_runs, backend):
    api = base_runs[backend]["first_step"]
    loss, grad_norm, loss_after = direct_first_step(backend)
    assert scalar_diff(api.loss, loss) <= PARITY, (api.loss, loss)
    assert scalar_diff(api.grad_norm, grad_norm) <= PARITY, (api.grad_norm, grad_norm)
    # The step itself: the client's AdamW settings reached the optimizer (set per step on the
    # server, from the config here); the parity checks' loss-curve bar.
    assert scalar_diff(api.loss_after, loss_after) <= 1e-4, (api.loss_after, loss_after)


def test_step_one_is_the_same_on_every_backend(base_runs):
    ref = base_runs[BACKENDS[0]]["first_step"]
    for backend in BACKENDS[1:]:
        got = base_runs[backend]["first_step"]
        for field in ("loss", "grad_norm"):
            assert scalar_diff(getattr(ref, field), getattr(got, field)) <= PARITY, (backend, field)
        # After an Adam step (about lr x sign(g) per element): the parity checks' loss-curve bar.
        assert scalar_diff(ref.loss_after, got.loss_after) <= 1e-4, backend
        np.testing.assert_allclose(np.concatenate(got.logprobs), np.concatenate(ref.logprobs), atol=PARITY)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sft_loss_falls_and_a_saved_state_continues_exactly(base_runs, backend):
    run = base_runs[backend]
    assert run["sft"][-1] < 0.8 * run["sft"][0], run["sft"]
    assert run["resumed_path"].startswith("tinker://") and "/weights/two-more" in run["resumed_path"]
    continued, resumed = run["continued"], run["resumed"]
    for field in ("loss", "grad_norm", "loss_after"):  # loss_after: Adam's moments came back too
        assert scalar_diff(getattr(continued, field), getattr(resumed, field)) <= PARITY, field


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_weight_training(base_runs, backend):
    run = base_runs[backend]
    assert run["full_info"].is_lora is False
    full, lora = run["full_step"], run["first_step"]
    assert scalar_diff(full.loss, lora.loss) <= PARITY  # step 0: LoRA's B = 0 is the base model
    assert full.grad_norm > 0 and full.loss_after < full.loss


#: The RL loop the tests run (the measured one of docs/tinker.md).
RL_STEPS, RL_GROUPS, RL_GROUP_SIZE, RL_LR, RL_RANK = 30, 16, 16, 1e-3, 16


@pytest.mark.parametrize("backend", BACKENDS)
def test_rl_learns_the_arithmetic_task(serve_cache, tmp_path_factory, backend):
    if backend == "jax_pjit":
        run = rl_in_a_server_process(backend, serve_cache, tmp_path_factory.mktemp("rl-jax"))
    else:
        with serving(backend, WARM, tmp_path_factory.mktemp(f"rl-{backend}")) as server:
            client = service_client(server)
            tc, tok = new_trainer(client, WARM, RL_RANK)
            loop = tinker_client.rl_loop(tc, tok, RL_STEPS, RL_GROUPS, RL_GROUP_SIZE, RL_LR)
            client.close("success").result()
        run = asdict(loop)
    rewards = [s["reward"] for s in run["steps"]]
    assert all(s["datums"] > 0 for s in run["steps"][:3]), "the warm start gives groups with mixed rewards"
    # 64 held-out problems x 8 seeded samples; the gains measured on each backend: docs/tinker.md.
    before, after = run["accuracy_before"], run["accuracy_after"]
    assert after >= before + 0.05, (before, after, rewards)


def rl_in_a_server_process(backend: str, cache: Any, out_dir: Any) -> dict[str, Any]:
    """The RL program against a server in a process of its own (``benchmarks.tinker_e2e``), with
    the Ray that ``dualrl serve`` starts: its JAX worker gets 2 host devices and XLA's CPU flags
    of ``core.distributed.ray_init.jax_cpu_flags`` (Eigen's intra-op pool off).  This test
    session's Ray gives JAX actors 8 host devices with that pool on (tests/conftest.py), where
    the RL loop's long run of steps deadlocked an XLA all-gather rendezvous (the worker died).
    On a loaded machine a participant of a CPU collective can also arrive later than XLA's
    default 40 s, which aborts the worker: the limit is raised to 10 minutes."""
    out = out_dir / "rl.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RAY_ADDRESS")}
    env.update(DUALRL_CACHE_DIR=str(cache), PYTHONPATH=os.getcwd(), TINKER_TELEMETRY="0")
    env["XLA_FLAGS"] = "--xla_cpu_collective_call_terminate_timeout_seconds=600"
    args = ["--backends", backend, "--programs", "rl", "--rl-steps", str(RL_STEPS), "--groups", str(RL_GROUPS)]
    args += ["--group-size", str(RL_GROUP_SIZE), "--rl-lr", str(RL_LR), "--lora-rank", str(RL_RANK)]
    args += ["--checkpoint-dir", str(out_dir), "--json", str(out)]
    subprocess.run([sys.executable, "-m", "benchmarks.tinker_e2e", *args], env=env, check=True, timeout=3000)
    return json.loads(out.read_text())[backend]["rl"]
