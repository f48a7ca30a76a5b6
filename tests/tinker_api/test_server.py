"""The real tinker SDK against ``dualrl serve`` (torch_fsdp, 2 workers, the random-weight
built-in model): SFT, the RL path, sampling, custom losses, and every refusal -- a 4xx with
a message, before any work, leaving the model, its optimizer state and other sessions as
they were.  The other backends, the learning runs and parity: test_backends.py (slow)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from benchmarks import tinker_client
from core.models.char_tokenizer import char_tokenizer
from tests.tinker_api.conftest import API_KEY, service_client, serving

MODEL = "builtin:arithmetic-llama-base"


@pytest.fixture(scope="module")
def server(serve_cache, tmp_path_factory):
    with serving("torch_fsdp", MODEL, tmp_path_factory.mktemp("serve_ckpt")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    sc = service_client(server)
    yield sc
    sc.close("success").result()


@pytest.fixture(scope="module")
def trainer(client):
    tc = client.create_lora_training_client(MODEL, rank=8, seed=0, train_unembed=False).result()
    return tc, tc.get_tokenizer()


def raw(server, method: str, path: str, key: str | None = API_KEY, **kwargs) -> httpx.Response:
    headers = kwargs.pop("headers", {})
    if key is not None:
        headers["X-API-Key"] = key
    return httpx.request(method, server.base_url + path, headers=headers, timeout=30, **kwargs)


def data(tokenizer, count: int = 8, start: int = 0) -> list[types.Datum]:
    rows = tinker_client.problems(seed=5, start=start, count=count)
    return [tinker_client.sft_datum(tokenizer, r["prompt"], r["answer"]) for r in rows]


def forward_logprobs(trainer, batch) -> list[np.ndarray]:
    tc, _ = trainer
    return [o["logprobs"].to_numpy() for o in tc.forward(batch, "cross_entropy").result().loss_fn_outputs]


def test_service_calls(server, client, trainer):
    tc, tokenizer = trainer
    info = tc.get_info()
    assert info.is_lora and info.lora_rank == 8 and info.model_id == tc.model_id
    # The SDK loaded it from the path the server gave: the built-in character tokenizer.
    assert tokenizer.encode("1+2=") == char_tokenizer().encode("1+2=")
    caps = tinker.RestClient(base_url=server.base_url, api_key=API_KEY).get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [info.model_data.model_name]
    assert raw(server, "GET", "/api/v1/healthz").json() == {"status": "ok"}


def test_sft_loss_falls(trainer):
    tc, tokenizer = trainer
    losses = tinker_client.sft_loop(tc, tokenizer, steps=8, batch=16, lr=5e-3)
    assert losses[-1] < 0.9 * losses[0], losses


def test_sampled_logprobs_are_the_training_logprobs(trainer):
    """A sample's logprobs and a forward over the same tokens agree (same weights, fp32)."""
    tc, tokenizer = trainer
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = tokenizer.encode("12+7=")
    params = types.SamplingParams(max_tokens=6, seed=11, stop=[tokenizer.eos_token_id])
    res = sampler.sample(types.ModelInput.from_ints(prompt), 4, params, include_prompt_logprobs=True).result()
    again = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result()
    assert [list(s.tokens) for s in res.sequences] == [list(s.tokens) for s in again.sequences]  # seeded
    assert np.isnan(res.prompt_logprobs_np[0]) and np.isfinite(res.prompt_logprobs_np[1:]).all()
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert logprobs[0] is None and np.allclose(logprobs[1:], res.prompt_logprobs_np[1:], atol=1e-6)
    for seq in res.sequences:
        assert seq.stop_reason in ("stop", "length") and 1 <= len(seq.tokens) <= 6
        full = prompt + list(seq.tokens)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)},
        )
        trained = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(trained[len(prompt) - 1 :], seq.logprobs, atol=2e-5)
        np.testing.assert_allclose(trained[: len(prompt) - 1], res.prompt_logprobs_np[1:], atol=2e-5)
    greedy = sampler.sample(
        types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=6, temperature=0)
    ).result()
    assert list(greedy.sequences[0].tokens) == list(greedy.sequences[1].tokens)


