"""The two results the SDK reads as protobuf (``ForwardBackwardOutput``, ``SampleResponse``:
it asks for them with ``Accept: application/x-protobuf`` and refuses them as JSON), encoded
with the SDK's own message classes.  Every other result is JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from tinker.proto import tinker_public_pb2 as public_pb

PROTOBUF = "application/x-protobuf"


def forward_backward_output(outputs: Sequence[Mapping[str, np.ndarray]], metrics: Mapping[str, float]) -> bytes:
    """One ``ArrayRecord`` of per-datum float32 vectors (``logprobs``, ``elementwise_loss``)."""
    record = public_pb.ArrayRecord(num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        arrays = [np.ascontiguousarray(out[name], dtype=np.float32).reshape(-1) for out in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
        record.fields[name].CopyFrom(
            public_pb.BatchedTensor(
                data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=public_pb.DTYPE_FLOAT32
            )
        )
    msg = public_pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=dict(metrics))
    msg.loss_fn_outputs.append(record)
    return msg.SerializeToString()


@dataclass(frozen=True)
class SampledSequence:
    """One completion: its tokens, their logprobs, and why it ended ("stop" or "length")."""

    tokens: np.ndarray
    logprobs: np.ndarray
    stop_reason: str


def sample_response(sequences: Sequence[SampledSequence], prompt_logprobs: np.ndarray | None) -> bytes:
    """``prompt_logprobs``: one float per prompt token, NaN where not scored (position 0)."""
    msg = public_pb.SampleResponse()
    for seq in sequences:
        reason = public_pb.STOP_REASON_STOP if seq.stop_reason == "stop" else public_pb.STOP_REASON_LENGTH
        msg.sequences.append(
            public_pb.SampledSequence(
                stop_reason=reason,
                tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
                logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes(),
            )
        )
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
