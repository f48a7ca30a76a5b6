"""A ``forward_backward`` / ``forward`` request (the SDK's protobuf) -> dualrl training rows.

A Tinker datum is ``model_input`` (N tokens) with ``loss_fn_inputs`` of N values per key,
position i predicting ``target_tokens[i]``.  dualrl's rows hold whole sequences in the
``get_logprobs`` layout (column i scores token i), so a datum becomes the sequence
``model_input + [target_tokens[-1]]`` with its N per-token values in columns 1..N.  That is
exact when the targets are the next tokens (``target_tokens[i] == model_input[i + 1]``, how
the SDK's and the cookbook's helpers build every datum); other targets are refused by name.

Everything is checked here, before the request is queued: the loss and its config keys, the
input keys and their shapes and dtypes, finite values, token ids in the vocabulary, the
sequence length.  A refusal names the datum, the key and the position.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as public_pb

from core.data import BatchedDataDict
from core.losses.tinker_losses import DEFAULT_CLIP, TINKER_LOSSES, loss_kind
from core.tinker_api.errors import bad_request

#: The ``loss_fn_inputs`` keys each loss needs, and the optional ones it reads.
REQUIRED_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
}
CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")
OPTIONAL_INPUTS = {"ppo": CLIP_KEYS, "cispo": CLIP_KEYS}
#: ``loss_fn_config`` keys each loss reads (numbers).
CONFIG_KEYS = {"ppo": CLIP_KEYS, "cispo": CLIP_KEYS}
#: Losses of the SDK's list this server does not compute, and why.
REFUSED_LOSSES = {
    "dro": "not implemented",
    "gspo": "not implemented",
    "stable_reinforce": "not implemented (it needs the sampler's recorded stability information)",
    "custom": (
        "server-side custom losses are not supported: the server's client config keeps "
        "custom_loss_server_side off, so forward_backward_custom runs the loss in the client "
        "(a forward, then a cross_entropy step with its gradient as weights)"
    ),
}
_DTYPES = {public_pb.DTYPE_FLOAT32: np.float32, public_pb.DTYPE_INT64: np.int64, public_pb.DTYPE_INT32: np.int64}


@dataclass(frozen=True)
class DatumLimits:
    """What every datum must fit."""

    vocab_size: int
    max_sequence_length: int
    """policy.max_total_sequence_length: a datum's N + 1 tokens."""
    max_datums: int


@dataclass(frozen=True)
class ForwardBackwardRequest:
    """A decoded, checked ``forward_backward`` (or ``forward``: ``forward_only``) request."""

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    rows: BatchedDataDict
    """One row per datum (``TinkerLoss``'s keys)."""
    target_counts: list[int]
    """N of each datum (its number of target tokens)."""


