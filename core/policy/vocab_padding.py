"""Vocabulary padding for tensor parallelism (Megatron style), the same for every backend.

Tensor parallelism shards the embedding and the output layer over the vocabulary, so the
vocabulary must divide by ``tp``.  Real checkpoints often do not (GPT-2's 50257, a 301-token
test model): instead of refusing them, the training copy of both matrices is padded with
zero rows up to :func:`padded_vocab_size`; the padded logits are masked to ``-inf`` before
any softmax (so they carry no probability, are never sampled and get no gradient), and
everything that leaves the backend -- HF export, refit into the generation engine, the
reference logprobs -- carries the original ``vocab_size`` rows only.
"""

from __future__ import annotations

__all__ = ["padded_vocab_size"]


def padded_vocab_size(vocab_size: int, tp: int = 1, make_divisible_by: int = 1) -> int:
    """The smallest size ``>= vocab_size`` divisible by ``tp`` and by ``make_divisible_by``."""
    for name, value in (("vocab_size", vocab_size), ("tp", tp), ("make_divisible_by", make_divisible_by)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"padded_vocab_size: {name} must be a positive int, got {value!r}")
    import math

    multiple = tp * make_divisible_by // math.gcd(tp, make_divisible_by)
    return -(-vocab_size // multiple) * multiple
