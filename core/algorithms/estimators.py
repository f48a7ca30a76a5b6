"""Per-prompt estimators of ``dualrl eval`` and GRPO's sampled validation, and the bootstrap
confidence interval of their mean over prompts.

Each estimator takes one prompt's n scored samples and returns the expected score of k of
them drawn at random without replacement -- an unbiased estimate of the score of k fresh
samples that uses all n samples for every k <= n:

* pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): some of
  the k is correct; ``1 - C(n-c, k) / C(n, k)`` for c correct samples, computed as
  ``prod_{i=n-c+1}^{n} (1 - k/i)``, which never forms the (huge) binomials.
* mean@k: the share of correct samples among the k, whose expectation is c / n for every k
  (listed per k so that the three curves share the axes of a table and a plot).
* maj@k: the k samples vote with their answers (``answers[i]``: the environment's
  comparable answer, ``info["answer"]``; None abstains); the score is the correctness of the
  most-voted answer, a tie broken uniformly at random, 0 when no sample answers.  Its
  expectation over all C(n, k) subsets is counted exactly (:func:`maj_at_k`).

Nothing here imports torch; numpy only.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

#: Bootstrap resamples of the prompts behind every confidence interval.
BOOTSTRAP_RESAMPLES = 1000
#: Seed of the resampling (fixed: the same samples always give the same interval).
BOOTSTRAP_SEED = 0
#: Coverage of the intervals (percentile bootstrap).
CONFIDENCE = 0.95
#: Largest n maj@k counts exactly: C(n, k) must stay finite in float64 (C(1000, 500) ~ 1e299).
MAJ_MAX_SAMPLES = 1000


def check_k(k: int, n: int) -> None:
    """k must be in 1..n: an estimate of k samples needs at least k of them."""
    if not 1 <= k <= n:
        raise ValueError(f"k={k}: needs 1 <= k <= n, the number of samples per prompt ({n})")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k of a prompt with ``c`` correct of ``n`` samples."""
    check_k(k, n)
    if not 0 <= c <= n:
        raise ValueError(f"c={c} correct samples: needs 0 <= c <= n ({n})")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_at_k(n: int, c: int, k: int) -> float:
    """Expected share of correct samples among k of the n: c / n (see the module docstring)."""
    check_k(k, n)
    return c / n


@dataclass(frozen=True)
class _Votes:
    """One prompt's samples grouped by answer: each answer's count and correctness."""

    counts: tuple[int, ...]
    correctness: tuple[float, ...]  # mean correct flag of the answer's samples (0 or 1 for a verifier)
    abstentions: int


def _group(answers: Sequence[Hashable | None], correct: Sequence[bool]) -> _Votes:
    flags: dict[Hashable, list[bool]] = defaultdict(list)
    for answer, ok in zip(answers, correct, strict=True):
        if answer is not None:
            flags[answer].append(bool(ok))
    groups = list(flags.values())
    return _Votes(
        tuple(len(g) for g in groups), tuple(sum(g) / len(g) for g in groups), len(answers) - sum(map(len, groups))
    )


def maj_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> float:
    """Expected majority-vote correctness of k of the prompt's samples (module docstring).

    Counting: for each possible winning count t, a recursion over the answers tracks the
    weighted number of ways to pick ``total`` samples with every answer picked at most t
    times, ``ties`` answers exactly t times (``ways[total, ties]``), and the same weighted
    by the summed correctness of those tied answers (``value``).  A full pick (total k)
    with ties >= 1 scores value / ties: a uniformly broken tie.
    """
    n = len(answers)
    check_k(k, n)
    if n > MAJ_MAX_SAMPLES:
        raise ValueError(f"maj@k is counted exactly up to {MAJ_MAX_SAMPLES} samples per prompt, got {n}")
    votes = _group(answers, correct)
    largest = max(votes.counts, default=0)
    expected = sum(_wins_at(t, votes, k) for t in range(1, min(k, largest) + 1))
    return expected / math.comb(n, k)


def _wins_at(t: int, votes: _Votes, k: int) -> float:
    """Summed score of the k-subsets whose most-voted answers have exactly t votes."""
    ways = np.zeros((k + 1, k // t + 1))  # at most k // t answers can tie at t
    value = np.zeros_like(ways)
    ways[0, 0] = 1.0
    for count, quality in zip(votes.counts, votes.correctness, strict=True):
        ways, value = _add_answer(ways, value, count, quality, t, k)
    ways, value = _add_answer(ways, value, votes.abstentions, 0.0, k + 1, k)  # never a vote, never a tie
    ties = np.arange(ways.shape[1])
    return float(np.sum(value[k, 1:] / ties[1:]))


def _add_answer(
    ways: np.ndarray, value: np.ndarray, count: int, quality: float, t: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The recursion's step: picking s <= min(count, t) of an answer's ``count`` samples."""
    new_ways, new_value = np.zeros_like(ways), np.zeros_like(value)
    for s in range(min(count, t, k) + 1):
        weight = math.comb(count, s)
        src_ways, src_value = ways[: k + 1 - s], value[: k + 1 - s]
        if s == t:  # this answer ties at the top: one more tie, its correctness joins the sum
            new_ways[s:, 1:] += weight * src_ways[:, :-1]
            new_value[s:, 1:] += weight * (src_value[:, :-1] + quality * src_ways[:, :-1])
        else:
            new_ways[s:] += weight * src_ways
            new_value[s:] += weight * src_value
    return new_ways, new_value


class Bootstrap:
    """Percentile bootstrap over prompts: ``BOOTSTRAP_RESAMPLES`` resamples of the prompt
    indices (with replacement, seed ``BOOTSTRAP_SEED``), shared by every metric of a report so
    that the intervals of two metrics come from the same resamples."""

    def __init__(self, num_prompts: int, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> None:
        if num_prompts < 1:
            raise ValueError("a confidence interval needs at least one prompt")
        rng = np.random.default_rng(seed)
        self.indices = rng.integers(0, num_prompts, size=(resamples, num_prompts))

    def interval(self, per_prompt: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
        """(low, high) of the mean of ``per_prompt`` (one value per prompt)."""
        values = np.asarray(per_prompt, dtype=np.float64)
        if values.shape != (self.indices.shape[1],):
            raise ValueError(f"expected one value per prompt ({self.indices.shape[1]}), got shape {values.shape}")
        means = values[self.indices].mean(axis=1)
        tail = (1.0 - confidence) / 2 * 100
        low, high = np.percentile(means, [tail, 100 - tail])
        return float(low), float(high)