def decode_forward_backward(body: bytes, limits: DatumLimits) -> ForwardBackwardRequest:
    """The request in ``body`` (``tinker_public.ForwardBackwardRequest``), or a refusal."""
    msg = public_pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as err:
        raise bad_request(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({err})") from None
    what = "forward" if msg.forward_only else "forward_backward"
    loss_fn = _checked_loss(msg.loss_fn, what)
    config = _loss_config(msg, loss_fn, what)
    if not 0 < len(msg.data) <= limits.max_datums:
        raise bad_request(
            f"{what}: {len(msg.data)} datums; a request carries 1 to {limits.max_datums} (serve.max_datums_per_request)"
        )
    parsed = [_datum(d, i, loss_fn, config, limits, what) for i, d in enumerate(msg.data)]
    rows = _rows(parsed, loss_fn)
    return ForwardBackwardRequest(
        msg.model_id, msg.seq_id, loss_fn, msg.forward_only, rows, [len(p[1]) for p in parsed]
    )


def _checked_loss(name: str, what: str) -> str:
    if name in TINKER_LOSSES:
        return name
    if name in REFUSED_LOSSES:
        raise bad_request(f"{what}: loss_fn {name!r} is refused by dualrl serve: {REFUSED_LOSSES[name]}")
    raise bad_request(f"{what}: unknown loss_fn {name!r}; dualrl serve computes {list(TINKER_LOSSES)}")


def _loss_config(msg: public_pb.ForwardBackwardRequest, loss_fn: str, what: str) -> dict[str, float]:
    """``loss_fn_config`` (the v2 map where set, else the legacy float map), checked."""
    raw: dict[str, float | str] = {}
    for key, value in msg.loss_fn_config_v2.items():
        raw[key] = value.text if value.WhichOneof("value") == "text" else value.number
    if not raw:
        raw = dict(msg.loss_fn_config.items())
    allowed = CONFIG_KEYS.get(loss_fn, ())
    config: dict[str, float] = {}
    for key, value in raw.items():
        if key not in allowed:
            reads = f"reads {list(allowed)}" if allowed else "reads no loss_fn_config"
            raise bad_request(f"{what}: loss_fn_config[{key!r}] is not a setting of {loss_fn!r} (it {reads})")
        if isinstance(value, str) or not np.isfinite(value):
            raise bad_request(f"{what}: loss_fn_config[{key!r}] = {value!r} must be a finite number")
        config[key] = float(value)
    low, high = config.get(CLIP_KEYS[0], DEFAULT_CLIP[0]), config.get(CLIP_KEYS[1], DEFAULT_CLIP[1])
    if loss_fn in CONFIG_KEYS and not 0 <= low <= 1 <= high:
        raise bad_request(
            f"{what}: loss_fn_config clip thresholds must satisfy 0 <= low <= 1 <= high, got {low}, {high}"
        )
    return config


def _datum(
    datum: public_pb.Datum, index: int, loss_fn: str, config: Mapping[str, float], limits: DatumLimits, what: str
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """``(model_input [N], target_tokens [N], {key: [N] float32})`` of one datum, checked."""
    where = f"{what}: data[{index}]"
    if len(datum.model_input_spans) or len(datum.loss_fn_input_spans):
        raise bad_request(f"{where}: provenance spans (StableReinforce) are not supported")
    tokens = _model_input_tokens(datum, where)
    inputs = dict(datum.loss_fn_inputs.items())
    required, optional = REQUIRED_INPUTS[loss_fn], OPTIONAL_INPUTS.get(loss_fn, ())
    missing = [k for k in required if k not in inputs]
    extra = sorted(k for k in inputs if k not in required and k not in optional)
    if missing or extra:
        problem = f"is missing {missing}" if missing else f"has keys {extra} that {loss_fn!r} does not read"
        raise bad_request(f"{where}.loss_fn_inputs {problem} (it takes {list(required) + list(optional)})")
    n = len(tokens)
    targets = _tensor(inputs["target_tokens"], f"{where}.loss_fn_inputs['target_tokens']", (n,), integer=True)
    _check_tokens(tokens, targets, where, limits)
    columns = {key: _tensor(inputs[key], f"{where}.loss_fn_inputs[{key!r}]", (n,)) for key in required[1:]}
    for key, default in zip(CLIP_KEYS, DEFAULT_CLIP, strict=True):
        if loss_fn in OPTIONAL_INPUTS:
            value = inputs.get(key)
            given = _tensor(value, f"{where}.loss_fn_inputs[{key!r}]", (n,), scalar=True) if value is not None else None
            columns[key] = np.broadcast_to(given if given is not None else config.get(key, default), (n,))
    return tokens, targets, columns


def _model_input_tokens(datum: public_pb.Datum, where: str) -> np.ndarray:
    parts = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise bad_request(
                f"{where}.model_input.chunks[{j}] is a {kind} chunk; dualrl serve trains on text tokens only"
            )
        if len(chunk.encoded_text.tokens) % 4:
            raise bad_request(f"{where}.model_input.chunks[{j}]: token bytes are not int32 values")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).astype(np.int64))
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if tokens.size == 0:
        raise bad_request(f"{where}.model_input is empty")
    return tokens


