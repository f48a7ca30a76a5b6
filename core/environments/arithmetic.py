"""The built-in task: integer arithmetic prompts generated on the fly, exact-answer reward.

A problem is ``"12+7="`` with answer ``"19"``.  Problems are a pure function of the
settings, a seed and an index, so training and validation sets need no files, every
process (driver, Ray workers, a resumed run) sees the same problem ``i``, and a run is
reproducible from its config alone.

Settings: ``env.arithmetic`` (``core.environments.config.ArithmeticTaskConfig``: every key optional).

Expressions follow Python's precedence (``*`` before ``+``/``-``), so ``eval`` of the
prompt without its ``=`` gives the answer.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping
from typing import Any

import numpy as np

from core.environments.config import SUPPORTED_OPERATIONS, ArithmeticTaskConfig, EnvConfig
from core.environments.interfaces import AnswerCheckingEnvironment, env_subsection

__all__ = ["ArithmeticTask", "ArithmeticEnvironment"]

# With allow_negative false a draw can paint itself into a corner (min_value > 0 and the
# running total already below it); such a draw is discarded and the next one tried.
_MAX_ATTEMPTS = 1000
# Problems generated at construction to reject settings that cannot produce any problem.
_PROBE_PROBLEMS = 8


class ArithmeticTask:
    """Generates problems from validated settings (see the module docstring)."""

    def __init__(
        self, cfg: ArithmeticTaskConfig | Mapping[str, Any] | None = None, path: str = "env.arithmetic"
    ) -> None:
        self.settings = ArithmeticTaskConfig.coerce({} if cfg is None else cfg, path)
        self.path = path
        self.min_value: int = self.settings.min_value
        self.max_value: int = self.settings.max_value
        self.num_operands: int = self.settings.num_operands
        self.operations: list[str] = list(self.settings.operations)
        self.allow_negative: bool = self.settings.allow_negative
        self._num_distinct: int | None = None
        for index in range(_PROBE_PROBLEMS):
            self.problem(0, index)

    # ------------------------------------------------------------------ problems
    def problem(self, seed: int, index: int) -> dict[str, str]:
        """Problem ``index`` of the stream ``seed``: ``{"prompt": "12+7=", "answer": "19"}``."""
        _require_int(seed, "seed")
        _require_int(index, "index")
        # A string seed goes through SHA-512 in random.seed (version 2), never through the
        # per-process salted hash(), so every process draws the same problem; and unlike
        # ``seed * K + index`` two (seed, index) pairs can never collide.
        rng = random.Random(f"arithmetic:{seed}:{index}")
        for _ in range(_MAX_ATTEMPTS):
            drawn = self._draw(rng)
            if drawn is not None:
                operands, ops = drawn
                answer = evaluate(operands, ops)
                return {"prompt": self.format_prompt(operands, ops), "answer": str(answer)}
        raise ValueError(
            f"{self.path}: no problem without a negative result found in {_MAX_ATTEMPTS} draws "
            f"(min_value={self.min_value}, max_value={self.max_value}, num_operands="
            f"{self.num_operands}, operations={self.operations}); lower min_value, raise "
            f"max_value, use fewer operands or set allow_negative: true"
        )

    def problems(self, seed: int, start: int, count: int) -> list[dict[str, str]]:
        """Problems ``start .. start+count-1`` of the stream ``seed``."""
        _require_int(start, "start")
        _require_int(count, "count")
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        return [self.problem(seed, start + i) for i in range(count)]

    def num_distinct_problems(self) -> int:
        """How many different prompts these settings can produce (computed once, cached)."""
        if self._num_distinct is None:
            self._num_distinct = self._count_problems()
        return self._num_distinct

    @staticmethod
    def format_prompt(operands: list[int], ops: list[str]) -> str:
        """``"12+7="``: operands and operators without spaces, then ``=``.

        A negative operand is parenthesised (``"3-(-4)="``) so that the prompt still reads
        as, and ``eval``s to, the intended expression.
        """
        if len(ops) != len(operands) - 1:
            raise ValueError(f"{len(operands)} operands need {len(operands) - 1} operators, got {len(ops)}")
        parts = [_format_operand(operands[0])]
        for op, value in zip(ops, operands[1:], strict=True):
            if op not in SUPPORTED_OPERATIONS:
                raise ValueError(f"unknown operation {op!r}; supported: {list(SUPPORTED_OPERATIONS)}")
            parts.append(op + _format_operand(value))
        return "".join(parts) + "="

    # ------------------------------------------------------------------ drawing
    def _draw(self, rng: random.Random) -> tuple[list[int], list[str]] | None:
        """One random problem, or ``None`` when this draw cannot avoid a negative total."""
        ops = [rng.choice(self.operations) for _ in range(self.num_operands - 1)]
        operands: list[int] = []
        total = 0
        for sign, size in _terms(ops):
            # Only a subtracted term can make the running total negative (operands are
            # >= 0 whenever allow_negative is false), so only it is bounded.
            bounded = sign == "-" and not self.allow_negative
            factors = self._draw_term(rng, size, cap=total if bounded else None)
            if factors is None:
                return None
            operands.extend(factors)
            total += math.prod(factors) if sign == "+" else -math.prod(factors)
        return operands, ops

    def _draw_term(self, rng: random.Random, size: int, cap: int | None) -> list[int] | None:
        """``size`` factors of one product term; with ``cap``, their product is <= cap."""
        lo, hi = self.min_value, self.max_value
        if cap is None:
            return [rng.randint(lo, hi) for _ in range(size)]
        factors: list[int] = []
        product = 1
        for j in range(size):
            # The smallest the factors still to come can make the product: lo ** remaining.
            floor_rest = product * lo ** (size - j - 1)
            top = hi if floor_rest == 0 else min(hi, cap // floor_rest)
            if top < lo:
                return None
            factors.append(rng.randint(lo, top))
            product *= factors[-1]
        return factors

    def _count_problems(self) -> int:
        """Exact size of the problem space (one prompt per operand/operator sequence)."""
        values = range(self.min_value, self.max_value + 1)
        if self.allow_negative or "-" not in self.operations:
            return len(self.operations) ** (self.num_operands - 1) * len(values) ** self.num_operands
        total = 0
        for ops in itertools.product(self.operations, repeat=self.num_operands - 1):
            terms = _terms(list(ops))
            if all(sign == "+" for sign, _ in terms):
                total += len(values) ** self.num_operands
            else:
                total += _count_nonnegative(terms, values)
        return total


class ArithmeticEnvironment(AnswerCheckingEnvironment):
    """Reward 1.0 when the completion, stripped, equals the ground-truth answer exactly."""

    name = "arithmetic"

    def __init__(self, cfg: EnvConfig | Mapping[str, Any] | None = None) -> None:
        # cfg is the whole `env` section; validating our sub-section here makes a bad
        # setting fail when the environment (or its pool) starts, not mid-training.
        self.task = ArithmeticTask(env_subsection(cfg, "arithmetic", ArithmeticTaskConfig), path="env.arithmetic")

    def judge(self, completion: str, ground_truth: str) -> tuple[bool, str | None]:
        """Exact answer: the completion, stripped, is the ground truth."""
        extracted = str(completion).strip()
        return extracted == ground_truth.strip(), extracted or None


# ---------------------------------------------------------------------- helpers
def evaluate(operands: list[int], ops: list[str]) -> int:
    """Value of the expression with ``*`` binding tighter than ``+``/``-`` (as Python)."""
    total, index = 0, 0
    for sign, size in _terms(ops):
        value = math.prod(operands[index : index + size])
        total += value if sign == "+" else -value
        index += size
    return total


def _terms(ops: list[str]) -> list[tuple[str, int]]:
    """Split an operator sequence into product terms: ``["+", "*"]`` -> ``[("+", 1), ("+", 2)]``."""
    signs, sizes = ["+"], [1]
    for op in ops:
        if op == "*":
            sizes[-1] += 1
        else:
            signs.append(op)
            sizes.append(1)
    return list(zip(signs, sizes, strict=True))


def _count_nonnegative(terms: list[tuple[str, int]], values: range) -> int:
    """How many operand sequences of one operator sequence (its product ``terms``) keep the
    running total >= 0 at every term's close, exactly as ``_draw`` checks it (operands >= 0).

    The distribution of the running total is a count per value (a dense array: totals are
    >= 0), each term's a count per product value; a closing term convolves them (``-``: with
    the totals it would make negative dropped).  The last term is only summed (a suffix sum for
    ``-``), so three operands up to 999 count in well under a second -- a dynamic programme over
    (total, open term) states had not finished after 8 minutes there."""
    counts = _product_counts(terms[0][1], values)
    for k, (sign, size) in enumerate(terms[1:], start=1):
        term = _product_counts(size, values)
        last = k == len(terms) - 1
        if sign == "+":
            if last:
                return int(counts.sum()) * int(term.sum())
            counts = np.convolve(counts, term)
        elif last:  # pairs (total T, term t) with t <= T: sum_t term[t] * #(T >= t)
            at_least = np.cumsum(counts[::-1])[::-1]
            n = min(len(term), len(at_least))
            return int((term[:n] * at_least[:n]).sum())
        else:  # new[v] = sum_t counts[v + t] * term[t], v >= 0
            counts = np.convolve(counts, term[::-1])[len(term) - 1 : len(term) - 1 + len(counts)]
    return int(counts.sum())


def _product_counts(size: int, values: range) -> np.ndarray:
    """``out[p]`` = how many sequences of ``size`` operands multiply to ``p`` (int64, dense)."""
    products, counts = np.array([1], dtype=np.int64), np.array([1], dtype=np.int64)
    factors = np.arange(values.start, values.stop, dtype=np.int64)
    for _ in range(size):
        products, inverse = np.unique(np.outer(products, factors).ravel(), return_inverse=True)
        counts = np.bincount(inverse, weights=np.repeat(counts, len(factors)), minlength=len(products))
        counts = counts.astype(np.int64)
    out = np.zeros(int(products[-1]) + 1, dtype=np.int64)
    out[products] = counts
    return out


def _format_operand(value: int) -> str:
    return f"({value})" if value < 0 else str(value)


def _require_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
