"""Requests as the tinker SDK writes them (its own protobuf encoder and request types) -> the
server's checked rows, and every refusal naming the datum, key and position (no server)."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from core.tinker_api.datums import DatumLimits, decode_forward_backward
from core.tinker_api.errors import RequestError
from core.tinker_api.sampling import SampleLimits, check_sample_request

LIMITS = DatumLimits(vocab_size=32, max_sequence_length=16, max_datums=8)
SAMPLE_LIMITS = SampleLimits(vocab_size=32, max_sequence_length=16, max_new_tokens=6, max_samples=8, eos_ids=(2,))


def body(data: list[types.Datum], loss_fn: str = "cross_entropy", config=None, forward_only=False) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s:train:0",
        seq_id=1,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def datum(tokens=(1, 5, 6, 14), **inputs) -> types.Datum:
    full = list(tokens)
    n = len(full) - 1
    fields = {"target_tokens": full[1:], "weights": [0.0] * (n - 1) + [1.0]}
    fields.update(inputs)
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs=fields)


def rl_datum(tokens=(1, 5, 6, 14), **extra) -> types.Datum:
    n = len(tokens) - 1
    inputs = {
        "target_tokens": list(tokens[1:]),
        "logprobs": [0.0] * (n - 1) + [-1.5],
        "advantages": [0.0] * (n - 1) + [1.0],
    }
    inputs.update(extra)
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens[:-1])), loss_fn_inputs=inputs)


def refused(raw: bytes, *words: str, status: int = 400) -> str:
    with pytest.raises(RequestError) as info:
        decode_forward_backward(raw, LIMITS)
    assert info.value.status == status
    for word in words:
        assert word in info.value.message, info.value.message
    return info.value.message


def test_datums_become_whole_sequences_with_values_on_their_targets():
    req = decode_forward_backward(body([datum(), datum((1, 7, 2))]), LIMITS)
    rows = req.rows
    assert req.loss_fn == "cross_entropy" and not req.forward_only and req.target_counts == [3, 2]
    assert rows["input_ids"].tolist() == [[1, 5, 6, 14], [1, 7, 2, 0]]
    assert rows["input_lengths"].tolist() == [4, 3]
    assert rows["token_mask"].tolist() == [[0, 1, 1, 1], [0, 1, 1, 0]]
    assert rows["target_weights"].tolist() == [[0, 0, 0, 1], [0, 0, 1, 0]]


def test_ppo_clip_thresholds_from_the_config_or_the_datum():
    req = decode_forward_backward(
        body([rl_datum(), rl_datum(clip_low_threshold=[0.5])], "ppo", {"clip_high_threshold": 1.5}), LIMITS
    )
    np.testing.assert_allclose(req.rows["clip_low"][:, 1:], [[0.8] * 3, [0.5] * 3])
    np.testing.assert_allclose(req.rows["clip_high"][0, 1:], [1.5] * 3)
    assert req.rows["sampling_logprobs"][0].tolist() == [0, 0, 0, -1.5]


def test_malformed_body():
    refused(b"\xff\x00 not a protobuf", "not a ForwardBackwardRequest protobuf")


def test_token_outside_the_vocabulary():
    refused(body([datum(), datum((1, 5, 40, 3))]), "data[1].model_input[2] = 40", "outside the vocabulary [0, 32)")


def test_targets_must_be_the_next_tokens():
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, 5, 6]),
        loss_fn_inputs={"target_tokens": [5, 9, 7], "weights": [1, 1, 1]},
    )
    refused(body([bad]), "target_tokens'][1] = 9 but model_input[2] = 6", "next-token targets")


def test_keys_shapes_and_values():
    refused(body([rl_datum()], "cross_entropy"), "missing ['weights']")
    mask = types.TensorData(data=[1.0, 1.0, 1.0], dtype="float32", shape=[3])
    refused(body([datum(mask=mask)]), "keys ['mask']")
    refused(body([datum(weights=[1.0, 1.0])]), "data[0].loss_fn_inputs['weights']: shape [2], expected [3]")
    refused(body([datum(weights=[1.0, float("nan"), 1.0])]), "loss_fn_inputs['weights'][1] is not finite")


def test_losses_and_config():
    refused(body([datum()], "dro"), "'dro' is refused")
    refused(body([rl_datum()], "ppo", {"beta": 0.1}), "loss_fn_config['beta'] is not a setting of 'ppo'")
    refused(body([datum()], "cross_entropy", {"clip_low_threshold": 0.5}), "reads no loss_fn_config")
    refused(body([rl_datum()], "ppo", {"clip_low_threshold": 1.5}), "0 <= low <= 1 <= high")


def test_lengths_and_counts():
    refused(body([datum(tuple(range(1, 18)))]), "17 tokens, more than policy.max_total_sequence_length=16")
    refused(body([datum()] * 9), "9 datums", "serve.max_datums_per_request")


def sample(prompt=(1, 5, 6), num_samples=2, **params) -> types.SampleRequest:
    return types.SampleRequest(
        prompt=types.ModelInput.from_ints(list(prompt)),
        num_samples=num_samples,
        sampling_params=types.SamplingParams(**params),
        sampling_session_id="s:sample:0",
        seq_id=0,
    )


def test_sample_requests():
    job = check_sample_request(sample(max_tokens=4, seed=5, stop=[2]), SAMPLE_LIMITS)
    assert (job.max_tokens, job.greedy, job.seed, job.stop_strings) == (4, False, 5, ())
    assert check_sample_request(sample(temperature=0.0, stop="="), SAMPLE_LIMITS).greedy
    assert check_sample_request(sample(prompt=range(1, 13)), SAMPLE_LIMITS).max_tokens == 4  # the room left
    for request, words in [
        (sample(temperature=0.7), "temperature=0.7"),
        (sample(top_p=0.9), "top_p"),
        (sample(stop=[5]), "stop token ids [5] are not end-of-sequence ids [2]"),
        (sample(max_tokens=7), "max_tokens=7"),
        (sample(num_samples=9), "num_samples=9"),
        (sample(prompt=(1, 99)), "prompt token [1] = 99"),
        (sample(prompt=range(1, 17)), "no room"),
    ]:
        with pytest.raises(RequestError) as info:
            check_sample_request(request, SAMPLE_LIMITS)
        assert info.value.status == 400 and words in info.value.message, info.value.message
    assert np.array_equal(check_sample_request(sample(), SAMPLE_LIMITS).prompt, [1, 5, 6])