def _check_tokens(tokens: np.ndarray, targets: np.ndarray, where: str, limits: DatumLimits) -> None:
    n = len(tokens)
    if n + 1 > limits.max_sequence_length:
        raise bad_request(
            f"{where}: {n} input tokens + the last target = {n + 1} tokens, more than "
            f"policy.max_total_sequence_length={limits.max_sequence_length}"
        )
    for name, ids in (("model_input", tokens), ("loss_fn_inputs['target_tokens']", targets)):
        bad = np.flatnonzero((ids < 0) | (ids >= limits.vocab_size))
        if bad.size:
            raise bad_request(
                f"{where}.{name}[{bad[0]}] = {ids[bad[0]]} is outside the vocabulary [0, {limits.vocab_size})"
            )
    shifted = np.flatnonzero(targets[:-1] != tokens[1:])
    if shifted.size:
        i = int(shifted[0])
        raise bad_request(
            f"{where}.loss_fn_inputs['target_tokens'][{i}] = {targets[i]} but model_input[{i + 1}] = {tokens[i + 1]}: "
            "dualrl serve trains next-token targets (target_tokens[i] == model_input[i + 1], as the SDK's "
            "datum helpers build them)"
        )


def _tensor(
    msg: public_pb.Tensor, where: str, shape: tuple[int, ...], integer: bool = False, scalar: bool = False
) -> np.ndarray:
    """A dense tensor of ``shape`` (or, with ``scalar``, one value), finite, as int64 or float32."""
    if msg.WhichOneof("encoding") != "dense":
        raise bad_request(f"{where}: sparse (CSR) tensors are not supported; send it dense and 1-D")
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None or (integer and dtype is np.float32):
        want = "int64" if integer else "float32"
        raise bad_request(f"{where}: dtype {public_pb.DType.Name(msg.dtype)} is not supported; send {want}")
    width = 4 if msg.dtype in (public_pb.DTYPE_FLOAT32, public_pb.DTYPE_INT32) else 8
    raw = np.int32 if msg.dtype == public_pb.DTYPE_INT32 else dtype
    if len(msg.dense) % width:
        raise bad_request(f"{where}: {len(msg.dense)} bytes is not a whole number of values")
    values = np.frombuffer(msg.dense, dtype=raw).astype(dtype)
    declared = tuple(msg.shape) or (values.size,)
    if int(np.prod(declared)) != values.size:
        raise bad_request(f"{where}: shape {list(declared)} does not hold its {values.size} values")
    if not (declared == shape or (scalar and values.size == 1)):
        expected = f"{list(shape)} (one value per target token)" + (" or one value" if scalar else "")
        raise bad_request(f"{where}: shape {list(declared)}, expected {expected}")
    if not integer and not np.all(np.isfinite(values)):
        raise bad_request(f"{where}[{int(np.flatnonzero(~np.isfinite(values))[0])}] is not finite")
    return values.reshape(-1) if values.size > 1 or not scalar else values.reshape(())


def _rows(parsed: list[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]], loss_fn: str) -> BatchedDataDict:
    """The datums as right-padded rows of ``TinkerLoss``'s keys (values in columns 1..N)."""
    width = max(len(tokens) + 1 for tokens, _, _ in parsed)
    b = len(parsed)
    ids = np.zeros((b, width), np.int64)
    cols = {k: np.zeros((b, width), np.float32) for k in ("token_mask", *_COLUMN_OF.values())}
    for i, (tokens, targets, columns) in enumerate(parsed):
        n = len(tokens)
        ids[i, :n] = tokens
        ids[i, n] = targets[-1]
        cols["token_mask"][i, 1 : n + 1] = 1.0
        for key, column in _COLUMN_OF.items():
            if key in columns:
                cols[column][i, 1 : n + 1] = columns[key]
    out: BatchedDataDict[Any] = BatchedDataDict(
        input_ids=torch.from_numpy(ids),
        input_lengths=torch.tensor([len(t) + 1 for t, _, _ in parsed], dtype=torch.int64),
        sample_mask=torch.ones(b, dtype=torch.float32),
        loss_kind=torch.full((b,), loss_kind(loss_fn), dtype=torch.int64),
    )
    for key, value in cols.items():
        out[key] = torch.from_numpy(value)
    return out


#: ``loss_fn_inputs`` key -> the ``TinkerLoss`` column it fills.
_COLUMN_OF = {
    "weights": "target_weights",
    "advantages": "advantages",
    "logprobs": "sampling_logprobs",
    "clip_low_threshold": "clip_low",
    "clip_high_threshold": "clip_high",
}
