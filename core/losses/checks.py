"""Input checks shared by the losses: bad data fails loudly, naming the loss, key and shape.

Shape checks always run (shapes are static, also under ``jax.jit``).  Value checks
(finite numbers, token ids inside the vocabulary) need concrete arrays: they run on torch
tensors and on jax arrays outside ``jit``; a jitted caller runs them at its boundary with
``LossInputChecker.check_values`` on the host batch before tracing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from core.kernels.ops import ops_for


class LossInputError(ValueError):
    """Raised for a batch a loss cannot be computed on; the message names the culprit."""


def _shape(x) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


class LossInputChecker:
    """Validates the ``data`` a loss receives.

    Args:
        loss_name: used as the prefix of every message.
        per_token_keys: keys that must be [B, S] like ``input_ids`` (aligned like
            ``get_logprobs`` output: column 0 unused).
        finite_keys: per-token float keys whose valid positions must be finite.
    """

    def __init__(self, loss_name: str, per_token_keys: Sequence[str], finite_keys: Sequence[str]):
        self.loss_name = loss_name
        self.per_token_keys = tuple(per_token_keys)
        self.finite_keys = tuple(finite_keys)

    def fail(self, message: str) -> None:
        raise LossInputError(f"{self.loss_name}: {message}")

    def required_keys(self) -> tuple[str, ...]:
        return ("input_ids", *self.per_token_keys, "sample_mask")

    def check_shapes(self, logits, data: Mapping[str, Any]) -> tuple[int, int]:
        """Keys present, per-token keys [B, S], sample_mask [B], logits [B, S, V]; returns (B, S)."""
        missing = [k for k in self.required_keys() if k not in data]
        if missing:
            self.fail(f"data is missing key(s) {missing}; it has {sorted(data.keys())}")
        ids_shape = _shape(data["input_ids"])
        if len(ids_shape) != 2:
            self.fail(f"data['input_ids'] must be [B, S], got shape {ids_shape}")
        batch, seq = ids_shape
        if batch == 0:
            self.fail("empty batch: data['input_ids'] has 0 rows")
        if seq < 2:
            self.fail(
                f"sequences need at least 2 tokens to score a next token, data['input_ids'] has shape {ids_shape}"
            )
        for key in self.per_token_keys:
            if _shape(data[key]) != ids_shape:
                self.fail(f"data[{key!r}] has shape {_shape(data[key])} but data['input_ids'] has shape {ids_shape}")
        if _shape(data["sample_mask"]) != (batch,):
            self.fail(f"data['sample_mask'] must have shape ({batch},), got {_shape(data['sample_mask'])}")
        if logits is not None:
            lshape = _shape(logits)
            if len(lshape) != 3 or lshape[:2] != ids_shape:
                self.fail(f"next_token_logits must be [B, S, V] = [{batch}, {seq}, V], got shape {lshape}")
        return batch, seq

    def check_values(self, data: Mapping[str, Any], vocab_size: int | None = None) -> None:
        """Finite values where the loss reads them; token ids in [0, vocab_size).

        One device->host sync on the happy path (a single count of every problem); the
        culprit is looked up only when that count is non-zero.  Silently skipped for traced
        (jitted) arrays, whose values are unknown.
        """
        ids = data["input_ids"]
        ops = ops_for(ids)
        if not ops.is_concrete(ids):
            return
        valid = self._valid_positions(ops, data)

        def n_bad_values(key):
            return ops.count_true(valid & ~ops.isfinite(data[key][:, 1:]))

        keys = [k for k in self.finite_keys if ops.is_concrete(data[k])]
        counts = [n_bad_values(k) for k in keys]
        if vocab_size is not None:
            counts.append(ops.count_true((ids < 0) | (ids >= vocab_size)))
        if not counts or ops.to_python(sum(counts)) == 0:
            return
        for key in keys:
            if ops.to_python(n_bad_values(key)) > 0:
                self.fail(f"data[{key!r}] has non-finite values at valid (masked-in) positions")
        lo, hi = ops.to_python(ids.min()), ops.to_python(ids.max())
        self.fail(f"data['input_ids'] has token ids in [{lo}, {hi}] outside the vocabulary [0, {vocab_size})")

    def _valid_positions(self, ops, data):
        """Boolean [B, S-1]: token_mask (if present) and sample_mask both on."""
        sample = ops.expand_dims(data["sample_mask"], -1) != 0
        if "token_mask" in data:
            return (data["token_mask"][:, 1:] != 0) & sample
        return sample & (ops.ones_like(data["input_ids"][:, 1:]) != 0)

    def __call__(self, logits, data: Mapping[str, Any]) -> tuple[int, int]:
        batch_seq = self.check_shapes(logits, data)
        vocab = None if logits is None else int(logits.shape[-1])
        if logits is not None and not ops_for(logits).is_concrete(logits):
            # under jit the host-side caller is responsible for check_values
            return batch_seq
        self.check_values(data, vocab)
        return batch_seq