def test_policy_gradient_losses_and_a_custom_loss(trainer):
    tc, tokenizer = trainer
    for loss_fn in ("importance_sampling", "ppo", "cispo"):
        step = tinker_client.first_step(tc, tokenizer, loss_fn, lr=1e-3)
        assert np.isfinite(step.loss) and step.grad_norm > 0 and step.loss_after != step.loss

    def neg_mean_logprob(batch, logprobs):
        total = sum((-lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(batch, logprobs, strict=True))
        return total, {"custom:sum": float(total.detach())}

    batch = data(tokenizer)
    expected = tc.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    out = tc.forward_backward_custom(batch, neg_mean_logprob).result()
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(
        expected, rel=1e-5
    )  # CE with the loss's gradient as weights
    assert tc.optim_step(tinker_client.adam(1e-3)).result().metrics["skipped:sum"] == 0


def test_a_large_batch_is_cut_by_the_sdk_to_the_servers_limits(trainer):
    """100 datums, serve.max_datums_per_request = 64: the SDK sends two requests (the client
    config says so), the step trains on all of them and the loss is the sum over both."""
    tc, tokenizer = trainer
    batch = data(tokenizer, count=100, start=200)
    out = tc.forward_backward(batch, "cross_entropy").result()
    assert len(out.loss_fn_outputs) == 100
    step = tc.optim_step(tinker_client.adam(1e-3)).result()
    assert step.metrics["num_datums:sum"] == 100 and step.metrics["loss:sum"] == pytest.approx(
        out.metrics["loss:sum"], rel=1e-5
    )


def test_a_stale_sampler_is_refused(trainer):
    tc, tokenizer = trainer
    sampler = tc.save_weights_and_get_sampling_client().result()
    tc.forward_backward(data(tokenizer), "cross_entropy").result()
    tc.optim_step(tinker_client.adam(1e-3)).result()
    with pytest.raises(tinker.RequestFailedError, match="has taken .* step"):
        sampler.sample(types.ModelInput.from_ints([1, 5]), 1, types.SamplingParams(max_tokens=2)).result()


def test_refusals_leave_the_model_and_its_pending_gradient_alone(server, client, trainer):
    tc, tokenizer = trainer
    batch = data(tokenizer, start=100)
    before = forward_logprobs(trainer, batch)
    good = tc.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"]

    # malformed request (not a protobuf; not JSON; a field of the wrong type)
    proto = {"Content-Type": "application/x-protobuf"}
    r = raw(server, "POST", "/api/v1/forward_backward", content=b"\xff\xfe garbage", headers=proto)
    assert r.status_code == 400 and "not a ForwardBackwardRequest protobuf" in r.json()["detail"]
    assert raw(server, "POST", "/api/v1/optim_step", content=b"{").status_code == 400
    r = raw(server, "POST", "/api/v1/optim_step", json={"model_id": tc.model_id, "adam_params": {"learning_rate": "x"}})
    assert r.status_code == 400 and "adam_params" in r.json()["detail"]
    # oversized request (serve.max_request_mb = 0.25)
    r = raw(server, "POST", "/api/v1/forward_backward", content=b"\0" * 300_000, headers=proto)
    assert r.status_code == 413 and "serve.max_request_mb" in r.json()["detail"]
    # a token id outside the vocabulary, through the SDK
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, 5, 99]),
        loss_fn_inputs={"target_tokens": [5, 99, 2], "weights": [1.0, 1.0, 1.0]},
    )
    with pytest.raises(tinker.BadRequestError, match=r"model_input\[2\] = 99 is outside the vocabulary"):
        tc.forward_backward([bad], "cross_entropy").result()
    # a wrong model id
    r = raw(server, "POST", "/api/v1/optim_step", json={"model_id": "nope:train:0", "adam_params": {}})
    assert r.status_code == 404 and "unknown model_id 'nope:train:0'" in r.json()["detail"]
    # an unsupported loss, an unsupported route
    with pytest.raises(tinker.BadRequestError, match="'dro' is refused"):
        tc.forward_backward(batch, "dro").result()
    with pytest.raises(tinker.NotFoundError, match="training_runs is not supported by dualrl serve"):
        tinker.RestClient(base_url=server.base_url, api_key=API_KEY).list_training_runs().result()

    assert all(np.array_equal(a, b) for a, b in zip(before, forward_logprobs(trainer, batch), strict=True))
    # The step trains on the one good forward_backward: its loss is that call's.
    step = tc.optim_step(tinker_client.adam(1e-3)).result()
    assert step.metrics["loss:sum"] == pytest.approx(good, rel=1e-5) and step.metrics["num_datums:sum"] == len(batch)


def test_api_key(server):
    for key in (None, "tml-wrong"):
        r = raw(server, "POST", "/api/v1/create_session", key=key, json={})
        assert r.status_code == 401 and "API key" in r.json()["detail"]


def test_one_model_at_a_time_and_closed_sessions(server, trainer):
    tc, tokenizer = trainer
    other = service_client(server)
    with pytest.raises(tinker.BadRequestError, match="one model at a time"):
        other.create_lora_training_client(MODEL, rank=4, train_unembed=False).result()
    with pytest.raises(tinker.BadRequestError, match="train_unembed=True"):
        other.create_lora_training_client(MODEL, rank=4).result()
    session = other.holder.get_session_id()
    other.close("success").result()
    r = raw(server, "POST", "/api/v1/session_heartbeat", json={"session_id": session})
    assert r.status_code == 410 and "is closed" in r.json()["detail"]
    body = {"session_id": session, "model_seq_id": 1, "base_model": MODEL}
    assert raw(server, "POST", "/api/v1/create_model", json=body).status_code == 410
    # The first session's model is untouched.
    assert tc.forward(data(tokenizer), "cross_entropy").result().metrics["loss:sum"] > 0
