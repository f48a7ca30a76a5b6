"""pass@k, maj@k, mean@k and the bootstrap interval (core.algorithms.estimators) against hand
values and brute force over every k-subset of the samples."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from core.algorithms.estimators import Bootstrap, maj_at_k, mean_at_k, pass_at_k


def _subsets(n: int, k: int):
    return itertools.combinations(range(n), k)


def brute_pass(n: int, c: int, k: int) -> float:
    """Share of k-subsets holding a correct sample (samples 0..c-1 are the correct ones)."""
    hits = [any(i < c for i in s) for s in _subsets(n, k)]
    return sum(hits) / len(hits)


def brute_maj(answers, correct, k: int) -> float:
    """Mean over k-subsets of the majority answer's correctness, ties split evenly."""
    quality = {a: np.mean([c for b, c in zip(answers, correct, strict=True) if b == a]) for a in set(answers) - {None}}
    scores = []
    for subset in _subsets(len(answers), k):
        votes = Counter(answers[i] for i in subset if answers[i] is not None)
        top = max(votes.values(), default=0)
        winners = [a for a, v in votes.items() if v == top]
        scores.append(sum(quality[a] for a in winners) / len(winners) if winners else 0.0)
    return float(np.mean(scores))


# ----------------------------------------------------------------------------- pass@k
def test_pass_at_k_hand_values():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(5, 1, 1) == pytest.approx(0.2)
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - 21 / 45)  # 1 - C(7,2)/C(10,2)
    assert pass_at_k(4, 2, 3) == 1.0  # only 2 wrong samples: every 3 of them hold a right one
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0


def test_pass_at_k_is_the_share_of_subsets_with_a_correct_sample():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_where_the_binomials_are_huge():
    for n, c, k in [(2000, 3, 100), (1000, 1, 500), (10_000, 9_000, 10), (600, 0, 600)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15), (n, c, k)


@pytest.mark.parametrize("n, c, k", [(4, 1, 5), (4, 1, 0), (4, 5, 1), (4, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match=r"k=|c="):
        pass_at_k(n, c, k)


# ----------------------------------------------------------------------------- mean@k
def test_mean_at_k_is_the_expected_share_correct_in_k_samples_for_every_k():
    n, c = 7, 3
    for k in range(1, n + 1):
        brute = np.mean([sum(i < c for i in s) / k for s in _subsets(n, k)])
        assert mean_at_k(n, c, k) == pytest.approx(brute) == pytest.approx(c / n)
    with pytest.raises(ValueError, match="k=8"):
        mean_at_k(n, c, 8)


# ----------------------------------------------------------------------------- maj@k
def test_maj_at_k_hand_values():
    # a a b, with a right: one sample is right 2/3 of the time; of the 3 pairs, {a, a} wins
    # and the two {a, b} ties are won half of the time: (1 + 0.5 + 0.5) / 3; all three: a.
    answers, right = ["a", "a", "b"], [True, True, False]
    assert maj_at_k(answers, right, 1) == pytest.approx(2 / 3)
    assert maj_at_k(answers, right, 2) == pytest.approx(2 / 3)
    assert maj_at_k(answers, right, 3) == 1.0
    # The right answer in the minority loses the full vote.
    assert maj_at_k(["a", "b", "b"], [True, False, False], 3) == 0.0
    # A sample without an answer abstains; a pick of abstentions only scores 0.
    assert maj_at_k([None, None, "a"], [False, False, True], 1) == pytest.approx(1 / 3)
    assert maj_at_k([None, None, "a"], [False, False, True], 2) == pytest.approx(2 / 3)
    assert maj_at_k([None, None], [False, False], 2) == 0.0


def test_maj_at_k_matches_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 9)
        pool = [None, "a", "b", "c", "d"][: rng.randint(1, 5)]
        answers = [rng.choice(pool) for _ in range(n)]
        right = rng.choice(pool)
        correct = [a is not None and a == right for a in answers]
        for k in range(1, n + 1):
            assert maj_at_k(answers, correct, k) == pytest.approx(brute_maj(answers, correct, k), abs=1e-12)


def test_maj_at_k_with_one_sample_per_vote_is_pass_at_1_and_fast_for_many_samples():
    answers = [str(i % 50) for i in range(64)]  # 50 answers over 64 samples
    correct = [a == "3" for a in answers]
    assert maj_at_k(answers, correct, 1) == pytest.approx(sum(correct) / 64)
    assert 0.0 < maj_at_k(answers, correct, 64) < 1.0  # "3" ties with 13 other answers at two votes
    assert maj_at_k(answers, correct, 64) == pytest.approx(1 / 14)


# ----------------------------------------------------------------------------- bootstrap
def test_bootstrap_interval_is_seeded_and_covers_the_mean():
    values = np.random.default_rng(1).binomial(1, 0.5, size=400).astype(float)
    low, high = Bootstrap(400).interval(values)
    assert (low, high) == Bootstrap(400).interval(values)  # a fixed seed: the same interval
    assert low < values.mean() < high
    # ~ the normal approximation's width: 2 * 1.96 * sqrt(p (1 - p) / n) = 0.098
    assert 0.08 < high - low < 0.12
    assert Bootstrap(3).interval([0.5, 0.5, 0.5]) == (0.5, 0.5)
    with pytest.raises(ValueError, match="one value per prompt"):
        Bootstrap(3).interval([1.0, 0.0])
